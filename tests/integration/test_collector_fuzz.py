"""More than 1,000 fuzzed, malformed, oversized and unauthenticated ingest requests
against a real collector: every one is answered 4xx with a JSON reason (never
5xx), the server stays up, and afterwards the tables hold exactly the rows of
the requests it accepted: no partial batch.

Shapes include headers nested up to 20,000 deep (arrays, objects, unclosed) at
every place the header takes free-form JSON, random recursive values in event
data and run config, and batch keys reused with other content."""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import wire
from tests.unit.collector.collector_batches import columns, encode_loose, make_batch, steps_section
from tests.unit.collector.collector_server import CollectorProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LIMIT = 64 * 1024
ROW_TABLES = ("steps", "collectives", "scalars", "heartbeats", "events")


def real_batch(seq: int) -> bytes:
    sections = {wire.STEP: steps_section([seq, seq + 1]),
                wire.COLLECTIVE: (3, columns(wire.COLLECTIVE, 3, op=[0, 1, 0], axis=[1, 0, 1])),
                wire.SCALAR: (1, columns(wire.SCALAR, 1, name=1)),
                wire.HEARTBEAT: (1, columns(wire.HEARTBEAT, 1, phase=1))}
    return make_batch("fuzz", seq % 4, seq, sections=sections, events=[{"ts": 1.0, "kind": "tick", "data": {"i": seq}}])


