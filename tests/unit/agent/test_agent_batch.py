"""A batch from the agent decodes with wire.decode_batch to exactly what was recorded.

The collector is absent (a closed port on 127.0.0.1), so each flush spools its
batch; the test reads the spool back. No thread is started: flush() runs the
cycle inline."""

from pathlib import Path

import numpy as np
import pytest

from agent import Agent, AgentConfig
from tests.unit.agent.spooled import closed_port, spooled_batches


class Clock:
    def __init__(self):
        self.t = 1_700_000_000.0

    def __call__(self):
        self.t += 0.5
        return self.t


@pytest.fixture
def spooled(tmp_path):
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=64,
                      timeout_s=0.5)
    agent = Agent(cfg, run_id="r1", rank=3, node="node1", coords={"dp": 1, "tp": 0, "pp": 1}, world_size=8,
                  run_info={"config": {"lr": 3e-4}, "nan": float("nan")}, clock=Clock())

    def batches():
        """The spooled batches before close(); close()'s own last batch, which carries
        the agent_closed event (and nothing else here), is checked and left out."""
        agent.close()
        out = spooled_batches(tmp_path)
        closing = out.pop()
        assert [e["kind"] for e in closing.header["events"]] == ["agent_closed"]
        assert closing.header["events"][0]["data"] == {} and not closing.columns.get("step")
        return out

    return agent, batches


def _rows(batch, kind):
    cols = batch.columns[kind]
    return [dict(zip(cols, vals)) for vals in zip(*(list(v) for v in cols.values()))]


def test_batch_decodes_to_exactly_the_recorded_values(spooled):
    agent, batches = spooled
    agent.set_attempt(1)
    agent.set_phase("backward", 11)
    agent.bind_seq_source(lambda: 77)
    agent.record_step(10, loss=2.75, grad_norm=0.5, loss_scale=1024.0, lr=1e-4, tokens=8192, step_s=0.25, fwd_s=0.1,
                      bwd_s=0.1, opt_s=0.02, data_s=0.01, comm_exposed_s=0.005, mem_bytes=2**40, skipped=False)
    agent.record_step(11, loss=float("nan"), grad_norm=float("inf"), loss_scale=512.0, lr=1e-4, tokens=8192,
                      step_s=0.3, fwd_s=0.1, bwd_s=0.15, opt_s=0.02, data_s=0.01, comm_exposed_s=0.0, mem_bytes=7,
                      skipped=True)
    agent.collective(11, 5, 2, "reduce_scatter", "dp", 1, -1, 4096, 1.5, 0.01, 0.002)
    agent.collective(11, 6, 0, "send", "pp", 2, 3, 64, 1.6, 0.02, 0.0)
    agent.record_scalar(11, "eval/code_loss", 3.25)
    agent.event("checkpoint_saved", step=11, path=Path("/ckpt/11"), num_shards=np.int64(4), loss=float("nan"))
    assert agent.flush(1.0) is False  # nothing answers: spooled
    (batch,) = batches()

    h = batch.header
    assert (h["run_id"], h["rank"], h["batch_seq"], h["node"], h["world_size"]) == ("r1", 3, 0, "node1", 8)
    assert h["incarnation"] == agent.incarnation and len(h["incarnation"]) == 32
    assert h["coords"] == {"dp": 1, "tp": 0, "pp": 1}
    assert h["run"] == {"config": {"lr": 3e-4}, "nan": "nan"}
    assert isinstance(h["pid"], int) and h["sent_ts"] > 1_700_000_000.0
    steps = _rows(batch, "step")
    assert len(steps) == 2
    assert steps[0] == {"step": 10, "attempt": 1, "ts": steps[0]["ts"], "loss": 2.75, "grad_norm": 0.5,
                        "loss_scale": 1024.0, "lr": 1e-4, "tokens": 8192, "step_s": 0.25, "fwd_s": 0.1,
                        "bwd_s": 0.1, "opt_s": 0.02, "data_s": 0.01, "comm_exposed_s": 0.005, "mem_bytes": 2**40,
                        "skipped": 0, "local_loss": 0.0, "local_loss_valid": 0, "finite_fwd": -1, "finite_bwd": -1,
                        "sample_epoch": -1, "sample_from": -1, "sample_to": -1}  # local signals: not measured
    assert np.isnan(steps[1]["loss"]) and steps[1]["grad_norm"] == float("inf") and steps[1]["skipped"] == 1
    assert steps[0]["ts"] < steps[1]["ts"]
    dicts = h["dicts"]
    colls = _rows(batch, "collective")
    assert [(dicts["op"][c["op"]], dicts["axis"][c["axis"]], c["seq"], c["group_seq"], c["group_id"], c["peer"],
             c["bytes"], c["start_ts"], c["duration_s"], c["wait_s"]) for c in colls] == [
        ("reduce_scatter", "dp", 5, 2, 1, -1, 4096, 1.5, 0.01, 0.002), ("send", "pp", 6, 0, 2, 3, 64, 1.6, 0.02, 0.0)]
    (scalar,) = _rows(batch, "scalar")
    assert (scalar["step"], scalar["attempt"], dicts["name"][scalar["name"]], scalar["value"]) == (
        11, 1, "eval/code_loss", 3.25)
    (hb,) = _rows(batch, "heartbeat")
    assert (hb["step"], dicts["phase"][hb["phase"]], hb["last_seq"]) == (11, "backward", 77)
    assert hb["interval_s"] == agent.config.heartbeat_interval_s  # the collector reads silence against it
    (ev,) = h["events"]
    assert ev["kind"] == "checkpoint_saved" and ev["step"] == 11 and ev["attempt"] == 1
    assert ev["data"] == {"path": "/ckpt/11", "num_shards": 4, "loss": "nan"}
    assert h["stats"]["recorded"] == {"step": 2, "collective": 2, "scalar": 1, "heartbeat": 1, "device_health": 1,
                                      "collective_summary": 0, "event": 1}  # a 1-rank job ships every op


