"""Who is where: each rank's node and mesh coordinates, as arrays indexed by rank.

Filled from whatever the commit carries: `ranks` rows (node, dp/tp/pp), the
`runs` row (world size, mesh, node map), `nodes` rows (a node's ranks), and the
`node` column of steps and heartbeats for ranks not known yet. Coordinates the
agent did not send are derived from the mesh in the trainer's rank order (tp
innermost, then dp, then pp: trainer/parallel_dims.py); a rank without either
is its own replica in stage 0.

Arrays grow to the highest rank seen: memory is a few bytes per rank.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl

from analysis.frames import Frames, has, ints


def _grow(a: np.ndarray, n: int, fill) -> np.ndarray:
    if len(a) >= n:
        return a
    out = np.full(max(n, 2 * len(a)), fill, dtype=a.dtype)
    out[:len(a)] = a
    return out


def _json(value):
    if value is None or isinstance(value, (dict, list)):
        return value
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return None


class Topology:
    __slots__ = ("world_size", "mesh", "node_of", "dp", "tp", "pp", "seen", "node_names", "_node_index",
                 "eval_every", "ckpt_every", "_node_map_text", "_node_ranks_text")

    def __init__(self) -> None:
        self.world_size = 0  # from the runs row; 0: unknown
        self.mesh: dict[str, int] = {}
        self.node_of = np.full(0, -1, np.int32)  # index into node_names, -1 unknown
        self.dp = np.full(0, -1, np.int32)
        self.tp = np.full(0, -1, np.int32)
        self.pp = np.full(0, -1, np.int32)
        self.seen = np.zeros(0, bool)  # ranks that sent anything
        self.node_names: list[str] = []
        self._node_index: dict[str, int] = {}
        self.eval_every = 0  # from the run's config; 0: unknown or never
        self.ckpt_every = 0
        # the meta rows' JSON as last read: a collector re-reads a run's meta every pass until every rank
        # has reported, and a 100,000-rank node map parsed each time was most of a pass
        self._node_map_text: str | None = None
        self._node_ranks_text: dict[str, tuple[str, np.ndarray]] = {}

    # -- sizes -----------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.seen)

    def ensure(self, num_ranks: int) -> None:
        if num_ranks <= len(self.seen):
            return
        self.node_of = _grow(self.node_of, num_ranks, -1)
        self.dp = _grow(self.dp, num_ranks, -1)
        self.tp = _grow(self.tp, num_ranks, -1)
        self.pp = _grow(self.pp, num_ranks, -1)
        self.seen = _grow(self.seen, num_ranks, False)

    @property
    def expected_ranks(self) -> int:
        """Ranks a complete step has: the run's world size, else the ranks seen."""
        return self.world_size or int(self.seen.sum())

    # -- lookups ---------------------------------------------------------------
    def node_code(self, name: str) -> int:
        code = self._node_index.get(name)
        if code is None:
            code = self._node_index[name] = len(self.node_names)
            self.node_names.append(name)
        return code

    def node_name(self, rank: int | None) -> str | None:
        if rank is None or not 0 <= rank < len(self.node_of) or self.node_of[rank] < 0:
            return None
        return self.node_names[self.node_of[rank]]

    def coords(self, rank: int) -> dict[str, int | None]:
        if not 0 <= rank < len(self.dp):
            return {"dp": None, "tp": None, "pp": None}
        return {a: (int(v) if v >= 0 else None) for a, v in (("dp", self.dp[rank]), ("tp", self.tp[rank]),
                                                             ("pp", self.pp[rank]))}

    def stage_of(self, ranks: np.ndarray) -> np.ndarray:
        """Pipeline stage of each rank (0 when unknown)."""
        self.ensure(int(ranks.max()) + 1 if len(ranks) else 0)
        return np.maximum(self.pp[ranks], 0)

    def replica_of(self, ranks: np.ndarray) -> np.ndarray:
        """Data-parallel replica of each rank (the rank itself when unknown)."""
        self.ensure(int(ranks.max()) + 1 if len(ranks) else 0)
        dp = self.dp[ranks]
        return np.where(dp >= 0, dp, ranks).astype(np.int64)

    def pipeline_of(self, ranks: np.ndarray) -> np.ndarray:
        """The pipeline each rank is a stage of: a code of its (dp, tp) coordinates, the ranks
        that pass one another the same micro-batches' activations (-1 - rank when unknown)."""
        self.ensure(int(ranks.max()) + 1 if len(ranks) else 0)
        dp, tp = self.dp[ranks].astype(np.int64), self.tp[ranks].astype(np.int64)
        return np.where((dp >= 0) & (tp >= 0), dp * (1 << 20) + tp, -1 - ranks.astype(np.int64))

    # -- updates ---------------------------------------------------------------
    def update(self, f: Frames) -> None:
        if f.runs is not None:
            self._from_runs(f.runs)
        if f.ranks is not None:
            self._from_ranks(f.ranks)
        if f.nodes is not None:
            self._from_nodes(f.nodes)
        for df in (f.steps, f.heartbeats):
            if df is not None and df.height:
                self._mark_seen(df)

    def _from_runs(self, runs: pl.DataFrame) -> None:
        for row in runs.iter_rows(named=True):  # one row per run
            if row.get("world_size"):
                self.world_size = int(row["world_size"])
                self.ensure(self.world_size)
            mesh = _json(row.get("mesh"))
            if isinstance(mesh, dict):
                self.mesh = {k: int(v) for k, v in mesh.items() if k in ("dp", "tp", "pp") and v}
            text = row.get("node_map")
            node_map = _json(text) if text != self._node_map_text else None  # as last read: applied already
            if isinstance(node_map, dict):
                self._set_node_map(node_map)
                self._node_map_text = text if isinstance(text, str) else None
            config = _json(row.get("config"))
            if isinstance(config, dict):
                self.eval_every = int(config.get("eval_every") or 0)
                ckpt = config.get("ckpt")
                self.ckpt_every = int((ckpt or {}).get("every") or 0) if isinstance(ckpt, dict) else 0
        self._coords_from_mesh()

    def _from_ranks(self, ranks: pl.DataFrame) -> None:
        r = ranks["rank"].to_numpy().astype(np.int64)
        if not len(r):
            return
        self.ensure(int(r.max()) + 1)
        for axis in ("dp", "tp", "pp"):
            if has(ranks, axis):
                v = ints(ranks[axis], -1)
                arr = getattr(self, axis)
                arr[r] = np.where(v >= 0, v, arr[r])
        if has(ranks, "node"):
            self._set_nodes(r, ranks["node"], overwrite=True)
        self.seen[r] = True
        self._coords_from_mesh()

    def _set_node_map(self, node_map: dict) -> None:
        """The runs row's {rank: node}, where a rank's node is not known yet."""
        ranks, names = [], []
        for r, node in node_map.items():
            try:
                rank = int(r)
            except ValueError:
                continue
            if rank >= 0 and node:
                ranks.append(rank)
                names.append(str(node))
        if not ranks:
            return
        r = np.array(ranks, np.int64)
        self.ensure(int(r.max()) + 1)
        codes = np.array([self.node_code(n) for n in names], np.int32)
        unknown = self.node_of[r] < 0
        self.node_of[r[unknown]] = codes[unknown]

    def _from_nodes(self, nodes: pl.DataFrame) -> None:
        if not has(nodes, "node") or not has(nodes, "ranks"):
            return
        seen = self._node_ranks_text  # node -> (its ranks' JSON as last read, those ranks)
        parts: list[np.ndarray] = []
        codes: list[np.ndarray] = []
        for node, text in zip(nodes["node"].to_list(), nodes["ranks"].to_list()):
            if not node:
                continue
            got = seen.get(node)
            if got is not None and isinstance(text, str) and got[0] == text:
                r = got[1]  # as last read: not parsed again
            else:
                members = _json(text)  # JSON text as stored (a list when not from DuckDB)
                if not isinstance(members, list):
                    continue
                r = np.array([m for m in members if isinstance(m, int) and m >= 0], np.int64)
                if isinstance(text, str):
                    seen[node] = (text, r)
            if len(r):
                parts.append(r)
                codes.append(np.full(len(r), self.node_code(str(node)), np.int32))
        if parts:  # in the rows' order, as one assignment: a later row's claim on a rank wins, as before
            r, c = np.concatenate(parts), np.concatenate(codes)
            self.ensure(int(r.max()) + 1)
            self.node_of[r] = c

    def _mark_seen(self, df: pl.DataFrame) -> None:
        r = df["rank"].to_numpy().astype(np.int64)
        r = r[r >= 0]
        if not len(r):
            return
        self.ensure(int(r.max()) + 1)
        self.seen[r] = True
        if "node" in df.columns:
            unknown = self.node_of[r] < 0
            if unknown.any():
                self._set_nodes(r[unknown], df["node"].filter(pl.Series(unknown)), overwrite=False)
        if (self.dp[r] < 0).any() and self.mesh:
            self._coords_from_mesh()

    def _set_nodes(self, r: np.ndarray, nodes: pl.Series, *, overwrite: bool) -> None:
        names = nodes.cast(pl.String)
        uniq = [n for n in names.unique().to_list() if n]
        if not uniq:
            return
        lut = {n: self.node_code(n) for n in uniq}
        codes = names.replace_strict(lut, default=-1, return_dtype=pl.Int32).to_numpy()
        ok = codes >= 0
        if not overwrite:
            ok &= self.node_of[r] < 0
        self.node_of[r[ok]] = codes[ok]

    def _coords_from_mesh(self) -> None:
        """Coordinates the agent did not send, from the mesh (tp innermost, dp, then pp)."""
        if not self.mesh:
            return
        dp, tp = self.mesh.get("dp", 1), self.mesh.get("tp", 1)
        n = self.world_size or len(self.seen)
        if n <= 0:
            return
        self.ensure(n)
        ranks = np.arange(n)
        for arr, val in ((self.tp, ranks % tp), (self.dp, (ranks // tp) % dp), (self.pp, ranks // (tp * dp))):
            unknown = arr[:n] < 0
            arr[:n][unknown] = val[unknown]
