"""The wire format: record kinds, their columns, and the batch encoding.

One definition, two users: the agent encodes, the collector decodes. Stdlib only.

A batch is columnar so that the collector can hand each column to Arrow/DuckDB
without touching rows in Python:

    offset 0   b"LWB1"                       magic and format version
           4   u32 little-endian             header length H
           8   H bytes of UTF-8 JSON          the header
       8 + H   zero padding to a multiple of 8
               the column area: every column's bytes, each followed by zero
               padding to a multiple of 8

Header:

    {
      "run_id": str, "rank": int, "incarnation": str, "batch_seq": int,
      "node": str, "pid": int, "sent_ts": float,
      "sections": {kind: {"n": rows, "columns": {name: [offset, nbytes]}}},
      "dicts": {dict name: [str, ...]},       # codes of dictionary columns (Column.dict_name)
      "events": [{"ts", "step", "attempt", "kind", "data": {...}}, ...],
      "run": {...} | null,                    # run metadata (sent at start)
      "stats": {"dropped": {kind: n}, "spooled": n, ...}
    }

The columns tile the column area exactly: sections in the header's order, each
section's columns in `SCHEMA` order, every column starting where the previous
one's padding ends (the first at 0), the last one's padding ending the batch.
Offsets are relative to the start of the column area; `nbytes` is the column's
length without its padding. So no two columns share a byte and no byte is
unaccounted for: a section's rows cost their full row size in the body,
whatever the header claims.
Optional columns (added after the first layout) may be left out of a section:
the rows of an older agent, or of a batch it spooled, then read as NULL there.
NULL inside a column: an integer column's `null` value (-1: its real values are
counts, flags, positions or codes, never negative); for a float, whose NaN is a
real value (a NaN loss is what the detectors look for), either a 0 in the int8
column its `valid` names (on the wire only), or the one NaN whose bits are
`NULL_F64_BITS` (its `null`): a quiet NaN with a payload of its own, which no
arithmetic produces from numbers (a NaN computed from numbers carries no payload),
so "not measured" costs the agent no store beyond the value's own.
A column's dtype is fixed by `SCHEMA`, never by the sender; `decode_batch`
checks the tiling, every length, the padding, the header JSON's nesting depth
and number of values (before parsing it), and every dictionary code, and
raises `WireError` with a reason a person can act on.

`(run_id, rank, incarnation, batch_seq)` identifies a batch: the collector
stores a batch seen twice once, and refuses a second batch with the same key
and other bytes.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import dataclass, field
from itertools import accumulate

MAGIC = b"LWB1"
CONTENT_TYPE = "application/x-llmwatch-batch"
MAX_HEADER_BYTES = 4 * 1024 * 1024
# The header's JSON: nesting levels (the header object is level 1) and values (not
# counting object keys). json.loads recurses once per level and builds ~50 bytes
# of Python objects per value, so both are bounded before it runs.
MAX_HEADER_DEPTH = 64
MAX_HEADER_VALUES = 500_000
_HDR = struct.Struct("<4sI")


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    fmt: str  # array/memoryview/struct format: d=f64, q=i64, i=i32, h=i16, b=i8
    dict_encoded: bool = False  # int16 codes into header["dicts"][dict_name]
    # Optional columns came after the first layout: a batch may leave them out (an older
    # agent's, or one sitting in an old spool) and the decoder then reads them as NULL.
    optional: bool = False
    # NULL on the wire (the "not measured" value): `null` is a value the column's real
    # values never take (-1 for a count, a flag, a sample position or a dictionary code;
    # for a float, the int64 bits of the NaN `NULL_F64`: compare `null_dtype` views); or
    # `valid` names the int8 column that says, per row, whether this one holds a value (1)
    # or NULL (0); a NULL row's own bytes are then 0.
    null: int | None = None
    valid: str | None = None
    stored: bool = True  # False: on the wire only (a `valid` column), not a table column
    recorded: bool = True  # False: set by the agent when it cuts a batch, not by a record_* call
    dictionary: str | None = None  # the header dict the codes index; None: the column's own name

    @property
    def dict_name(self) -> str:
        return self.dictionary or self.name

    @property
    def itemsize(self) -> int:
        return struct.calcsize(self.fmt)

    @property
    def numpy_dtype(self) -> str:
        return {"d": "<f8", "q": "<i8", "i": "<i4", "h": "<i2", "b": "<i1"}[self.fmt]

    @property
    def null_dtype(self) -> str:
        """The dtype to compare `null` in: a float's NULL is a bit pattern (NaN != NaN)."""
        return "<i8" if self.fmt == "d" else self.numpy_dtype


