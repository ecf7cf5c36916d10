"""The launcher's reports: every rank's exit once and in order (the failed one before
the ones it stopped), the rank -1 batches that carry them, a collector that does
not answer, and the demo terminal's incident lines."""

from __future__ import annotations

import io
import signal
import socket
import threading
import time

from agent import wire
from agent.launcher import LauncherReporter
from agent.transport import PostResult
from collector.ingest.decode import decode
from tests.unit.trainer.fakes import FakeClock, FakeProc
from trainer import supervisor
from trainer.config import HealingConfig, JobConfig, ParallelConfig
from trainer.incident_feed import IncidentFeed, describe, read_token
from trainer.supervisor import Supervisor


def supervise(procs, *, on_exit, policy="auto", monkeypatch, tmp_path) -> int:
    """One job under the supervisor (trainer/supervisor.py), its one round these ranks."""
    monkeypatch.setattr(supervisor, "time", FakeClock())
    cfg = JobConfig(parallel=ParallelConfig(dp=len(procs)), healing=HealingConfig(policy=policy))
    rounds = iter([procs])
    return Supervisor(cfg, tmp_path, spawn=lambda cfg, layout, round_: next(rounds), on_exit=on_exit,
                      log=lambda m: None).run()


def test_a_clean_run_reports_every_rank_exited_zero(monkeypatch, tmp_path):
    seen = []
    procs = [FakeProc(0, polls=p) for p in (1, 3, 2)]
    assert supervise(procs, on_exit=lambda r, c, cause: seen.append((r, c, cause)), monkeypatch=monkeypatch,
                     tmp_path=tmp_path) == 0
    assert seen == [(0, 0, "exited"), (2, 0, "exited"), (1, 0, "exited")]


def test_a_failed_rank_is_reported_before_the_ranks_the_launcher_stops(monkeypatch, tmp_path):
    seen = []

    def on_exit(rank, code, *, cause):
        seen.append((rank, code, cause, [list(p.signals) for p in procs]))

    procs = [FakeProc(None), FakeProc(17, polls=2), FakeProc(None), FakeProc(0, polls=1)]
    # without healing a failed rank ends the job, as it would without this tool
    assert supervise(procs, on_exit=on_exit, policy="off", monkeypatch=monkeypatch, tmp_path=tmp_path) == 1
    # rank 3 finished on its own first; rank 1's failure is reported before anyone is signalled
    assert [s[:3] for s in seen] == [(3, 0, "exited"), (1, 17, "exited"), (0, 143, "stopped"), (2, 143, "stopped")]
    assert seen[1][3] == [[], [], [], []]


def test_a_peer_that_fails_after_the_crash_went_down_with_the_job(monkeypatch, tmp_path):
    """Rank 1 crashed; rank 0's collective failed on the closed socket and it exited on its
    own before the launcher signalled it: it is not a second culprit."""
    seen = []
    procs = [FakeProc(1, polls=3), FakeProc(17, polls=2), FakeProc(None)]
    assert supervise(procs, on_exit=lambda r, c, cause: seen.append((r, c, cause)), policy="off",
                     monkeypatch=monkeypatch, tmp_path=tmp_path) == 1
    assert seen == [(1, 17, "exited"), (0, 1, "stopped"), (2, 143, "stopped")]
    assert procs[0].signals == []


def test_a_report_that_raises_does_not_stop_the_supervision(monkeypatch, tmp_path):
    def on_exit(rank, code, *, cause):
        raise RuntimeError("collector client bug")

    assert supervise([FakeProc(0), FakeProc(0, polls=2)], on_exit=on_exit, monkeypatch=monkeypatch,
                     tmp_path=tmp_path) == 0


class StubClient:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.bodies: list[bytes] = []
        self.block = block
        self.closed = False

    def post(self, body, *, timeout_s=None):
        if self.block is not None:
            self.block.wait(10)
        self.bodies.append(bytes(body))
        return PostResult("ok", 200, {"accepted": 1})

    def close(self) -> None:
        self.closed = True


