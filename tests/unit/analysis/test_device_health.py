"""`device_health` on synthetic samples: ECC increase, persistent throttle, low host
memory fire and name rank and node; a healthy run and a short throttle blip do not."""

from __future__ import annotations

from types import SimpleNamespace

import polars as pl

from analysis import rules_from_dict
from analysis.detectors.device_health import DeviceHealthDetector
from analysis.state import Pass, new_run_state

GIB = 1 << 30


def sample(rank, t, *, node=None, ecc=0, reasons=0, avail=64 * GIB, total=128 * GIB, temp=60.0):
    return {"run_id": "r", "rank": rank, "ts": 1000.0 + t, "node": node or f"n{rank // 2}", "step": int(t),
            "gpu_index": rank % 2, "temperature_c": temp, "power_w": 300.0, "sm_clock_mhz": 1980,
            "throttle_reasons": reasons, "ecc_uncorrectable": ecc, "retired_pages": 0,
            "mem_available_bytes": avail, "mem_total_bytes": total, "cpu_s": float(t)}


class Run:
    """The detector over passes of one-second batches, with a real RunState and book."""

    def __init__(self, **rules):
        r = rules_from_dict({"device_health": rules} if rules else None)
        self.rules = r
        self.det = DeviceHealthDetector(r)
        self.state = new_run_state("r", r, [self.det])
        self.findings = []

    def feed(self, rows, now):
        df = pl.DataFrame(rows) if rows else None
        p = Pass(run=self.state, rules=self.rules, now=now, frames=SimpleNamespace(device_health=df),
                 first_sight=[], released=None)
        self.det.run(p, self.state.detectors["device_health"])
        self.findings.extend(p.out)
        return p.out

    def over(self, seconds, make, ranks=range(4)):
        for t in range(seconds):
            self.feed([make(rank, t) for rank in ranks], now=1000.0 + t + 0.5)
        return self.findings

    def open(self):
        return [self.state.book.get(k) for k in self.state.book.open_keys("device_health")]


def test_a_healthy_run_opens_nothing():
    run = Run()
    assert run.over(120, lambda r, t: sample(r, t, temp=70 + (t % 5), reasons=0x1 if t % 7 else 0)) == []


def test_an_ecc_increase_is_critical_at_once_naming_rank_and_node():
    run = Run()
    run.over(20, lambda r, t: sample(r, t, ecc=3 if r == 2 and t >= 12 else 0))
    (f,) = run.open()
    assert (f.kind, f.severity, f.rank, f.node, f.step_from) == ("device_health", "critical", 2, "n1", 12)
    assert f.evidence["cause"] == "ecc" and f.evidence["new_errors"] == 3
    assert run.findings[0].ts == 1012.5  # the pass that saw it


def test_an_ecc_count_already_there_at_start_is_not_new():
    run = Run()
    assert run.over(20, lambda r, t: sample(r, t, ecc=7 if r == 1 else 0)) == []


def test_persistent_thermal_throttle_opens_and_a_short_blip_does_not():
    run = Run(throttle_window_s=10.0, resolve_after_s=5.0)
    # rank 3: a 5 s blip at t=5..9, then throttled from t=30 on; rank 0: idle bit only
    hot = lambda r, t: sample(r, t, reasons=0x40 if r == 3 and (5 <= t < 10 or 30 <= t < 60) else 0x1)  # noqa: E731
    run.over(29, hot)
    assert run.findings == []
    run.over(60, hot)
    opened = [f for f in run.findings if f.status == "open"]
    assert opened and {(f.rank, f.node, f.evidence["cause"]) for f in opened} == {(3, "n1", "thermal_throttle")}
    assert opened[0].step_from == 30 and opened[0].evidence["lasted_s"] >= 10.0
    assert opened[0].ts == 1000.0 + 40 + 0.5  # 10 s after the first throttled sample
    # t=60.. healthy again: closes after resolve_after_s
    for t in range(60, 70):
        run.feed([sample(r, t) for r in range(4)], now=1000.0 + t + 0.5)
    assert run.open() == [] and run.findings[-1].status == "resolved"


def test_power_brake_counts_and_the_sw_power_cap_does_not_by_default():
    run = Run(throttle_window_s=5.0)
    run.over(20, lambda r, t: sample(r, t, reasons=0x04 if r == 0 else 0x80 if r == 1 else 0))
    assert {(f.rank, f.evidence["cause"]) for f in run.open()} == {(1, "power_throttle")}
    run = Run(throttle_window_s=5.0, count_sw_power_cap=True)
    run.over(20, lambda r, t: sample(r, t, reasons=0x04 if r == 0 else 0))
    assert {(f.rank, f.evidence["cause"]) for f in run.open()} == {(0, "power_throttle")}


def test_low_host_memory_for_a_window_names_the_node_once():
    run = Run(memory_window_s=8.0)
    # node n1 (ranks 2, 3) drops to 2% available at t=10; n0 stays at 50%
    low = lambda r, t: sample(r, t, avail=int(0.02 * 128 * GIB) if r >= 2 and t >= 10 else 64 * GIB)  # noqa: E731
    run.over(17, low)
    assert run.open() == []  # 7 s of it: not yet
    run.over(30, low)
    (f,) = run.open()
    assert (f.rank, f.node, f.evidence["cause"], f.step_from) == (2, "n1", "memory_pressure", 10)
    assert f.evidence["mem_available_share"] == 0.02 and "n1" in f.root_cause


def test_a_cpu_host_without_gpu_columns_is_judged_on_memory_only():
    run = Run(memory_window_s=3.0)
    rows = lambda r, t: {**sample(r, t, avail=GIB if t >= 2 else 64 * GIB), "temperature_c": None,  # noqa: E731
                         "throttle_reasons": None, "ecc_uncorrectable": None, "gpu_index": None}
    run.over(10, rows, ranks=[0])
    assert [(f.rank, f.evidence["cause"]) for f in run.open()] == [(0, "memory_pressure")]


def test_no_samples_no_findings_and_the_state_stays_bounded():
    run = Run()
    assert run.feed([], now=1.0) == []
    run.over(300, lambda r, t: sample(r, t, reasons=0x40 if t % 3 == 0 else 0))
    st = run.state.detectors["device_health"]
    assert st.footprint()["ranks"] == 4 and st.footprint()["episodes"] <= 8 and run.findings == []