def test_batches_are_numbered_and_only_the_first_carries_the_run(spooled):
    agent, batches = spooled
    for step in range(3):
        agent.record_scalar(step, "x", float(step))
        agent.flush(1.0)
    got = batches()
    assert [b.header["batch_seq"] for b in got] == [0, 1, 2]
    assert got[0].header["run"] is not None and got[1].header["run"] is None
    assert {b.header["incarnation"] for b in got} == {agent.incarnation}
    assert [list(b.columns["scalar"]["value"]) for b in got] == [[0.0], [1.0], [2.0]]


def test_every_batch_says_the_ranks_hardware_id(tmp_path, monkeypatch):
    """LLMWATCH_HW_ID (a CPU host, a test), else the GPU's NVML UUID: the collector keeps it in
    ranks.hw_id, and a node's history across runs follows it."""
    monkeypatch.setenv("LLMWATCH_HW_ID", "rack4-slot2")
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=64, timeout_s=0.5)
    agent = Agent(cfg, run_id="r1", rank=0, node="node1", clock=Clock())
    agent.record_scalar(1, "x", 1.0)
    agent.flush(1.0)
    agent.close()
    got = spooled_batches(tmp_path)
    assert got and {b.header["hw_id"] for b in got} == {"rack4-slot2"}


def test_buffer_drops_are_reported_once_in_headers_and_in_stats(tmp_path):
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=2, timeout_s=0.5)
    agent = Agent(cfg, run_id="r1", rank=0)
    for step in range(5):
        agent.record_scalar(step, "x", 1.0)
    agent.flush(1.0)
    agent.record_scalar(5, "x", 1.0)
    agent.flush(1.0)
    stats = agent.stats()
    agent.close()
    assert stats["dropped"]["scalar"] == 3 and stats["recorded"]["scalar"] == 3
    assert stats["spooled"]["scalar"] == 3 and stats["batches"]["spooled"] == 2
    first, second = spooled_batches(tmp_path)[:2]
    # headers carry drops not yet carried by a sent or spooled batch: the collector sums them
    assert first.header["stats"]["dropped"]["scalar"] == 3
    assert second.header["stats"]["dropped"]["scalar"] == 0


