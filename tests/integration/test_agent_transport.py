"""The agent against a small real HTTP server on 127.0.0.1 that decodes batches.

The server stands in for the collector (written elsewhere): it decodes every
POST with `wire.decode_batch`, stores each batch key once (and counts repeats),
answers with the collector's response shape, and can reject, stall or carry
commands. Intervals are 0.05 s so the suite stays fast.

No test sleeps to let something happen: each waits for the condition it needs
(`_wait_for`, bounded), so a loaded machine makes it slower, not flaky.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import statistics
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent import Agent, AgentConfig, wire
from tests.polling import wait_until as _wait_for

pytestmark = pytest.mark.integration


class FakeCollector:
    def __init__(self, port: int = 0, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.batches: list[wire.Batch] = []  # distinct batches in arrival order
        self.keys: set[tuple] = set()
        self.num_duplicates = 0
        self.num_posts = 0
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.reject = False
        self.stall_s = 0.0
        self.num_stalls_left = -1  # how many requests still stall; -1: all while stall_s is set
        self.commands: list[dict] = []
        self.followup_s: float | None = None  # answered as `followup_s` (the policy watches the run) when set
        self.fail_seqs: dict[int, int] = {}  # batch_seq -> HTTP status answered to it, every time
        self.num_busy_left = 0  # answer this many more POSTs with 503 + Retry-After
        self.echo_auth = False  # answer 500 with the Authorization header in the body (a careless server)
        self.num_unauthorized = 0
        self.spans: list = []  # (name, span_id, parent_span_id, resource attributes)
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    outer._traces(body)
                    return self._reply(200, b"", "application/x-protobuf")
                with outer.lock:
                    outer.num_posts += 1
                    outer.num_in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.num_in_flight)
                try:
                    with outer.lock:
                        stall = outer.stall_s if outer.num_stalls_left != 0 else 0.0
                        outer.num_stalls_left -= 1 if outer.num_stalls_left > 0 else 0
                    if stall:
                        time.sleep(stall)
                    if outer.reject:
                        return self._reply(400, b'{"detail":"rejected by the test"}')
                    if outer.echo_auth:
                        return self._reply(500, json.dumps({"error": f"bad {self.headers['Authorization']}"}).encode())
                    if self.headers["Authorization"] != "Bearer tok":
                        with outer.lock:
                            outer.num_unauthorized += 1
                        return self._reply(401, b'{"error":"unauthorized"}')
                    with outer.lock:
                        busy = outer.num_busy_left > 0
                        outer.num_busy_left -= busy
                    if busy:
                        return self._reply(503, b'{"error":"busy, retry later"}', extra={"Retry-After": "1"})
                    assert self.headers["Content-Type"] == wire.CONTENT_TYPE
                    batch = wire.decode_batch(body)
                    if batch.header["batch_seq"] in outer.fail_seqs:
                        return self._reply(outer.fail_seqs[batch.header["batch_seq"]], b'{"error":"test"}')
                    with outer.lock:
                        if batch.key in outer.keys:
                            outer.num_duplicates += 1
                        else:
                            outer.keys.add(batch.key)
                            outer.batches.append(batch)
                        commands = list(outer.commands)
                    rows = sum(batch.num_rows(k) for k in wire.KINDS)
                    answer = {"accepted": rows, "duplicate": False, "commands": commands}
                    if outer.followup_s is not None:
                        answer["followup_s"] = outer.followup_s
                    self._reply(200, json.dumps(answer).encode())
                finally:
                    with outer.lock:
                        outer.num_in_flight -= 1

            def _reply(self, code: int, data: bytes, ctype: str = "application/json", extra: dict | None = None):
                self.send_response(code)
                for name, value in (extra or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        if ssl_context is not None:  # the handshake runs in accept(); a client that fails it is only logged
            self.server.socket = ssl_context.wrap_socket(self.server.socket, server_side=True)
            self.server.handle_error = lambda request, client_address: None
        self.port = self.server.server_address[1]
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def _traces(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            attrs = {a.key: (a.value.string_value or a.value.int_value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    with self.lock:
                        self.spans.append((span.name, span.span_id, span.parent_span_id, attrs,
                                           span.start_time_unix_nano, span.end_time_unix_nano))

    def rows(self, kind: str) -> list[dict]:
        out = []
        with self.lock:
            batches = list(self.batches)
        for b in batches:
            cols = b.columns.get(kind)
            if cols:
                out.extend(dict(zip(cols, vals)) for vals in zip(*(list(v) for v in cols.values())))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(url: str, tmp_path, **kw) -> AgentConfig:
    base = dict(url=url, token="tok", flush_interval_s=0.05, heartbeat_interval_s=0.05, spool_dir=str(tmp_path),
                capacity=4096, timeout_s=1.0, retry_min_s=0.05, retry_max_s=0.2, spool_flush_interval_s=0.2)
    base.update(kw)
    return AgentConfig(**base)


def _step(agent: Agent, step: int) -> None:
    agent.record_step(step, loss=1.0 / (step + 1), grad_norm=0.5, loss_scale=1.0, lr=1e-3, tokens=1024, step_s=0.01,
                      fwd_s=0.003, bwd_s=0.004, opt_s=0.001, data_s=0.001, comm_exposed_s=0.001, mem_bytes=10,
                      skipped=False)


@pytest.fixture
def collector():
    server = FakeCollector()
    yield server
    server.close()


def test_normal_flush_delivers_every_row_exactly_once(collector, tmp_path):
    agent = Agent(_config(collector.url, tmp_path), run_id="run1", rank=2, node="n0", coords={"dp": 2},
                  world_size=4, run_info={"config": {"steps": 200}})
    agent.start()
    for step in range(200):
        _step(agent, step)
        for seq in range(3):
            agent.collective(step, 3 * step + seq, step, "all_reduce", "dp", 0, -1, 4096, time.time(), 1e-4, 1e-5)
        if step % 20 == 0:
            agent.record_scalar(step, "eval/loss", step / 10)
        if step in (50, 100):  # several batches, however fast this loop runs against the flusher
            sent = collector.num_posts
            assert _wait_for(lambda: collector.num_posts > sent)
    agent.event("run_finished", step=199, status="completed")
    assert agent.flush(5.0)
    agent.close()
    assert [r["step"] for r in collector.rows("step")] == list(range(200))
    assert [r["loss"] for r in collector.rows("step")] == [1.0 / (s + 1) for s in range(200)]
    assert [r["seq"] for r in collector.rows("collective")] == list(range(600))
    assert [r["value"] for r in collector.rows("scalar")] == [s / 10 for s in range(0, 200, 20)]
    seqs = [b.header["batch_seq"] for b in collector.batches]
    assert len(seqs) > 2 and seqs == list(range(len(seqs))) and collector.num_duplicates == 0
    assert collector.batches[0].header["run"] == {"config": {"steps": 200}}
    assert all(b.header["run"] is None for b in collector.batches[1:])
    events = [e for b in collector.batches for e in b.header["events"]]
    assert [e["kind"] for e in events] == ["run_finished", "agent_closed"]  # close() says it closed cleanly
    stats = agent.stats()
    assert stats["sent"]["step"] == 200 and stats["sent"]["collective"] == 600
    assert sum(stats["dropped"].values()) == 0 and stats["batches"]["spooled"] == 0


def test_absent_collector_spools_then_everything_is_replayed_in_order(tmp_path):
    port = _free_port()
    agent = Agent(_config(f"http://127.0.0.1:{port}", tmp_path), run_id="run2", rank=0)
    agent.start()
    for step in range(60):
        _step(agent, step)
        time.sleep(0.005)
    assert _wait_for(lambda: agent.stats()["batches"]["spooled"] >= 3)
    server = FakeCollector(port)  # the collector appears on the same port
    try:
        for step in range(60, 120):
            _step(agent, step)
            time.sleep(0.002)
        assert _wait_for(lambda: len(server.rows("step")) == 120), len(server.rows("step"))
        agent.close()
        assert [r["step"] for r in server.rows("step")] == list(range(120))  # none lost, none twice, in order
        seqs = [b.header["batch_seq"] for b in server.batches]
        assert seqs == sorted(seqs) == list(range(len(seqs)))
        stats = agent.stats()
        assert stats["replayed"]["step"] > 0 and stats["replayed"]["step"] + stats["sent"]["step"] == 120
        assert stats["batches"]["replayed"] == stats["batches"]["spooled"] and stats["spool_bytes"] == 0
        print(f"duplicates seen by the server after retries: {server.num_duplicates}")
    finally:
        server.close()


def test_a_timed_out_post_is_spooled_and_replayed_and_the_server_dedupes_it(collector, tmp_path):
    collector.stall_s, collector.num_stalls_left = 0.6, 1  # the first POST outlives the agent's timeout
    agent = Agent(_config(collector.url, tmp_path, timeout_s=0.2), run_id="run2b", rank=0)
    agent.start()
    for step in range(20):
        _step(agent, step)
    assert _wait_for(lambda: agent.stats()["batches"]["spooled"] >= 1)
    for step in range(20, 40):
        _step(agent, step)
    assert agent.flush(5.0)
    assert _wait_for(lambda: collector.num_in_flight == 0)  # the stalled handler finished too
    agent.close()
    assert [r["step"] for r in collector.rows("step")] == list(range(40))
    assert collector.num_duplicates == 1  # stored by the stalled request and again by the replay


def test_restarted_rank_replays_what_its_crashed_incarnation_spooled(tmp_path):
    port = _free_port()
    first = Agent(_config(f"http://127.0.0.1:{port}", tmp_path), run_id="run3", rank=1)
    for step in range(10):
        _step(first, step)
    first.flush(1.0)  # no server: spooled
    first.close()
    server = FakeCollector(port)
    try:
        second = Agent(_config(server.url, tmp_path), run_id="run3", rank=1)
        second.start()
        _step(second, 10)
        assert second.flush(5.0)
        second.close()
        assert [r["step"] for r in server.rows("step")] == list(range(11))
        assert [b.header["incarnation"] for b in server.batches][0] == first.incarnation
        assert server.batches[-1].header["incarnation"] == second.incarnation
    finally:
        server.close()


def test_rejected_batch_is_dropped_counted_and_the_agent_keeps_going(collector, tmp_path, caplog):
    collector.reject = True
    agent = Agent(_config(collector.url, tmp_path), run_id="run4", rank=0)
    agent.start()
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        for step in range(5):
            _step(agent, step)
            assert not agent.flush(5.0)
    stats = agent.stats()
    assert stats["rejected"]["step"] == 5 and stats["batches"]["rejected"] >= 5
    assert "HTTP 400" in stats["last_error"] and stats["batches"]["spooled"] == 0
    assert sum("rejected a batch" in r.getMessage() for r in caplog.records) == 1  # logged once
    collector.reject = False
    # This flush answers for what was lost since the last one: on a loaded host the flusher's
    # own cycle (a heartbeat) can have shipped, and lost, a batch before `reject` went off.
    agent.flush(5.0)
    for step in range(5, 10):
        _step(agent, step)
    assert agent.flush(5.0)
    agent.close()
    assert [r["step"] for r in collector.rows("step")] == list(range(5, 10))


def test_commands_land_in_the_mailbox_once_and_acks_come_back(collector, tmp_path):
    collector.commands = [{"id": "c1", "kind": "rollback", "args": {"to_step": 3}, "issued_ts": 12.5}]
    agent = Agent(_config(collector.url, tmp_path), run_id="run5", rank=0)
    agent.start()
    for step in range(3):  # every response repeats the command
        _step(agent, step)
        assert agent.flush(5.0)
    (cmd,) = agent.commands()
    assert (cmd.id, cmd.kind, cmd.args, cmd.issued_ts) == ("c1", "rollback", {"to_step": 3}, 12.5)
    assert collector.num_posts >= 3 and agent.commands() == []
    agent.ack("c1", "done", "at step 3")
    assert agent.flush(5.0)
    agent.close()
    acks = [e for b in collector.batches for e in b.header["events"] if e["kind"] == "command_ack"]
    assert [a["data"] for a in acks] == [{"command_id": "c1", "status": "done", "detail": "at step 3"}]


def test_a_collector_asking_for_a_follow_up_gets_flushes_at_the_follow_up_interval(collector, tmp_path):
    """While the policy watches a slow-down it may act on any moment, the collector's answers to rank 0
    carry `followup_s`: the agent then ships every `urgent_followup_interval_s`, not every flush
    interval, so a command decided meanwhile comes back within a fraction of a second. An agent whose
    collector does not ask keeps its interval (30 s here: its first flush only)."""
    quiet = FakeCollector()
    try:
        collector.followup_s = 5.0
        slow = dict(flush_interval_s=30.0, heartbeat_interval_s=30.0, urgent_followup_interval_s=0.05)
        asked = Agent(_config(collector.url, tmp_path / "asked", **slow), run_id="run-f", rank=0)
        plain = Agent(_config(quiet.url, tmp_path / "plain", **slow), run_id="run-q", rank=0)
        asked.start()
        plain.start()
        steps = iter(range(1 << 30))

        def training(until) -> bool:  # a step every poll: a cycle with nothing to send posts nothing
            step = next(steps)
            _step(asked, step)
            _step(plain, step)
            return until()

        assert _wait_for(lambda: training(lambda: collector.num_posts >= 6), timeout_s=20.0)
        assert quiet.num_posts <= 1
        collector.commands = [{"id": "c9", "kind": "isolate", "args": {"node": "node1"}, "issued_ts": 1.0}]
        got: list[str] = []
        assert _wait_for(lambda: training(lambda: got.extend(c.id for c in asked.commands()) or got == ["c9"]),
                         timeout_s=20.0), got
        asked.close()
        plain.close()
    finally:
        quiet.close()


def test_record_never_blocks_while_the_collector_stalls(collector, tmp_path):
    collector.stall_s = 3.0  # well past the 1 s of recording below, even on a loaded machine
    agent = Agent(_config(collector.url, tmp_path, timeout_s=5.0), run_id="run6", rank=0)
    agent.start()
    assert _wait_for(lambda: collector.num_in_flight > 0, 5.0)  # the flusher is stuck in a POST
    durations = []
    end = time.monotonic() + 1.0
    step = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        _step(agent, step)
        durations.append(time.perf_counter() - t0)
        step += 1
        if step % 100 == 0:
            time.sleep(0.001)
    assert collector.num_in_flight > 0  # still stalled while we recorded
    median_us = statistics.median(durations) * 1e6
    print(f"record_step during a stall: {len(durations)} calls, median {median_us:.2f} us, "
          f"max {max(durations) * 1e3:.2f} ms")
    assert median_us < 50 and max(durations) < 1.5  # a call blocked on the stalled POST would take ~2-3 s
    collector.stall_s = 0.0
    agent.close(timeout_s=8.0)


def test_heartbeats_continue_while_the_training_thread_sleeps(collector, tmp_path):
    agent = Agent(_config(collector.url, tmp_path), run_id="run7", rank=0)
    agent.bind_seq_source(lambda: 41)
    agent.start()
    agent.set_phase("backward", 7)
    # a "hung" training thread records nothing; the flusher's heartbeats go on
    assert _wait_for(lambda: sum(1 for h in collector.rows("heartbeat") if h["step"] == 7) >= 5)
    agent.close()
    hbs = collector.rows("heartbeat")
    phases = [b.header["dicts"]["phase"] for b in collector.batches if b.num_rows("heartbeat")]
    assert len(hbs) >= 5
    late = hbs[-4:]
    assert all(h["step"] == 7 and h["last_seq"] == 41 for h in late)
    assert all(phases[-1][h["phase"]] == "backward" for h in late)
    ts = [h["ts"] for h in hbs]
    assert ts == sorted(ts)


def test_prometheus_bridge_serves_gauges_on_a_free_port(collector, tmp_path):
    agent = Agent(_config(collector.url, tmp_path, prometheus_port=0), run_id="run8", rank=3, node="n1")
    agent.start()
    agent.record_step(42, loss=2.5, grad_norm=0.75, loss_scale=128.0, lr=1e-3, tokens=2048, step_s=0.5, fwd_s=0.1,
                      bwd_s=0.2, opt_s=0.1, data_s=0.05, comm_exposed_s=0.05, mem_bytes=1000, skipped=False)
    assert agent.flush(5.0)
    port = agent.stats()["prometheus_port"]
    assert port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    agent.close()
    labels = '{node="n1",rank="3",run_id="run8"}'
    for line in (f"llmwatch_step{labels} 42.0", f"llmwatch_loss{labels} 2.5", f"llmwatch_grad_norm{labels} 0.75",
                 f"llmwatch_loss_scale{labels} 128.0", f"llmwatch_tokens_per_s{labels} 4096.0",
                 f"llmwatch_step_seconds{labels} 0.5", f"llmwatch_agent_dropped_total{labels} 0.0"):
        assert line in text.splitlines(), line


def test_otel_bridge_exports_step_phase_spans_over_otlp_http(collector, tmp_path):
    agent = Agent(_config(collector.url, tmp_path, otlp_endpoint=collector.url), run_id="run9", rank=1, node="n2")
    agent.start()
    ts0 = time.time()
    for step in range(2):
        agent.record_step(step, loss=2.0, grad_norm=1.0, loss_scale=1.0, lr=1e-3, tokens=1024, step_s=0.5, fwd_s=0.1,
                          bwd_s=0.2, opt_s=0.1, data_s=0.05, comm_exposed_s=0.05, mem_bytes=1, skipped=False)
    agent.close()  # shuts the tracer provider down, which exports what it holds
    names = sorted(s[0] for s in collector.spans)
    assert names == sorted(["step", "forward", "backward", "communication", "optimizer"] * 2)
    steps = {s[1]: s for s in collector.spans if s[0] == "step"}
    for name, _, parent, attrs, start_ns, end_ns in collector.spans:
        assert attrs["run_id"] == "run9" and attrs["rank"] == 1 and attrs["node"] == "n2"
        if name != "step":
            step_span = steps[parent]
            assert step_span[4] <= start_ns <= end_ns <= step_span[5]
    for _, _, _, _, start_ns, end_ns in steps.values():
        assert abs((end_ns - start_ns) / 1e9 - 0.5) < 1e-6 and end_ns / 1e9 >= ts0


def test_drop_counts_reach_the_collector_once_even_past_a_lost_batch(collector, tmp_path):
    """Headers carry the drops no delivered batch has carried yet: the collector can
    add them up. A batch that is itself lost (here: refused) hands its counts on."""
    cfg = AgentConfig(url=collector.url, token="tok", flush_interval_s=60.0, heartbeat_interval_s=60.0,
                      spool_dir=str(tmp_path), capacity=2, timeout_s=2.0)
    agent = Agent(cfg, run_id="drops", rank=0)
    collector.reject = True
    for step in range(5):  # capacity 2: three dropped in the buffer
        agent.record_scalar(step, "x", 1.0)
    assert not agent.flush(5.0)
    collector.reject = False
    agent.record_scalar(5, "x", 1.0)
    assert agent.flush(5.0)
    agent.record_scalar(6, "x", 1.0)
    assert agent.flush(5.0)
    stats = agent.stats()
    agent.close()
    reported = [b.header["stats"]["dropped"].get("scalar", 0) for b in collector.batches]
    # the 3 buffer drops rode on the refused batch, so the first delivered one carries them, once
    assert reported[0] == 3 and sum(reported) == 3
    assert stats["rejected"]["scalar"] == 2  # the refused rows: the collector counted those itself


# -- close: deliver what the spool holds, within the deadline ----------------------------------------------------


def _record_for(agent: Agent, duration_s: float, first_step: int = 0) -> int:
    """A training loop's pace: one step every ~10 ms for `duration_s`. Returns the next step."""
    step, end = first_step, time.monotonic() + duration_s
    while time.monotonic() < end:
        _step(agent, step)
        step += 1
        time.sleep(0.01)
    return step


