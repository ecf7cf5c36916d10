"""The embedded collector's tokens: role files 0600 in a 0700 dir, paths in argv, nothing in env."""

import os
import stat

from trainer.embedded import collector_argv, collector_env, write_tokens


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_three_role_tokens_the_ranks_get_ingest(tmp_path):
    rank_token, paths = write_tokens(tmp_path / "tokens", token=None)
    assert set(paths) == {"ingest", "read", "control"}
    assert mode(tmp_path / "tokens") == 0o700
    values = {role: p.read_text().strip() for role, p in paths.items()}
    assert all(mode(p) == 0o600 for p in paths.values())
    assert len(set(values.values())) == 3 and all(len(v) >= 40 for v in values.values())
    assert rank_token == values["ingest"]


def test_existing_token_files_are_tightened_and_a_rerun_makes_new_tokens(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "read").write_text("old\n")
    os.chmod(d / "read", 0o644)
    _, paths = write_tokens(d, token=None)
    assert mode(d) == 0o700 and mode(paths["read"]) == 0o600 and paths["read"].read_text() != "old\n"


def test_the_users_token_serves_every_role_and_old_role_files_go(tmp_path):
    write_tokens(tmp_path / "tokens", token=None)
    rank_token, paths = write_tokens(tmp_path / "tokens", token="users-own-token-0123456789")
    assert rank_token == "users-own-token-0123456789"
    assert list(paths) == ["all"] and mode(paths["all"]) == 0o600
    assert sorted(p.name for p in (tmp_path / "tokens").iterdir()) == ["token"]


def test_argv_and_env_carry_no_token(tmp_path):
    rank_token, paths = write_tokens(tmp_path / "tokens", token=None)
    secrets_ = [p.read_text().strip() for p in paths.values()]
    argv = collector_argv(db_path=tmp_path / "t.duckdb", host="127.0.0.1", port=1234, token_paths=paths)
    for role in ("ingest", "read", "control"):
        assert argv[argv.index(f"--{role}-token-file") + 1] == str(paths[role])
    assert "--token" not in argv
    env = collector_env({"PATH": "/bin", "LLMWATCH_TOKEN": rank_token, "LLMWATCH_READ_TOKEN": "x" * 20,
                         "LLMWATCH_INGEST_TOKEN": "y" * 20, "LLMWATCH_CONTROL_TOKEN": "z" * 20})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "POLARS_MAX_THREADS": "1"}
    assert collector_env({"POLARS_MAX_THREADS": "4"})["POLARS_MAX_THREADS"] == "4"  # the user's own setting kept
    blob = " ".join(argv) + " ".join(f"{k}={v}" for k, v in env.items())
    assert not any(s in blob for s in secrets_)
    _, one = write_tokens(tmp_path / "tokens", token="users-own-token-0123456789")
    argv = collector_argv(db_path=tmp_path / "t.duckdb", host="127.0.0.1", port=1234, token_paths=one)
    assert argv[argv.index("--token-file") + 1] == str(one["all"]) and "users-own-token" not in " ".join(argv)


def test_alert_flags_reach_the_collector_the_secret_only_as_a_0600_file(tmp_path):
    from trainer.embedded import write_webhook_secret

    secret = "webhook-secret-0123456789abcdef"
    _, paths = write_tokens(tmp_path / "tokens", token=None)
    secret_path = write_webhook_secret(tmp_path / "tokens", secret)
    assert mode(secret_path) == 0o600 and secret_path.read_text().strip() == secret
    (tmp_path / "rules.toml").write_text("")
    argv = collector_argv(db_path=tmp_path / "t.duckdb", host="127.0.0.1", port=1234, token_paths=paths,
                          rules=str(tmp_path / "rules.toml"), webhooks=["https://h/1", "http://h/2"],
                          alertmanagers=["http://am:9093"], webhook_secret_path=secret_path)
    assert argv[argv.index("--rules") + 1] == str(tmp_path / "rules.toml")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--webhook"] == ["https://h/1", "http://h/2"]
    assert argv[argv.index("--alertmanager") + 1] == "http://am:9093"
    assert argv[argv.index("--webhook-secret-file") + 1] == str(secret_path)
    env = collector_env({"PATH": "/bin", "LLMWATCH_WEBHOOK_SECRET": secret})
    assert secret not in " ".join(argv) + repr(env) and "LLMWATCH_WEBHOOK_SECRET" not in env
    assert write_webhook_secret(tmp_path / "tokens", None) is None and not secret_path.exists()  # no stale secret


def test_the_sidecars_run_below_the_ranks():
    """The embedded collector and dashboard start as much lower than the launcher as
    LLMWATCH_SIDECAR_NICE says (the child's own niceness, read back from the kernel); by default
    `SIDECAR_NICE`, the launcher's priority."""
    import subprocess
    import sys

    import pytest

    from trainer.embedded import sidecar_nice
    from trainer.lifeline import sidecar_preexec

    # unset or blank: the ranks' own priority (nice 10 delayed detection on CPU-bound ranks)
    assert sidecar_nice({}) == 0 and sidecar_nice({"LLMWATCH_SIDECAR_NICE": " "}) == 0
    assert sidecar_nice({"LLMWATCH_SIDECAR_NICE": " 0 "}) == 0 and sidecar_nice({"LLMWATCH_SIDECAR_NICE": "19"}) == 19
    for bad in ("-5", "20", "low"):
        with pytest.raises(ValueError, match="LLMWATCH_SIDECAR_NICE"):
            sidecar_nice({"LLMWATCH_SIDECAR_NICE": bad})
    mine = os.nice(0)
    read = [sys.executable, "-c", "import os; print(os.nice(0))"]
    for nice in (10, 0):
        out = subprocess.run(read, capture_output=True, text=True, check=True, preexec_fn=sidecar_preexec(nice))
        assert int(out.stdout) == min(mine + nice, 19)
    if os.path.exists("/proc/self/autogroup"):  # in a session of its own, its autogroup is lowered as well...
        ours = open("/proc/self/autogroup").read()
        read = [sys.executable, "-c", "print(open('/proc/self/autogroup').read().split()[-1])"]
        out = subprocess.run(read, capture_output=True, text=True, check=True, start_new_session=True,
                             preexec_fn=sidecar_preexec(10))
        assert int(out.stdout) == 10
        assert open("/proc/self/autogroup").read() == ours  # ...and the launcher's (the ranks') never


def test_a_bad_sidecar_nice_is_refused_before_anything_is_written(tmp_path):
    import pytest

    from trainer.embedded import EmbeddedCollector

    c = EmbeddedCollector(db_path=tmp_path / "t.duckdb", tokens_dir=tmp_path / "tokens", log_path=tmp_path / "c.log",
                          environ={"LLMWATCH_SIDECAR_NICE": "high"})
    with pytest.raises(ValueError, match="LLMWATCH_SIDECAR_NICE must be an integer from 0 to 19, not 'high'"):
        c.start()
    assert c.proc is None and not (tmp_path / "tokens").exists() and not (tmp_path / "c.log").exists()
