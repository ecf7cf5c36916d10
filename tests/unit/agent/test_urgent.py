"""Urgent flushes: which steps ask for one, the running loss baseline, the rate
limit (injected clock), and the flusher shipping at once (stub transport)."""

from __future__ import annotations

import math
import threading

import pytest

from agent import Agent, AgentConfig, wire
from agent.ring import Recorder
from agent.transport import PostResult
from agent.urgent import LossBaseline
from tests.polling import wait_until as wait_for

NAN, INF = math.nan, math.inf


def noisy(n: int, level: float = 3.0, start: int = 0):
    """A flat-ish loss curve with +-3 % alternating noise."""
    return [level * (1.03 if (start + i) % 2 else 0.97) for i in range(n)]


# -- the baseline ----------------------------------------------------------------------
def test_the_baseline_judges_nothing_during_its_warm_up():
    b = LossBaseline(warmup=10)
    assert [b.far(x) for x in [10.0, 1.0, 30.0, 2.0, 5.0, 9.0, 0.5, 3.0, 7.0, 100.0]] == [False] * 10
    assert b.n == 10


def test_after_the_warm_up_a_spike_is_far_and_noise_is_not():
    b = LossBaseline(warmup=20)
    assert not any(b.far(x) for x in noisy(200))
    mean, bound = b.mean, b.bound
    assert b.far(9.0)  # 3x the level
    # a spike moves the baseline only up to the bound it crossed
    assert 0 < b.mean - mean <= b.alpha * bound + 1e-12
    assert not b.far(3.0)
    assert not b.far(0.3)  # below the baseline: what a falling curve looks like, never urgent


def test_the_baseline_follows_a_falling_curve_and_a_lasting_shift():
    b = LossBaseline(warmup=20)
    falling = [6.0 * math.exp(-0.01 * i) for i in range(300)]  # training: the loss falls steadily
    assert not any(b.far(x) for x in falling)
    shifted = [b.far(x) for x in noisy(300, level=falling[-1] * 1.5)]
    assert shifted[0] and not any(shifted[-100:])  # a new level is learned, then quiet again


def test_non_positive_and_non_finite_losses_are_ignored():
    b = LossBaseline(warmup=1)
    for x in (NAN, INF, -INF, 0.0, -1.0):
        assert b.far(x) is False
    assert b.n == 0


# -- the conditions (record_step's own test, counted by a bare Recorder) -------------
NORMAL = dict(loss=3.0, grad_norm=1.0, loss_scale=1024.0, skipped=False, finite_fwd=1, finite_bwd=1)


def record(rec: Recorder, step: int, **values) -> None:
    v = {**NORMAL, **values}
    rec.record_step(step, loss=v["loss"], grad_norm=v["grad_norm"], loss_scale=v["loss_scale"], lr=1e-3, tokens=64,
                    step_s=0.1, fwd_s=0.03, bwd_s=0.04, opt_s=0.01, data_s=0.0, comm_exposed_s=0.0, mem_bytes=1,
                    skipped=v["skipped"], finite_fwd=v["finite_fwd"], finite_bwd=v["finite_bwd"])


def warmed(n: int = 30) -> Recorder:
    """A Recorder whose baseline learned `n` ordinary losses, as the flusher feeds it."""
    rec = Recorder(capacity=256)
    for step, loss in enumerate(noisy(n)):
        record(rec, step, loss=loss)
    rec._learn_losses(rec._step_buf)
    assert rec.num_urgent == 0 and rec.spike_above < 9.0
    return rec


@pytest.mark.parametrize("change", [
    dict(loss=NAN), dict(loss=INF), dict(grad_norm=NAN), dict(grad_norm=-INF), dict(finite_fwd=0),
    dict(finite_bwd=0), dict(skipped=True), dict(loss_scale=512.0), dict(loss=9.0),
])
def test_each_condition_asks_for_an_urgent_flush(change):
    rec = warmed()
    record(rec, 100, **change)
    assert rec.num_urgent == 1


def test_not_measured_flags_a_growing_scale_and_a_cold_baseline_are_not_urgent():
    rec = Recorder(capacity=16)
    record(rec, 1, finite_fwd=-1, finite_bwd=-1)
    record(rec, 2, loss_scale=2048.0, finite_fwd=-1, finite_bwd=-1)  # growth
    record(rec, 3, loss=1000.0, loss_scale=2048.0)  # no baseline yet: nothing is a spike
    assert rec.num_urgent == 0
    record(rec, 4, loss_scale=1024.0)  # backoff: lower than the previous step's
    record(rec, 5, loss_scale=1024.0)  # the same scale again
    assert rec.num_urgent == 1


def test_the_flusher_side_learns_from_steps_that_were_not_skipped():
    rec = Recorder(capacity=64)
    for step, loss in enumerate(noisy(25)):
        record(rec, step, loss=loss)
    record(rec, 25, loss=50.0, skipped=True)
    rec._learn_losses(rec._step_buf)
    assert rec.loss_baseline.n == 25 and 3.0 < rec.spike_above < 9.0
    assert rec.spike_above == pytest.approx(math.exp(rec.loss_baseline.mean + rec.loss_baseline.bound))


