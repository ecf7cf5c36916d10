"""`trainer` command line: flags -> `JobConfig` -> launch.

The flag names are a contract (tests, the demo, the compose files and the
healing actions use them). `--config FILE` loads a JSON `JobConfig`; flags given
on the command line override it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainer.config import AlertReceivers, ConfigError, JobConfig
from trainer.private import WEBHOOK_SECRET_ENV, TokenError, resolve_token, resolve_webhook_secret


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainer",
        description="Hybrid-parallel (dp x pp x tp, +sp) GPT trainer with telemetry and fault injection.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", type=Path, help="JSON file with a JobConfig; flags override it")
    g = p.add_argument_group("parallelism")
    g.add_argument("--dp", type=int, help="data-parallel degree (default 1)")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    g.add_argument("--pp", type=int, help="pipeline-parallel stages (default 1)")
    g.add_argument("--sp", action="store_true", help="sequence parallel over the TP group")
    g.add_argument("--nodes", type=int, help="simulated nodes the ranks are placed on (default 1)")
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), help="process-group backend")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, help="transformer blocks, split over the pp stages")
    g.add_argument("--d-model", type=int, help="hidden size (a multiple of --heads and of --tp)")
    g.add_argument("--heads", type=int, help="attention heads (a multiple of --tp)")
    g.add_argument("--seq-len", type=int, help="tokens per sample (a multiple of --tp with --sp)")
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int, help="samples per micro-batch, per dp replica")
    g.add_argument("--micro-batches", type=int, help="micro-batches per step, per dp replica")
    g.add_argument("--dp-shares", type=_shares, metavar="M0,M1,...",
                   help="micro-batches of each dp replica when they differ (a slower device takes fewer): dp "
                        "of them, summing to dp x --micro-batches; the global batch and the loss are unchanged")
    g.add_argument("--steps", type=int, help="optimizer steps to train")
    g.add_argument("--lr", type=float, help="peak learning rate (AdamW, cosine after warmup)")
    g.add_argument("--warmup-steps", type=int, help="linear learning-rate warmup")
    g.add_argument("--grad-clip", type=float, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--seed", type=int, help="seeds the model init and the data order")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                   help="autocast dtype; fp16 uses dynamic loss scaling")
    g.add_argument("--eval-every", type=int, help="held-out loss per domain every N steps (0: never)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--ckpt-dir", help="fast tier for the async sharded checkpoints (none: no checkpoints)")
    g.add_argument("--ckpt-every", type=int, help="checkpoint every N steps")
    g.add_argument("--ckpt-persist-dir", help="slow tier each verified checkpoint is copied to in the background")
    g.add_argument("--ckpt-keep", type=int, help="newest checkpoints kept in --ckpt-dir (0: all)")
    g.add_argument("--resume", action="store_true", help="restore the newest verified checkpoint")
    g = p.add_argument_group("run and output")
    g.add_argument("--run-id", help="the run's id in the collector (default: a fresh one; under torchrun its rendezvous id)")
    g.add_argument("--run-dir", help="where the run writes its files (default runs/<run id>)")
    g.add_argument("--metrics-jsonl", help="rank 0 writes one JSON object per step here")
    g.add_argument("--inject", action="append", metavar="KIND@k=v,...",
                   help="fault injection: nan@step=S,rank=R[,mode=data|transient|device] | spike@step=S[,mode=data|step] | "
                        "straggler@rank=R,from=S,factor=F[,to=E] | slowlink@rank=R,axis=dp|tp|pp,from=S,factor=F[,to=E] "
                        "(that rank's ops on the axis take F x as long) | slowio@rank=R,from=S,factor=F,what=data|ckpt[,to=E] "
                        "(that rank's data fetch or checkpoint shard writes take F x as long) | "
                        "bitflip@rank=R,step=S[,target=param|optim] (one bit of one element after the step's "
                        "update) | hang@rank=R,step=S | crash@rank=R,step=S | "
                        "overflow@rank=R,from=S,to=E (fp16: infinite gradients) | "
                        "devhealth@rank=R,from=S,what=ecc|thermal|memory[,to=E] (a simulated device: that rank's "
                        "device-health samples show ECC errors, thermal throttling or its node's memory nearly gone; "
                        "no to for ecc) | "
                        "jitter@pct=P[,seed=S] (background noise on every rank; not a fault). A rank names the "
                        "job's first layout (the hardware); straggler, slowlink and slowio take on=place to follow "
                        "the current rank instead (its data, stage, links: a spare in its place is as slow)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("telemetry")
    g.add_argument("--telemetry", action="store_true", help="record telemetry in every rank")
    g.add_argument("--collector", metavar="URL", help="ship to a running collector (default: start an embedded one)")
    g.add_argument("--token-file", metavar="PATH",
                   help="file holding the collector bearer token (keep it 0600); also under torchrun")
    g.add_argument("--token", help="collector bearer token; visible in `ps`: prefer --token-file or "
                                   "env LLMWATCH_TOKEN")
    g.add_argument("--ca-file", metavar="PEM", help="CA bundle to verify an https:// --collector")
    g.add_argument("--telemetry-flush-s", type=float,
                   help="how often each agent ships a batch (default 1.0; urgent steps, e.g. a NaN, "
                        "go at once; longer costs less CPU, shows data later)")
    g.add_argument("--checksum-every", type=int, metavar="N",
                   help="every N steps each rank records its parameter shard's checksum; the dp replicas' "
                        "are compared (replica_divergence; default 10, 0: never)")
    g.add_argument("--otlp-endpoint", help="also export step-phase spans over OTLP/HTTP to this endpoint")
    g.add_argument("--prometheus-port", type=int, help="serve live gauges on this port (+ local rank)")
    g.add_argument("--keep-collector", action="store_true",
                   help="leave the embedded collector and dashboard running after training (Ctrl-C stops them)")
    g.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="do not start the dashboard next to the embedded collector")
    g.add_argument("--dashboard-port", type=int,
                   help="the embedded dashboard's loopback port (default 8050; any free one if taken)")
    g = p.add_argument_group("embedded collector", "passed to the collector --telemetry starts (not with --collector: "
                             "give these to `collector serve` there)")
    g.add_argument("--rules", metavar="FILE", help="detection rules (TOML) overriding analysis/rules.toml")
    g.add_argument("--archive", metavar="DIR",
                   help="the Parquet archive of earlier runs (`collector archive --out DIR`): a node that failed in "
                        "them is flagged when this run starts on it (docs/rules.md [node_history])")
    g.add_argument("--webhook", action="append", metavar="URL",
                   help="POST each incident's alert here, signed (repeatable; needs a webhook secret)")
    g.add_argument("--webhook-secret-file", metavar="PATH",
                   help="file (0600) holding the webhooks' HMAC key (or env LLMWATCH_WEBHOOK_SECRET)")
    g.add_argument("--webhook-secret", help="the webhooks' HMAC key; visible in `ps`: prefer the file or the env")
    g.add_argument("--alertmanager", action="append", metavar="URL",
                   help="push alerts to this Alertmanager (repeatable)")
    g = p.add_argument_group("healing", "what is done about incidents (docs/rules.md [policy])")
    g.add_argument("--policy", choices=("auto", "shadow", "off"),
                   help="auto: roll back, skip bad data, isolate nodes, restart (default); shadow: record what "
                        "it would do and do nothing; off: detect and alert only")
    g.add_argument("--max-restarts", type=int, help="restarts after a crash or a hang (default 3)")
    g.add_argument("--min-nodes", type=int, help="never isolate below this many nodes (default 1)")
    g.add_argument("--preflight", action="store_true", default=None,
                   help="before the first step, time every node's matmuls and, in rounds of pairs, its links "
                        "(trainer/preflight.py); a slow node is isolated before it costs the run (a spare takes its "
                        "place)")
    g.add_argument("--preflight-ratio", type=float, metavar="X",
                   help="pre-flight: a node this many times the median node (or pair) is slow, and its pair is "
                        "re-paired (default: the --rules file's [preflight] ratio, which the collector judges by, "
                        "else 2)")
    g.add_argument("--preflight-timeout-s", type=float, metavar="S",
                   help="pre-flight: a rank that has not answered a phase by then has its node judged no_answer "
                        "(default 30)")
    g.add_argument("--spare-nodes", type=int, metavar="N",
                   help="standby nodes (embedded launcher): an isolated node's place is taken by one, the data-"
                        "parallel size stays; the policy weighs replacing against shrinking (default 0)")
    g.add_argument("--on-isolate", metavar="CMD",
                   help="shell command run on each node isolation, with LLMWATCH_RUN_ID, LLMWATCH_NODE and "
                        "LLMWATCH_REASON in its environment (drain a Slurm node, cordon a Kubernetes node)")
    return p


def _shares(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated micro-batch counts, one per replica") from None


# flag -> (component, field)
_MAP = {
    "dp": ("parallel", "dp"), "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "sp": ("parallel", "sp"),
    "nodes": ("parallel", "nodes"), "backend": ("parallel", "backend"),
    "micro_batch_size": ("parallel", "micro_batch_size"), "micro_batches": ("parallel", "micro_batches"),
    "dp_shares": ("parallel", "shares"),
    "layers": ("model", "layers"), "d_model": ("model", "d_model"), "heads": ("model", "heads"),
    "seq_len": ("model", "seq_len"),
    "lr": ("optim", "lr"), "warmup_steps": ("optim", "warmup_steps"), "grad_clip": ("optim", "grad_clip"),
    "precision": ("precision", "precision"),
    "ckpt_dir": ("ckpt", "dir"), "ckpt_every": ("ckpt", "every"), "ckpt_persist_dir": ("ckpt", "persist_dir"),
    "ckpt_keep": ("ckpt", "keep"), "resume": ("ckpt", "resume"),
    "telemetry": ("telemetry", "enabled"), "collector": ("telemetry", "collector_url"),
    "otlp_endpoint": ("telemetry", "otlp_endpoint"), "ca_file": ("telemetry", "ca_file"),
    "telemetry_flush_s": ("telemetry", "flush_interval_s"), "checksum_every": ("telemetry", "checksum_every"),
    "prometheus_port": ("telemetry", "prometheus_port"), "rules": ("telemetry", "rules"),
    "archive": ("telemetry", "archive"),
    "dashboard": ("telemetry", "dashboard"), "dashboard_port": ("telemetry", "dashboard_port"),
    "policy": ("healing", "policy"), "max_restarts": ("healing", "max_restarts"),
    "min_nodes": ("healing", "min_nodes"), "on_isolate": ("healing", "on_isolate"),
    "spare_nodes": ("healing", "spare_nodes"), "preflight": ("healing", "preflight"),
    "preflight_ratio": ("healing", "preflight_ratio"), "preflight_timeout_s": ("healing", "preflight_timeout_s"),
}
_TOP = ("steps", "seed", "eval_every", "metrics_jsonl", "run_id", "run_dir")


def config_from_args(args: argparse.Namespace) -> JobConfig:
    base = json.loads(args.config.read_text()) if getattr(args, "config", None) else {}
    cfg = JobConfig.from_dict(base)
    for key, value in vars(args).items():
        if key in _MAP:
            part, name = _MAP[key]
            setattr(getattr(cfg, part), name, value)
        elif key in _TOP:
            setattr(cfg, key, value)
        elif key == "inject":
            cfg.inject = tuple(cfg.inject) + tuple(value)
    cfg.telemetry.alerts = AlertReceivers(webhooks=tuple(getattr(args, "webhook", ())),
                                          alertmanagers=tuple(getattr(args, "alertmanager", ())))
    return cfg


def _embedded_only(cfg: JobConfig) -> None:
    """--rules, --webhook, --alertmanager configure the collector this command starts."""
    t = cfg.telemetry
    if (t.rules or t.alerts or t.archive) and (not t.enabled or t.collector_url):
        raise ConfigError("--rules, --archive, --webhook and --alertmanager configure the embedded collector: they "
                          "need --telemetry without --collector (give them to `collector serve` instead)")


def _webhook_secret(args: argparse.Namespace, cfg: JobConfig) -> None:
    """Put the webhook secret where the embedded collector takes it from: this process's
    $LLMWATCH_WEBHOOK_SECRET (never config.json, a command line or a rank's environment)."""
    if getattr(args, "webhook_secret", None):
        print(f"trainer: warning: --webhook-secret is visible to every user in `ps`; prefer --webhook-secret-file "
              f"or env {WEBHOOK_SECRET_ENV}", file=sys.stderr, flush=True)
    secret = resolve_webhook_secret(secret=getattr(args, "webhook_secret", None),
                                    secret_file=getattr(args, "webhook_secret_file", None), environ=os.environ)
    if cfg.telemetry.alerts.webhooks and not secret:
        raise ConfigError("--webhook needs a secret to sign with: --webhook-secret-file FILE (0600) or env "
                          f"{WEBHOOK_SECRET_ENV}")
    if secret:
        os.environ[WEBHOOK_SECRET_ENV] = secret


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        cfg.validate()
        _embedded_only(cfg)
        _webhook_secret(args, cfg)
        # the token stays out of cfg (see TelemetryConfig); read only when it will be sent
        token = resolve_token(token=getattr(args, "token", None), token_file=getattr(args, "token_file", None),
                              environ=os.environ) if cfg.telemetry.enabled else None
    except (ConfigError, TokenError, OSError, json.JSONDecodeError, TypeError) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    from trainer.launch import launch

    return launch(cfg, token=token, progress=not getattr(args, "no_progress", False),
                  keep_collector=getattr(args, "keep_collector", False))


if __name__ == "__main__":
    sys.exit(main())
