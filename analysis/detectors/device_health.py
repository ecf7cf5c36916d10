"""`device_health`: a rank's GPU or host is failing, from the `device_health` table.

One sample per heartbeat per rank (agent/device_health.py). Three causes, each
its own incident, naming the rank and the node:

- `ecc`: the rank's volatile uncorrectable ECC count rose (against its first
  sample in this run, or any later one). Critical at once: the device's memory
  corrupts data. It stays open for the run (the count never goes back).
- `thermal_throttle` / `power_throttle`: NVML's clock event reasons say
  thermal (SW 0x20, HW 0x40) or power (HW power brake 0x80, HW slowdown 0x8;
  the SW power cap 0x4 only with `count_sw_power_cap`, as a GPU at its power
  limit under a heavy load is normal) in every sample for `throttle_window_s`
  on the rank's clock. A shorter blip is not counted. Closes after
  `resolve_after_s` without those bits.
- `memory_pressure`: the host's MemAvailable / MemTotal stays below
  `min_available_share` for `memory_window_s`: the node is about to be out of
  memory (the OOM killer takes a rank next). Per node; the rank named is the
  lowest reporting it. Closes after `resolve_after_s` above the share.

NULL columns (a CPU host has no GPU columns; an old agent sends no table) are
skipped. Pure: reads the pass's frame, keeps per-rank and per-node state
(bounded by the ranks and nodes of the run).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from analysis.findings import Finding, json_number
from analysis.registry import register

THERMAL_BITS = 0x20 | 0x40  # SwThermalSlowdown, HwThermalSlowdown
POWER_BITS = 0x80 | 0x08  # HwPowerBrakeSlowdown, HwSlowdown
SW_POWER_CAP = 0x04


class _Episode:
    """A condition's run of samples: when it began, when it was last (not) seen, the open key."""

    __slots__ = ("since_ts", "since_step", "clear_since", "key", "peak")

    def __init__(self) -> None:
        self.since_ts: float | None = None  # first sample of the current run of bad samples
        self.since_step: int | None = None
        self.clear_since: float | None = None  # first good sample after an open incident
        self.key: str | None = None
        self.peak = 0.0


class _State:
    __slots__ = ("ecc_base", "ecc_key", "episodes")

    def __init__(self) -> None:
        self.ecc_base: dict[int, int] = {}  # rank -> its first ECC count
        self.ecc_key: dict[int, str] = {}
        self.episodes: dict[tuple[str, object], _Episode] = {}  # (cause, rank or node)

    def footprint(self) -> dict[str, int]:
        return {"ranks": len(self.ecc_base), "episodes": len(self.episodes)}


def _col(df: pl.DataFrame, name: str, fill: float) -> np.ndarray:
    if name not in df.columns:
        return np.full(df.height, fill)
    s = df[name].cast(pl.Float64)
    return (s.fill_null(fill) if s.null_count() else s).to_numpy()