def _left_in_spool(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "left in the spool" in r.getMessage()]


def test_close_delivers_the_backlog_of_an_outage_to_a_collector_that_acks_slowly(tmp_path, caplog):
    """The flake of test_collector_never_started_then_appears, in small: the collector
    acks each POST only after its group commit (here 0.2 s), so replay costs a round
    trip per batch; a batch per 0.05 s flush made the backlog outgrow close()'s budget.
    While spooling the agent cuts a batch per spool_flush_interval_s instead."""
    port = _free_port()
    agent = Agent(_config(f"http://127.0.0.1:{port}", tmp_path, spool_flush_interval_s=2.0), run_id="slow", rank=0)
    agent.start()
    steps = _record_for(agent, 1.5)  # the collector is away: ~30 flush intervals
    assert _wait_for(lambda: agent.stats()["batches"]["spooled"] >= 1)
    server = FakeCollector(port)
    server.stall_s = 0.2
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
            agent.close(timeout_s=3.0)
        close_s = time.monotonic() - t0
        stats = agent.stats()
        assert [r["step"] for r in server.rows("step")] == list(range(steps))
        assert stats["spool_bytes"] == 0 and not _left_in_spool(caplog)
        assert close_s < 4.5  # its 3 s, plus the scheduling of a loaded machine
        print(f"{steps} steps, {stats['batches']['spooled']} spooled batches, close took {close_s:.2f} s")
    finally:
        server.close()


