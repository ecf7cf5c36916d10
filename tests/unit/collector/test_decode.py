"""Batch validation: everything that could fail an INSERT fails here, with a reason."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import numpy as np
import pytest

from agent import wire
from collector.ingest.decode import BatchRejected, decode
from tests.unit.collector.collector_batches import DICTS, columns, encode_loose, make_batch, steps_section


def coll(n=2, **given):
    return {wire.COLLECTIVE: (n, columns(wire.COLLECTIVE, n, **given))}


def rejected(body) -> BatchRejected:
    with pytest.raises(BatchRejected) as info:
        decode(body)
    return info.value


def test_valid_batch_is_views_of_the_body():
    body = make_batch(rank=4, batch_seq=9, sections={**coll(3), wire.STEP: steps_section([1, 2])},
                      events=[{"ts": 1.0, "kind": "restart"}], stats={"dropped": {"step": 2}})
    b = decode(body)
    assert b.key == ("run1", 4, "inc0", 9)
    assert b.num_rows == 3 + 2 + 1 and b.num_drops == 2 and b.nbytes == len(body)
    steps = b.sections[wire.STEP].array("step")
    assert steps.tolist() == [1, 2] and not steps.flags.writeable  # a view of the body, no copy
    assert b.sections[wire.COLLECTIVE].dicts["op"] == ["all_reduce", "all_gather"]


@pytest.mark.parametrize("op, match", [([0, 2], "code 2 outside its dictionary of 2"),
                                       ([-1, 0], "code -1 outside its dictionary of 2")])
def test_dictionary_codes_checked_vectorised(op, match):
    err = rejected(make_batch(sections=coll(2, op=op)))
    assert err.status == 400 and match in str(err)


@pytest.mark.parametrize("n", [3, 64, 65, 300])  # min/max over the bytes up to 64 rows, numpy above
def test_dictionary_codes_are_checked_at_both_ends_whatever_the_row_count(n):
    def refused(kind, name, codes, dicts):
        return rejected(make_batch(sections={kind: (n, columns(kind, n, **{name: codes}))}, dicts=dicts))

    ops = {**DICTS, "op": ["all_reduce", "all_gather"]}
    for bad, code in ((2, "code 2"), (-1, "code -1"), (-32768, "code -32768"), (32767, "code 32767")):
        codes = np.zeros(n, np.int16)
        codes[n // 2] = bad
        err = refused(wire.COLLECTIVE, "op", codes, ops)
        assert err.status == 400 and f"collective.op: {code} outside its dictionary of 2" in str(err)
    fine = np.ones(n, np.int16)
    assert decode(make_batch(sections={wire.COLLECTIVE: (n, columns(wire.COLLECTIVE, n, op=fine))},
                             dicts=ops)).num_rows == n
    # a column whose -1 is NULL: -1 stored, -2 and the dictionary's size refused
    beats = {**DICTS, "op": ["all_reduce"]}
    nulls = np.full(n, -1, np.int16)
    assert decode(make_batch(sections={wire.HEARTBEAT: (n, columns(wire.HEARTBEAT, n, last_op=nulls))},
                             dicts=beats)).num_rows == n
    for bad, code in ((-2, "code -2"), (1, "code 1")):
        codes = np.zeros(n, np.int16)
        codes[-1] = bad
        err = refused(wire.HEARTBEAT, "last_op", codes, beats)
        assert err.status == 400 and f"heartbeat.last_op: {code} outside its dictionary of 1" in str(err)


def test_dictionary_missing():
    err = rejected(make_batch(sections=coll(1), dicts={"axis": ["dp"]}))
    assert "outside its dictionary of 0" in str(err)


@pytest.mark.parametrize("header, match", [
    ({"rank": 2**31}, "rank"),
    ({"pid": 2**70}, "pid"),
    ({"batch_seq": 2**63}, "batch_seq"),
    ({"incarnation": "x" * 201}, "incarnation"),
    ({"node": 5}, "node"),
    ({"coords": {"dp": "0"}}, "coords.dp"),
    ({"events": [{"ts": float("nan"), "kind": "x"}]}, "events.0.ts"),
    ({"events": [{"ts": 1.0, "kind": ""}]}, "events.0.kind"),
    ({"events": [{"ts": 1.0, "kind": "x", "step": True}]}, "events.0.step"),
    ({"events": [{"ts": 1.0, "kind": "x", "data": {"v": float("inf")}}]}, "JSON value cannot be stored"),
    ({"events": [{"ts": 1.0, "kind": "checkpoint_saved", "data": {"path": "/x"}}]}, "checkpoint_saved"),
    ({"events": [{"ts": 1.0, "kind": "command_ack", "data": {"command_id": "one", "status": "ok"}}]}, "command_ack"),
    ({"run": {"run_id": "other"}}, "run info is for run 'other'"),
    ({"run": {"node_map": {"zero": "n0"}}}, "node_map keys"),
    ({"run": {"node_map": {"²": "n0"}}}, "node_map keys"),
    ({"run": {"world_size": 2**40}}, "world_size"),
    ({"stats": {"dropped": {"step": -1}}}, "stats.dropped"),
    ({"incarnation": "\ud800"}, "incarnation"),
])
def test_header_content_refused_with_422(header, match):
    err = rejected(_raw_batch(header))
    assert err.status == 422 and match in str(err), str(err)


def test_events_not_a_list_is_a_framing_error():
    err = rejected(_raw_batch({"events": 7}))
    assert err.status == 400 and "events must be a list" in str(err)


def test_lone_surrogate_in_dictionary_refused():
    err = rejected(make_batch(sections=coll(1, op=0), dicts={"op": ["\udc80"], "axis": ["dp"]}))
    assert err.status == 422 and "dicts.op" in str(err)


@pytest.mark.parametrize("body, match", [
    (b"", "too short"),
    (b"XXXX" + bytes(8), "bad magic"),
    (struct.pack("<4sI", wire.MAGIC, 10**9), "header length"),
    (struct.pack("<4sI", wire.MAGIC, 2) + b"[]", "JSON object"),
])
def test_framing_errors_are_400(body, match):
    err = rejected(body)
    assert err.status == 400 and match in str(err)


def _raw_batch(changes: dict) -> bytes:
    header = {"run_id": "run1", "rank": 0, "incarnation": "inc0", "batch_seq": 0, "node": "n", "dicts": {}}
    return encode_loose({**header, **changes}, {wire.STEP: steps_section([1])})


def test_nan_loss_is_data_not_an_error():
    b = decode(make_batch(sections={wire.STEP: steps_section([1], loss=float("nan"))}))
    assert np.isnan(b.sections[wire.STEP].array("loss")[0])


# -- bounded parsing: every malformed input is a 4xx with a reason ----------------------
def _deep(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _nested_text(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["events.data", "run.config", "stats", "coords", "top"])
def test_a_header_nested_5000_deep_is_a_400_not_a_recursion_error(where):
    deep = _nested_text(5000)
    field = {"events.data": f'"events":[{{"ts":1.0,"kind":"x","data":{{"a":{deep}}}}}]',
             "run.config": f'"run":{{"config":{{"a":{deep}}}}}', "stats": f'"stats":{{"more":{deep}}}',
             "coords": f'"coords":{{"dp":{deep}}}', "top": f'"extra":{deep}'}[where]
    err = rejected(_header_text('"node":"n",' + field))
    assert err.status == 400 and "levels deep (limit 64)" in str(err)


def test_nesting_within_the_limit_is_data():
    data = {"a": _deep(40)}
    b = decode(make_batch(events=[{"ts": 1.0, "kind": "x", "data": data}], run={"config": {"c": _deep(50)}},
                          sections={wire.STEP: steps_section([1])}))
    assert json.loads(b.events[0].data_json) == data and json.loads(b.run_json["config"]) == {"c": _deep(50)}


@pytest.mark.parametrize("text, match", [
    ('"x":' + "1" * 5000, "not valid JSON"),  # an int of more than 4,300 digits: a ValueError, not JSONDecodeError
    ('"x":[' + "[" * 200, "levels deep"),  # never closed
])
def test_header_text_that_the_parser_would_choke_on(text, match):
    err = rejected(_header_text(text))
    assert err.status == 400 and match in str(err)


def test_overlapping_columns_are_a_400():
    """8 MiB claiming 4 M rows: every column of a section at the same offset."""
    n = 1000
    layout = {c.name: [0, n * c.itemsize] for c in wire.SCHEMA[wire.STEP]}
    header = {"run_id": "run1", "rank": 0, "incarnation": "inc0", "batch_seq": 0,
              "sections": {wire.STEP: {"n": n, "columns": layout}}}
    err = rejected(_framed(json.dumps(header).encode(), bytes(8 * n)))
    assert err.status == 400 and "starts at 0" in str(err)


def test_content_hash_in_pieces_is_the_hash_of_the_whole():
    """A small body is hashed in pieces that keep the GIL, a large one in one call: either way
    the digest of its bytes, at every size around a piece's and the switch between the two."""
    from collector.ingest.decode import _HASH_IN_PIECES_MAX, _HASH_PIECE, content_hash

    data = bytes(range(256)) * 1100
    for size in (0, 1, _HASH_PIECE - 1, _HASH_PIECE, _HASH_PIECE + 1, 2 * _HASH_PIECE, 5000,
                 _HASH_IN_PIECES_MAX, _HASH_IN_PIECES_MAX + 1, len(data)):
        body = data[:size]
        want = hashlib.blake2b(body, digest_size=16).digest()
        assert content_hash(body) == want and content_hash(memoryview(body)) == want, size


def test_content_hash_is_of_the_bytes():
    a = make_batch(sections={wire.STEP: steps_section([1])})
    b = make_batch(sections={wire.STEP: steps_section([2])})
    assert decode(a).content_hash == decode(a).content_hash == hashlib.blake2b(a, digest_size=16).digest()
    assert decode(b).content_hash != decode(a).content_hash and decode(b).key == decode(a).key


def _framed(text: bytes, area: bytes) -> bytes:
    return struct.pack("<4sI", wire.MAGIC, len(text)) + text + b"\0" * ((-(8 + len(text))) % 8) + area


def _header_text(extra: str) -> bytes:
    return _framed(('{"run_id":"run1","rank":0,"incarnation":"inc0","batch_seq":0,' + extra + "}").encode(), b"")