def _cols(*spec: tuple | Column) -> tuple[Column, ...]:
    return tuple(s if isinstance(s, Column) else Column(*s) for s in spec)


NOT_MEASURED = -1  # the `null` of every optional integer column: the agent's default, NULL in the tables
# The float NULL: a quiet NaN with the payload "LWNULL" (0x4c574e554c4c). Stored as is by the
# agent for a value not given; the collector reads these bits as NULL, any other NaN as NaN.
NULL_F64_BITS = 0x7FF8_4C57_4E55_4C4C
NULL_F64: float = struct.unpack("<d", struct.pack("<q", NULL_F64_BITS))[0]


def _measured(name: str, fmt: str) -> Column:
    """A step value a loop may not measure: NULL when the agent was not given it."""
    return Column(name, fmt, null=NULL_F64_BITS if fmt == "d" else NOT_MEASURED)


def _opt(name: str, fmt: str, **kw) -> Column:
    if "valid" not in kw and kw.get("stored", True):
        kw["null"] = NULL_F64_BITS if fmt == "d" else NOT_MEASURED
    return Column(name, fmt, optional=True, **kw)


# Record kinds. Column order is the order of the agent's record_* arguments.
STEP = "step"
COLLECTIVE = "collective"
SCALAR = "scalar"
HEARTBEAT = "heartbeat"
DEVICE_HEALTH = "device_health"
COLLECTIVE_SUMMARY = "collective_summary"

SCHEMA: dict[str, tuple[Column, ...]] = {
    STEP: _cols(
        ("step", "q"), ("attempt", "i"), ("ts", "d"),
        # NULL when not given to record_step (`_measured`): floats NULL_F64, integers -1
        *(_measured(name, fmt) for name, fmt in (
            ("loss", "d"), ("grad_norm", "d"), ("loss_scale", "d"), ("lr", "d"), ("tokens", "q"),
            ("step_s", "d"), ("fwd_s", "d"), ("bwd_s", "d"), ("opt_s", "d"), ("data_s", "d"),
            ("comm_exposed_s", "d"), ("mem_bytes", "q"))),
        ("skipped", "b"),
        # the per-rank local signals (analysis/frames.py): optional, NULL when not measured
        _opt("local_loss", "d", valid="local_loss_valid"), _opt("local_loss_valid", "b", stored=False),
        _opt("finite_fwd", "b"), _opt("finite_bwd", "b"),
        _opt("sample_epoch", "q"), _opt("sample_from", "q"), _opt("sample_to", "q"),
    ),
    COLLECTIVE: _cols(
        ("step", "q"), ("attempt", "i"), ("seq", "q"), ("group_seq", "q"),
        ("op", "h", True), ("axis", "h", True), ("group_id", "i"), ("peer", "i"),
        ("bytes", "q"), ("start_ts", "d"), ("duration_s", "d"), ("wait_s", "d"),
        # 1: an op row of an agent that summarizes its collectives (agent/summary.py), shipped
        # as a sample or because the collector asked; NULL: an agent that ships every op
        _opt("sampled", "b", recorded=False),
    ),
    SCALAR: _cols(
        ("step", "q"), ("attempt", "i"), ("ts", "d"), ("name", "h", True), ("value", "d"),
    ),
    HEARTBEAT: _cols(
        ("ts", "d"), ("step", "q"), ("phase", "h", True), ("last_seq", "q"),
        # the collective `last_seq` names; its op and axis share the collectives' dictionaries
        _opt("last_op", "h", dict_encoded=True, dictionary="op"),
        _opt("last_axis", "h", dict_encoded=True, dictionary="axis"),
        _opt("last_group_id", "i"), _opt("last_group_seq", "q"),
        # the agent's heartbeat interval (s): how long its silence must last before it means
        # anything (analysis/liveness.py); NULL from an agent older than the column
        _opt("interval_s", "d"),
    ),
    # One sample per heartbeat, taken on the agent's thread (agent/device_health.py).
    # NULL (`_measured`) what this host cannot tell: the GPU columns without NVML.
    DEVICE_HEALTH: _cols(
        ("ts", "d"), ("step", "q"),
        *(_measured(name, fmt) for name, fmt in (
            ("gpu_index", "i"), ("temperature_c", "d"), ("power_w", "d"), ("sm_clock_mhz", "q"),
            ("throttle_reasons", "q"), ("ecc_uncorrectable", "q"), ("retired_pages", "q"),
            ("mem_available_bytes", "q"), ("mem_total_bytes", "q"), ("cpu_s", "d"))),
    ),
    # One row per (attempt, step, op, axis, group_id, peer) of a rank's collectives, made by
    # the agent at flush time instead of the op rows (agent/summary.py): counts, sums and
    # maxima, the first entry and last completion, the mean entry and completion, and the
    # highest seq and group_seq.
    # Stored in `collectives_rollup`, where the collector's own rollup puts old op rows.
    # duration_s / wait_s: NULL when any op of the row had none measured.
    COLLECTIVE_SUMMARY: _cols(
        ("step", "q"), ("attempt", "i"), ("op", "h", True), ("axis", "h", True), ("group_id", "i"), ("peer", "i"),
        ("num_ops", "q"), ("bytes", "q"),
        _measured("duration_s", "d"), _measured("max_duration_s", "d"),
        _measured("wait_s", "d"), _measured("max_wait_s", "d"),
        ("start_ts", "d"), ("end_ts", "d"), ("mean_start_ts", "d"), ("mean_end_ts", "d"),
        ("max_seq", "q"), ("max_group_seq", "q"),
    ),
}
KINDS = tuple(SCHEMA)
# the columns a record_* call stores, per kind: the agent's buffers (agent/ring.py)
RECORDED: dict[str, tuple[Column, ...]] = {kind: tuple(c for c in cols if c.recorded) for kind, cols in SCHEMA.items()}
# The rank of a batch the launcher sends about its ranks (`rank_exited` events): it
# carries events only, and the collector keeps no `ranks` row for it.
LAUNCHER_RANK = -1
MAX_DICT_ENTRIES = 32767


