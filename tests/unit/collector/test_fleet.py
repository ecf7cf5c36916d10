"""Fleet memory, the read side (collector/read/fleet.py) and what uses it: each node's history
across runs from a collector's file and from the Parquet archive (an older schema's runs, an
empty archive, a run in both counted once), `collector nodes`, and a live collector that
opens a node_history incident when a run starts on a node that failed in two earlier runs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import polars as pl
import pytest

from agent import wire
from analysis import Analyzer
from collector.offline import nodes as nodes_cmd
from collector.offline.archive import archive
from collector.offline.replay import replay_run
from collector.read import fleet, queries
from collector.settings import Settings, WriterSettings
from collector.storage import Storage
from tests.fleet_runs import runs_file
from tests.polling import wait_until
from tests.unit.collector.collector_batches import make_batch, steps_section
from tests.unit.collector.collector_server import ROOT, TOKEN, CollectorProcess

DAY = 86400.0
NOW = time.time()


@pytest.fixture
def fleet_file(tmp_path) -> Path:
    """r1 (3 days ago): node1 straggled twice; r2 (1 day ago): node1 isolated after a hang, node0 a
    loss spike (not a node's fault); r0 (30 days ago): node1 crashed."""
    return runs_file(tmp_path / "fleet.duckdb", [
        ("r0", NOW - 30 * DAY, {"node0": [], "node1": ["crash"]}),
        ("r1", NOW - 3 * DAY, {"node0": [], "node1": ["straggler", "straggler"]}),
        ("r2", NOW - DAY, {"node0": ["loss_spike"], "node1": ["hang"]}, ("node1",))])


def _what(table) -> list[tuple[str, str, str]]:
    return sorted((r["past_run_id"], r["node"], r["what"]) for r in table.to_pylist())


def test_a_files_history_of_some_nodes_within_the_window(fleet_file):
    con = duckdb.connect(str(fleet_file), read_only=True)
    try:
        t = fleet.file_history(con, "new", ["node1"], since_ts=NOW - 7 * DAY, until_ts=NOW)
        every = fleet.fleet_history(con, "", None, since_ts=NOW - 60 * DAY, until_ts=NOW)
        assert fleet.run_nodes(con, "r2") == ["node0", "node1"]
    finally:
        con.close()
    assert t.schema == fleet.HISTORY_SCHEMA and set(t.column("run_id").to_pylist()) == {"new"}
    assert _what(t) == [("r1", "node1", "seen"), ("r1", "node1", "straggler"), ("r1", "node1", "straggler"),
                        ("r2", "node1", "hang"), ("r2", "node1", "isolated"), ("r2", "node1", "seen")]
    assert ("r0", "node1", "crash") in _what(every) and ("r2", "node0", "loss_spike") in _what(every)


def test_the_archive_gives_the_same_history_and_a_run_in_both_counts_once(fleet_file, tmp_path):
    out = tmp_path / "archive"
    archive(fleet_file, out)
    from_archive = fleet.fleet_history(None, "new", ["node0", "node1"], since_ts=NOW - 7 * DAY, until_ts=NOW,
                                       archive_dir=out)
    con = duckdb.connect(str(fleet_file), read_only=True)
    try:
        from_file = fleet.file_history(con, "new", ["node0", "node1"], since_ts=NOW - 7 * DAY, until_ts=NOW)
        both = fleet.fleet_history(con, "new", ["node0", "node1"], since_ts=NOW - 7 * DAY, until_ts=NOW,
                                   archive_dir=out)
    finally:
        con.close()
    assert _what(from_archive) == _what(from_file) == _what(both)  # the file's runs are not read twice
    assert sorted(from_archive.column("incident_id").to_pylist(), key=str) == sorted(
        from_file.column("incident_id").to_pylist(), key=str)


def test_an_older_schemas_runs_an_empty_archive_and_no_archive(tmp_path):
    root = tmp_path / "archive"
    con = duckdb.connect()
    try:  # an archive written before nodes had isolated_ts and incident_id, and ranks hw_id
        for table, sql in {
            "ranks": f"SELECT 'old' AS run_id, 0 AS rank, 'node1' AS node, {NOW - DAY} AS first_seen_ts",
            "nodes": f"SELECT 'old' AS run_id, 'node1' AS node, 'isolated' AS status, {NOW - DAY} AS updated_ts",
            "incidents": f"SELECT 1::BIGINT AS id, 'old' AS run_id, 'hang' AS kind, 'node1' AS node, "
                         f"{NOW - DAY} AS opened_ts",
        }.items():
            (root / table).mkdir(parents=True)
            con.execute(f"COPY (SELECT *, '2026-01-01' AS day FROM ({sql})) TO '{root / table}' "
                        "(FORMAT parquet, PARTITION_BY (run_id, day))")  # the archive's layout: run and day
    finally:
        con.close()
    got = fleet.archive_history(root, "new", ["node1"], since_ts=NOW - 7 * DAY, until_ts=NOW)
    assert _what(got) == [("old", "node1", "hang"), ("old", "node1", "seen")]  # no isolated_ts: no isolation
    empty = tmp_path / "empty"
    (empty / "incidents").mkdir(parents=True)
    for where in (empty, tmp_path / "missing"):
        assert fleet.archive_history(where, "new", ["node1"], since_ts=0.0, until_ts=NOW).num_rows == 0


def _nodes_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"db": None, "archive": None, "since": None, "rules": None, "json": False, **kw})


