"""The wire framing: columns tile the body exactly, and the header's JSON is
bounded in depth and size before it is parsed."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import wire


def column_bytes(kind: str, n: int, *, optional: bool = True) -> dict[str, bytes]:
    """Every column of `kind` (`optional=False`: the first layout's only, as an older agent sent)."""
    return {c.name: bytes(range(1, 1 + n * c.itemsize)) if c.itemsize == 1 else bytes(n * c.itemsize)
            for c in wire.SCHEMA[kind] if optional or not c.optional}


HEADER = {"run_id": "r", "rank": 0, "incarnation": "i", "batch_seq": 0, "dicts": {"op": ["a"], "axis": ["dp"],
                                                                               "phase": ["f"], "name": ["x"]}}


def batch(*, optional: bool = True, **sections_n: int) -> bytes:
    return wire.encode_batch(HEADER, {kind: (n, column_bytes(kind, n, optional=optional))
                                      for kind, n in sections_n.items()})


def split(body: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack_from("<I", body, 4)
    return json.loads(body[8:8 + hlen]), body[8 + hlen + (-(8 + hlen)) % 8:]


def reframe(header: dict | bytes, area: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<4sI", wire.MAGIC, len(text)) + text + bytes((-(8 + len(text))) % 8) + area


def refused(body: bytes, match: str) -> str:
    with pytest.raises(wire.WireError) as info:
        wire.decode_batch(body)
    assert match in str(info.value), str(info.value)
    return str(info.value)


# -- tiling --------------------------------------------------------------------------
def test_encode_lays_columns_end_to_end_in_schema_order():
    body = batch(step=3, collective=5)
    header, area = split(body)
    pos = 0
    for kind in ("step", "collective"):
        layout = header["sections"][kind]["columns"]
        assert list(layout) == [c.name for c in wire.SCHEMA[kind]]
        for col in wire.SCHEMA[kind]:
            off, nbytes = layout[col.name]
            assert off == pos and nbytes == header["sections"][kind]["n"] * col.itemsize
            pos = off + nbytes + (-nbytes) % 8
    assert pos == len(area) and len(body) % 8 == 0
    decoded = wire.decode_batch(body)
    assert decoded.num_rows("step") == 3 and decoded.num_rows("collective") == 5
    assert bytes(decoded.columns["step"]["skipped"]) == bytes([1, 2, 3])
    # typed=False: the same bytes, uncast ("B"); the codes are still checked when asked
    raw = wire.decode_batch(body, typed=False)
    for kind, cols in decoded.columns.items():
        assert {name: (v.format, v.tobytes()) for name, v in raw.columns[kind].items()} == \
            {name: ("B", v.tobytes()) for name, v in cols.items()}


def test_overlapping_columns_cannot_multiply_rows():
    """The attack: every column of a huge section points at the same bytes, so a
    small body claims rows it does not hold."""
    n = 1000
    layout = {c.name: [0, n * c.itemsize] for c in wire.SCHEMA["step"]}
    body = reframe({**HEADER, "sections": {"step": {"n": n, "columns": layout}}}, bytes(n * 8))
    refused(body, "step.attempt: starts at 0, but the previous column's padding ends at 8000")


def _gap(h, a):
    h["sections"]["step"]["columns"]["ts"][0] += 8
    return h, a + bytes(8)


def _reordered(h, a):
    h["sections"] = dict(reversed(list(h["sections"].items())))
    return h, a


def _more_rows(h, a):
    h["sections"]["step"]["n"] = 4
    return h, a


@pytest.mark.parametrize("edit, match", [
    (_gap, "step.ts: starts at"),
    (lambda h, a: (h, a + bytes(8)), "8 bytes belong to no column"),
    (lambda h, a: (h, a[:-8]), "step.skipped: [408, 3] and its padding run past the column area (408 bytes)"),
    (lambda h, a: (h, a[:-3]), "run past the column area"),  # the last padding cut short
    (lambda h, a: (h, a[:-1] + b"\x01"), "step.skipped: the padding after the column is not zero"),
    (_reordered, "starts at"),
    (_more_rows, "step.step: 24 bytes for 4 rows"),
])
def test_anything_but_an_exact_tiling_is_refused(edit, match):
    # without the optional columns: ends with step.skipped, 3 bytes and 5 of padding
    header, area = split(batch(heartbeat=2, step=3, optional=False))
    refused(reframe(*edit(header, area)), match)


def test_header_padding_must_be_present_and_zero():
    body = batch(step=1)
    (hlen,) = struct.unpack_from("<I", body, 4)
    assert (8 + hlen) % 8, "this header needs padding for the test to mean anything"
    bad = bytearray(body)
    bad[8 + hlen] = 7
    refused(bytes(bad), "zero bytes of padding")
    refused(body[:8 + hlen], "zero bytes of padding")


def test_an_empty_section_takes_no_bytes():
    header, area = split(batch(step=2))
    header["sections"]["heartbeat"] = {"n": 0, "columns": {c.name: [len(area), 0] for c in wire.SCHEMA["heartbeat"]}}
    assert wire.decode_batch(reframe(header, area)).num_rows("heartbeat") == 0


# -- the header's JSON ---------------------------------------------------------------
def nested(depth: int, shape: str = "[]") -> str:
    return shape[0] * depth + shape[1] * depth


@pytest.mark.parametrize("where", ["extra", "events", "run"])
@pytest.mark.parametrize("shape", ["[]", "{}"])
def test_deep_nesting_is_refused_before_parsing(where, shape):
    inner = nested(5000, "[]") if shape == "[]" else '{"a":' * 5000 + "1" + "}" * 5000
    field = {"extra": f'"x":{inner}', "events": f'"events":[{{"ts":1.0,"kind":"k","data":{{"d":{inner}}}}}]',
             "run": f'"run":{{"config":{inner}}}'}[where]
    text = json.dumps(HEADER)[:-1] + "," + field + "}"
    refused(reframe(text.encode(), b""), "levels deep (limit 64)")


def test_unclosed_nesting_is_refused_too():
    refused(reframe(b'{"x":' + b"[" * 100_000, b""), "levels deep")


def test_depth_limit_is_exact_and_strings_do_not_count():
    # the header object is level 1, so a value nested 63 deep inside it is level 64
    ok = json.dumps(HEADER)[:-1] + ',"x":' + nested(wire.MAX_HEADER_DEPTH - 1) + "}"
    wire.decode_batch(reframe(ok.encode(), b""))
    deep = json.dumps(HEADER)[:-1] + ',"x":' + nested(wire.MAX_HEADER_DEPTH) + "}"
    refused(reframe(deep.encode(), b""), "nests 65 levels deep")
    in_strings = {**HEADER, "x": ["[" * 500, '\\"[[[' * 100, "{" * 300]}
    wire.decode_batch(reframe(json.dumps(in_strings).encode(), b""))
    # an escaped backslash ends before the quote: the brackets after it are real
    tricky = json.dumps(HEADER)[:-1] + ',"x":["\\\\",' + nested(wire.MAX_HEADER_DEPTH) + "]}"
    assert json.loads(tricky)["x"][0] == "\\"
    refused(reframe(tricky.encode(), b""), "levels deep")


def test_number_of_values_is_bounded(monkeypatch):
    monkeypatch.setattr(wire, "MAX_HEADER_VALUES", 1000)
    wire.decode_batch(reframe(json.dumps({**HEADER, "x": [0] * 900}).encode(), b""))
    refused(reframe(json.dumps({**HEADER, "x": [{}] * 1000}).encode(), b""), "values (limit 1000)")
    refused(reframe(json.dumps({**HEADER, "x": [0] * 1000}).encode(), b""), "values (limit 1000)")


@pytest.mark.parametrize("text, match", [
    (b'{"run_id": "\xff"}', "not UTF-8"),
    (b'{"x": ' + b"1" * 5000 + b"}", "not valid JSON"),  # Python refuses ints of over 4,300 digits
    (b"\xef\xbb\xbf{}", "not valid JSON"),  # a BOM
])
def test_header_text_errors_are_wire_errors(text, match):
    refused(reframe(text, b""), match)


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


_tricky_text = st.text(alphabet='[]{}",\\:a\u00e9\u4e16', max_size=6)
_json_values = st.recursive(st.none() | st.integers() | _tricky_text,
                            lambda children: st.lists(children, max_size=3)
                            | st.dictionaries(_tricky_text, children, max_size=3), max_leaves=25)


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(_json_values, st.booleans())
def test_the_byte_scan_agrees_with_the_parser(value, ascii_only):
    """Whatever the strings hold (brackets, quotes, backslashes, non-ASCII), the
    scan refuses exactly the headers nested deeper than the limit."""
    limit = 4
    text = json.dumps({"x": value}, ensure_ascii=ascii_only).encode()
    old = wire.MAX_HEADER_DEPTH
    wire.MAX_HEADER_DEPTH = limit
    try:
        wire._check_header_shape(text)
        accepted = True
    except wire.WireError:
        accepted = False
    finally:
        wire.MAX_HEADER_DEPTH = old
    assert accepted == (1 + _depth(value) <= limit)


# -- the canonical layout, checked in one comparison ---------------------------------------
def _decoded(body: bytes) -> dict:
    b = wire.decode_batch(body)
    return {kind: {name: (v.format, v.tolist()) for name, v in cols.items()} for kind, cols in b.columns.items()}


@pytest.mark.parametrize("optional", [True, False])
def test_the_one_comparison_path_decodes_what_the_column_by_column_path_does(monkeypatch, optional):
    kinds = {kind: n for kind, n in zip(wire.SCHEMA, (3, 5, 1, 2, 4, 6, 7, 8))}
    body = batch(optional=optional, **kinds)
    fast = _decoded(body)
    monkeypatch.setattr(wire, "_plan", lambda kind, n, names: None)  # every section the long way
    assert _decoded(body) == fast and set(fast) == set(kinds)


def test_a_layout_listed_in_another_order_is_the_same_layout():
    header, area = split(batch(step=3, collective=2))
    cols = header["sections"]["step"]["columns"]
    header["sections"]["step"]["columns"] = dict(reversed(list(cols.items())))
    assert _decoded(reframe(header, area)) == _decoded(batch(step=3, collective=2))


@pytest.mark.parametrize("where, value", [(0, 8.0), (1, True)])
def test_numbers_that_only_compare_equal_are_refused(where, value):
    """8.0 == 8 and True == 1 in Python: the one comparison alone would take them."""
    header, area = split(batch(step=1, optional=False))
    loc = header["sections"]["step"]["columns"]["skipped" if value is True else "attempt"]
    assert loc[where] == value  # skipped: 1 byte (n=1, int8); attempt: starts at 8
    loc[where] = value
    refused(reframe(header, area), "location must be [offset, nbytes]")


# -- bundles -------------------------------------------------------------------------------
def test_a_bundle_frames_whole_batches_and_gives_them_back_as_they_were():
    bodies = [batch(step=n) for n in (1, 2, 3)]
    items = wire.decode_bundle(wire.encode_bundle(bodies), max_items=3, max_item_bytes=max(map(len, bodies)))
    assert [bytes(i) for i in items] == bodies
    assert [wire.decode_batch(i).num_rows("step") for i in items] == [1, 2, 3]


@pytest.mark.parametrize("edit, match", [
    (lambda b: b"LWB1" + b[4:], "not an llmwatch bundle"),
    (lambda b: b[:5], "bundle too short"),
    (lambda b: b[:-1], "runs past the bundle's end"),
    (lambda b: b + b"x", "1 bytes after the bundle's last item"),
    (lambda b: b[:4] + struct.pack("<I", 0) + b[8:], "1..4 batches, not 0"),
    (lambda b: b[:4] + struct.pack("<I", 5) + b[8:], "1..4 batches, not 5"),
    (lambda b: b[:4] + struct.pack("<I", 3) + b[8:], "ends inside item 2's length"),
    (lambda b: b[:4] + struct.pack("<I", 1) + b[8:], "5 bytes after the bundle's last item"),
])
def test_a_bundle_that_is_not_one_is_refused(edit, match):
    good = wire.encode_bundle([b"x" * 16, b"y"])
    with pytest.raises(wire.WireError, match=match):
        wire.decode_bundle(edit(good), max_items=4, max_item_bytes=100)


def test_a_bundle_item_over_the_batch_limit_is_refused_before_it_is_read():
    body = wire.encode_bundle([b"x" * 10, b"y" * 101])
    with pytest.raises(wire.WireError, match="item 1 is 101 bytes, over the limit of 100"):
        wire.decode_bundle(body, max_items=4, max_item_bytes=100)
    with pytest.raises(wire.WireError, match="ends inside item 1's length"):
        wire.decode_bundle(body[:8 + 4 + 10 + 2], max_items=4, max_item_bytes=200)


@pytest.mark.parametrize("typed", [True, False])
def test_a_code_outside_its_dictionary_is_refused_typed_or_not(typed):
    cols = column_bytes("collective", 2)
    cols["op"] = struct.pack("<2h", 0, 1)  # "op" holds one value: code 1 is outside it
    body = wire.encode_batch(HEADER, {"collective": (2, cols)})
    with pytest.raises(wire.WireError, match="collective.op: code 1 outside its dictionary of 1"):
        wire.decode_batch(body, typed=typed)
    assert wire.decode_batch(body, check_codes=False, typed=typed).num_rows("collective") == 2