@register
class DeviceHealthDetector:
    name = "device_health"
    kinds = ("device_health",)

    def __init__(self, rules) -> None:
        self.cfg = rules.device_health
        self.throttle_bits = THERMAL_BITS | POWER_BITS | (SW_POWER_CAP if self.cfg.count_sw_power_cap else 0)

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        df = getattr(p.frames, "device_health", None)
        if df is None or not df.height:
            return
        df = df.sort("rank", "ts")
        ranks = df["rank"].to_numpy().astype(np.int64)
        ts = _col(df, "ts", math.nan)
        steps = _col(df, "step", -1).astype(np.int64)
        ecc = _col(df, "ecc_uncorrectable", -1).astype(np.int64)
        reasons = _col(df, "throttle_reasons", -1).astype(np.int64)
        avail = _col(df, "mem_available_bytes", math.nan)
        total = _col(df, "mem_total_bytes", math.nan)
        temp = _col(df, "temperature_c", math.nan)
        nodes = df["node"].cast(pl.String).to_list() if "node" in df.columns else [None] * df.height
        node_ranks: dict[str, int] = {}
        for i in range(df.height):
            rank, node = int(ranks[i]), nodes[i] or p.topo.node_name(int(ranks[i]))
            if not math.isfinite(ts[i]):
                continue
            if ecc[i] >= 0:
                self._ecc(p, st, rank, node, int(ecc[i]), int(steps[i]))
            if reasons[i] >= 0:
                bits = int(reasons[i]) & self.throttle_bits
                cause = "thermal_throttle" if bits & THERMAL_BITS else "power_throttle" if bits else None
                for c in ("thermal_throttle", "power_throttle"):
                    self._episode(p, st, c, rank, rank, node, c == cause, ts[i], int(steps[i]),
                                  self.cfg.throttle_window_s, {"throttle_reasons": int(reasons[i]),
                                                               "temperature_c": json_number(temp[i])}, 0.0)
            if node is not None and total[i] > 0 and math.isfinite(avail[i]):
                share = avail[i] / total[i]
                first = node_ranks.setdefault(node, rank)
                if first == rank:  # one judgement per node and sample: its lowest reporting rank's
                    self._episode(p, st, "memory_pressure", node, rank, node, share < self.cfg.min_available_share,
                                  ts[i], int(steps[i]), self.cfg.memory_window_s,
                                  {"mem_available_share": json_number(share, 4),
                                   "mem_available_bytes": int(avail[i]), "mem_total_bytes": int(total[i])},
                                  1.0 - share)

    def _ecc(self, p, st: _State, rank: int, node, count: int, step: int) -> None:
        base = st.ecc_base.setdefault(rank, count)
        if count <= base:
            return
        key = st.ecc_key.get(rank) or st.ecc_key.setdefault(rank, p.book.new_key(f"device_health:ecc:rank{rank}"))
        prev = p.book.get(key)
        step_from = prev.step_from if prev is not None else step
        p.report(Finding(
            kind="device_health", key=key, run_id=p.run.run_id, severity="critical", rank=rank, node=node,
            step_from=step_from, step_to=step,
            evidence={"cause": "ecc", "ecc_uncorrectable": count, "ecc_at_start": base, "new_errors": count - base},
            root_cause=f"rank {rank}'s GPU reported {count - base} new uncorrectable ECC error(s)"
                       f"{f' on node {node}' if node else ''}: its memory corrupts data",
            confidence=0.95))

    def _episode(self, p, st: _State, cause: str, who, rank: int, node, bad: bool, ts: float, step: int,
                 window_s: float, detail: dict, severity_of: float) -> None:
        ep = st.episodes.get((cause, who))
        if ep is None:
            if not bad:
                return
            ep = st.episodes[(cause, who)] = _Episode()
        if bad:
            ep.clear_since = None
            if ep.since_ts is None:
                ep.since_ts, ep.since_step, ep.peak = ts, step, 0.0
            ep.peak = max(ep.peak, severity_of)
            lasted = ts - ep.since_ts
            if lasted < window_s:
                return
            if ep.key is None:
                ep.key = p.book.new_key(f"device_health:{cause}:{who}")
            where = f" on node {node}" if node else ""
            what = {"thermal_throttle": f"rank {rank}'s GPU is thermally throttled",
                    "power_throttle": f"rank {rank}'s GPU is power throttled",
                    "memory_pressure": f"node {node} is out of memory headroom"}[cause]
            p.report(Finding(
                kind="device_health", key=ep.key, run_id=p.run.run_id, severity="warning", rank=rank, node=node,
                step_from=ep.since_step, step_to=step,
                evidence={"cause": cause, "lasted_s": json_number(lasted, 3), "window_s": window_s, **detail},
                root_cause=f"{what}{where if cause != 'memory_pressure' else ''} for {lasted:.0f} s",
                confidence=0.8))
            return
        ep.since_ts = None
        if ep.key is None:
            del st.episodes[(cause, who)]
            return
        if ep.clear_since is None:
            ep.clear_since = ts
        if ts - ep.clear_since >= self.cfg.resolve_after_s:
            prev = p.book.get(ep.key)
            if prev is not None:
                p.resolve(ep.key, evidence={**prev.evidence, "resolved_because":
                                            f"healthy for {ts - ep.clear_since:.0f} s"})
            del st.episodes[(cause, who)]