def test_collector_nodes_lists_the_flagged_node_first(fleet_file, tmp_path, capsys):
    assert nodes_cmd.main(_nodes_args(db=str(fleet_file), json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(n["node"], n["runs"], n["fault_runs"], n["faults"], n["isolations"], n["flagged"]) for n in out["nodes"]] \
        == [("node1", 2, 2, 3, 1, True), ("node0", 2, 0, 0, 0, False)]  # r0 is past the 7-day window
    assert out["nodes"][0]["by_kind"] == {"straggler": 2, "hang": 1, "isolated": 1}
    assert out["nodes"][0]["last_fault_run"] == "r2"
    assert nodes_cmd.main(_nodes_args(db=str(fleet_file), since="60d")) == 0
    text = capsys.readouterr().out
    assert "2 node(s) seen since" in text and "1 flagged" in text and "3 run(s)" in text
    line = next(ln for ln in text.splitlines() if "node1" in ln)
    assert line.startswith("!") and "crash 1" in line and "straggler 2" in line
    out_dir = tmp_path / "archive"
    archive(fleet_file, out_dir)
    assert nodes_cmd.main(_nodes_args(archive=str(out_dir), json=True)) == 0
    assert json.loads(capsys.readouterr().out)["nodes"][0]["fault_runs"] == 2
    assert nodes_cmd.main(_nodes_args()) == 2  # neither a file nor an archive


def test_the_history_is_read_again_only_when_the_nodes_change_or_it_got_old(fleet_file):
    calls = []
    con = duckdb.connect(str(fleet_file), read_only=True)

    def read(fn, *args, **kw):
        calls.append(kw["nodes"])
        return fn(con, *args, **kw)

    try:
        h = fleet.RunHistories(read, window_s=7 * DAY, max_age_s=3600.0)
        assert h.for_run("new", ["node1", "node1"]).num_rows == 6
        h.for_run("new", ["node1"])
        h.for_run("new", ["node1", "node0"])  # a new node: read again
        assert calls == [["node1"], ["node0", "node1"]]
        h.max_age_s = 0.0
        h.for_run("new", ["node0", "node1"])
        assert len(calls) == 3
    finally:
        con.close()


def test_a_live_collector_flags_a_run_on_a_node_that_failed_in_two_runs(fleet_file, tmp_path):
    """The file's own runs are the history: a new run on node0 and node1 opens one node_history
    incident at step 0, for node1 (rank 2), with its record; a replay of the file finds it too."""
    settings = Settings(db_path=fleet_file, writer=WriterSettings(linger_s=0.0, min_interval_s=0.0))
    storage = Storage(settings, analyzer=Analyzer(), detection_tick_s=0.1)
    try:
        info = {"run_id": "new", "world_size": 4, "mesh": {"dp": 4, "tp": 1, "pp": 1}}
        for rank in range(4):
            storage.ingest_blocking(_decode(make_batch(
                "new", rank, 0, node=f"node{rank // 2}", run=info if rank == 0 else None,
                coords={"dp": rank, "tp": 0, "pp": 0},
                sections={wire.STEP: steps_section([1], step_s=0.5)})))

        def flagged():
            return [r for r in storage.read(queries.incidents, "new") if r["kind"] == "node_history"]

        assert wait_until(flagged, timeout_s=20)
        got = flagged()
    finally:
        storage.close()
    assert len(got) == 1, got
    con = duckdb.connect(str(fleet_file), read_only=True)
    try:  # `collector replay` of the file says the same: the history is what came before the run began
        replayed = [i for i in replay_run(con, "new").incidents if i["kind"] == "node_history"]
    finally:
        con.close()
    assert [(i["node"], i["rank"], i["step_from"]) for i in replayed] == [("node1", 2, 0)]
    inc = got[0]
    assert (inc["node"], inc["rank"], inc["step_from"], inc["status"]) == ("node1", 2, 0, "open")
    ev = inc["evidence"] if isinstance(inc["evidence"], dict) else json.loads(inc["evidence"])
    assert (ev["runs"], ev["fault_runs"], ev["by_kind"]) == (2, 2, {"straggler": 2, "hang": 1, "isolated": 1})
    assert pl.DataFrame(ev["latest_faults"])["run_id"].to_list()[:2] == ["r2", "r2"]


def test_a_renamed_host_keeps_its_record_by_its_hardware_id(tmp_path):
    """The agents send each rank's hardware id (its GPU's UUID, or LLMWATCH_HW_ID) with every batch;
    the collector keeps it in `ranks.hw_id`. A host that failed in two runs as gpu-host-7 and comes
    back as node1 is flagged as node1, its old name in the evidence; and with the archive, the
    same from the archived runs."""
    path = runs_file(tmp_path / "hw.duckdb", [
        ("r1", NOW - 2 * DAY, {"gpu-host-7": ["straggler"], "node0": []}, (), {"gpu-host-7": "GPU-7", "node0": "GPU-0"}),
        ("r2", NOW - DAY, {"gpu-host-7": ["hang"], "node0": []}, (), {"gpu-host-7": "GPU-7", "node0": "GPU-0"})])
    settings = Settings(db_path=path, writer=WriterSettings(linger_s=0.0, min_interval_s=0.0))
    storage = Storage(settings, analyzer=Analyzer(), detection_tick_s=0.1)
    try:
        info = {"run_id": "new", "world_size": 2, "mesh": {"dp": 2, "tp": 1, "pp": 1}}
        for rank, (node, hw) in enumerate((("node0", "GPU-0"), ("node1", "GPU-7"))):
            storage.ingest_blocking(_decode(make_batch(
                "new", rank, 0, node=node, hw_id=hw, run=info if rank == 0 else None,
                coords={"dp": rank, "tp": 0, "pp": 0}, sections={wire.STEP: steps_section([1], step_s=0.5)})))

        def flagged():
            return [r for r in storage.read(queries.incidents, "new") if r["kind"] == "node_history"]

        assert wait_until(flagged, timeout_s=20)
        got = flagged()
        stored = storage.read(lambda cur: cur.execute(
            "SELECT rank, hw_id FROM ranks WHERE run_id = 'new' ORDER BY rank").fetchall())
    finally:
        storage.close()
    assert stored == [(0, "GPU-0"), (1, "GPU-7")]
    assert [(i["node"], i["rank"]) for i in got] == [("node1", 1)], got
    ev = got[0]["evidence"] if isinstance(got[0]["evidence"], dict) else json.loads(got[0]["evidence"])
    assert ev["past_names"] == ["gpu-host-7"] and ev["hw_ids"] == ["GPU-7"] and ev["fault_runs"] == 2


def _decode(body: bytes):
    from collector.ingest.decode import decode

    return decode(body)


@pytest.mark.slow  # a real collector process
def test_a_running_collector_answers_for_its_runs_and_its_archive(fleet_file, tmp_path):
    """GET /v1/fleet/nodes (the read role) and `collector nodes --url`: the collector's own runs and
    those of the archive it was started with (`--archive`), one record per node."""
    other = runs_file(tmp_path / "other.duckdb", [
        ("r8", NOW - 2 * DAY, {"node2": ["slow_link"]}), ("r9", NOW - DAY, {"node2": ["device_health"]})])
    archive(other, tmp_path / "archive")
    proc = CollectorProcess(fleet_file, args=("--archive", str(tmp_path / "archive"))).start()
    try:
        token = tmp_path / "read.token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        out = subprocess.run([sys.executable, "-m", "collector", "nodes", "--url", proc.url, "--token-file",
                              str(token), "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        refused = subprocess.run([sys.executable, "-m", "collector", "nodes", "--url", proc.url], capture_output=True,
                                 text=True, timeout=60, cwd=ROOT, env={k: v for k, v in os.environ.items()
                                                                        if not k.startswith("LLMWATCH_")})
    finally:
        proc.stop()
    got = {n["node"]: (n["runs"], n["fault_runs"], n["flagged"]) for n in json.loads(out.stdout)["nodes"]}
    assert got == {"node1": (2, 2, True), "node2": (2, 2, True), "node0": (2, 0, False)}, got
    assert refused.returncode != 0 and "401" in refused.stderr, refused.stderr