def test_close_retries_a_busy_collector_within_its_deadline(collector, tmp_path, caplog):
    agent = Agent(_config(collector.url, tmp_path), run_id="busy", rank=0)
    agent.start()
    _step(agent, 0)
    assert agent.flush(5.0)
    _step(agent, 1)
    collector.num_busy_left = 3  # 503 + Retry-After for the next three POSTs
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        agent.close(timeout_s=5.0)
    assert [r["step"] for r in collector.rows("step")] == [0, 1]
    assert collector.num_busy_left == 0 and not _left_in_spool(caplog)
    assert agent.stats()["batches"]["quarantined"] == 0  # busy is not the batch's fault


def test_close_without_a_collector_returns_at_once_and_says_what_stays_in_the_spool(tmp_path, caplog):
    agent = Agent(_config(f"http://127.0.0.1:{_free_port()}", tmp_path), run_id="gone", rank=0)
    agent.start()
    for step in range(20):
        _step(agent, step)
    assert _wait_for(lambda: agent.stats()["batches"]["spooled"] >= 1)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        agent.close(timeout_s=5.0)
    assert time.monotonic() - t0 < 2.0  # connection refused: nobody to wait for
    (msg,) = _left_in_spool(caplog)
    num = agent.stats()["batches"]["spooled"]
    assert msg.startswith(f"llmwatch agent: {num} undelivered batches left in the spool {tmp_path}")


