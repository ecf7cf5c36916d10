"""Exact wire batches for the collector's tests, built with agent.wire.encode_batch."""

from __future__ import annotations

import numpy as np

from agent import wire

DICTS = {"op": ["all_reduce", "all_gather"], "axis": ["dp", "tp"], "phase": ["forward", "backward"],
         "name": ["eval_loss", "eval_ppl"]}


def columns(kind: str, n: int, **given) -> dict[str, bytes]:
    """Raw column bytes of `kind` with n rows: `given` values (scalars or sequences),
    every other column a deterministic ramp."""
    out = {}
    for i, col in enumerate(wire.SCHEMA[kind]):
        dt = np.dtype(col.numpy_dtype)
        if col.name in given:
            arr = np.broadcast_to(np.asarray(given[col.name], dtype=dt), (n,))
        elif col.dict_encoded:
            arr = np.arange(n) % 2
        else:
            arr = np.arange(n) + i
        out[col.name] = np.ascontiguousarray(arr, dtype=dt).tobytes()
    return out


def make_batch(run_id: str = "run1", rank: int = 0, batch_seq: int = 0, *, incarnation: str = "inc0",
               sections: dict | None = None, dicts: dict | None = None, **header) -> bytes:
    """A wire batch; `sections` maps kind -> (n, {column: bytes}) as encode_batch takes."""
    h = {"run_id": run_id, "rank": rank, "incarnation": incarnation, "batch_seq": batch_seq,
         "node": f"node{rank // 2}", "pid": 100 + rank, "sent_ts": 1.0, "dicts": dicts or DICTS,
         "events": [], "run": None, "stats": {"dropped": {}}}
    h.update(header)
    return wire.encode_batch(h, sections or {})


def steps_section(steps, *, attempt: int = 0, **given) -> tuple[int, dict[str, bytes]]:
    steps = np.asarray(steps)
    return len(steps), columns(wire.STEP, len(steps), step=steps, attempt=attempt, **given)


def encode_loose(header: dict, sections: dict) -> bytes:
    """Like encode_batch, but the header is dumped as a careless sender might
    (NaN, Infinity, integers wider than 64 bits): same framing, same columns."""
    import json
    import struct

    strict = wire.encode_batch({"run_id": "x", "rank": 0, "incarnation": "i", "batch_seq": 0}, sections)
    (hlen,) = struct.unpack_from("<I", strict, 4)
    column_area = strict[8 + hlen + (-(8 + hlen)) % 8:]
    text = json.dumps({**header, "sections": json.loads(strict[8:8 + hlen])["sections"]}).encode()
    return struct.pack("<4sI", wire.MAGIC, len(text)) + text + b"\0" * ((-(8 + len(text))) % 8) + column_area