def test_the_fleet_report_has_each_run_on_each_node_and_the_runs_goodput(fleet_file):
    """What the Fleet page draws: per run and node its faults, kinds and isolation; per run its
    goodput, by the same SQL as docs/fleet.md's goodput_per_run."""
    from analysis import load_rules
    from tests.docs_sql import DOCS, sql_blocks

    assert sql_blocks(DOCS / "fleet.md")["goodput_per_run"].split() == fleet.GOODPUT_PER_RUN_SQL.format(
        where="").split()
    con = duckdb.connect(str(fleet_file), read_only=True)
    try:
        report = fleet.node_records(con, since_ts=NOW - 7 * DAY, until_ts=NOW, rules=load_rules())
    finally:
        con.close()
    cells = {(c["run_id"], c["node"]): c for c in report["cells"]}
    assert cells[("r2", "node1")] == {"run_id": "r2", "node": "node1", "faults": 1, "kinds": ["hang"],
                                      "isolated": True, "seen": True}
    assert cells[("r1", "node1")]["faults"] == 2 and cells[("r2", "node0")]["faults"] == 0  # a spike: not a fault
    assert [r["run_id"] for r in report["runs"]] == ["r1", "r2"] and report["num_runs"] == 2
    assert all(r["goodput"] is None for r in report["runs"])  # these runs have no steps
