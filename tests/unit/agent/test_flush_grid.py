"""The flusher's wall-clock grid (agent/agent.py `flush_phase`, `until_grid`): the ranks of
a job flush in the same instant, so that the collector commits and judges them together."""

from __future__ import annotations

import ast
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.agent import FLUSH_SLOTS_MAX, Agent, AgentConfig, flush_phase, until_grid
from tests.unit.agent.ingest_server import serve


def test_until_grid_is_the_wait_to_the_next_point_after_now():
    assert until_grid(100.25, 1.0, 0.0) == pytest.approx(0.75)
    assert until_grid(100.0, 1.0, 0.0) == pytest.approx(1.0)  # on a point: the next one, never 0
    assert until_grid(100.25, 1.0, 0.5) == pytest.approx(0.25)
    assert until_grid(100.75, 0.5, 0.1) == pytest.approx(0.35)
    for now in (0.0, 3.3, 1e9 + 0.123):
        assert 0.0 < until_grid(now, 2.0, 0.7) <= 2.0


def test_a_small_job_flushes_at_one_instant_whatever_its_nodes():
    assert {flush_phase(f"node{i}", 127, 1.0) for i in range(16)} == {0.0}


def test_a_large_job_spreads_its_nodes_over_the_interval_a_nodes_ranks_together():
    phases = {f"node{i}": flush_phase(f"node{i}", 10_000, 2.0) for i in range(1250)}
    slots = sorted(set(phases.values()))
    assert len(slots) == FLUSH_SLOTS_MAX
    assert slots == pytest.approx([k * 2.0 / FLUSH_SLOTS_MAX for k in range(FLUSH_SLOTS_MAX)])
    # every rank of a node computes the same phase in its own process: no per-process salt
    # (Python's str hash() differs from process to process)
    other = subprocess.run([sys.executable, "-c", "from agent.agent import flush_phase; "
                            "print(repr([flush_phase(f'node{i}', 10_000, 2.0) for i in range(1250)]))"],
                           capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "7"},
                           cwd=Path(__file__).resolve().parents[3])
    assert ast.literal_eval(other.stdout) == list(phases.values())
    per_slot = statistics.pstdev([list(phases.values()).count(s) for s in slots])
    assert per_slot < 10  # ~20 nodes a slot, not a few slots holding most


def test_ranks_started_apart_flush_together_one_post_a_period_each(tmp_path):
    """Two ranks started half a period apart (the worst case for a schedule counted from each
    rank's start) post in the same instants, and each posts once a period: its heartbeat
    rides with its flush instead of waking the flusher on a phase of its own."""
    period = 0.5
    arrivals: list[list[float]] = [[], []]  # per rank, one server each
    servers = [serve(arrivals=a) for a in arrivals]

    def agent_for(rank: int) -> Agent:
        cfg = AgentConfig(url=f"http://127.0.0.1:{servers[rank].server_address[1]}", flush_interval_s=period,
                          heartbeat_interval_s=period, device_health=False, spool_dir=str(tmp_path / f"r{rank}"))
        return Agent(cfg, run_id="grid", rank=rank, node=f"node{rank}", world_size=2)

    agents = []
    try:
        time.sleep(until_grid(time.time(), period, 0.0) + 0.05)  # rank 0 starts just past a grid point
        agents.append(agent_for(0))
        agents[0].start()
        time.sleep(period / 2)  # and rank 1 half a period later
        agents.append(agent_for(1))
        agents[1].start()
        t_both = time.time()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and min(len(a) for a in arrivals) < 8:
            agents[0].record_step(len(arrivals[0]), loss=1.0)
            agents[1].record_step(len(arrivals[1]), loss=1.0)
            time.sleep(0.02)
        t_end = time.time()
    finally:
        for a in agents:
            a.close()
        for s in servers:
            s.shutdown()
            s.server_close()
    steady = [[t for t in a if t_both + period < t < t_end] for a in arrivals]
    assert all(len(a) >= 5 for a in steady), arrivals

    # together: each of rank 1's POSTs a few ms from one of rank 0's (counted from each rank's
    # start they would stay half a period apart)
    apart = [min(abs(t - u) for u in arrivals[0]) for t in steady[1]]
    assert statistics.median(apart) < 0.2 * period, (apart, steady)
    # one POST a period: a heartbeat on a phase of its own would double it
    for a in steady:
        assert len(a) <= (a[-1] - a[0]) / period + 1.5, a