# -- the rate limit (no thread: the flusher's half is called by hand) -------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.num_set = 0

    def set(self) -> None:
        self.num_set += 1
        super().set()


STEP = dict(loss=2.5, grad_norm=1.0, loss_scale=1.0, lr=1e-3, tokens=64, step_s=0.1, fwd_s=0.03, bwd_s=0.04,
            opt_s=0.01, data_s=0.0, comm_exposed_s=0.0, mem_bytes=1, skipped=False)


def nan_step(agent: Agent, step: int) -> None:
    agent.record_step(step, **{**STEP, "loss": NAN, "grad_norm": NAN, "skipped": True})


def test_urgent_flushes_are_rate_limited_and_a_deferred_one_is_served_later():
    mono = Clock()
    agent = Agent(AgentConfig(capacity=4096, urgent_min_interval_s=0.1), run_id="r", rank=0, monotonic=mono)
    agent._wake = wake = CountingEvent()
    nan_step(agent, 1)
    assert wake.num_set == 1 and agent._take_urgent() == (True, 1000.1)
    mono.t = 1000.05
    nan_step(agent, 2)  # inside the limit: no wake, remembered
    assert wake.num_set == 1 and agent._take_urgent() == (False, 1000.1)
    mono.t = 1000.1
    assert agent._take_urgent() == (True, pytest.approx(1000.2))  # served once the limit has passed
    assert agent._take_urgent() == (False, math.inf)
    # a flood: a NaN step every 10 ms for 2 s wakes the flusher ~once per 0.1 s, not 200 times
    for i in range(200):
        mono.t = 1001.0 + i * 0.01
        nan_step(agent, 10 + i)
    assert 19 <= wake.num_set - 1 <= 21
    assert agent.num_urgent == 202
    agent.close(timeout_s=0.1)


def test_an_ordinary_step_asks_for_nothing():
    agent = Agent(AgentConfig(capacity=64), run_id="r", rank=0, monotonic=Clock())
    agent._wake = wake = CountingEvent()
    for step in range(50):
        agent.record_step(step, **{**STEP, "loss": noisy(1, start=step)[0]})
    assert wake.num_set == 0 and agent.num_urgent == 0 and agent._take_urgent() == (False, math.inf)
    agent.close(timeout_s=0.1)


# -- the flusher ships an urgent step at once -------------------------------------------
class StubClient:
    def __init__(self) -> None:
        self.batches: list[wire.Batch] = []

    def post(self, body, *, timeout_s=None):
        self.batches.append(wire.decode_batch(bytes(body)))
        return PostResult("ok", 200, {"accepted": 1})

    def close(self) -> None:
        pass


def test_the_flusher_ships_an_urgent_step_without_waiting_for_its_period(monkeypatch, tmp_path):
    client = StubClient()
    monkeypatch.setattr("agent.agent.HttpClient", lambda *a, **k: client)
    cfg = AgentConfig(url="http://collector.invalid:1", spool_dir=str(tmp_path), flush_interval_s=3600.0,
                      heartbeat_interval_s=3600.0, capacity=64)
    agent = Agent(cfg, run_id="r", rank=0)
    agent.start()
    try:
        assert wait_for(lambda: len(client.batches) >= 1)  # the first cycle runs at start (the heartbeat)
        first = len(client.batches)
        agent.record_step(1, **STEP)  # ordinary: waits for the (hour-long) period
        nan_step(agent, 2)  # urgent: shipped now, and the ordinary row with it
        assert wait_for(lambda: len(client.batches) > first)
        steps = [b for b in client.batches[first:] if b.num_rows("step")]
        assert [list(b.columns["step"]["step"]) for b in steps] == [[1, 2]]
        assert agent.stats()["urgent"] == {"steps": 1, "flushes": 1}
    finally:
        agent.close(timeout_s=2.0)
    assert client.batches[-1].header["events"][-1]["kind"] == "agent_closed"


def test_an_agents_flush_teaches_the_baseline_and_a_spike_after_it_is_urgent():
    agent = Agent(AgentConfig(capacity=64), run_id="r", rank=0, monotonic=Clock())  # no URL: cycles inline
    agent._wake = wake = CountingEvent()
    for step, loss in enumerate(noisy(30)):
        agent.record_step(step, **{**STEP, "loss": loss})
    assert agent.spike_above == math.inf  # nothing learned before a flush
    assert agent.flush(1.0)
    assert agent.loss_baseline.n == 30 and agent.spike_above < 9.0
    agent.record_step(30, **{**STEP, "loss": 3.1})
    assert wake.num_set == 0
    agent.record_step(31, **{**STEP, "loss": 9.0})
    assert wake.num_set == 1 and agent.num_urgent == 1
    agent.close(timeout_s=0.1)
