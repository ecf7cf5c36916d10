"""Secrets stay out of the config and are written 0600; run dirs are 0700."""

import json
import os
import stat

import pytest

from trainer.cli import build_parser, config_from_args, main
from trainer.config import ConfigError, JobConfig
from trainer.private import TokenError, is_private, private_dir, read_token_file, resolve_token, write_secret
from trainer.rundir import prepare_run

SECRET = "s3cret-token-value-0123456789"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_write_secret_creates_0600_and_tightens_an_existing_file(tmp_path):
    new = write_secret(tmp_path / "new", SECRET)
    assert mode(new) == 0o600 and new.read_text() == SECRET + "\n"
    old = tmp_path / "old"
    old.write_text("previous, longer contents than the token\n")
    os.chmod(old, 0o644)
    write_secret(old, SECRET)
    assert mode(old) == 0o600 and old.read_text() == SECRET + "\n"


def test_write_secret_does_not_follow_a_planted_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        write_secret(tmp_path / "link", SECRET)
    assert target.read_text() == ""


def test_private_dir_is_0700_new_or_existing(tmp_path):
    assert mode(private_dir(tmp_path / "a" / "b")) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    os.chmod(wide, 0o755)
    assert mode(private_dir(wide)) == 0o700
    os.chmod(wide, 0o755)
    assert mode(private_dir(wide, tighten_existing=False)) == 0o755


def test_token_sources_file_then_flag_then_env(tmp_path):
    f = write_secret(tmp_path / "tok", "from-file-xxxxxxxxxxxx")
    env = {"LLMWATCH_TOKEN": "from-env-xxxxxxxxxxxx"}
    assert resolve_token(token="from-flag", token_file=f, environ=env) == "from-file-xxxxxxxxxxxx"
    assert resolve_token(token="from-flag", token_file=None, environ=env) == "from-flag"
    assert resolve_token(token=None, token_file=None, environ=env) == "from-env-xxxxxxxxxxxx"
    assert resolve_token(token=None, token_file=None, environ={}) is None


def test_token_file_errors_name_the_file_not_the_token(tmp_path):
    with pytest.raises(TokenError, match="missing"):
        read_token_file(tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="empty"):
        read_token_file(tmp_path / "empty")


def test_no_token_field_anywhere_in_the_config():
    cfg = config_from_args(build_parser().parse_args(["--telemetry", "--token", SECRET]))
    assert SECRET not in cfg.to_json()
    keys = set()

    def walk(d):
        for k, v in d.items():
            keys.add(k)
            if isinstance(v, dict):
                walk(v)
    walk(cfg.to_dict())
    assert not {k for k in keys if "token" in k and k not in ("min_sample_tokens",)}


def test_a_config_file_with_a_token_is_refused(tmp_path, capsys):
    d = JobConfig().to_dict()
    d["telemetry"]["token"] = SECRET
    with pytest.raises(ConfigError, match="--token-file"):
        JobConfig.from_dict(d)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(d))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--token-file" in err and SECRET not in err


def test_an_older_config_json_with_a_null_token_still_loads():
    d = JobConfig().to_dict()
    d["telemetry"]["token"] = None
    assert JobConfig.from_dict(d) == JobConfig()


def test_cli_reports_an_unreadable_token_file(tmp_path, capsys):
    assert main(["--telemetry", "--token-file", str(tmp_path / "nope")]) == 2
    assert "token file" in capsys.readouterr().err


def test_prepare_run_makes_a_private_dir(tmp_path):
    cfg = JobConfig(run_id="r1", run_dir=str(tmp_path / "runs" / "r1"))
    assert mode(prepare_run(cfg)) == 0o700


def test_prepare_run_tightens_a_previous_run_but_not_a_users_dir(tmp_path, capsys):
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    os.chmod(previous, 0o755)
    prepare_run(JobConfig(run_id="r", run_dir=str(previous)))
    assert mode(previous) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("the user's")
    os.chmod(shared, 0o755)
    prepare_run(JobConfig(run_id="r", run_dir=str(shared)))
    assert mode(shared) == 0o755 and not is_private(shared)
    assert "readable by others" in capsys.readouterr().err


def test_prepare_run_needs_the_run_id(tmp_path):
    with pytest.raises(ValueError):
        prepare_run(JobConfig(run_dir=str(tmp_path / "x")))
