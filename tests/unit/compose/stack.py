"""compose/ as the tests read it: the compose file with its variables filled in the way
compose fills them, each service's command line, and the tools that check the files
(skipped with the reason outside CI when missing; in CI, $CI set, a failure)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
PROMETHEUS_DIR = COMPOSE_DIR / "prometheus"
ALERTMANAGER_CONFIG = COMPOSE_DIR / "alertmanager" / "alertmanager.yml"
SECRETS_MOUNT = "/run/secrets/"

# what installs each tool (.ci/system-deps installs the Debian ones in CI)
_INSTALL = {"promtool": "apt-get install prometheus", "prometheus": "apt-get install prometheus",
            "amtool": "apt-get install prometheus-alertmanager",
            "prometheus-alertmanager": "apt-get install prometheus-alertmanager",
            "docker-compose": "apt-get install docker-compose",
            "check-jsonschema": "pip install -e '.[dev]'"}


def tool(name: str) -> str:
    """The executable `name` (the venv's bin first, then PATH); skip without it, or fail in CI."""
    venv_bin = Path(sys.executable).parent / name
    found = str(venv_bin) if venv_bin.exists() else shutil.which(name)
    if found is None:
        why = f"{name} is not installed ({_INSTALL.get(name, 'see .ci/system-deps')})"
        if os.environ.get("CI"):
            pytest.fail(why + ": .ci/system-deps --require installs it in CI")
        pytest.skip(why)
    return found


_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, $$ (a literal $)."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("plain")
        value, op = env.get(name), m.group("op")
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            if op.endswith("?"):
                raise KeyError(f"${name} must be set: {m.group('arg')}")
            return m.group("arg")
        return value or ""
    return _VAR.sub(sub, text)


def _fill(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_fill(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _fill(v, env) for k, v in node.items()}
    return node


def load_compose(env: dict[str, str] | None = None) -> dict:
    """The compose file, anchors merged and variables filled from `env` (default: none
    set, so every default applies)."""
    return _fill(yaml.safe_load(COMPOSE_FILE.read_text()), env or {})


def command(service: dict) -> list[str]:
    cmd = service["command"]
    assert isinstance(cmd, list), "commands are lists: no shell between compose and the program"
    return [str(x) for x in cmd]


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def published(service: dict) -> list[tuple[str, str, int]]:
    """(host address, host port, container port) of each `ports` entry."""
    out = []
    for entry in service.get("ports", []):
        parts = str(entry).split(":")
        assert len(parts) == 3, f"{entry!r}: name the host address (ADDRESS:HOST_PORT:CONTAINER_PORT)"
        out.append((parts[0], parts[1], int(parts[2].split("/")[0])))
    return out


def prometheus_config() -> dict:
    return yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
