"""Every command, flag, port, path and secret compose/docker-compose.yml names exists
in the project: the commands go through the programs' own argument parsers (collector,
dashboard, trainer, torchrun), the ports agree between who listens, who is published
and who connects, and the files it mounts or copies are there."""

from __future__ import annotations

import argparse
import subprocess
import tomllib

import pytest

from tests.unit.compose.stack import (COMPOSE_DIR, ROOT, SECRETS_MOUNT, command, host_port, load_compose,
                                      prometheus_config, published, tool)

COMPOSE = load_compose()
SERVICES = COMPOSE["services"]
TRAINERS = sorted(name for name in SERVICES if name.startswith("trainer"))


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # argparse printed why on stderr
        pytest.fail(f"{parser.prog} refuses {argv}: exit {e.code}")


def collector_args() -> argparse.Namespace:
    from collector.cli import build_parser

    cmd = command(SERVICES["collector"])
    assert cmd[:2] == ["collector", "serve"]
    return parse(build_parser(), cmd[1:])


def dashboard_args() -> argparse.Namespace:
    from dashboard.cli import build_parser

    cmd = command(SERVICES["dashboard"])
    assert cmd[0] == "dashboard"
    return parse(build_parser(), cmd[1:])


def torchrun_args(service: str, services: dict = SERVICES) -> argparse.Namespace:
    from torch.distributed.run import get_args_parser

    cmd = command(services[service])
    assert cmd[0] == "torchrun"
    return parse(get_args_parser(), cmd[1:])


def trainer_args(service: str, services: dict = SERVICES) -> argparse.Namespace:
    from trainer.cli import build_parser

    t = torchrun_args(service, services)
    assert t.module and t.training_script == "trainer", "torchrun -m trainer"
    return parse(build_parser(), t.training_script_args)


def secret_path(path: str | None, service: str) -> str:
    """The secret a /run/secrets/ path names, checked granted to `service` and defined."""
    assert path and path.startswith(SECRETS_MOUNT), f"{service}: {path!r} is not a Docker secret"
    name = path[len(SECRETS_MOUNT):]
    assert name in SERVICES[service].get("secrets", []), f"{service} reads secret {name} it is not given"
    assert name in COMPOSE["secrets"], f"secret {name} is not defined"
    return name


def listen_port(service: str) -> int:
    """The port `service`'s own command listens on in its container."""
    if service == "collector":
        return collector_args().port
    if service == "dashboard":
        return dashboard_args().port
    flag = "--web.listen-address="
    (address,) = [a[len(flag):] for a in command(SERVICES[service]) if a.startswith(flag)]
    return int(address.rsplit(":", 1)[1])


def test_the_collector_binds_beyond_loopback_only_as_its_cli_allows():
    from collector.cli import LOOPBACK, _check_exposure

    args = collector_args()
    assert args.host not in LOOPBACK  # reachable by the other containers
    assert _check_exposure(args) is None  # the check `collector serve` makes before it binds
    assert args.insecure_plaintext or (args.tls_cert and args.tls_key)
    assert args.token is None and args.token_file is None and args.webhook_secret is None  # nothing in `ps`
    assert {secret_path(p, "collector") for p in (args.ingest_token_file, args.read_token_file,
                                                  args.control_token_file, args.webhook_secret_file)} == \
        {"ingest_token", "read_token", "control_token", "webhook_secret"}


def test_the_collectors_db_lies_on_its_named_volume():
    args = collector_args()
    mounts = {m.split(":")[1]: m.split(":")[0] for m in SERVICES["collector"]["volumes"]}  # target: source
    (mount,) = [m for m in mounts if args.db.startswith(m.rstrip("/") + "/")]
    assert mounts[mount] in COMPOSE["volumes"]


def test_the_collector_pushes_its_alerts_to_the_alertmanager_service():
    (url,) = collector_args().alertmanager
    host, port = host_port(url)
    assert host == "alertmanager" and port == listen_port("alertmanager")


def test_the_collectors_health_check_asks_its_port():
    (probe,) = [a for a in SERVICES["collector"]["healthcheck"]["test"] if "/healthz" in a]
    assert f"http://127.0.0.1:{collector_args().port}/healthz" in probe


