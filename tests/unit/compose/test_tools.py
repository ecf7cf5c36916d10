"""compose/ through the tools that read it: the compose-spec schema, Debian's
docker-compose (v1.29), promtool and amtool. Each skips with the reason when its tool
is missing, except in CI ($CI set), where it fails (.ci/system-deps installs them)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.unit.compose.stack import (ALERTMANAGER_CONFIG, COMPOSE_DIR, COMPOSE_FILE, PROMETHEUS_DIR, SECRETS_MOUNT,
                                      prometheus_config, tool)

RULES = PROMETHEUS_DIR / "rules" / "llmwatch.rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "tests" / "llmwatch.rules.test.yml"
SECRET_NAMES = ("ingest_token", "read_token", "control_token", "webhook_secret")


def run(*argv, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, f"{' '.join(map(str, argv))} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def test_the_compose_file_follows_the_compose_spec():
    out = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", COMPOSE_FILE)
    assert "ok" in out.stdout


@pytest.fixture
def secrets_dir(tmp_path):
    """A secrets directory as compose/make-secrets.sh writes it."""
    d = tmp_path / "secrets"
    run("sh", COMPOSE_DIR / "make-secrets.sh", env=dict(os.environ, LLMWATCH_SECRETS_DIR=str(d)))
    return d


def test_docker_compose_renders_the_file(secrets_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_")}
    env["LLMWATCH_SECRETS_DIR"] = str(secrets_dir)
    compose = tool("docker-compose")
    run(compose, "-f", COMPOSE_FILE, "config", "-q", env=env)
    services = run(compose, "-f", COMPOSE_FILE, "config", "--services", env=env).stdout.split()
    assert sorted(services) == ["alertmanager", "collector", "dashboard", "prometheus", "trainer0", "trainer1"]
    rendered = run(compose, "-f", COMPOSE_FILE, "config", env=env).stdout
    # the secrets are files from the directory given; none of their values is in the file
    for name in SECRET_NAMES:
        assert str(secrets_dir / name) in rendered
        assert (secrets_dir / name).read_text().strip() not in rendered


def test_make_secrets_takes_the_environment_generates_the_rest_and_keeps_them(tmp_path):
    d = tmp_path / "s"
    given = "read-token-from-the-environment-0123"
    run("sh", COMPOSE_DIR / "make-secrets.sh", env=dict(os.environ, LLMWATCH_SECRETS_DIR=str(d),
                                                         LLMWATCH_READ_TOKEN=given))
    assert sorted(p.name for p in d.iterdir()) == sorted(SECRET_NAMES)
    assert oct(d.stat().st_mode & 0o777) == "0o700"  # what keeps them from this host's other users
    assert {oct(p.stat().st_mode & 0o777) for p in d.iterdir()} == {"0o644"}  # containers' users read them
    first = {p.name: p.read_text() for p in d.iterdir()}
    assert first["read_token"] == given + "\n"
    generated = [first[n].strip() for n in SECRET_NAMES if n != "read_token"]
    assert len(set(generated)) == 3 and all(len(t) >= 32 for t in generated)
    run("sh", COMPOSE_DIR / "make-secrets.sh", env=dict(os.environ, LLMWATCH_SECRETS_DIR=str(d)))
    assert {p.name: p.read_text() for p in d.iterdir()} == first


def test_promtool_accepts_the_prometheus_config_and_its_rules(tmp_path):
    """The shipped config, checked with its file references resolved: the read token's
    path is the container's secret mount, so the copy here points it at a real file."""
    token = tmp_path / "read_token"
    token.write_text("a-read-token-of-enough-length\n")
    text = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    assert text.count(SECRETS_MOUNT + "read_token") == 1
    (tmp_path / "prometheus.yml").write_text(text.replace(SECRETS_MOUNT + "read_token", str(token)))
    shutil.copytree(PROMETHEUS_DIR / "rules", tmp_path / "rules")
    out = run(tool("promtool"), "check", "config", tmp_path / "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in out.stdout + out.stderr
    assert prometheus_config()["rule_files"] == ["rules/*.yml"]


def test_promtool_accepts_the_rules():
    out = run(tool("promtool"), "check", "rules", RULES)
    assert "SUCCESS: 7 rules found" in out.stdout


def test_promtool_unit_tests_of_the_rules_pass():
    run(tool("promtool"), "test", "rules", RULE_TESTS)


def test_the_rule_tests_cover_every_alert():
    import yaml

    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert alerts == {"LlmwatchTokensPerSecondDrop", "LlmwatchStepStalled", "LlmwatchRunOpenIncident",
                      "LlmwatchCollectorDown"}
    assert fired == alerts and quiet == alerts  # each one seen firing and seen not firing


def test_amtool_accepts_the_alertmanager_config():
    out = run(tool("amtool"), "check-config", ALERTMANAGER_CONFIG)
    assert "SUCCESS" in out.stdout and "1 inhibit rules" in out.stdout
