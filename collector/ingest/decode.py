"""Request body -> a validated batch whose columns are numpy views of the body.

`agent.wire.decode_batch` checks the framing (magic, the columns' tiling of the
body, the header JSON's depth and size). This module
checks what the wire module leaves to its caller, vectorised: dictionary codes
in range (one min/max per column), then the header's free-form parts (events,
run info, stats) with pydantic, and every value the database would refuse later
(integers wider than their column, strings that are not UTF-8, NaN in JSON).
Everything that could fail an INSERT fails here, so a group commit never fails
because of one sender's bad batch.

It also hashes the body (`content_hash`, blake2b-128, ~1 GB/s; a large body off the GIL):
the writer stores it with the batch key, so that a key seen again with other
bytes is refused (409) instead of being taken for a duplicate.

Cost: a few microseconds per column plus the header's JSON and the hash; no
per-row Python.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from agent import wire

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_EVENTS = 10_000
MAX_NAME_CHARS = 200

Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class BatchRejected(ValueError):
    """A batch that will not be stored. `status` is the HTTP status to answer."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class Coords(_Strict):
    dp: Int32 | None = None
    tp: Int32 | None = None
    pp: Int32 | None = None


class Event(_Strict):
    ts: float
    kind: Annotated[str, Field(min_length=1, max_length=100)]
    step: Int64 | None = None
    attempt: Int32 | None = None
    data: dict[str, Any] | None = None


class RunInfo(_Strict):
    run_id: Name | None = None
    config: dict[str, Any] | None = None
    mesh: dict[str, Any] | None = None
    world_size: Int32 | None = None
    node_map: dict[str, Name] | None = None
    spares: Annotated[list[Name], Field(max_length=4096)] | None = None  # standby nodes (the launcher's spares)
    code_version: Name | None = None
    data_version: Name | None = None
    started_ts: float | None = None