class WireError(ValueError):
    """A batch that cannot be decoded. The message says what is wrong."""


@dataclass(slots=True)
class Batch:
    header: dict
    # kind -> column name -> memoryview cast to the column's format (zero-copy; its bytes
    # with decode_batch(typed=False))
    columns: dict[str, dict[str, memoryview]]

    def num_rows(self, kind: str) -> int:
        sec = self.header["sections"].get(kind)
        return int(sec["n"]) if sec else 0

    @property
    def key(self) -> tuple[str, int, str, int]:
        h = self.header
        return (h["run_id"], h["rank"], h["incarnation"], h["batch_seq"])


def _pad8(n: int) -> int:
    return (-n) % 8


_ZEROS = bytes(8)


def encode_batch(header: dict, sections: dict[str, tuple[int, dict[str, bytes | memoryview]]]) -> bytes:
    """Encode one batch. `header` holds everything but "sections"; `sections` maps a
    kind to (rows, {column name: raw little-endian bytes of exactly rows items}).

    The layout is the one `decode_batch` accepts and no other: sections in the
    order of `sections` (empty ones left out), columns in `SCHEMA` order, each
    column followed by zero padding to a multiple of 8. An optional column not
    in `cols` is left out (as an older agent's batch does)."""
    if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
        raise WireError("encode_batch supports little-endian hosts only")
    layout: dict[str, dict] = {}
    bufs: list[bytes | memoryview] = []
    offset = 0
    for kind, (n, cols) in sections.items():
        if n == 0:
            continue
        spec = SCHEMA[kind]
        col_layout = {}
        for col in spec:
            buf = cols.get(col.name)
            if buf is None:
                if col.optional:
                    continue  # left out: read as NULL
                raise WireError(f"{kind}.{col.name}: missing (only optional columns may be left out)")
            nbytes = len(buf) if isinstance(buf, bytes) else buf.nbytes
            if nbytes != n * col.itemsize:
                raise WireError(f"{kind}.{col.name}: {nbytes} bytes for {n} rows of {col.fmt}")
            col_layout[col.name] = [offset, nbytes]
            bufs.append(buf)
            pad = _pad8(nbytes)
            if pad:
                bufs.append(_ZEROS[:pad])
            offset += nbytes + pad
        layout[kind] = {"n": n, "columns": col_layout}
    head = dict(header)
    head["sections"] = layout
    hj = json.dumps(head, separators=(",", ":"), allow_nan=False).encode()
    parts = [_HDR.pack(MAGIC, len(hj)), hj, _ZEROS[:_pad8(_HDR.size + len(hj))]]
    parts.extend(bufs)
    return b"".join(parts)


