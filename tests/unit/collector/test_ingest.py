"""POST /v1/ingest in-process: where decoding runs, and what a conflict answers."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent import wire
from collector.http.routes import ingest
from collector.settings import GateSettings, Settings, WriterSettings
from collector.storage import Storage
from tests.unit.collector.collector_batches import columns, make_batch, steps_section


@pytest.fixture
def storage(tmp_path):
    s = Storage(Settings(db_path=tmp_path / "i.duckdb", writer=WriterSettings(linger_s=0.0, min_interval_s=0.0),
                         gate=GateSettings(inline_decode_max_bytes=4096)))
    yield s
    s.close()


async def post(endpoint: ingest.IngestEndpoint, body: bytes, content_type: str = wire.CONTENT_TYPE,
               path: str = "/v1/ingest") -> tuple[int, dict]:
    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    await endpoint(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_small_bodies_decode_inline_large_ones_on_a_worker_thread(storage, monkeypatch):
    hops = []

    async def counting(fn, *args, **kwargs):
        hops.append(len(args[0]))
        return fn(*args, **kwargs)

    monkeypatch.setattr(ingest, "run_in_threadpool", counting)
    small = make_batch(batch_seq=0, sections={wire.STEP: steps_section([1])})
    large = make_batch(batch_seq=1, sections={wire.COLLECTIVE: (100, columns(wire.COLLECTIVE, 100))})
    assert len(small) <= 4096 < len(large)

    async def main():
        endpoint = ingest.IngestEndpoint(storage)
        return [await post(endpoint, small), await post(endpoint, large)]

    (s1, a1), (s2, a2) = asyncio.run(main())
    assert (s1, a1["accepted"], s2, a2["accepted"]) == (200, 1, 200, 100)
    assert hops == [len(large)]


def test_a_reused_key_with_other_content_is_a_409_counted_as_conflict(storage):
    first = make_batch(sections={wire.STEP: steps_section([1])})
    other = make_batch(sections={wire.STEP: steps_section([2])})

    async def main():
        endpoint = ingest.IngestEndpoint(storage)
        return [await post(endpoint, b) for b in (first, first, other)]

    (s1, _), (s2, a2), (s3, a3) = asyncio.run(main())
    assert (s1, s2, a2["duplicate"]) == (200, 200, True)
    assert s3 == 409 and "already stored with other content" in a3["error"]
    sample = storage.metrics.registry.get_sample_value
    assert sample("llmwatch_collector_rejects_total", {"reason": "conflict"}) == 1
    assert sample("llmwatch_collector_conflicting_batches_total") == 1


# -- bundles: a node relay's batches in one request (collector/relay.py) ---------------------
def bundle_post(storage, *bodies: bytes, raw: bytes | None = None, content_type: str = wire.BUNDLE_CONTENT_TYPE):
    async def main():
        endpoint = ingest.BundleEndpoint(storage)
        return await post(endpoint, raw if raw is not None else wire.encode_bundle(list(bodies)), content_type,
                          wire.BUNDLE_PATH)
    return asyncio.run(main())


def test_a_bundles_batches_are_each_stored_and_answered_as_if_posted_alone(storage):
    good = [make_batch(rank=r, sections={wire.STEP: steps_section([1, 2])}) for r in range(3)]
    status, answer = bundle_post(storage, good[0], good[1], b"LWB1" + bytes(12), good[2], good[0])
    assert status == 200
    results = answer["results"]
    assert [r["status"] for r in results] == [200, 200, 400, 200, 200]
    assert [r.get("accepted") for r in results] == [2, 2, None, 2, 0]
    assert [r.get("duplicate") for r in results] == [False, False, None, False, True]  # the repeat stored once
    assert "header is not valid JSON" in results[2]["error"]
    assert all(isinstance(r["commands"], list) and r["server_ts"] == answer["server_ts"]
               for r in results if r["status"] == 200)
    assert storage.read(lambda con: con.execute("SELECT count(*) FROM steps").fetchone()[0]) == 6
    sample = storage.metrics.registry.get_sample_value
    assert sample("llmwatch_collector_rejects_total", {"reason": "bad_batch"}) == 1


def test_a_bundle_item_reusing_a_key_with_other_bytes_is_its_409_alone(storage):
    first = make_batch(sections={wire.STEP: steps_section([1])})
    other = make_batch(sections={wire.STEP: steps_section([2])})
    bundle_post(storage, first)
    status, answer = bundle_post(storage, other, make_batch(rank=1, sections={wire.STEP: steps_section([2])}))
    assert status == 200 and [r["status"] for r in answer["results"]] == [409, 200]
    assert "already stored with other content" in answer["results"][0]["error"]


@pytest.mark.parametrize("raw, content_type, status, reason", [
    (b"LWN1" + bytes(4), wire.BUNDLE_CONTENT_TYPE, 400, "1..1024 batches, not 0"),
    (b"nope", wire.BUNDLE_CONTENT_TYPE, 400, "bundle too short"),
    (wire.encode_bundle([b"x"]), wire.CONTENT_TYPE, 415, f"Content-Type must be {wire.BUNDLE_CONTENT_TYPE}"),
])
def test_a_bundle_that_is_not_one_is_refused_whole(storage, raw, content_type, status, reason):
    got, answer = bundle_post(storage, raw=raw, content_type=content_type)
    assert got == status and reason in answer["error"]