class Stats(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    dropped: dict[str, Annotated[int, Field(ge=0, le=INT64_MAX)]] = {}


class HeaderMeta(_Strict):
    incarnation: Annotated[str, Field(max_length=MAX_NAME_CHARS)]
    rank: Annotated[int, Field(ge=wire.LAUNCHER_RANK, le=INT32_MAX)]  # -1: the launcher (events only)
    batch_seq: Annotated[int, Field(ge=0, le=INT64_MAX)]
    node: Name = ""
    pid: Int64 | None = None
    hw_id: Name | None = None  # the rank's hardware id (its GPU's UUID): fleet memory
    coords: Coords | None = None
    events: Annotated[list[Event], Field(max_length=MAX_EVENTS)] = []
    run: RunInfo | None = None
    stats: Stats | None = None


class CheckpointSaved(_Strict):
    step: Int64
    path: str | None = None
    num_shards: Int32 | None = None
    bytes: Int64 | None = None
    checksums: Any = None
    write_s: float | None = None
    verified: bool = False


class CheckpointVerified(_Strict):
    step: Int64
    verified: bool = True


class RunFinished(_Strict):
    status: Annotated[str, Field(min_length=1, max_length=50)] = "finished"


def _int_from_digits(v: Any) -> Any:
    """The agent keeps command ids as opaque strings; ours are integers."""
    return int(v) if isinstance(v, str) and v.isdigit() else v


class CommandAck(_Strict):
    command_id: Annotated[Int64, BeforeValidator(_int_from_digits)]
    status: Annotated[str, Field(min_length=1, max_length=50)]
    detail: Any = None


# Event kinds that also update another table; their data must match the model.
SPECIAL_EVENTS: dict[str, type[_Strict]] = {
    "checkpoint_saved": CheckpointSaved,
    "checkpoint_verified": CheckpointVerified,
    "run_finished": RunFinished,
    "command_ack": CommandAck,
}


@dataclass(slots=True)
class Section:
    kind: str
    n: int
    # the request body's column bytes (no copy; format "B", `array` reads them as their
    # dtype); an optional column the sender left out (an older agent) is absent: its rows
    # are NULL
    views: dict[str, memoryview]
    dicts: dict[str, list[str]]  # dictionary values of the dict-encoded columns, by column name

    def array(self, name: str) -> np.ndarray:
        return np.frombuffer(self.views[name], dtype=_DTYPES[self.kind][name])


_DTYPES = {kind: {c.name: c.numpy_dtype for c in cols} for kind, cols in wire.SCHEMA.items()}
_DICT_COLUMNS = {kind: [c for c in cols if c.dict_encoded] for kind, cols in wire.SCHEMA.items()}


@dataclass(slots=True)
class DecodedEvent:
    ts: float
    step: int | None
    attempt: int | None
    kind: str
    data_json: str | None
    special: _Strict | None  # parsed data of a SPECIAL_EVENTS kind


@dataclass(slots=True)
class DecodedBatch:
    run_id: str
    rank: int
    incarnation: str
    batch_seq: int
    node: str
    pid: int | None
    coords: Coords | None
    sections: dict[str, Section]
    events: list[DecodedEvent]
    run: RunInfo | None
    run_json: dict[str, str | None] = field(default_factory=dict)  # JSON text of config/mesh/node_map
    num_drops: int = 0
    nbytes: int = 0
    content_hash: bytes = b""  # blake2b-128 of the whole body; b"" when unknown
    hw_id: str | None = None  # the rank's hardware id, when its agent knows one

    @property
    def key(self) -> tuple[str, int, str, int]:
        return (self.run_id, self.rank, self.incarnation, self.batch_seq)

    @property
    def num_rows(self) -> int:
        return sum(s.n for s in self.sections.values()) + len(self.events)


def json_text(value: Any) -> str | None:
    """JSON text DuckDB's JSON type accepts: no NaN/Infinity, valid UTF-8."""
    if value is None:
        return None
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        text.encode("utf-8")
    except (ValueError, UnicodeEncodeError) as e:
        raise BatchRejected(f"JSON value cannot be stored: {e}", 422) from None
    return text


def _check_utf8(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BatchRejected(f"{name} is not valid UTF-8 (lone surrogate escape)", 422) from None


def _validation_reason(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "header"
    return f"header field {where}: {first['msg']}"


_FEW_ROWS = 64


def decode(body: bytes | memoryview) -> DecodedBatch:
    """Validate a wire batch; raise `BatchRejected` (400 framing, 422 content)."""
    try:
        batch = wire.decode_batch(body, check_codes=False, typed=False)  # numpy reads the bytes
    except wire.WireError as e:
        raise BatchRejected(str(e), 400) from None
    header = batch.header
    try:
        meta = HeaderMeta.model_validate(header)
    except ValidationError as e:
        raise BatchRejected(_validation_reason(e), 422) from None
    run_id = header["run_id"]
    for name, text in (("run_id", run_id), ("incarnation", meta.incarnation), ("node", meta.node)):
        _check_utf8(name, text)
    dicts = header.get("dicts", {})
    try:  # every dictionary string at once (wire.decode_batch checked they are strings); else one by one below
        "".join(v for values in dicts.values() for v in values).encode("utf-8")
        dicts_utf8 = True
    except UnicodeEncodeError:
        dicts_utf8 = False
    sections = {}
    for kind, cols in batch.columns.items():
        n = batch.num_rows(kind)
        if n == 0:
            continue
        sec_dicts = {}
        for col in _DICT_COLUMNS[kind]:
            name = col.name
            if name not in cols:  # an optional column left out
                continue
            values = dicts.get(col.dict_name, [])
            # a few rows (an agent's flush: ~0.5 us) by min/max over the bytes cast, more with numpy
            # (~2 us a call whatever the size: ~7 calls a batch, a 100,000-rank collector's main cost)
            if col.null == -1:  # -1 is NULL: two reductions
                if n <= _FEW_ROWS:
                    codes = cols[name].cast("h")
                    lo, hi = min(codes), max(codes)
                else:
                    codes = np.frombuffer(cols[name], dtype="<i2")
                    lo, hi = int(codes.min()), int(codes.max())
                bad = lo if lo < -1 else hi if hi >= len(values) else None
            else:  # one reduction checks both ends: as uint16, a negative int16 code is >= 32768
                top = max(cols[name].cast("H")) if n <= _FEW_ROWS else int(np.frombuffer(cols[name], dtype="<u2").max())
                bad = (top - 65536 if top >= 32768 else top) if top >= len(values) else None
            if bad is not None:
                raise BatchRejected(f"{kind}.{name}: code {bad} outside its dictionary of {len(values)}", 400)
            if not dicts_utf8:
                for v in values:
                    _check_utf8(f"dicts.{col.dict_name}", v)
            sec_dicts[name] = values
        sections[kind] = Section(kind=kind, n=n, views=cols, dicts=sec_dicts)
    events = [_decode_event(i, ev) for i, ev in enumerate(meta.events)]
    run_json = {}
    if meta.run is not None:
        if meta.run.run_id is not None and meta.run.run_id != run_id:
            raise BatchRejected(f"run info is for run {meta.run.run_id!r}, the batch for {run_id!r}", 422)
        if meta.run.node_map and not all(k.isascii() and k.isdigit() and int(k) <= INT32_MAX for k in meta.run.node_map):
            raise BatchRejected("run.node_map keys must be rank numbers", 422)
        for key in ("config", "mesh", "node_map"):
            run_json[key] = json_text(getattr(meta.run, key))
        for key in ("code_version", "data_version"):
            if getattr(meta.run, key) is not None:
                _check_utf8(f"run.{key}", getattr(meta.run, key))
    num_drops = sum(meta.stats.dropped.values()) if meta.stats else 0
    if num_drops > INT64_MAX:
        raise BatchRejected("stats.dropped adds up past int64", 422)
    return DecodedBatch(
        run_id=run_id, rank=meta.rank, incarnation=meta.incarnation, batch_seq=meta.batch_seq,
        node=meta.node, pid=meta.pid, coords=meta.coords, sections=sections, events=events,
        run=meta.run, run_json=run_json, num_drops=num_drops, nbytes=len(body),
        content_hash=content_hash(body), hw_id=meta.hw_id or None,
    )


# hashlib lets go of the GIL for an update of 2,048 bytes or more. Taking it back costs a
# thread up to the interpreter's switch interval (5 ms) while another thread runs Python:
# a 5 KB body hashed in one call beside a busy thread took 2.3 ms of wall and 25 us of CPU,
# in pieces 12 us and 6 us. The event loop decodes thousands of small bodies a second beside
# the writer and detection, so a small body is hashed in pieces that keep the GIL; a large
# one (decoded on a worker thread) in one call that lets the others run meanwhile.
_HASH_PIECE = 2047
_HASH_IN_PIECES_MAX = 64 * 1024


def content_hash(body: bytes | memoryview) -> bytes:
    """What the writer compares when a batch key comes again: the body's bytes
    (the agent encodes a batch once; retries and spool replays resend those bytes)."""
    if len(body) > _HASH_IN_PIECES_MAX:
        return hashlib.blake2b(body, digest_size=16).digest()
    h = hashlib.blake2b(digest_size=16)
    view = memoryview(body)
    for i in range(0, len(view), _HASH_PIECE):
        h.update(view[i:i + _HASH_PIECE])
    return h.digest()


def _decode_event(i: int, ev: Event) -> DecodedEvent:
    _check_utf8(f"events[{i}].kind", ev.kind)
    special = None
    model = SPECIAL_EVENTS.get(ev.kind)
    if model is not None:
        try:
            # the event's own step is the default: agents send it beside the data
            fields = {"step": ev.step, **(ev.data or {})} if ev.step is not None else (ev.data or {})
            special = model.model_validate(fields)
        except ValidationError as e:
            raise BatchRejected(f"events[{i}] ({ev.kind}): {_validation_reason(e)}", 422) from None
    return DecodedEvent(ts=ev.ts, step=ev.step, attempt=ev.attempt, kind=ev.kind,
                        data_json=json_text(ev.data), special=special)
