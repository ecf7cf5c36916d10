"""`collector replay` without processes: a simulated run written into a DuckDB file
(tests/unit/analysis/sim.py), replayed from it, its incidents collapsed by the live
collector's IncidentBook and scored against the simulator's truth."""

from __future__ import annotations

import json

import duckdb
import polars as pl
import pytest

from analysis import Finding, score, truths_from_rows
from collector import cli
from collector.offline.replay import IncidentLedger, replay_run, scored_incidents
from collector.read import queries
from collector.store.schema import migrate
from tests.unit.analysis.sim import Layout, Nan, Sim, Straggler

_ROW_TABLES = ("steps", "collectives", "heartbeats", "events", "scalars", "runs", "ranks", "nodes")
_KEYS = {"runs": ["run_id"], "ranks": ["run_id", "rank"], "nodes": ["run_id", "node"]}  # sent more than once


def write_sim(path, sim: Sim) -> None:
    """Every commit's rows into the collector's tables (the columns both have)."""
    con = duckdb.connect(str(path))
    migrate(con)
    frames: dict[str, list[pl.DataFrame]] = {}
    for _, f in sim.build():
        for name, df in f.tables().items():
            frames.setdefault(name, []).append(df)
    for name in _ROW_TABLES:
        if name not in frames:
            continue
        df = pl.concat(frames[name], how="diagonal_relaxed")
        if name in _KEYS:
            df = df.unique(subset=_KEYS[name], keep="last")
        if name == "runs":
            df = df.with_columns(pl.lit(0.0).alias("created_ts"), pl.lit(0.0).alias("updated_ts"))
        if name == "ranks":
            df = df.with_columns(pl.lit(0.0).alias("first_seen_ts"), pl.lit(0.0).alias("last_seen_ts"))
        cols = {c for (c,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?",
                                          [name]).fetchall()}
        df = df.select([c for c in df.columns if c in cols])  # the INSERT below reads `df` by name
        con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM df")
    con.close()


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=120, seed=7, local_signals=True, finish=True,
              faults=(Straggler(rank=3, start=30, factor=1.6), Nan(step=80, rank=1)))
    path = tmp_path_factory.mktemp("replay") / "sim.duckdb"
    write_sim(path, sim)
    truth = path.parent / "injections.jsonl"
    truth.write_text("".join(json.dumps(r) + "\n" for r in sim.truth))
    return path, truth


def test_replay_of_the_file_finds_the_faults(simulated):
    path, truth = simulated
    con = duckdb.connect(str(path), read_only=True)
    try:
        (run_id,) = queries.run_ids(con)
        r = replay_run(con, run_id)
    finally:
        con.close()
    kinds = {(i["kind"], i["rank"]) for i in r.incidents}
    assert ("straggler", 3) in kinds and ("nan", 1) in kinds, r.incidents
    s = score(scored_incidents([r]), truths_from_rows(json.loads(x) for x in truth.read_text().splitlines()))
    assert not s.missed and not s.false_positives, s.table()
    assert s.by_kind["nan"].culprit_accuracy == 1.0 and s.by_kind["straggler"].culprit_accuracy == 1.0
    assert all(st is not None for st in r.opened_step.values())  # latency in steps is known


def test_cli_replay_prints_incidents_and_scores(simulated, capsys):
    path, truth = simulated
    before = path.read_bytes()
    assert cli.main(["replay", "--db", str(path), "--truth", str(truth)]) == 0
    out = capsys.readouterr().out
    assert path.read_bytes() == before
    lines = out.splitlines()
    assert any(line.split()[:1] == ["straggler"] and line.split()[5:6] == ["1.000"] for line in lines), out
    assert any(line.startswith("  nan ") and "rank 1 " in line for line in lines), out
    assert cli.main(["replay", "--db", str(path), "--run", "nope"]) == 2


def _finding(status="open", **kw) -> Finding:
    base = dict(kind="straggler", key="straggler:node1#1", run_id="r", rank=3, node="node1", step_from=10,
                step_to=12, ts=100.0, detected_step=12, evidence={"fired_at_step": 11})
    return Finding(**{**base, **kw, "status": status})