_REQUIRED = {"run_id": str, "rank": int, "incarnation": str, "batch_seq": int}
# bytes.translate tables: keep only the bytes that shape JSON; map brackets to +1/-1
_NOT_STRUCTURAL = bytes(range(256)).translate(None, b'"[]{},')
_LEVEL_STEPS = bytes.maketrans(b"[{]},", b"\x01\x01\xff\xff\x00")


def _check_header_shape(text: bytes) -> None:
    """Refuse a header nested deeper than MAX_HEADER_DEPTH or holding more than
    MAX_HEADER_VALUES values, before json.loads builds it (5,000 levels is a
    RecursionError inside the parser; 4 MiB of `[{},{},...]` is ~90 MB of dicts).

    Brackets and commas outside strings are counted with C-speed byte passes
    (count, translate, split on quotes after dropping escaped quotes); the one
    Python-level pass, a running sum over the brackets alone, runs only when the
    bracket count says the nesting could be too deep and taking out the innermost
    pairs level by level (`_nests_within`) does not empty them within the limit.
    Exact for valid UTF-8 JSON, whose multi-byte characters never contain an ASCII
    byte; for text that is not JSON it only has to be no lower than what the parser
    reaches before failing, and the parser agrees with this tokenisation up to that
    point. ~7 us for an agent's 1.5 KB header (~70 brackets: one per column), ~0.1 s
    for a 4 MiB one of nothing but brackets."""
    opens = text.count(b"[") + text.count(b"{")
    if opens <= MAX_HEADER_DEPTH and opens + text.count(b",") < MAX_HEADER_VALUES:
        return  # upper bounds already (brackets and commas inside strings included)
    if b"\\" in text:  # drop escape pairs first, so that \" does not end a string
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(text.translate(None, _NOT_STRUCTURAL).split(b'"')[::2])
    opens = outside.count(b"[") + outside.count(b"{")
    values = outside.count(b",") + opens + 1  # a container of k > 0 values holds k - 1 commas
    if values > MAX_HEADER_VALUES:
        raise WireError(f"header JSON holds about {values} values (limit {MAX_HEADER_VALUES})")
    if opens > MAX_HEADER_DEPTH and not _nests_within(outside, MAX_HEADER_DEPTH):
        depth = max(accumulate(array("b", outside.translate(_LEVEL_STEPS))))
        if depth > MAX_HEADER_DEPTH:
            raise WireError(f"header JSON nests {depth} levels deep (limit {MAX_HEADER_DEPTH})")


_ONE_KIND = bytes.maketrans(b"{}", b"[]")


def _nests_within(outside: bytes, limit: int) -> bool:
    """True when the brackets of `outside` (JSON's structure with the strings taken out) close
    in order and nest at most `limit` deep: every innermost pair taken out at once, once a
    level (C-speed replaces: an agent's header, 5 levels but ~70 brackets, one per column,
    in ~1 us against ~5 for the running sum). False: nested deeper, or not closed in order,
    which the running sum then measures."""
    text = outside.translate(_ONE_KIND, b",")
    for _ in range(limit):
        if not text:
            return True
        inner = text.replace(b"[]", b"")
        if len(inner) == len(text):
            return False
        text = inner
    return not text