def split(body: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack_from("<I", body, 4)
    base = 8 + hlen + (-(8 + hlen)) % 8
    return json.loads(body[8:8 + hlen]), body[base:]


def reframe(header_text: bytes, column_area: bytes) -> bytes:
    return struct.pack("<4sI", wire.MAGIC, len(header_text)) + header_text + b"\0" * ((-(8 + len(header_text))) % 8) \
        + column_area


# -- strategies: each draws (body, headers) -----------------------------------------
seqs = st.integers(0, 10**6)
auth = {"Authorization": "Bearer tok", "Content-Type": wire.CONTENT_TYPE}


@st.composite
def random_bytes(draw):
    return draw(st.binary(max_size=2048)), auth


@st.composite
def truncated(draw):
    body = real_batch(draw(seqs))
    return body[:draw(st.integers(0, len(body) - 1))], auth


@st.composite
def header_bit_flips(draw):
    body = real_batch(draw(seqs))
    (hlen,) = struct.unpack_from("<I", body, 4)
    buf = bytearray(body)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, 8 + hlen - 1))
        buf[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(buf), auth


def _edit(header: dict, draw) -> dict:
    step = header["sections"]["step"]
    coll = header["sections"]["collective"]
    choice = draw(st.sampled_from([
        "drop_column", "extra_column", "negative_offset", "misaligned", "huge_n", "zero_n", "past_end",
        "unknown_kind", "sections_list", "rank_str", "rank_huge", "seq_negative", "run_id_empty", "run_id_long",
        "dict_not_list", "dict_not_str", "events_bad", "run_bad", "nbytes_wrong", "n_bool", "loc_str"]))
    if choice == "drop_column":
        step["columns"].pop(draw(st.sampled_from(sorted(step["columns"]))))
    elif choice == "extra_column":
        step["columns"]["bogus"] = [0, 8]
    elif choice == "negative_offset":
        step["columns"]["loss"][0] = -draw(st.integers(1, 10**6))
    elif choice == "misaligned":
        step["columns"]["loss"][0] += draw(st.integers(1, 7))
    elif choice == "huge_n":
        step["n"] = draw(st.integers(10**6, 2**62))
    elif choice == "zero_n":
        coll["n"] = 0
    elif choice == "past_end":
        coll["columns"]["wait_s"][0] = 10**9
    elif choice == "unknown_kind":
        header["sections"]["bogus"] = {"n": 1, "columns": {}}
    elif choice == "sections_list":
        header["sections"] = []
    elif choice == "rank_str":
        header["rank"] = "0"
    elif choice == "rank_huge":
        header["rank"] = draw(st.integers(2**31, 2**80))
    elif choice == "seq_negative":
        header["batch_seq"] = -1
    elif choice == "run_id_empty":
        header["run_id"] = ""
    elif choice == "run_id_long":
        header["run_id"] = "r" * 201
    elif choice == "dict_not_list":
        header["dicts"]["op"] = "all_reduce"
    elif choice == "dict_not_str":
        header["dicts"]["op"] = [1, 2]
    elif choice == "events_bad":
        header["events"] = draw(st.sampled_from([[{"kind": "x"}], [{"ts": "now", "kind": "x"}], [1], "x",
                                                 [{"ts": 1.0, "kind": "checkpoint_saved", "data": {"step": "x"}}]]))
    elif choice == "run_bad":
        header["run"] = draw(st.sampled_from([{"run_id": "other"}, {"world_size": "4"}, {"node_map": {"a": "n"}}, 7]))
    elif choice == "nbytes_wrong":
        step["columns"]["loss"][1] += 8
    elif choice == "n_bool":
        step["n"] = True
    elif choice == "loc_str":
        step["columns"]["loss"] = "0,16"
    return header


@st.composite
def wrong_layout(draw):
    header, area = split(real_batch(draw(seqs)))
    return reframe(json.dumps(_edit(header, draw)).encode(), area), auth


@st.composite
def bad_codes(draw):
    n = 3
    op = draw(st.lists(st.integers(-(2**15), 2**15 - 1), min_size=n, max_size=n))
    if all(0 <= c < 2 for c in op):
        op[0] = draw(st.sampled_from([-1, 2, 2**15 - 1, -(2**15)]))
    sections = {wire.COLLECTIVE: (n, columns(wire.COLLECTIVE, n, op=np.array(op), axis=0))}
    return make_batch("fuzz", 0, draw(seqs), sections=sections), auth


@st.composite
def unauthenticated(draw):
    body = real_batch(draw(seqs))
    token = draw(st.sampled_from([None, "", "Bearer", "Bearer wrong", "Basic dG9rOg==", "bearer tok2", "tok"]))
    headers = {"Content-Type": wire.CONTENT_TYPE}
    if token is not None:
        headers["Authorization"] = token
    return body, headers


@st.composite
def oversized(draw):
    return b"\0" * (LIMIT + draw(st.integers(1, 4096))), auth


@st.composite
def wrong_content_type(draw):
    ctype = draw(st.sampled_from(["application/json", "text/plain", "multipart/form-data", "image/png"]))
    return real_batch(draw(seqs)), {**auth, "Content-Type": ctype}


# -- nested and recursive shapes ---------------------------------------------------------
def _nest(depth: int, shape: str) -> str:
    """JSON text `depth` levels deep: arrays, objects, both in turn, or never closed."""
    if shape == "arrays":
        return "[" * depth + "1" + "]" * depth
    if shape == "objects":
        return '{"k":' * depth + "1" + "}" * depth
    if shape == "mixed":
        opens = "".join('[' if i % 2 else '{"k":' for i in range(depth))
        return opens + "1" + "".join("]" if i % 2 else "}" for i in reversed(range(depth)))
    return "[" * depth  # unclosed


# where the header takes free-form JSON: (the header field it replaces, its text around the value {v})
_PLACES = {
    "top": ("extra", '"extra":{v}'),
    "events.data": ("events", '"events":[{{"ts":1.0,"kind":"tick","data":{{"d":{v}}}}}]'),
    "checksums": ("events", '"events":[{{"ts":1.0,"step":1,"kind":"checkpoint_saved",'
                            '"data":{{"step":1,"checksums":{v}}}}}]'),
    "run.config": ("run", '"run":{{"config":{{"c":{v}}}}}'),
    "run.mesh": ("run", '"run":{{"mesh":{{"m":{v}}}}}'),
    "stats": ("stats", '"stats":{{"dropped":{{}},"other":{v}}}'),
    "dicts": ("dicts", '"dicts":{{"op":{v}}}'),
}


@st.composite
def deep_nesting(draw):
    """Nesting around the limit and far past it; past it is always a 400."""
    header, area = split(real_batch(draw(seqs)))
    shape = draw(st.sampled_from(["arrays", "objects", "mixed", "unclosed"]))
    deepest = [20000] if shape in ("arrays", "unclosed") else []  # 2 bytes a level: within LIMIT
    depth = draw(st.sampled_from([wire.MAX_HEADER_DEPTH - 4, wire.MAX_HEADER_DEPTH - 2, wire.MAX_HEADER_DEPTH + 1,
                                  200, 1000, 5000, *deepest]))
    key, template = _PLACES[draw(st.sampled_from(sorted(_PLACES)))]
    header.pop(key, None)
    field = template.format(v=_nest(depth, shape))
    text = json.dumps(header)[:-1] + "," + field + "}"
    prefix = template.format(v="\0").split("\0")[0]  # the place's containers still open at the value
    levels = 1 + prefix.count("{") + prefix.count("[") - prefix.count("}") - prefix.count("]") + depth
    expect = {400} if levels > wire.MAX_HEADER_DEPTH or shape == "unclosed" else None
    body = reframe(text.encode(), area)
    assert len(body) <= LIMIT
    return body, auth, expect


_json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
                 | st.text(max_size=8) | st.sampled_from(["\ud800", "\x00", "]}\"[{", "\\"]))
