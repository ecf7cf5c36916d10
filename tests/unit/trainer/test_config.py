import pytest

from trainer.cli import build_parser, config_from_args, main
from trainer.config import ConfigError, JobConfig


def cfg_from(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_flags_map_onto_components():
    cfg = cfg_from("--dp", "2", "--tp", "2", "--pp", "2", "--sp", "--layers", "4", "--d-model", "64",
                   "--heads", "4", "--seq-len", "32", "--micro-batches", "3", "--precision", "bf16",
                   "--ckpt-dir", "/tmp/x", "--ckpt-every", "5", "--inject", "spike@step=3", "--inject",
                   "nan@step=4,rank=1", "--telemetry", "--telemetry-flush-s", "1.5")
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp) == (2, 2, 2, True)
    assert cfg.model.d_model == 64 and cfg.parallel.micro_batches == 3
    assert cfg.precision.precision == "bf16" and cfg.ckpt.every == 5 and cfg.telemetry.enabled
    assert cfg.telemetry.flush_interval_s == 1.5
    assert cfg.inject == ("spike@step=3", "nan@step=4,rank=1")
    cfg.validate()


def test_json_round_trip():
    cfg = cfg_from("--dp", "2", "--inject", "crash@rank=1,step=2")
    again = JobConfig.from_json(cfg.to_json())
    assert again == cfg


def test_config_file_backs_flags(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(cfg_from("--layers", "6", "--steps", "9").to_json())
    cfg = cfg_from("--config", str(path), "--steps", "11")
    assert cfg.model.layers == 6 and cfg.steps == 11


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "3"], "not divisible by --tp"),
    (["--heads", "4", "--tp", "8", "--d-model", "64"], "--heads 4 is not divisible by --tp 8"),
    (["--pp", "8", "--layers", "4"], "fewer than --pp"),
    (["--sp"], "--sp needs --tp > 1"),
    (["--inject", "meteor@step=3"], "unknown kind"),
    (["--inject", "nan@step=3"], "missing rank"),
    (["--inject", "nan@step=3,rank=9"], "outside world"),
    (["--ckpt-every", "3"], "--ckpt-every needs --ckpt-dir"),
    (["--dp", "2", "--tp", "2", "--nodes", "4"], "TP group must not span nodes"),
])
def test_bad_layouts_fail_before_any_rank(argv, needle, capsys):
    assert main(argv + ["--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1


def test_world_size_mismatch():
    cfg = cfg_from("--dp", "2", "--tp", "2")
    with pytest.raises(ConfigError, match="does not match the world size 8"):
        cfg.validate(world_size=8)


def test_alert_receivers_stay_out_of_the_config_json_and_the_rules_path_stays_in():
    cfg = cfg_from("--telemetry", "--rules", "/etc/rules.toml", "--webhook", "https://hooks.example/T0K3N",
                   "--alertmanager", "http://user:pw@am:9093")
    assert cfg.telemetry.alerts.webhooks == ("https://hooks.example/T0K3N",)
    text = cfg.to_json()
    assert "T0K3N" not in text and "user:pw" not in text and "alerts" not in text
    assert "T0K3N" not in repr(cfg)
    assert JobConfig.from_json(text).telemetry.rules == "/etc/rules.toml"
    d = cfg.to_dict()
    d["telemetry"]["alerts"] = {"webhooks": ["https://x"]}
    with pytest.raises(ConfigError, match="alert receivers"):
        JobConfig.from_dict(d)


@pytest.mark.parametrize("argv, needle", [
    (["--telemetry", "--webhook", "https://h/x"], "needs a secret"),
    (["--telemetry", "--webhook", "ftp://h/x", "--webhook-secret-file", "/dev/null"], "not an http"),
    (["--telemetry", "--collector", "http://c:1", "--alertmanager", "http://am:9093"], "embedded collector"),
    (["--rules", "r.toml"], "embedded collector"),
])
def test_alert_flags_are_checked_before_any_rank(argv, needle, capsys, monkeypatch):
    monkeypatch.setenv("LLMWATCH_WEBHOOK_SECRET", "")  # restored (to absent) after the test
    monkeypatch.delenv("LLMWATCH_WEBHOOK_SECRET")
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_the_webhook_secret_reaches_the_launcher_env_only(tmp_path, monkeypatch):
    import os

    from trainer import cli

    monkeypatch.setenv("LLMWATCH_WEBHOOK_SECRET", "")  # restored (to absent) after the test
    monkeypatch.delenv("LLMWATCH_WEBHOOK_SECRET")
    (tmp_path / "s").write_text("file-secret-0123456789\n")
    args = build_parser().parse_args(["--telemetry", "--webhook", "https://h/x", "--webhook-secret-file",
                                      str(tmp_path / "s")])
    cfg = config_from_args(args)
    cli._webhook_secret(args, cfg)
    assert os.environ["LLMWATCH_WEBHOOK_SECRET"] == "file-secret-0123456789"
    assert "file-secret" not in cfg.to_json() + repr(cfg)
