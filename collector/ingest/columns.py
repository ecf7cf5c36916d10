"""Many decoded batches -> one Arrow table per target table, vectorised.

A group commit holds anywhere from one large batch to thousands of tiny ones (one
per rank). Building one Arrow table per batch and concatenating would leave
DuckDB scanning thousands of tiny chunks and cost Python time per batch and
column, so each column's bytes are joined once across the group (one memcpy)
and wrapped as an Arrow buffer; dictionary codes are used as sent when the
batches' dictionaries agree (the usual case) and re-coded through a lookup
table otherwise; per-batch constants (run_id, rank, node) become `np.repeat`
over the row counts. A single batch's columns reach Arrow without any copy.
NULLs (wire.Column `null`/`valid`: a step value or local signal the loop did not
measure, and every row of an optional column an older agent left out) become
Arrow validity bitmaps, built only for a column that has some (one vectorised
compare per column and group). Pure: no DuckDB, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from agent import wire
from collector.ingest.decode import DecodedBatch, Section

# wire record kind -> table
KIND_TABLES = {wire.STEP: "steps", wire.COLLECTIVE: "collectives", wire.SCALAR: "scalars", wire.HEARTBEAT: "heartbeats",
               wire.DEVICE_HEALTH: "device_health",
               # a summarizing agent's per-step rows (agent/summary.py): where the rollup puts old op rows
               wire.COLLECTIVE_SUMMARY: "collectives_rollup"}

# Per-batch constants added to each kind's rows (header field -> column).
_CONSTANTS = {
    wire.STEP: ("run_id", "rank", "node"),
    wire.COLLECTIVE: ("run_id", "rank"),
    wire.SCALAR: ("run_id", "rank"),
    wire.HEARTBEAT: ("run_id", "rank", "node", "pid"),
    wire.DEVICE_HEALTH: ("run_id", "rank", "node"),
    wire.COLLECTIVE_SUMMARY: ("run_id", "rank"),
}


class _Dictionary:
    """Group-wide string dictionary: value -> code, in first-seen order."""

    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def lookup(self, values: Sequence[str]) -> np.ndarray:
        return np.fromiter((self.index.setdefault(v, len(self.index)) for v in values), dtype=np.int32,
                           count=len(values))

    def array(self, codes: np.ndarray) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(list(self.index), pa.string()))


_ARROW_TYPES = {"d": pa.float64(), "q": pa.int64(), "i": pa.int32(), "h": pa.int16(), "b": pa.int8()}
_COLUMNS = {kind: {c.name: c for c in cols} for kind, cols in wire.SCHEMA.items()}


def _primitive(fmt: str, views: list, n: int, valid: np.ndarray | None = None) -> pa.Array:
    """The column bytes of every batch, as one Arrow array (a single join, no numpy).
    `valid`: bool per row (False: NULL), or None when every row holds a value."""
    buf = views[0] if len(views) == 1 else b"".join(views)
    bitmap = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(_ARROW_TYPES[fmt], n, [bitmap, pa.py_buffer(buf)])


class _Joined:
    """Each column's bytes across a group's sections, joined once (a column's NULLs are read
    from the same bytes its Arrow buffer is made of); a section without an optional column
    (an older agent's) contributes its NULL: the `null` value, or 0 (a `valid` column's 0)."""

    __slots__ = ("sections", "_bytes", "_by_name")

    def __init__(self, sections: list[Section]) -> None:
        self.sections = sections
        self._bytes: dict[str, bytes | memoryview] = {}
        # Sections with the same columns (every rank of a job, as a rule) are transposed at once,
        # column by column in C, instead of a dict lookup per section and column in Python
        # (a 100,000-rank commit: ~3,600 sections x ~50 columns).
        names = tuple(sections[0].views)
        self._by_name: dict[str, tuple] | None = (
            dict(zip(names, zip(*(sec.views.values() for sec in sections))))
            if all(tuple(sec.views) == names for sec in sections) else None)

    def __call__(self, col: wire.Column) -> bytes | memoryview:
        buf = self._bytes.get(col.name)
        if buf is None:
            if self._by_name is None:
                views = [sec.views.get(col.name) for sec in self.sections]
            else:
                views = self._by_name.get(col.name) or [None] * len(self.sections)
            if col.optional and any(view is None for view in views):  # (`is`: comparing memoryviews is slow)
                fill = col.null if col.null is not None else 0
                views = [np.full(sec.n, fill, dtype=col.null_dtype).data if view is None else view
                         for view, sec in zip(views, self.sections)]
            buf = self._bytes[col.name] = views[0] if len(views) == 1 else b"".join(views)
        return buf


def _valid(kind: str, col: wire.Column, joined: _Joined) -> np.ndarray | None:
    """Which rows of a column hold a value (None: all of them, no bitmap)."""
    if col.valid is not None:
        valid = np.frombuffer(joined(_COLUMNS[kind][col.valid]), dtype="<i1") != 0
    elif col.null is not None:
        valid = np.frombuffer(joined(col), dtype=col.null_dtype) != col.null
    else:
        return None
    return None if valid.all() else valid


def _dictionary_column(name: str, sections: list[Section], valid: np.ndarray | None = None) -> pa.Array:
    """Codes of all batches against one dictionary. Agents build their dictionaries
    in the same first-seen order, so usually each batch's values are a prefix of
    the group's (or extend it) and its codes are used as they are; a batch with a
    different order is re-coded through a lookup table. `valid` (False: NULL, the
    column's -1 code) makes those rows null; their index is set to 0."""
    values: list[str] = []
    index: dict[str, int] = {}
    parts: list[memoryview | np.ndarray] = []
    recoded = False
    n = sum(sec.n for sec in sections)
    if valid is not None and not valid.any():
        return pa.nulls(n, pa.dictionary(pa.int32(), pa.string()))
    for sec in sections:
        vals = sec.dicts.get(name, [])
        view = sec.views.get(name)
        if view is None:  # left out by an older agent: NULL (masked by `valid`)
            view = np.zeros(sec.n, "<i2").data
        if vals == values:  # the usual case, with no slices to compare
            parts.append(view)
            continue
        k = min(len(vals), len(values))
        if vals[:k] == values[:k]:
            for v in vals[k:]:
                index[v] = len(values)
                values.append(v)
            parts.append(view)
        else:
            recoded = True
            lut = np.fromiter((index.setdefault(v, len(index)) for v in vals), dtype=np.int32, count=len(vals))
            values.extend(list(index)[len(values):])
            codes = np.frombuffer(view, dtype="<i2")
            parts.append(lut[np.where(codes >= 0, codes, 0)] if len(lut) else np.zeros(sec.n, np.int32))
    if recoded:
        flat = np.concatenate([p if isinstance(p, np.ndarray) else np.frombuffer(p, "<i2") for p in parts])
        if valid is not None:
            flat = np.where(valid, flat, 0)
        codes = pa.array(flat, pa.int32(), mask=None if valid is None else ~valid)
    elif valid is not None:
        flat = np.concatenate([np.frombuffer(p, "<i2") for p in parts])
        codes = _primitive("h", [np.where(valid, flat, 0).astype("<i2").data], n, valid)
    else:
        codes = _primitive("h", parts, n)
    return pa.DictionaryArray.from_arrays(codes, pa.array(values, pa.string()))


def section_table(kind: str, batches: Sequence[DecodedBatch]) -> pa.Table | None:
    """One table of all `kind` rows in `batches` (None when there are none)."""
    parts = [b for b in batches if kind in b.sections]
    if not parts:
        return None
    sections = [b.sections[kind] for b in parts]
    counts = np.fromiter((s.n for s in sections), dtype=np.int64, count=len(sections))
    n = int(counts.sum())
    cols: dict[str, pa.Array] = {}
    joined = _Joined(sections)
    for col in wire.SCHEMA[kind]:
        if not col.stored:  # a `valid` column: it becomes the other's null bitmap
            continue
        valid = _valid(kind, col, joined) if col.optional or col.null is not None else None
        if col.dict_encoded:
            cols[col.name] = _dictionary_column(col.name, sections, valid)
        else:
            cols[col.name] = _primitive(col.fmt, [joined(col)], n, valid)
    for name in _CONSTANTS[kind]:
        if name in ("run_id", "node"):
            d = _Dictionary()
            per_batch = d.lookup([getattr(b, name) for b in parts])
            cols[name] = d.array(np.repeat(per_batch, counts))
        elif name == "rank":
            cols[name] = pa.array(np.repeat(np.fromiter((b.rank for b in parts), np.int32, len(parts)), counts))
        else:  # pid, possibly unknown
            cols[name] = pa.array(np.repeat(np.array([b.pid for b in parts], dtype=object), counts), pa.int64())
    return pa.table(cols)


def events_table(batches: Sequence[DecodedBatch]) -> pa.Table | None:
    rows = [(b.run_id, b.rank, e) for b in batches for e in b.events]
    if not rows:
        return None
    return pa.table({
        "run_id": pa.array([r for r, _, _ in rows], pa.string()),
        "rank": pa.array([k for _, k, _ in rows], pa.int32()),
        "ts": pa.array([e.ts for _, _, e in rows], pa.float64()),
        "step": pa.array([e.step for _, _, e in rows], pa.int64()),
        "attempt": pa.array([e.attempt for _, _, e in rows], pa.int32()),
        "kind": pa.array([e.kind for _, _, e in rows], pa.string()),
        "data": pa.array([e.data_json for _, _, e in rows], pa.string()),
    })


def batches_table(batches: Sequence[DecodedBatch], received_ts: float) -> pa.Table:
    return pa.table({
        "run_id": pa.array([b.run_id for b in batches], pa.string()),
        "rank": pa.array([b.rank for b in batches], pa.int32()),
        "incarnation": pa.array([b.incarnation for b in batches], pa.string()),
        "batch_seq": pa.array([b.batch_seq for b in batches], pa.int64()),
        "received_ts": pa.array(np.full(len(batches), received_ts)),
        "rows": pa.array([b.num_rows for b in batches], pa.int64()),
        "content_hash": pa.array([b.content_hash or None for b in batches], pa.binary()),
    })


def ranks_table(latest: Sequence[DecodedBatch], drops: dict[tuple[str, int], int], received_ts: float) -> pa.Table:
    """One row per rank: the identity of its latest batch, the drops it reported. The
    launcher's batches (rank -1, events only) are not a rank: they get no row."""
    latest = [b for b in latest if b.rank >= 0]
    coord = lambda b, axis: getattr(b.coords, axis) if b.coords else None  # noqa: E731
    return pa.table({
        "run_id": pa.array([b.run_id for b in latest], pa.string()),
        "rank": pa.array([b.rank for b in latest], pa.int32()),
        "node": pa.array([b.node for b in latest], pa.string()),
        "dp": pa.array([coord(b, "dp") for b in latest], pa.int32()),
        "tp": pa.array([coord(b, "tp") for b in latest], pa.int32()),
        "pp": pa.array([coord(b, "pp") for b in latest], pa.int32()),
        "pid": pa.array([b.pid for b in latest], pa.int64()),
        "incarnation": pa.array([b.incarnation for b in latest], pa.string()),
        "first_seen_ts": pa.array(np.full(len(latest), received_ts)),
        "last_seen_ts": pa.array(np.full(len(latest), received_ts)),
        "agent_drops": pa.array([drops.get((b.run_id, b.rank), 0) for b in latest], pa.int64()),
        "hw_id": pa.array([b.hw_id for b in latest], pa.string()),
    })


def last_seen_table(last_seen: dict[tuple[str, int], float]) -> pa.Table:
    return pa.table({
        "run_id": pa.array([k[0] for k in last_seen], pa.string()),
        "rank": pa.array([k[1] for k in last_seen], pa.int32()),
        "last_seen_ts": pa.array(list(last_seen.values()), pa.float64()),
    })


def ingest_tables(batches: Sequence[DecodedBatch]) -> dict[str, pa.Table]:
    """Every row table of the group, keyed by table name (empty ones left out)."""
    tables = {}
    for kind, table in KIND_TABLES.items():
        t = section_table(kind, batches)
        if t is not None:
            tables[table] = t
    ev = events_table(batches)
    if ev is not None:
        tables["events"] = ev
    return tables
