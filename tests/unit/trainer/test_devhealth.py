"""`devhealth` injections: parsed and validated, one ground-truth row, and the simulated device's samples
(the agent's overlay) showing ECC errors, thermal throttling or a node's memory nearly gone from the step
on, for the injected rank (memory: every rank of its node) only."""

import json
import socket
import sys

import pytest

from agent import Agent, AgentConfig, wire
from agent.device_health import FIELDS
from agent.spool import Spool
from tests.polling import wait_until
from trainer.config import ConfigError
from trainer.faults import NO_FAULTS, FaultInjector, parse_injection

GiB = 1 << 30
# what a CPU host samples: no GPU columns, the host's memory and CPU time
CPU = dict.fromkeys(FIELDS) | {"mem_available_bytes": 20 * GiB, "mem_total_bytes": 32 * GiB, "cpu_s": 1.5}
# what a GPU host samples
GPU = CPU | {"gpu_index": 0, "temperature_c": 71.0, "power_w": 300.0, "sm_clock_mhz": 1410, "throttle_reasons": 0x1,
             "ecc_uncorrectable": 3, "retired_pages": 1}


def sample(values: dict) -> tuple:
    return tuple(values[f] for f in FIELDS)


def overlaid(inj: FaultInjector, values: dict, step: int) -> dict:
    return dict(zip(FIELDS, inj.device_health(sample(values), step)))


def injector(spec: str, tmp_path, *, rank: int = 1, ranks_per_node: int = 1) -> FaultInjector:
    return FaultInjector([parse_injection(spec)], rank=rank, node=rank // ranks_per_node, run_dir=tmp_path,
                         ranks_per_node=ranks_per_node)


def test_parse_devhealth():
    inj = parse_injection("devhealth@rank=1,from=30,what=thermal,to=80", world_size=2)
    assert (inj.kind, inj.rank, inj.step, inj.what, inj.to_step) == ("devhealth", 1, 30, "thermal", 80)
    assert inj.name == "devhealth@step=30,rank=1,what=thermal"
    assert parse_injection("devhealth@rank=0,from=5,what=ecc").to_step == 1 << 62
    assert parse_injection("devhealth@rank=0,from=5,what=memory").what == "memory"


@pytest.mark.parametrize("spec, message", [
    ("devhealth@rank=1,from=30", "missing what"),
    ("devhealth@rank=1,what=ecc", "missing from"),
    ("devhealth@from=30,what=ecc", "missing rank"),
    ("devhealth@rank=1,from=30,what=disk", "what must be one of ecc, thermal, memory"),
    ("devhealth@rank=1,from=30,what=thermal,to=10", "to must be >= from"),
    ("devhealth@rank=1,from=30,what=ecc,to=40", "what=ecc takes no to"),
    ("devhealth@rank=4,from=30,what=ecc", "outside world of 4"),
    ("devhealth@rank=1,from=30,what=ecc,factor=2", "bad field"),
    ("devhealth@rank=1,from=-1,what=memory", "step must be >= 0"),
])
def test_bad_devhealth_specs_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_injection(spec, world_size=4)


def test_one_ground_truth_row_from_the_named_rank_and_nothing_for_the_engine(tmp_path):
    specs = [parse_injection("devhealth@rank=3,from=5,what=memory,to=8")]
    named = FaultInjector(specs, rank=3, node=1, run_dir=tmp_path, ranks_per_node=2)
    peer = FaultInjector(specs, rank=2, node=1, run_dir=tmp_path, ranks_per_node=2)  # its node: shows it too
    for step in range(1, 12):
        for fi in (named, peer):
            assert fi.step_faults(step, 0, (0, 0, 8)) is NO_FAULTS  # training itself is untouched
    rows = [json.loads(x) for x in (tmp_path / "injections.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"], r["node"], r["step"], r["what"]) for r in rows] == [("devhealth", 3, 1, 5, "memory")]


def test_ecc_errors_rise_on_a_simulated_gpu_and_never_go_back(tmp_path):
    inj = injector("devhealth@rank=1,from=10,what=ecc", tmp_path)
    assert inj.shows_device_faults()
    before = overlaid(inj, CPU, 9)  # a CPU host: a healthy simulated GPU before the fault
    assert (before["ecc_uncorrectable"], before["retired_pages"], before["throttle_reasons"],
            before["temperature_c"]) == (0, 0, 0, 60.0)
    assert {k: before[k] for k in ("gpu_index", "power_w", "sm_clock_mhz", "mem_available_bytes")} == {
        "gpu_index": None, "power_w": None, "sm_clock_mhz": None, "mem_available_bytes": 20 * GiB}
    assert [overlaid(inj, CPU, s)["ecc_uncorrectable"] for s in (10, 11, 500)] == [2, 2, 2]
    assert overlaid(inj, CPU, 10)["retired_pages"] == 1
    # on a GPU the device's own count goes up
    assert (overlaid(inj, GPU, 12)["ecc_uncorrectable"], overlaid(inj, GPU, 12)["temperature_c"]) == (5, 71.0)
    inj.step_faults(10, 0, (0, 0, 8))  # the training thread reached the step: fired (the ground truth)
    assert overlaid(inj, CPU, 4)["ecc_uncorrectable"] == 2  # a rollback to before it: the errors happened
    again = injector("devhealth@rank=1,from=10,what=ecc", tmp_path)  # a restarted process
    assert overlaid(again, CPU, 4)["ecc_uncorrectable"] == 2


