"""`replica_divergence`: data-parallel replicas of one shard no longer hold the same bits.

The dp replicas of a (pp, tp) shard hold bit-identical parameters after every
step. Every `checksum_every` steps (a trainer flag) each rank records its shard's
checksum (trainer/integrity.py: the sum of the parameters' bit patterns, modulo
2^52, taken as the step began) as the scalar `checksum/pp<PP>-tp<TP>`. Once
every replica of a shard reported a step (the mesh's dp), the values are
compared:

- all equal: the shard agrees (the step is its last agreeing step); an open
  incident of the shard closes (after a repair or a rollback);
- not all equal: the incident opens. Its step range is (the last agreeing step,
  the first disagreeing one): the corruption happened in between. With dp >= 3
  the value most replicas hold is the healthy one, and the rank(s) that differ
  from it are named (rank and node); with dp = 2, or no value held by more than
  half, there is no majority: both (all) replicas are named in the evidence
  (`divergent_ranks`, `suspect_nodes`) and `why` says so.

The evidence carries what the policy needs to choose between a repair in place
and a rollback (analysis/policy.py): `majority`, `src_dp` (a healthy replica),
`caught_within_steps` (first disagreeing - last agreeing step) and
`checksum_every` (the interval the shard's checksums come at: the smallest gap
between two consecutive ones of an attempt, leaving out the extra check the
step after a repair and the one after it; a lost checksum only widens a gap, so
it cannot make a late catch look like a timely one). Groups are judged in
(attempt, step) order; a group of an older attempt than one already judged is
stale (a rollback replaced that lineage) and is dropped. An incomplete group is
given up once a later group of its shard is complete (each rank ships its rows in
order: the missing checksum was lost, and waiting for it would hold back every
later verdict); at most `max_pending_groups` incomplete groups are held (a rank
that stopped reporting cannot make the state grow).
"""

from __future__ import annotations

import re

import polars as pl

from analysis.findings import Finding
from analysis.registry import register

PREFIX = "checksum/"
_SHARD = re.compile(r"^pp(\d+)-tp(\d+)$")


class _State:
    __slots__ = ("pending", "attempt", "last_agree", "last_seen", "every", "open")

    def __init__(self) -> None:
        self.pending: dict[tuple[int, int, str], dict[int, int]] = {}  # (attempt, step, shard) -> rank -> checksum
        self.attempt = -1  # newest attempt judged
        self.last_agree: dict[str, tuple[int, int]] = {}  # shard -> (attempt, step) of its last agreeing checksum
        self.last_seen: dict[str, tuple[int, int]] = {}  # shard -> (attempt, step) of its last judged checksum
        self.every: dict[str, int] = {}  # shard -> smallest gap between consecutive regular checksum steps
        self.open: dict[str, str] = {}  # shard -> open incident key

    def footprint(self) -> dict[str, int]:
        return {"pending_groups": len(self.pending), "shards": len(self.last_seen)}


