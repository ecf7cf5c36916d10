"""Configuration: one dataclass per component, composed into `JobConfig`.

The CLI (`trainer.cli`) maps flags onto these; a JSON file may back them. Every
check that can be made before a rank starts lives in `JobConfig.validate()`, so a
bad layout exits with a one-line reason instead of a hang in `init_process_group`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

VOCAB_PAD_MULTIPLE = 64  # padded vocab must split evenly over any tp degree we allow
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration that cannot run. The message is one line, meant for a user."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    vocab_size: int = 320  # byte tokenizer (256 + specials) padded to VOCAB_PAD_MULTIPLE
    dropout: float = 0.0
    init_std: float = 0.02

    def validate(self) -> None:
        if self.layers < 1 or self.d_model < 1 or self.heads < 1 or self.seq_len < 2:
            raise ConfigError("--layers, --d-model, --heads must be >= 1 and --seq-len >= 2")
        if self.d_model % self.heads:
            raise ConfigError(f"--d-model {self.d_model} is not divisible by --heads {self.heads}")
        if self.vocab_size % VOCAB_PAD_MULTIPLE:
            raise ConfigError(f"vocab_size {self.vocab_size} must be a multiple of {VOCAB_PAD_MULTIPLE}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout {self.dropout} must be in [0, 1)")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    nodes: int = 1
    micro_batch_size: int = 4  # per data-parallel replica
    micro_batches: int = 2  # per data-parallel replica, per optimizer step
    # micro-batches per replica when they differ (None: micro_batches each): dp of them, summing to
    # dp x micro_batches (the global batch is unchanged; a slower replica takes fewer: trainer/data.py)
    shares: tuple[int, ...] | None = None
    bucket_mb: float = 1.0  # DP gradient bucket size
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # process-group timeout: a hang turns into an error after this

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def validate(self, model: ModelConfig, world_size: int | None = None) -> None:
        for name in ("dp", "tp", "pp", "nodes", "micro_batch_size", "micro_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"dp*pp*tp = {self.dp}*{self.pp}*{self.tp} = {self.world_size} "
                f"does not match the world size {world_size}"
            )
        if self.shares is not None and (len(self.shares) != self.dp or min(self.shares) < 1
                                        or sum(self.shares) != self.dp * self.micro_batches):
            raise ConfigError(f"--dp-shares {','.join(map(str, self.shares))}: one per replica ({self.dp}), each "
                              f">= 1, summing to dp x micro-batches = {self.dp * self.micro_batches}")
        if model.heads % self.tp:
            raise ConfigError(f"--heads {model.heads} is not divisible by --tp {self.tp}")
        if (model.d_model * model.mlp_ratio) % self.tp:
            raise ConfigError(f"MLP width {model.d_model * model.mlp_ratio} is not divisible by --tp {self.tp}")
        if model.vocab_size % self.tp:
            raise ConfigError(f"vocab size {model.vocab_size} is not divisible by --tp {self.tp}")
        if model.layers < self.pp:
            raise ConfigError(f"--layers {model.layers} is fewer than --pp {self.pp} pipeline stages")
        if self.sp and self.tp == 1:
            raise ConfigError("--sp needs --tp > 1 (sequence parallel splits the TP regions)")
        if self.world_size % self.nodes:
            raise ConfigError(f"world size {self.world_size} does not split evenly over --nodes {self.nodes}")
        ranks_per_node = self.world_size // self.nodes
        if ranks_per_node % self.tp:
            raise ConfigError(
                f"{ranks_per_node} ranks per node cannot hold a whole TP group of {self.tp}: "
                "a TP group must not span nodes"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"unknown backend {self.backend!r} (auto, gloo, nccl)")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    precision: str = "fp32"  # fp32 | bf16 | fp16
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 200
    min_scale: float = 1.0

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    domains: tuple[str, ...] = ("code", "math")
    min_sample_tokens: int = 16
    group_window: int = 64  # length grouping: sort within windows of this many micro-batches
    prefetch: int = 2  # steps prepared ahead by the prefetch thread
    eval_samples: int = 32  # held-out samples per domain
    cache_dir: str | None = None  # where the built corpus is cached (default: ~/.cache/llmwatch)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 0  # steps; 0 = never
    persist_dir: str | None = None
    keep: int = 3
    resume: bool = False


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    enabled: bool = False
    collector_url: str | None = None  # None with enabled=True: the launcher starts an embedded collector
    ca_file: str | None = None  # PEM bundle that verifies an https:// collector (default: the system's)
    # No token here: this config is written to config.json, shipped into the runs table and
    # copied into every spool segment. The token comes from --token-file or $LLMWATCH_TOKEN.
    # ~once a second; a step a detector must see now is flushed at once (agent/urgent.py)
    flush_interval_s: float = 1.0
    heartbeat_interval_s: float = 1.0
    # Every N steps each rank records its parameter shard's checksum (trainer/integrity.py),
    # compared across the dp replicas by the `replica_divergence` detector; 0: never.
    # A repair in place needs the corruption caught within N steps (docs/healing.md).
    checksum_every: int = 10
    spool_bytes: int = 256 * 1024 * 1024
    otlp_endpoint: str | None = None
    prometheus_port: int | None = None  # rank r listens on prometheus_port + local rank
    rules: str | None = None  # the embedded collector's detection rules file (--rules)
    # the Parquet archive the embedded collector reads for the history of the run's nodes (--archive)
    archive: str | None = None
    # The embedded collector comes with a dashboard (`python -m dashboard --collector`) on
    # this loopback port (0, or the port taken: any free one); off with --no-dashboard.
    dashboard: bool = True
    dashboard_port: int = 8050
    # Where the embedded collector sends alerts. Never serialised (see JobConfig.to_dict):
    # a URL may be a credential (userinfo, a query token, a Slack webhook's path).
    alerts: AlertReceivers = field(default_factory=lambda: AlertReceivers(), repr=False)


@dataclass(kw_only=True, slots=True)
class AlertReceivers:
    """`--webhook` and `--alertmanager` URLs for the embedded collector. The webhook
    secret is not here: it travels in $LLMWATCH_WEBHOOK_SECRET or a 0600 file."""

    webhooks: tuple[str, ...] = ()
    alertmanagers: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"AlertReceivers({len(self.webhooks)} webhooks, {len(self.alertmanagers)} alertmanagers)"

    def __bool__(self) -> bool:
        return bool(self.webhooks or self.alertmanagers)

    def validate(self) -> None:
        for flag, urls in (("--webhook", self.webhooks), ("--alertmanager", self.alertmanagers)):
            for n, url in enumerate(urls, 1):
                if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
                    raise ConfigError(f"{flag} #{n} is not an http:// or https:// URL")


POLICY_MODES = ("auto", "shadow", "off")


@dataclass(kw_only=True, slots=True)
class HealingConfig:
    """What the job does about its incidents (DESIGN.md section 7). The policy itself
    runs in the collector; the launcher is the supervisor that restarts the job."""

    policy: str = "auto"  # auto | shadow | off: the embedded collector's --policy, and whether the supervisor heals
    max_restarts: int = 3  # restarts after a crash or a hang (isolations are bounded by the nodes)
    min_nodes: int = 1  # never isolate below this many nodes
    on_isolate: str | None = None  # a shell command run on each isolation (LLMWATCH_RUN_ID, _NODE, _REASON)
    isolate_grace_s: float = 5.0  # ranks of an isolated node's job that do not leave by themselves are stopped
    spare_nodes: int = 0  # standby nodes of the embedded launcher: one takes an isolated node's place, dp stays
    # before the first step, every node's compute and links are timed (trainer/preflight.py); a node that
    # fails is recorded as the `preflight` event, and the collector's policy isolates it
    preflight: bool = False
    # the checks' own verdicts, and the suspects they re-pair: this many times the median; None: the
    # embedded collector's rules file's [preflight] ratio (the one it judges by), else 2, the rules' default
    preflight_ratio: float | None = None
    preflight_timeout_s: float = 30.0  # a rank that has not answered a phase of the checks by then: `no_answer`

    def validate(self) -> None:
        if self.policy not in POLICY_MODES:
            raise ConfigError(f"--policy {self.policy!r}: one of {', '.join(POLICY_MODES)}")
        if self.max_restarts < 0 or self.min_nodes < 1 or self.isolate_grace_s < 0 or self.spare_nodes < 0:
            raise ConfigError("--max-restarts and --spare-nodes must be >= 0, --min-nodes >= 1")
        if (self.preflight_ratio is not None and self.preflight_ratio <= 1.0) or self.preflight_timeout_s <= 0:
            raise ConfigError("--preflight-ratio must be > 1 and --preflight-timeout-s > 0")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    healing: HealingConfig = field(default_factory=HealingConfig)
    steps: int = 50
    seed: int = 1234
    eval_every: int = 0
    log_every: int = 1
    metrics_jsonl: str | None = None
    run_id: str | None = None
    run_dir: str | None = None
    inject: tuple[str, ...] = ()

    def validate(self, world_size: int | None = None, *, injection_world: int | None = None) -> None:
        """`injection_world`: the world size the --inject ranks are of (the job's first
        layout, after an elastic restart on fewer ranks); default this layout's."""
        if self.steps < 1:
            raise ConfigError("--steps must be >= 1")
        self.model.validate()
        self.telemetry.alerts.validate()
        self.parallel.validate(self.model, world_size)
        self.precision.validate()
        self.healing.validate()
        if self.parallel.sp and self.model.seq_len % self.parallel.tp:
            raise ConfigError(f"--seq-len {self.model.seq_len} is not divisible by --tp {self.parallel.tp} (needed by --sp)")
        if self.ckpt.every and not self.ckpt.dir:
            raise ConfigError("--ckpt-every needs --ckpt-dir")
        if self.telemetry.checksum_every < 0:
            raise ConfigError("--checksum-every must be >= 0")
        if self.ckpt.resume and not self.ckpt.dir:
            raise ConfigError("--resume needs --ckpt-dir")
        # Imported here so that parsing specs never needs torch.
        from trainer.faults import parse_injections

        parse_injections(self.inject, world_size=injection_world or self.parallel.world_size)

    # -- (de)serialisation: the launcher hands the config to its ranks as JSON --
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["telemetry"].pop("alerts", None)  # URLs that may be credentials: never in config.json or runs
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobConfig":
        parts = {
            "model": ModelConfig,
            "parallel": ParallelConfig,
            "optim": OptimConfig,
            "precision": PrecisionConfig,
            "data": DataConfig,
            "ckpt": CheckpointConfig,
            "telemetry": TelemetryConfig,
            "healing": HealingConfig,
        }
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in parts:
                sub = dict(value)
                if key == "telemetry" and sub.pop("token", None) is not None:  # null: an older config.json
                    raise ConfigError("a config file must not hold the collector token (it would be copied into "
                                      "config.json and the runs table): use --token-file or $LLMWATCH_TOKEN")
                if key == "telemetry" and "alerts" in sub:
                    raise ConfigError("a config file must not hold alert receivers (a URL may be a credential, "
                                      "and config.json is copied into the runs table): use --webhook, "
                                      "--alertmanager")
                if "domains" in sub:
                    sub["domains"] = tuple(sub["domains"])
                if sub.get("shares") is not None:
                    sub["shares"] = tuple(int(x) for x in sub["shares"])
                kwargs[key] = parts[key](**sub)
            elif key == "inject":
                kwargs[key] = tuple(value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "JobConfig":
        return cls.from_dict(json.loads(text))