def test_close_never_outlasts_its_timeout_against_a_stalled_collector(collector, tmp_path, caplog):
    """Each request's timeout is cut to what is left of close()'s deadline (the
    client's own timeout_s, 5 s here, would have run past it)."""
    collector.stall_s = 2.0  # every POST hangs past close()'s deadline
    agent = Agent(_config(collector.url, tmp_path, timeout_s=5.0), run_id="stall", rank=0)
    _step(agent, 0)  # no flusher thread: close() runs the final cycle itself
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        agent.close(timeout_s=0.5)
    assert time.monotonic() - t0 < 1.9  # its 0.5 s, not the request's 5 s or the stall's 2 s
    (msg,) = _left_in_spool(caplog)
    assert msg.startswith("llmwatch agent: 1 undelivered batches left in the spool")
    assert _wait_for(lambda: collector.num_in_flight == 0)


# -- retries: 4xx never, 5xx a bounded number of times ------------------------------------------------------------


def test_a_batch_the_collector_keeps_failing_is_quarantined_and_replayable(collector, tmp_path, caplog, capsys,
                                                                         monkeypatch):
    from agent import replay

    agent = Agent(_config(collector.url, tmp_path, max_batch_failures=3), run_id="poison", rank=0)
    collector.fail_seqs = {1: 500}  # batch 1 always gets a 500
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        flushed = []
        for step in range(4):  # no flusher thread: each flush() is one batch
            _step(agent, step)
            flushed.append(agent.flush(5.0))
        stats = agent.stats()
        agent.close()
    assert [r["step"] for r in collector.rows("step")] == [0, 2, 3]  # the rest flowed on
    assert flushed == [True, False, True, True]  # a quarantined batch did not reach the collector
    assert stats["batches"]["quarantined"] == 1 and stats["quarantined"]["step"] == 1
    counts = [b.header["stats"]["quarantined"] for b in collector.batches]  # close() cut one more batch
    assert counts == [0] + [1] * (len(counts) - 1) and len(counts) >= 3
    quarantine = tmp_path / "quarantine"
    assert any("set aside in " + str(quarantine) in r.getMessage() for r in caplog.records)
    assert any("1 batches are in the quarantine" in r.getMessage() for r in caplog.records)
    collector.fail_seqs = {}
    monkeypatch.setenv("LLMWATCH_TOKEN", "tok")
    assert replay.main([str(tmp_path), "--url", collector.url]) == 0  # the rank's spool: quarantine left out
    assert "quarantine: batches set aside" in capsys.readouterr().err
    assert replay.main([str(quarantine), "--url", collector.url]) == 0
    assert sorted(r["step"] for r in collector.rows("step")) == [0, 1, 2, 3]


def test_503_never_quarantines(collector, tmp_path):
    collector.fail_seqs = {0: 503}
    agent = Agent(_config(collector.url, tmp_path, max_batch_failures=2), run_id="busy2", rank=0)
    _step(agent, 0)
    for _ in range(4):
        assert not agent.flush(0.3)
    collector.fail_seqs = {}
    assert agent.flush(5.0)
    agent.close()
    assert [r["step"] for r in collector.rows("step")] == [0]
    assert agent.stats()["batches"]["quarantined"] == 0


def test_token_never_reaches_a_log_line_even_when_the_server_echoes_it(collector, tmp_path, caplog):
    collector.echo_auth = True
    agent = Agent(_config(collector.url, tmp_path, max_batch_failures=1), run_id="echo", rank=0)
    with caplog.at_level(logging.DEBUG, logger="llmwatch.agent"):
        _step(agent, 0)
        agent.flush(2.0)
        stats = agent.stats()
        agent.close()
    assert "Bearer <redacted>" in stats["last_error"] and "tok" not in stats["last_error"].replace("<redacted>", "")
    assert caplog.records
    for r in caplog.records:
        assert "Bearer tok" not in r.getMessage()
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert b"Bearer tok" not in f.read_bytes()