def test_the_ledger_collapses_findings_as_the_writer_does():
    ledger = IncidentLedger()
    ledger.record("r", [_finding()], now=100.0)
    ledger.record("r", [_finding(step_from=9, step_to=15, rank=None, ts=101.0, detected_step=15)], now=101.0)
    ledger.record("r", [_finding(status="resolved", ts=105.0)], now=105.0)
    ledger.record("r", [_finding(ts=110.0, step_from=30, step_to=31)], now=110.0)  # the cause again: a new one
    (first, second) = [ledger.rows[i] for i in sorted(ledger.rows)]
    assert (first["step_from"], first["step_to"], first["rank"], first["node"]) == (9, 15, None, "node1")
    assert (first["status"], first["opened_ts"], first["closed_ts"]) == ("closed", 100.0, 105.0)
    assert ledger.opened_step[first["id"]] == 11  # a straggler's fired_at_step
    assert (second["status"], second["step_from"]) == ("open", 30)


def test_a_slow_links_latency_counts_from_its_fired_step_and_a_divergence_keeps_its_suspects():
    from collector.offline.replay import RunReplay

    ledger = IncidentLedger()
    ledger.record("r", [_finding(kind="slow_link", key="slow_link:dp0#1", evidence={"fired_at_step": 11}),
                        _finding(kind="data_stall", key="data_stall:node1#1", detected_step=14, evidence={}),
                        _finding(kind="replica_divergence", key="replica_divergence#1", rank=None, node=None,
                                 step_from=20, step_to=30, detected_step=31,
                                 evidence={"divergent_ranks": [0, 1], "majority": False})], now=100.0)
    rows = [ledger.rows[i] for i in sorted(ledger.rows)]
    assert [ledger.opened_step[r["id"]] for r in rows] == [11, 14, 31]
    incs = scored_incidents([RunReplay(run_id="r", incidents=rows, opened_step=ledger.opened_step)])
    assert [(i.kind, i.opened_step, i.suspects) for i in incs] == [
        ("slow_link", 11, ()), ("data_stall", 14, ()), ("replica_divergence", 31, (0, 1))]


def test_rules_change_what_the_replay_finds(simulated, tmp_path, capsys):
    path, _ = simulated
    rules = tmp_path / "rules.toml"
    rules.write_text("[straggler]\nenabled = false\n")
    assert cli.main(["replay", "--db", str(path), "--rules", str(rules), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"].values()
    assert {i["kind"] for i in run["incidents"]} == {"nan"}
    rules.write_text("[straggler]\nno_such_key = 1\n")
    assert cli.main(["replay", "--db", str(path), "--rules", str(rules)]) == 2


def test_the_cost_models_decisions_are_scored_on_what_they_realized(tmp_path, capsys):
    """Each live action the cost model chose, its predicted gain against the realized one: one that
    paid, one that did not (the node's replacement was slow too), one the run ended before measuring;
    a rollback (no prediction) is not among them."""
    path = tmp_path / "sim.duckdb"
    write_sim(path, Sim(layout=Layout(dp=2, nodes=2), steps=40, seed=3))
    con = duckdb.connect(str(path))
    run_id = queries.run_ids(con)[0]
    rows = [(1, "isolate", "node1", {"predicted": {"best": "replace", "gain_s": 14.6},
                                     "realized": {"gain_s": 19.3, "step_s_before": 0.16, "step_s_after": 0.03,
                                                  "recovery_s": 1.1}}),
            (2, "isolate", "node2", {"predicted": {"best": "shrink", "gain_s": 3.0},
                                     "realized": {"gain_s": -2.5, "step_s_before": 0.2, "step_s_after": 0.21}}),
            (3, "isolate", "node3", {"predicted": {"best": "shrink", "gain_s": 5.0}}),
            (4, "rollback", None, {"reason": "nan"})]
    for id_, kind, node, detail in rows:
        con.execute("INSERT INTO actions (id, run_id, kind, status, mode, requested_ts, node, incident_id, detail) "
                    "VALUES (?, ?, ?, 'done', 'auto', ?, ?, ?, ?)", [id_, run_id, kind, float(id_), node, id_,
                                                                       json.dumps(detail)])
    con.close()
    assert cli.main(["replay", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cost model: 1 of 2 measured decisions paid (1 not measured)" in out, out
    assert "isolate node1 (replace, done): predicted gain 14.6 s, realized 19.3 s [paid]" in out, out
    assert "isolate node2 (shrink, done): predicted gain 3 s, realized -2.5 s [DID NOT PAY]" in out, out
    assert cli.main(["replay", "--db", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["cost_model"]
    assert (got["num_paid"], got["num_measured"]) == (1, 2)
    assert [(d["node"], d["best"], d["paid"]) for d in got["decisions"]] == [
        ("node1", "replace", True), ("node2", "shrink", False), ("node3", "shrink", None)]