def test_thermal_throttling_sets_the_hw_slowdown_bit_and_the_heat_within_its_window(tmp_path):
    inj = injector("devhealth@rank=1,from=10,what=thermal,to=20", tmp_path)
    got = [overlaid(inj, CPU, s) for s in (9, 10, 20, 21)]
    assert [(g["throttle_reasons"], g["temperature_c"], g["ecc_uncorrectable"]) for g in got] == [
        (0, 60.0, 0), (0x40, 95.0, 0), (0x40, 95.0, 0), (0, 60.0, 0)]
    on_gpu = overlaid(inj, GPU | {"temperature_c": 97.0}, 15)
    assert (on_gpu["throttle_reasons"], on_gpu["temperature_c"], on_gpu["ecc_uncorrectable"]) == (0x41, 97.0, 3)


def test_memory_pressure_is_the_whole_nodes(tmp_path):
    spec = "devhealth@rank=3,from=10,what=memory"
    named, peer = injector(spec, tmp_path, rank=3, ranks_per_node=2), injector(spec, tmp_path, rank=2,
                                                                                  ranks_per_node=2)
    other_node = injector(spec, tmp_path, rank=1, ranks_per_node=2)
    assert named.shows_device_faults() and peer.shows_device_faults() and not other_node.shows_device_faults()
    for fi in (named, peer):
        got = overlaid(fi, CPU, 10)
        assert (got["mem_available_bytes"], got["mem_total_bytes"]) == (int(32 * GiB * 0.01), 32 * GiB)
        assert got["temperature_c"] is None and got["ecc_uncorrectable"] is None  # the host's, no GPU faked
        assert overlaid(fi, CPU, 9) == CPU
    assert overlaid(other_node, CPU, 10) == CPU
    # a host whose /proc/meminfo said nothing: a simulated one
    blind = overlaid(named, CPU | {"mem_available_bytes": None, "mem_total_bytes": None}, 11)
    assert blind["mem_available_bytes"] / blind["mem_total_bytes"] == pytest.approx(0.01)
    # another rank's GPU fault is not this rank's
    assert not injector("devhealth@rank=3,from=10,what=ecc", tmp_path, rank=2, ranks_per_node=2).shows_device_faults()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spooled_health_rows(spool_dir) -> list[dict]:
    spool = Spool(str(spool_dir), max_bytes=1 << 30)
    rows = []
    while (payload := spool.peek()) is not None:
        cols = wire.decode_batch(payload).columns.get(wire.DEVICE_HEALTH)
        if cols:
            rows += [dict(zip(cols, vals)) for vals in zip(*(list(v) for v in cols.values()))]
        spool.pop()
    spool.close()
    return rows


def test_the_agent_ships_the_overlaid_samples(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # a CPU host: no NVML
    inj = injector("devhealth@rank=1,from=10,what=thermal", tmp_path)
    cfg = AgentConfig(url=f"http://127.0.0.1:{_closed_port()}", spool_dir=str(tmp_path / "spool"), capacity=16,
                      timeout_s=0.5, heartbeat_interval_s=0.001)
    agent = Agent(cfg, run_id="r1", rank=1, node="node1")

    def sample_once() -> None:  # no flusher thread: a flush cycles inline, with a heartbeat and a sample when due
        n = agent.stats()["recorded"][wire.HEARTBEAT] + 1
        assert wait_until(lambda: agent.flush(1.0) is not None and agent.stats()["recorded"][wire.HEARTBEAT] >= n,
                          timeout_s=5.0, interval_s=0.002)

    agent.set_health_overlay(inj.device_health)
    for step in (9, 10):
        agent.set_phase("train", step)
        sample_once()
    agent.set_health_overlay(lambda sample, step: 1 / 0)  # an overlay that fails costs its sample only
    sample_once()
    stats = agent.stats()
    agent.close()
    rows = _spooled_health_rows(tmp_path / "spool")
    assert [(r["step"], r["throttle_reasons"], r["temperature_c"]) for r in rows[:2]] == [(9, 0, 60.0), (10, 0x40, 95.0)]
    assert rows[1]["mem_total_bytes"] > 0 and rows[1]["ecc_uncorrectable"] == 0
    assert len(rows) == 2 and stats["dropped"][wire.DEVICE_HEALTH] == 1, (rows, stats)


def test_an_overlay_set_after_start_is_sampled_at_once(tmp_path, monkeypatch):
    """The agent samples at start, before the trainer sets its overlay; the overlay's first sample
    comes at once, not a heartbeat later: a detector takes the first sample it sees as the device's
    state at start, and a fast job's ECC fault a heartbeat in was in that baseline (a CI run)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # a CPU host: no NVML
    inj = injector("devhealth@rank=1,from=10,what=ecc", tmp_path)
    cfg = AgentConfig(url=f"http://127.0.0.1:{_closed_port()}", spool_dir=str(tmp_path / "spool"), capacity=16,
                      timeout_s=0.5, heartbeat_interval_s=3600.0)  # no heartbeat after the first but the overlay's
    agent = Agent(cfg, run_id="r1", rank=1, node="node1")
    agent.start()
    try:
        assert wait_until(lambda: agent.stats()["recorded"][wire.HEARTBEAT] >= 1, timeout_s=10.0)
        agent.flush(5.0)  # a cycle after the first one: its sample, taken right after the heartbeat, is in
        agent.set_health_overlay(inj.device_health)
        assert wait_until(lambda: agent.stats()["recorded"][wire.HEARTBEAT] >= 2, timeout_s=10.0)
    finally:
        agent.close()
    rows = _spooled_health_rows(tmp_path / "spool")
    # a CPU host's (not measured), then the simulated healthy GPU's at step 0: the baseline, before the fault
    assert [r["ecc_uncorrectable"] for r in rows] == [wire.NOT_MEASURED, 0]