def test_the_dashboard_reads_the_collector_with_the_read_token():
    from dashboard.cli import is_loopback

    args = dashboard_args()
    assert host_port(args.collector) == ("collector", listen_port("collector"))
    assert secret_path(args.token_file, "dashboard") == "read_token"
    # beyond loopback, viewers sign in: with --collector the read token is the viewer token
    assert not is_loopback(args.host) and args.collector and args.token_file


def test_prometheus_scrapes_the_collectors_metrics_with_the_read_token():
    jobs = {j["job_name"]: j for j in prometheus_config()["scrape_configs"]}
    job = jobs["llmwatch-collector"]
    assert job.get("metrics_path", "/metrics") == "/metrics" and job.get("scheme", "http") == "http"
    (target,) = [t for c in job["static_configs"] for t in c["targets"]]
    assert target == f"collector:{listen_port('collector')}"
    assert job["authorization"].get("type", "Bearer") == "Bearer"
    assert secret_path(job["authorization"]["credentials_file"], "prometheus") == "read_token"
    (am,) = [t for a in prometheus_config()["alerting"]["alertmanagers"] for c in a["static_configs"]
             for t in c["targets"]]
    assert am == f"alertmanager:{listen_port('alertmanager')}"
    assert jobs["prometheus"]["static_configs"][0]["targets"] == [f"localhost:{listen_port('prometheus')}"]


@pytest.mark.parametrize("service", ["collector", "dashboard", "prometheus", "alertmanager"])
def test_published_ports_are_the_listening_ones_on_loopback(service):
    (entry,) = published(SERVICES[service])
    address, _, container_port = entry
    assert address == "127.0.0.1"
    assert container_port == listen_port(service)
    other = load_compose({"LLMWATCH_BIND_ADDRESS": "192.0.2.7"})["services"][service]
    assert published(other)[0][0] == "192.0.2.7"


def test_no_trainer_publishes_a_port():
    assert all("ports" not in SERVICES[s] for s in TRAINERS)


@pytest.mark.parametrize("service", ["prometheus", "alertmanager"])
def test_prometheus_and_alertmanager_flags_exist(service):
    binary = {"prometheus": "prometheus", "alertmanager": "prometheus-alertmanager"}[service]
    help_text = subprocess.run([tool(binary), "--help-long"], capture_output=True, text=True, timeout=30)
    text = help_text.stdout + help_text.stderr
    for arg in command(SERVICES[service]):
        flag = arg.split("=", 1)[0]
        assert f"{flag}=" in text or f"{flag} " in text, f"{binary} has no {flag}"


def test_the_trainer_nodes_run_one_torchrun_job_shipping_to_the_collector():
    assert len(TRAINERS) >= 2
    assert len({tuple(command(SERVICES[s])) for s in TRAINERS}) == 1  # the same job on every node
    t = torchrun_args(TRAINERS[0])
    assert t.rdzv_backend == "c10d"
    host, port = t.rdzv_endpoint.rsplit(":", 1)
    assert host == "trainer0" and SERVICES["trainer0"].get("hostname", "trainer0") == "trainer0" and int(port) > 0
    min_nodes, _, max_nodes = t.nnodes.partition(":")
    assert int(max_nodes or min_nodes) == len(TRAINERS), "--nnodes names as many nodes as there are services"
    names = [SERVICES[s]["environment"]["LLMWATCH_NODE_NAME"] for s in TRAINERS]
    assert names == [SERVICES[s]["hostname"] for s in TRAINERS] and len(set(names)) == len(names)
    assert sorted(int(SERVICES[s]["environment"]["LLMWATCH_NODE_INDEX"]) for s in TRAINERS) == \
        list(range(len(TRAINERS)))
    args = trainer_args(TRAINERS[0])
    assert args.telemetry and host_port(args.collector) == ("collector", listen_port("collector"))
    assert "token" not in args  # only the file
    for s in TRAINERS:
        assert secret_path(args.token_file, s) == "ingest_token"