@register
class ReplicaDivergenceDetector:
    name = "replica_divergence"
    kinds = ("replica_divergence",)

    def __init__(self, rules) -> None:
        self.cfg = rules.replica_divergence

    def new_state(self) -> _State:
        return _State()

    def run(self, p, st: _State) -> None:
        sc = p.frames.scalars
        if sc is not None and sc.height:
            rows = sc.select(pl.col("attempt").cast(pl.Int64), pl.col("step").cast(pl.Int64),
                             pl.col("name").cast(pl.String), pl.col("rank").cast(pl.Int64),
                             pl.col("value").cast(pl.Float64))
            rows = rows.filter(pl.col("name").str.starts_with(PREFIX) & pl.col("value").is_finite())
            for attempt, step, name, rank, value in rows.iter_rows():
                if attempt >= st.attempt:
                    st.pending.setdefault((attempt, step, name[len(PREFIX):]), {})[rank] = int(value)
        dp = int(p.topo.mesh.get("dp") or 0)
        if dp < 2:
            st.pending.clear()  # one replica (or no mesh yet): nothing to compare
            return
        complete = [k for k, g in st.pending.items() if len(g) >= dp]
        for key in sorted(st.pending):
            group = st.pending[key]
            if len(group) < dp:
                if any(k[2] == key[2] and k[:2] > key[:2] for k in complete):
                    del st.pending[key]  # every replica reported a later checksum: this one was lost
                    continue
                if len(st.pending) <= self.cfg.max_pending_groups:
                    break  # judged in order: wait for the missing replicas
                del st.pending[key]  # too many held: the oldest incomplete one is given up
                continue
            del st.pending[key]
            if key[0] >= st.attempt:
                self._judge(p, st, *key, group)

    def _judge(self, p, st: _State, attempt: int, step: int, shard: str, group: dict[int, int]) -> None:
        st.attempt = max(st.attempt, attempt)
        prev = st.last_seen.get(shard)
        key = st.open.get(shard)
        if prev is not None and prev[0] == attempt and step > prev[1] and key is None:
            gap = step - prev[1]
            st.every[shard] = min(st.every.get(shard, gap), gap)
        st.last_seen[shard] = (attempt, step)
        values = set(group.values())
        if len(values) == 1:
            st.last_agree[shard] = (attempt, step)
            if key is not None:
                st.last_seen.pop(shard)  # a repair's extra check, off the interval: no gap to the next one
            if key is not None and p.book.is_open(key):
                f = p.book.get(key)
                p.resolve(key, evidence={**f.evidence, "agreeing_again_step": step, "agreeing_again_attempt": attempt,
                                         "resolved_because": f"the {len(group)} replicas of {shard} agree again "
                                                             f"at step {step}"})
            st.open.pop(shard, None)
            return
        if key is not None and p.book.is_open(key):
            return  # already open: the action is under way (its first disagreeing step stays)
        self._open(p, st, attempt, step, shard, group)

    def _open(self, p, st: _State, attempt: int, step: int, shard: str, group: dict[int, int]) -> None:
        ranks = sorted(group)
        counts: dict[int, int] = {}
        for v in group.values():
            counts[v] = counts.get(v, 0) + 1
        top, top_n = max(counts.items(), key=lambda kv: (kv[1], -min(r for r in ranks if group[r] == kv[0])))
        majority = top_n * 2 > len(ranks)
        divergent = [r for r in ranks if group[r] != top] if majority else ranks
        healthy = [r for r in ranks if group[r] == top] if majority else []
        nodes = sorted({n for n in (p.topo.node_name(r) for r in divergent) if n is not None})
        rank = divergent[0] if majority and len(divergent) == 1 else None
        node = p.topo.node_name(rank) if rank is not None else (nodes[0] if len(nodes) == 1 else None)
        last = st.last_agree.get(shard)
        last_step = last[1] if last is not None and last[0] == attempt else None
        m = _SHARD.match(shard)
        pp, tp = (int(m.group(1)), int(m.group(2))) if m else (None, None)
        src_dp = p.topo.coords(healthy[0])["dp"] if healthy else None
        if majority:
            why = (f"{top_n} of {len(ranks)} replicas agree; rank{'s' if len(divergent) > 1 else ''} "
                   f"{', '.join(map(str, divergent))} differ{'s' if len(divergent) == 1 else ''} from the majority")
        elif len(ranks) == 2:
            why = ("dp = 2: the two replicas disagree and there is no majority to tell which one is corrupted; "
                   "both are named")
        else:
            why = f"no checksum is held by more than half of the {len(ranks)} replicas: every one is named"
        where = f"after step {last_step}" if last_step is not None else "before its first compared checksum"
        key = st.open[shard] = p.book.new_key("replica_divergence")
        p.report(Finding(
            kind="replica_divergence", key=key, run_id=p.run.run_id, severity="critical", rank=rank, node=node,
            step_from=last_step if last_step is not None else step, step_to=step,
            evidence={"shard": shard, "pp": pp, "tp": tp, "dp": len(ranks), "attempt": attempt,
                      "last_agreeing_step": last_step, "first_disagreeing_step": step,
                      "caught_within_steps": step - last_step if last_step is not None else None,
                      "checksum_every": st.every.get(shard), "majority": majority,
                      "divergent_ranks": divergent, "healthy_ranks": healthy, "src_dp": src_dp,
                      "suspect_nodes": nodes, "checksums": {str(r): group[r] for r in ranks}, "why": why},
            root_cause=(f"silent data corruption: the dp replicas of shard {shard} diverged {where} "
                        f"(first seen at step {step}); {why}"),
            confidence=0.95 if majority else 0.6))
