"""A node's relay (collector/relay.py) in process, against a stand-in upstream: the ranks'
batches go up as one bundle, each rank gets its own batch's answer, and whatever goes wrong
upstream reaches every held rank as a 503 (its agent spools) instead of a hang."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest

from agent import wire
from agent.clock import ClockSync
from agent.transport import PostResult
from collector.relay import Relay, RelaySettings


class Upstream:
    """Takes bundles; answers each with `answer(items)` (default: every item accepted)."""

    def __init__(self, answer=None, *, offset_s: float = 0.0, error_s: float = 0.001) -> None:
        self.bundles: list[list[bytes]] = []
        self.answer = answer or (lambda items: PostResult("ok", 200, {"results": [
            {"status": 200, "accepted": len(i), "duplicate": False, "commands": [{"id": f"c{len(i)}"}],
             "server_ts": 0.0} for i in items]}))
        self.clock = ClockSync(local=False)
        self.clock.offset_s, self.clock.error_s = offset_s, error_s
        self.closed = False
        self.gate = threading.Event()
        self.gate.set()

    def post(self, body: bytes, *, timeout_s: float | None = None) -> PostResult:
        items = [bytes(i) for i in wire.decode_bundle(body, max_items=10_000, max_item_bytes=1 << 30)]
        self.bundles.append(items)
        self.gate.wait(10)
        return self.answer(items)

    def close(self) -> None:
        self.closed = True


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def held(relay: Relay, bodies: list[bytes]) -> list[tuple[int, dict, list]]:
    relay.start()
    try:
        answers = await asyncio.gather(*(relay.hold(b) for b in bodies))
    finally:
        await relay.stop()
    return [(status, json.loads(content), extra) for status, content, extra in answers]


def test_batches_arriving_together_go_up_as_one_bundle_and_each_gets_its_own_answer():
    up = Upstream(offset_s=100.0)
    relay = Relay(up, RelaySettings(linger_s=0.2))
    bodies = [b"a" * n for n in (1, 2, 3, 4)]
    answers = run(held(relay, bodies))
    assert up.bundles == [bodies]
    assert [(s, a["accepted"], a["commands"]) for s, a, _ in answers] == [
        (200, n, [{"id": f"c{n}"}]) for n in (1, 2, 3, 4)]
    for _, a, _ in answers:  # the collector's clock as the relay knows it, at the middle of its hold
        assert a["relayed"]["error_s"] == 0.001 and 0.0 <= a["relayed"]["hold_s"] < 10
        assert abs(a["server_ts"] - 100.0 - time.time()) < 10
    assert (relay.stats.bundles, relay.stats.batches, relay.stats.max_bundle_items) == (1, 4, 4)
    assert up.closed  # stop() closed the upstream connection


def test_a_bundle_leaves_when_full_without_waiting_out_its_linger():
    up = Upstream()
    relay = Relay(up, RelaySettings(linger_s=20.0, max_items=3))
    t0 = time.monotonic()
    answers = run(held(relay, [bytes([i]) * 8 for i in range(6)]))
    assert time.monotonic() - t0 < 10  # two full bundles, neither waited 20 s
    assert [len(b) for b in up.bundles] == [3, 3]
    assert all(s == 200 for s, _, _ in answers)


def test_the_byte_bound_splits_bundles_but_never_refuses_one_large_batch():
    up = Upstream()
    relay = Relay(up, RelaySettings(linger_s=0.05, max_bytes=100))
    run(held(relay, [b"x" * 60, b"y" * 60, b"z" * 500]))
    assert [[len(i) for i in b] for b in up.bundles] == [[60], [60], [500]]


def test_each_items_status_is_passed_on_and_a_busy_item_says_retry_after():
    def mixed(items):
        return PostResult("ok", 200, {"results": [
            {"status": 200, "accepted": 1, "duplicate": False, "commands": []},
            {"status": 422, "error": "header field rank: too large"},
            {"status": 503, "error": "busy, retry later"}]})

    answers = run(held(Relay(Upstream(mixed), RelaySettings(linger_s=0.2)), [b"a", b"b", b"c"]))
    assert [(s, extra) for s, _, extra in answers] == [(200, []), (422, []), (503, [(b"retry-after", b"1")])]
    assert answers[1][1] == {"error": "header field rank: too large"}
    assert "relayed" not in answers[1][1]


@pytest.mark.parametrize("result", [
    PostResult("unavailable", reason="ConnectionRefusedError: [Errno 111] Connection refused"),
    PostResult("unavailable", 503, reason="HTTP 503: busy", retry_after_s=3.0),
    PostResult("unavailable", 401, reason="HTTP 401: missing or wrong bearer token"),
    PostResult("rejected", 413, reason="HTTP 413: too large"),
    PostResult("ok", 200, {"results": [{"status": 200}]}),  # one result for two batches
    PostResult("ok", 200, {"accepted": 1}),  # not a bundle's answer at all
])
def test_whatever_goes_wrong_upstream_every_held_rank_gets_a_503_to_spool_on(result):
    relay = Relay(Upstream(lambda items: result), RelaySettings(linger_s=0.2))
    answers = run(held(relay, [b"a", b"b"]))
    retry = str(max(1, math.ceil(result.retry_after_s or 1))).encode()
    assert [(s, extra) for s, _, extra in answers] == [(503, [(b"retry-after", retry)])] * 2
    assert "the collector did not take the bundle" in answers[0][1]["error"]
    assert relay.stats.failed_bundles == 1


def test_a_failure_inside_the_relay_answers_the_bundle_and_the_next_one_still_goes():
    calls = []

    def flaky(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return Upstream().answer(items)

    async def scenario():
        relay = Relay(Upstream(flaky), RelaySettings(linger_s=0.05))
        relay.start()
        try:
            first = await relay.hold(b"a")
            second = await relay.hold(b"b")
        finally:
            await relay.stop()
        return first[0], second[0]

    assert run(scenario()) == (503, 200)


def test_the_asgi_app_forwards_only_ingest_and_bounds_it():
    up = Upstream()
    relay = Relay(up, RelaySettings(linger_s=0.01, max_batch_bytes=100))

    async def scenario():
        relay.start()
        transport = httpx.ASGITransport(app=relay)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://relay") as c:
                ok = await c.post("/v1/ingest", content=b"x" * 10, headers={"content-type": wire.CONTENT_TYPE})
                too_big = await c.post("/v1/ingest", content=b"x" * 101, headers={"content-type": wire.CONTENT_TYPE})
                wrong_type = await c.post("/v1/ingest", content=b"{}", headers={"content-type": "application/json"})
                empty = await c.post("/v1/ingest", content=b"", headers={"content-type": wire.CONTENT_TYPE})
                other = await c.get("/v1/runs")
                health = await c.get("/healthz")
        finally:
            await relay.stop()
        return ok, too_big, wrong_type, empty, other, health

    ok, too_big, wrong_type, empty, other, health = run(scenario())
    assert ok.status_code == 200 and ok.json()["accepted"] == 10
    assert too_big.status_code == 413 and wrong_type.status_code == 415 and empty.status_code == 400
    assert other.status_code == 404
    assert health.status_code == 200 and health.json()["batches"] == 1
    assert up.bundles == [[b"x" * 10]]  # nothing refused went upstream
