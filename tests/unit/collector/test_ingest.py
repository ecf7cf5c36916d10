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


async def post(endpoint: ingest.IngestEndpoint, body: bytes) -> tuple[int, dict]:
    scope = {"type": "http", "method": "POST", "path": "/v1/ingest",
             "headers": [(b"content-type", wire.CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]}
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