_json_values = st.recursive(_json_scalars, lambda children: st.lists(children, max_size=4)
                            | st.dictionaries(st.text(max_size=4), children, max_size=4), max_leaves=40)


@st.composite
def recursive_content(draw):
    """A real batch whose event data and run config are random recursive JSON
    (NaN, huge integers, lone surrogates included): stored, or a 422."""
    seq = 2 * 10**6 + draw(seqs)
    data = draw(st.dictionaries(st.text(max_size=4), _json_values, max_size=4))
    config = draw(st.dictionaries(st.text(max_size=4), _json_values, max_size=4))
    header = {"run_id": "fuzz", "rank": seq % 4, "incarnation": "inc0", "batch_seq": seq, "node": "n",
              "dicts": {}, "events": [{"ts": 1.0, "kind": "tick", "data": data}],
              "run": {"config": config} if draw(st.booleans()) else None}
    return encode_loose(header, {wire.STEP: steps_section([seq])}), auth


@st.composite
def reused_key(draw):
    """The key of a real batch with other bytes: a 409 when the first was stored."""
    seq = draw(seqs)
    header, area = split(real_batch(seq))
    header["events"] = [{"ts": 2.0, "kind": "tick", "data": {"i": -seq}}]
    return reframe(json.dumps(header).encode(), area), auth


requests = st.one_of(random_bytes(), truncated(), header_bit_flips(), wrong_layout(), wrong_layout(), bad_codes(),
                     unauthenticated(), oversized(), wrong_content_type(), deep_nesting(), deep_nesting(),
                     recursive_content(), reused_key())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = CollectorProcess(tmp_path_factory.mktemp("fuzz") / "f.duckdb", token="tok",
                            args=("--group-linger-s", "0", "--group-min-interval-s", "0",
                                  "--max-batch-bytes", str(LIMIT))).start()
    yield proc
    assert proc.stop() == 0


def test_fuzzed_requests_get_4xx_reasons_and_leave_no_partial_rows(server):
    accepted_rows = 0
    statuses: dict[int, int] = {}
    client = httpx.Client(base_url=server.url, timeout=30.0)

    @settings(max_examples=1100, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(req):
        nonlocal accepted_rows
        body, headers, *expect = req
        r = client.post("/v1/ingest", content=body, headers=headers)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text)
        if expect and expect[0]:
            assert r.status_code in expect[0], (r.status_code, r.text)
        if r.status_code == 200:  # a mutation that is still a valid batch
            accepted_rows += r.json()["accepted"]
        else:
            assert 400 <= r.status_code < 500
            reason = r.json()["error"]
            assert isinstance(reason, str) and reason

    one()
    # the valid batches, each once
    for seq in range(20):
        r = client.post("/v1/ingest", content=real_batch(10**7 + seq), headers=auth)
        assert r.status_code == 200
        accepted_rows += r.json()["accepted"]
    # a stored batch's key again: the same bytes are an acknowledged duplicate, other bytes a 409
    header, area = split(real_batch(10**7))
    header["events"][0]["data"] = {"i": "other"}
    r = client.post("/v1/ingest", content=reframe(json.dumps(header).encode(), area), headers=auth)
    assert r.status_code == 409 and "already stored with other content" in r.json()["error"]
    assert client.post("/v1/ingest", content=real_batch(10**7), headers=auth).json()["duplicate"]
    client.close()
    assert sum(statuses.values()) >= 1000
    assert {401, 413, 415, 400, 422} <= set(statuses), statuses
    stored = sum(server.sql(f"SELECT count(*) FROM {t}")[0][0] for t in ROW_TABLES)
    (batch_rows,) = server.sql("SELECT coalesce(sum(rows), 0) FROM batches")[0]
    assert stored == batch_rows == accepted_rows
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