def test_exits_go_out_as_launcher_batches_the_collector_accepts():
    client = StubClient()
    rep = LauncherReporter("http://unused", "tok", "run-7", client=client, clock=lambda: 50.0, node="host")
    rep.rank_exited(1, 17, cause="exited")
    rep.rank_exited(2, -signal.SIGKILL, cause="stopped")
    rep.close(timeout_s=5.0)
    batches = [decode(b) for b in client.bodies]
    assert [(b.rank, b.batch_seq, b.run_id, b.sections) for b in batches] == [
        (-1, 0, "run-7", {}), (-1, 1, "run-7", {})]
    assert [(e.kind, e.ts, e.data_json) for b in batches for e in b.events] == [
        ("rank_exited", 50.0, '{"rank":1,"exit_code":17,"signal":null,"cause":"exited"}'),
        ("rank_exited", 50.0, '{"rank":2,"exit_code":null,"signal":"SIGKILL","cause":"stopped"}')]
    assert rep.num_sent == 2 and client.closed
    assert wire.decode_batch(client.bodies[0]).header["node"] == "host"


def test_a_collector_that_is_down_or_stuck_costs_a_bounded_wait(caplog):
    with socket.socket() as s:  # nobody listens here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rep = LauncherReporter(f"http://127.0.0.1:{port}", "tok", "r", timeout_s=0.5)
    rep.rank_exited(0, 1, cause="exited")
    rep.rank_exited(1, 1, cause="exited")
    rep.close(timeout_s=5.0)
    assert rep.num_failed == 2 and rep.num_sent == 0
    assert sum("could not report" in r.message for r in caplog.records) == 1  # logged once
    stuck = threading.Event()
    rep = LauncherReporter("http://unused", None, "r", client=StubClient(block=stuck))
    rep.rank_exited(0, 1, cause="exited")
    t0 = time.monotonic()
    rep.close(timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0
    stuck.set()


def test_the_feed_prints_each_incident_once_and_the_list_at_the_end(tmp_path):
    rows = []
    out = io.StringIO()
    feed = IncidentFeed("http://unused", "t", "r", out=out, fetch=lambda: list(rows))
    feed.poll()
    rows.append({"id": 1, "kind": "nan", "step_from": 40, "rank": 2, "node": "node0", "status": "open",
                 "root_cause": "non-finite first in rank 2's forward at step 40"})
    feed.poll()
    rows[0] = {**rows[0], "root_cause": "updated"}
    rows.append({"id": 2, "kind": "crash", "step_from": None, "rank": None, "node": None, "status": "open",
                 "root_cause": None, "evidence": {"summary": "every rank went silent"}})
    feed.poll()
    feed.finish()
    assert out.getvalue().splitlines() == [
        "incident: nan step 40 rank 2 node node0  non-finite first in rank 2's forward at step 40",
        "incident: crash step - rank - node -  every rank went silent",
        "incidents: 2",
        "  nan step 40 rank 2 node node0  updated  [open]",
        "  crash step - rank - node -  every rank went silent  [open]",
    ]
    empty = io.StringIO()
    IncidentFeed("http://unused", "t", "r", out=empty, fetch=list).finish()
    assert empty.getvalue() == "incidents: none\n"
    (tmp_path / "read").write_text("secret\n")
    assert read_token(tmp_path) == "secret" and read_token(tmp_path / "missing") is None
    assert describe({"kind": "spike"}) == "incident: spike step - rank - node -"


def test_a_collector_that_does_not_answer_leaves_the_feed_quiet(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = io.StringIO()
    feed = IncidentFeed(f"http://127.0.0.1:{port}", "t", "r", timeout_s=0.5, out=out)
    feed.poll()
    feed.poll()
    feed.finish()
    assert out.getvalue() == "incidents: none\n"
    assert capsys.readouterr().err.count("cannot read incidents") == 1