@pytest.mark.parametrize("num_nodes", [None, "3"])
def test_the_trainer_flags_make_a_valid_job_on_every_membership(num_nodes):
    """What trainer/launch.py's torchrun path does with the ranks there are: all nodes,
    and the fewest --nnodes allows (dp fitted to them, the same global batch); with the
    default node count and with LLMWATCH_NODES=3 (docs/deployment.md, scaling)."""
    from trainer.cli import config_from_args
    from trainer.supervisor import fit_world

    services = load_compose({"LLMWATCH_NODES": num_nodes} if num_nodes else {})["services"]
    t = torchrun_args(TRAINERS[0], services)
    min_nodes, _, max_nodes = t.nnodes.partition(":")
    assert int(max_nodes) == int(num_nodes or len(TRAINERS))
    per_node = int(t.nproc_per_node)
    first = config_from_args(trainer_args(TRAINERS[0], services))
    global_batch = first.parallel.dp * first.parallel.micro_batches * first.parallel.micro_batch_size
    for nodes in range(int(min_nodes), int(max_nodes) + 1):
        cfg = config_from_args(trainer_args(TRAINERS[0], services))
        world = nodes * per_node
        fit_world(cfg, world)
        cfg.parallel.nodes = nodes
        cfg.validate(world_size=world)
        assert cfg.parallel.dp * cfg.parallel.micro_batches * cfg.parallel.micro_batch_size == global_batch
    cfg = config_from_args(trainer_args(TRAINERS[0]))
    assert cfg.ckpt.dir.startswith(cfg.run_dir + "/") and cfg.run_dir.startswith("/runs/")
    for s in TRAINERS:  # the run dir and its checkpoints on the volume every node shares
        assert "runs:/runs" in SERVICES[s]["volumes"]


def test_no_secret_is_written_in_the_compose_file():
    for name, spec in COMPOSE["secrets"].items():
        assert set(spec) == {"file"} and spec["file"] == f"./secrets/{name}"
    moved = load_compose({"LLMWATCH_SECRETS_DIR": "/etc/llmwatch"})["secrets"]
    assert {s["file"] for s in moved.values()} == {f"/etc/llmwatch/{n}" for n in COMPOSE["secrets"]}
    for name, service in SERVICES.items():
        env = service.get("environment", {})
        assert not [k for k in env if "TOKEN" in k or "SECRET" in k], name
        assert not [a for a in command(service) if a.startswith(("--token=", "--webhook-secret="))], name
        for arg in command(service):
            if SECRETS_MOUNT in arg:
                secret_path(arg.split("=", 1)[1], name)


def test_bind_mounts_name_files_in_compose_and_named_volumes_are_declared():
    for name, service in SERVICES.items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name} mounts {source}, missing in compose/"
            else:
                assert source in COMPOSE["volumes"], f"{name} mounts undeclared volume {source}"


def dockerfile() -> list[list[str]]:
    lines = (COMPOSE_DIR / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    return [line.split() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_image_build_copies_what_exists_and_installs_every_package():
    build = SERVICES["collector"]["build"]
    context = (COMPOSE_DIR / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).resolve() == COMPOSE_DIR / "Dockerfile"
    copied = [src for words in dockerfile() if words[0] == "COPY" for src in words[1:-1]]
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for src in copied:
        assert (context / src).exists(), f"COPY {src}: not in the build context"
        assert src not in ignored, f"COPY {src}: .dockerignore leaves it out"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {p.rstrip("*") for p in packages["include"]} <= set(copied)
    assert {"pyproject.toml", "README.md"} <= set(copied)  # the project's metadata and its readme


def test_the_image_pins_the_torch_the_project_pins():
    args = {w[1].split("=", 1)[0]: w[1].split("=", 1)[1] for w in dockerfile() if w[0] == "ARG"}
    assert dockerfile()[0] == ["FROM", "python:3.11-slim"]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert SERVICES["collector"]["build"]["args"] == {"TORCH_VERSION": args["TORCH_VERSION"],
                                                      "TORCH_INDEX_URL": args["TORCH_INDEX_URL"]}
    assert f"torch=={args['TORCH_VERSION']}" in (ROOT / "Makefile").read_text()
    for name in ("collector", "dashboard", *TRAINERS):  # one image for every llmwatch service
        assert SERVICES[name]["image"] == SERVICES["collector"]["image"] and "build" in SERVICES[name]
