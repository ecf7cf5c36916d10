"""No token leaves its 0600 file: not into config.json, the run dir, the spool, a log or a table.

Three runs cover the three ways a token reaches the ranks: the embedded collector's
generated role tokens, the user's one token for an external collector (and for an
embedded one), and a collector that never answers (everything goes to the spool).
"""

import os
import secrets
import stat
from pathlib import Path

import duckdb
import pytest

from tests.integration.trainer_run import run_trainer
from tests.unit.collector.collector_server import CollectorProcess
from trainer.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RUN = ["--steps", "3", "--dp", "2", "--layers", "2"]
NO_TOKEN_ENV = {"LLMWATCH_TOKEN": "", "LLMWATCH_INGEST_TOKEN": "", "LLMWATCH_READ_TOKEN": "",
                "LLMWATCH_CONTROL_TOKEN": ""}


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def files_holding(root: Path, needles: list[str], *, skip=("tokens",)) -> list[str]:
    """Every file under `root` (outside `skip`) whose bytes contain a needle."""
    hits = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or rel.parts[0] in skip:
            continue
        data = path.read_bytes()
        hits += [f"{rel}" for n in needles if n.encode() in data]
    return hits


def tables_holding(db: Path, needles: list[str]) -> list[str]:
    """Every table of the DuckDB file with a value containing a needle (all columns as text:
    the raw file is compressed, so only a query can say a string is not there)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        hits = []
        tables = [t for (t,) in con.execute("SELECT table_name FROM information_schema.tables "
                                            "WHERE table_type = 'BASE TABLE'").fetchall()]
        assert "runs" in tables and con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
        for t in tables:
            for row in con.execute(f'SELECT * FROM "{t}"').fetchall():
                text = repr(row)
                hits += [t for n in needles if n in text]
        return hits
    finally:
        con.close()


def test_embedded_collector_role_tokens_stay_in_their_files(tmp_path):
    r = run_trainer(tmp_path / "run", "--telemetry", *RUN, env=NO_TOKEN_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    tokens_dir = r.run_dir / "tokens"
    files = {p.name: p for p in tokens_dir.iterdir()}
    assert sorted(files) == ["control", "ingest", "read"]
    assert mode(r.run_dir) == 0o700 and mode(tokens_dir) == 0o700
    assert all(mode(p) == 0o600 for p in files.values())
    tokens = [p.read_text().strip() for p in files.values()]
    assert len(set(tokens)) == 3 and all(len(t) >= 40 for t in tokens)
    assert not (r.run_dir / "collector.token").exists()
    # the user is told where they are, and only that
    for role in ("read", "control", "ingest"):
        assert f"{role} token in {tokens_dir / role}" in r.stdout
    assert (r.run_dir / "config.json").exists() and (r.run_dir / "collector.log").exists()
    assert files_holding(r.run_dir, tokens) == []  # config.json, collector.log, the DuckDB file, ...
    assert not any(t in r.stdout or t in r.stderr for t in tokens)
    assert tables_holding(r.run_dir / "telemetry.duckdb", tokens) == []
    con = duckdb.connect(str(r.run_dir / "telemetry.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 3 * 2  # the ingest token worked
    con.close()


def test_users_token_file_with_the_embedded_collector(tmp_path):
    token = secrets.token_urlsafe(32)
    token_file = tmp_path / "my.token"
    token_file.write_text(token + "\n")
    os.chmod(token_file, 0o600)
    r = run_trainer(tmp_path / "run", "--telemetry", "--token-file", str(token_file), "--steps", "2",
                    "--layers", "2", env=NO_TOKEN_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    copy = r.run_dir / "tokens" / "token"
    assert sorted(p.name for p in copy.parent.iterdir()) == ["token"] and mode(copy) == 0o600
    assert copy.read_text().strip() == token
    assert files_holding(r.run_dir, [token]) == [] and token not in r.stdout + r.stderr
    assert tables_holding(r.run_dir / "telemetry.duckdb", [token]) == []


def test_external_collector_token_reaches_no_file_log_or_table(tmp_path):
    token = secrets.token_urlsafe(32)
    token_file = tmp_path / "ingest.token"
    token_file.write_text(token + "\n")
    os.chmod(token_file, 0o600)
    col = CollectorProcess(tmp_path / "ext.duckdb", token=token).start()
    try:
        r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--token-file", str(token_file),
                        *RUN, env=NO_TOKEN_ENV)
    finally:
        col.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (r.run_dir / "tokens").exists()  # nothing to write: the user holds the token
    assert files_holding(r.run_dir, [token], skip=()) == []
    assert token not in r.stdout + r.stderr
    assert token not in "".join(col.output)
    assert tables_holding(tmp_path / "ext.duckdb", [token]) == []
    con = duckdb.connect(str(tmp_path / "ext.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 3 * 2
    con.close()


def test_spooled_batches_hold_no_token(tmp_path):
    token = secrets.token_urlsafe(32)
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: every batch goes to the spool
    r = run_trainer(tmp_path / "run", "--telemetry", "--collector", url, "--steps", "2", "--layers", "2",
                    env={**NO_TOKEN_ENV, "LLMWATCH_TOKEN": token})
    assert r.returncode == 0, r.stderr[-3000:]
    segments = list((r.run_dir / "spool").glob("rank*/seg-*"))
    # the batch headers are plain JSON, rank 0's first one with the run's config: a search means something
    assert any(b'"micro_batch_size"' in p.read_bytes() for p in segments)
    assert files_holding(r.run_dir, [token], skip=()) == []
    assert token not in r.stdout + r.stderr


def test_ranks_ship_over_tls_with_only_the_ingest_token(tmp_path):
    """A collector beyond loopback: HTTPS with a CA file, role tokens, the ranks
    holding the ingest token alone."""
    from tests.integration.test_collector_gate import _self_signed

    cert, key = _self_signed(tmp_path)
    tokens = {role: secrets.token_urlsafe(32) for role in ("ingest", "read", "control")}
    args = ["--tls-cert", str(cert), "--tls-key", str(key)]
    for role, token in tokens.items():
        (tmp_path / role).write_text(token + "\n")
        os.chmod(tmp_path / role, 0o600)
        args += [f"--{role}-token-file", str(tmp_path / role)]
    col = CollectorProcess(tmp_path / "tls.duckdb", token=None, scheme="https", args=tuple(args)).start()
    try:
        r = run_trainer(tmp_path / "run", "--telemetry", "--collector", col.url, "--ca-file", str(cert),
                        "--token-file", str(tmp_path / "ingest"), *RUN, env=NO_TOKEN_ENV)
    finally:
        col.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list((r.run_dir / "spool").glob("rank*/seg-*"))  # everything was delivered
    con = duckdb.connect(str(tmp_path / "tls.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 3 * 2
    assert con.execute("SELECT config->'telemetry'->>'ca_file' FROM runs").fetchone()[0] == str(cert)
    con.close()
    assert tables_holding(tmp_path / "tls.duckdb", list(tokens.values())) == []