def _parse_header(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")  # strict: the header is UTF-8 (json.loads would guess UTF-16/32 too)
    except UnicodeDecodeError as e:
        raise WireError(f"header is not UTF-8: {e}") from None
    _check_header_shape(raw)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; an integer of over 4,300 digits
        raise WireError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError("header must be a JSON object")
    return header


def decode_batch(data: bytes | memoryview, *, check_codes: bool = True, typed: bool = True) -> Batch:
    """Decode and validate a batch without copying its columns.

    `check_codes=False` skips the per-row dictionary-code range check (a Python
    loop); a caller that checks codes vectorised (the collector, with numpy)
    must then do it itself, against `len(header["dicts"][col.dict_name])` (and
    -1, NULL, for a column whose `null` is -1). `typed=False` leaves each column
    as its bytes (format "B"), for a caller that reads them with numpy or joins
    them: a cast is ~0.1 us, and a 100,000-rank collector made ~50 a batch."""
    mv = memoryview(data)
    if len(mv) < _HDR.size:
        raise WireError(f"batch too short ({len(mv)} bytes)")
    magic, hlen = _HDR.unpack_from(mv, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not an llmwatch batch (expected {MAGIC!r})")
    if hlen > MAX_HEADER_BYTES or _HDR.size + hlen > len(mv):
        raise WireError(f"header length {hlen} exceeds the batch ({len(mv)} bytes) or the limit ({MAX_HEADER_BYTES})")
    header = _parse_header(bytes(mv[_HDR.size:_HDR.size + hlen]))
    for key, typ in _REQUIRED.items():
        v = header.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise WireError(f"header field {key!r} must be {typ.__name__}")
    if not header["run_id"] or len(header["run_id"]) > 200:
        raise WireError("run_id must be 1..200 characters")
    if header["rank"] < LAUNCHER_RANK or header["batch_seq"] < 0:
        raise WireError(f"rank must be >= 0 ({LAUNCHER_RANK} for the launcher) and batch_seq >= 0")
    end = _HDR.size + hlen
    base = end + _pad8(end)
    if len(mv) < base or mv[end:base] != _ZEROS[:base - end]:
        raise WireError(f"the header must be followed by {base - end} zero bytes of padding")
    body = mv[base:]
    sections = header.get("sections", {})
    dicts = header.get("dicts", {})
    if not isinstance(sections, dict) or not isinstance(dicts, dict):
        raise WireError("sections and dicts must be objects")
    for name, values in dicts.items():
        if not isinstance(values, list) or len(values) > MAX_DICT_ENTRIES or not all(isinstance(v, str) for v in values):
            raise WireError(f"dict {name!r} must be a list of at most {MAX_DICT_ENTRIES} strings")
    columns: dict[str, dict[str, memoryview]] = {}
    # A layout is checked against the one canonical layout for its kind, row count and
    # columns (cached: an agent sends the same few again and again) in one comparison,
    # and its numbers for being ints (1.0 and true compare equal to 1); only one that
    # differs goes through the column-by-column check that says what is wrong.
    pos = 0  # where the next column must start: the columns tile the column area
    for kind, sec in sections.items():
        if type(sec) is dict:
            n, layout = sec.get("n"), sec.get("columns")
            if type(n) is int and n >= 0 and type(layout) is dict:
                plan = _plan(kind, n, tuple(layout))
                at = plan.at_offset(pos) if plan is not None and pos + plan.span <= len(body) else None
                if (at is not None and layout == at.layout
                        and {type(x) for loc in layout.values() for x in loc} <= _INT
                        and all(map(memoryview.__eq__, map(body.__getitem__, at.pads), at.zeros))):
                    views = map(body.__getitem__, at.columns)
                    cols = ({name: v.cast(c[3]) for name, v, c in zip(plan.names, views, plan.cols)}
                            if typed else dict(zip(plan.names, views)))
                    if check_codes and n:
                        _check_codes(kind, cols, dicts)
                    columns[kind] = cols
                    pos += plan.span
                    continue
        columns[kind], pos = _section(kind, sec, body, pos, dicts, check_codes, typed)
    if header["rank"] == LAUNCHER_RANK and any(sec["n"] for sec in sections.values()):
        raise WireError(f"rank {LAUNCHER_RANK} (the launcher) sends events only, no rows")
    if pos != len(body):
        raise WireError(f"the columns end at {pos} of a {len(body)}-byte column area: {len(body) - pos} bytes "
                        f"belong to no column")
    for key in ("events",):
        if key in header and not isinstance(header[key], list):
            raise WireError(f"{key} must be a list")
    return Batch(header=header, columns=columns)


def _section(kind: str, sec, body: memoryview, pos: int, dicts: dict, check_codes: bool, typed: bool = True
             ) -> tuple[dict[str, memoryview], int]:
    """One section's columns, checked one by one (the error says what is wrong); and
    where the next section's columns must start."""
    spec = SCHEMA.get(kind)
    if spec is None:
        raise WireError(f"unknown record kind {kind!r} (known: {', '.join(KINDS)})")
    if not isinstance(sec, dict):
        raise WireError(f"section {kind!r} must be an object")
    n = sec.get("n")
    layout = sec.get("columns")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0 or not isinstance(layout, dict):
        raise WireError(f"section {kind!r} needs an integer n >= 0 and a columns object")
    missing = [c.name for c in spec if c.name not in layout and not c.optional]
    extra = sorted(set(layout) - {c.name for c in spec})
    if missing or extra:
        raise WireError(f"section {kind!r}: missing columns {missing}, unknown columns {extra}")
    cols = {}
    for col in spec:
        loc = layout.get(col.name)
        if loc is None:  # an optional column the sender left out: NULL
            continue
        if (not isinstance(loc, list) or len(loc) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in loc)):
            raise WireError(f"{kind}.{col.name}: location must be [offset, nbytes]")
        off, nbytes = loc
        if nbytes != n * col.itemsize:
            raise WireError(f"{kind}.{col.name}: {nbytes} bytes for {n} rows of {col.itemsize} bytes")
        if off != pos:
            raise WireError(f"{kind}.{col.name}: starts at {off}, but the previous column's padding ends at "
                            f"{pos} (columns follow each other in header and SCHEMA order, without gaps)")
        pad = _pad8(nbytes)
        pos = off + nbytes + pad
        if pos > len(body):
            raise WireError(f"{kind}.{col.name}: [{off}, {nbytes}] and its padding run past the column area "
                            f"({len(body)} bytes)")
        if pad and body[pos - pad:pos] != _ZEROS[:pad]:
            raise WireError(f"{kind}.{col.name}: the padding after the column is not zero")
        view = body[off:off + nbytes].cast(col.fmt)
        if check_codes and col.dict_encoded and n:
            size = len(dicts.get(col.dict_name, ()))
            lo, hi = min(view), max(view)
            if lo < (-1 if col.null == -1 else 0) or hi >= size:
                raise WireError(f"{kind}.{col.name}: code {hi if hi >= size else lo} outside its dictionary of {size}")
        cols[col.name] = view if typed else body[off:off + nbytes]
    return cols, pos


def _check_codes(kind: str, cols: dict[str, memoryview], dicts: dict) -> None:
    for col in SCHEMA[kind]:
        view = cols.get(col.name)
        if col.dict_encoded and view is not None and len(view):
            view = view.cast(col.fmt) if view.format == "B" else view
            size = len(dicts.get(col.dict_name, ()))
            lo, hi = min(view), max(view)
            if lo < (-1 if col.null == -1 else 0) or hi >= size:
                raise WireError(f"{kind}.{col.name}: code {hi if hi >= size else lo} outside its dictionary of {size}")


@dataclass(frozen=True, slots=True)
class _Plan:
    cols: tuple[tuple[str, int, int, str], ...]  # (name, offset from the section's start, bytes, format)
    pads: tuple[tuple[int, int], ...]  # the padding's [start, end) after each column that has some
    span: int  # the section's bytes, padding included
    names: tuple[str, ...] = ()  # the columns' names, in order
    # this layout starting at a given offset: an agent's sections start at the same few
    # offsets batch after batch
    at: dict[int, _At] = field(default_factory=dict)

    def at_offset(self, pos: int) -> _At:
        at = self.at.get(pos)
        if at is None:
            if len(self.at) >= 64:
                self.at.clear()
            at = self.at[pos] = _At(
                layout={name: [pos + rel, nb] for name, rel, nb, _ in self.cols},
                columns=tuple(slice(pos + rel, pos + rel + nb) for _, rel, nb, _ in self.cols),
                pads=tuple(slice(pos + a, pos + b) for a, b in self.pads),
                zeros=tuple(_ZEROS[:b - a] for a, b in self.pads))
        return at


@dataclass(frozen=True, slots=True)
class _At:
    """A plan's layout at one offset: the header's "columns" object it must equal (compared,
    never changed), each column's slice of the column area, and its padding's (all zero)."""

    layout: dict[str, list[int]]
    columns: tuple[slice, ...]
    pads: tuple[slice, ...]
    zeros: tuple[bytes, ...]


_PLANS: dict[tuple, _Plan | None] = {}
_MAX_PLANS = 4096


def _plan(kind: str, n: int, names: tuple[str, ...]) -> _Plan | None:
    """The canonical layout of `kind` with `n` rows and the columns `names` (SCHEMA order,
    no gaps, each padded to 8 bytes); None when `names` is not a valid set of columns."""
    key = (kind, n, names)
    plan = _PLANS.get(key, _MISSING)
    if plan is not _MISSING:
        return plan
    spec = SCHEMA.get(kind)
    given = set(names)
    plan = None
    if spec is not None and len(given) == len(names) and given <= {c.name for c in spec} \
            and all(c.optional or c.name in given for c in spec):
        cols, pads, rel = [], [], 0
        for c in spec:
            if c.name in given:
                nb = n * c.itemsize
                cols.append((c.name, rel, nb, c.fmt))
                pad = _pad8(nb)
                if pad:
                    pads.append((rel + nb, rel + nb + pad))
                rel += nb + pad
        plan = _Plan(tuple(cols), tuple(pads), rel, names=tuple(c[0] for c in cols))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


_MISSING = object()
_INT = {int}


# -- bundles: several batches in one request (a node's relay, collector/relay.py) -------------
#
#   "LWN1" | u32 count | count x (u32 length | batch bytes)
#
# Each item is a whole batch, decoded and answered on its own: a bundle only saves the
# per-request cost (HTTP, the gate, one hop to the writer per batch), never merges batches.
BUNDLE_MAGIC = b"LWN1"
BUNDLE_CONTENT_TYPE = "application/x-llmwatch-bundle"
BUNDLE_PATH = "/v1/ingest/bundle"
_BUNDLE_HDR = struct.Struct("<4sI")
_ITEM_LEN = struct.Struct("<I")


def encode_bundle(batches: list[bytes | memoryview]) -> bytes:
    """Frame `batches` (encoded batches, each as sent to /v1/ingest) as one bundle."""
    parts = [_BUNDLE_HDR.pack(BUNDLE_MAGIC, len(batches))]
    for b in batches:
        parts += (_ITEM_LEN.pack(len(b)), b)
    return b"".join(parts)


def decode_bundle(data: bytes | memoryview, *, max_items: int, max_item_bytes: int) -> list[memoryview]:
    """The items of a bundle, as views of `data` (not decoded: each is a batch to
    `decode_batch`). Checks the framing only: the count against `max_items`, each
    length against `max_item_bytes` and what is left, and that the items tile the body."""
    mv = memoryview(data)
    if len(mv) < _BUNDLE_HDR.size:
        raise WireError(f"bundle too short ({len(mv)} bytes)")
    magic, count = _BUNDLE_HDR.unpack_from(mv, 0)
    if magic != BUNDLE_MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not an llmwatch bundle (expected {BUNDLE_MAGIC!r})")
    if not 0 < count <= max_items:
        raise WireError(f"a bundle holds 1..{max_items} batches, not {count}")
    items, pos = [], _BUNDLE_HDR.size
    for i in range(count):
        if pos + _ITEM_LEN.size > len(mv):
            raise WireError(f"bundle ends inside item {i}'s length")
        (n,) = _ITEM_LEN.unpack_from(mv, pos)
        pos += _ITEM_LEN.size
        if n > max_item_bytes:
            raise WireError(f"item {i} is {n} bytes, over the limit of {max_item_bytes}")
        if pos + n > len(mv):
            raise WireError(f"item {i} ({n} bytes) runs past the bundle's end")
        items.append(mv[pos:pos + n])
        pos += n
    if pos != len(mv):
        raise WireError(f"{len(mv) - pos} bytes after the bundle's last item")
    return items