def test_while_spooling_rows_wait_for_a_larger_batch_but_never_overflow_the_buffer(tmp_path):
    """Collector away: a periodic cycle holds the rows back (one spooled batch per
    spool_flush_interval_s, each replay costs a round trip) unless a buffer is half
    full or filling fast enough to overflow before the next cycle."""
    cfg = AgentConfig(url=f"http://127.0.0.1:{closed_port()}", spool_dir=str(tmp_path), capacity=100,
                      timeout_s=0.5, spool_flush_interval_s=3600.0)
    agent = Agent(cfg, run_id="r", rank=0)
    agent.record_scalar(0, "x", 1.0)
    agent._cycle_guarded(deadline=None)  # the first cycle cuts, the POST is refused: spooled
    assert agent.stats()["batches"]["spooled"] == 1
    for step in range(1, 11):  # 10 % full, growing slowly: held back
        agent.record_scalar(step, "x", 1.0)
        agent._cycle_guarded(deadline=None)
    assert agent.stats()["batches"]["spooled"] == 1
    for step in range(11, 51):  # +40 % in one cycle: could overflow by the next one
        agent.record_scalar(step, "x", 1.0)
    agent._cycle_guarded(deadline=None)
    assert agent.stats()["batches"]["spooled"] == 2
    agent.record_scalar(51, "x", 1.0)
    assert agent.flush(0.5) is False  # flush() always cuts
    stats = agent.stats()
    agent.close(timeout_s=0.5)
    assert stats["batches"]["spooled"] == 3 and sum(stats["dropped"].values()) == 0


def test_the_collectors_watermark_counts_for_the_attempt_it_was_about():
    """An ingest answer's `clean_through` (collector/live/watermark.py) is the trainer's
    known-good step, only while the rank is in that attempt: after a rollback the new
    lineage's steps are not judged yet, whatever the old lineage reached."""
    agent = Agent(AgentConfig(url=None, device_health=False), run_id="r", rank=0)
    try:
        assert agent.clean_through() is None
        agent._on_response({"accepted": 1})  # a collector without detection: no watermark ever
        assert agent.clean_through() is None and agent.end_wait_s() is None
        agent._on_response({"accepted": 1, "clean_through": None, "end_wait_s": 30.0})  # detection, nothing judged yet
        assert agent.clean_through() == -1 and agent.judged_through() is None
        agent._on_response({"accepted": 1, "clean_through": {"attempt": 0, "step": 28, "judged": 31},
                            "end_wait_s": 30.0})
        assert (agent.clean_through(), agent.judged_through(), agent.end_wait_s()) == (28, 31, 30.0)
        agent._on_response({"accepted": 1, "end_wait_s": -1})  # nonsense: the last one stands
        assert agent.end_wait_s() == 30.0
        agent._on_response({"accepted": 1, "clean_through": None})  # no news: the last one stands
        agent._on_response({"accepted": 1, "clean_through": {"attempt": "x"}})  # malformed: ignored
        assert agent.clean_through() == 28
        agent.set_attempt(1)
        assert agent.clean_through() == -1  # a new lineage: nothing of it vouched for yet
        agent._on_response({"accepted": 1, "clean_through": {"attempt": 1, "step": 24}})
        assert agent.clean_through() == 24
    finally:
        agent.close()


def test_the_flush_and_heartbeat_periods_come_from_the_environment_when_not_given(monkeypatch):
    """$LLMWATCH_FLUSH_S / $LLMWATCH_HEARTBEAT_S: a job too large to post every second sets both
    without code (an agent made by watch(), llmwatch-instrument or an integration); a value given
    in code wins, and one that is not a period is refused naming the variable."""
    from agent.agent import AgentConfig

    assert (AgentConfig().flush_interval_s, AgentConfig().heartbeat_interval_s) == (1.0, 1.0)
    monkeypatch.setenv("LLMWATCH_FLUSH_S", "30")
    monkeypatch.setenv("LLMWATCH_HEARTBEAT_S", " 30.0 ")
    assert (AgentConfig().flush_interval_s, AgentConfig().heartbeat_interval_s) == (30.0, 30.0)
    assert AgentConfig(heartbeat_interval_s=2.0).heartbeat_interval_s == 2.0
    for bad in ("0", "-1", "nan", "inf", "30s"):
        monkeypatch.setenv("LLMWATCH_HEARTBEAT_S", bad)
        with pytest.raises(ValueError, match=r"\$LLMWATCH_HEARTBEAT_S must be a number of seconds > 0"):
            AgentConfig()
    monkeypatch.setenv("LLMWATCH_HEARTBEAT_S", "")
    assert AgentConfig().heartbeat_interval_s == 1.0
