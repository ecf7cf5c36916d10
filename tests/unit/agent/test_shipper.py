"""Send-or-spool decisions, replay order and backoff, with a scripted client and clock."""

from agent import wire
from agent.spool import Spool
from agent.transport import PostResult, Shipper


class ScriptedClient:
    """Answers POSTs with the outcome currently set; records what it was sent."""

    def __init__(self):
        self.outcome = PostResult("ok", 200, {"accepted": 1})
        self.received: list[int] = []
        self.num_posts = 0

    def post(self, body, *, timeout_s=None):
        self.num_posts += 1
        if self.outcome.status == "ok":
            self.received.append(wire.decode_batch(body).header["batch_seq"])
        return self.outcome

    def close(self):
        pass


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def _batch(seq: int) -> bytes:
    return wire.encode_batch({"run_id": "r", "rank": 0, "incarnation": "i", "batch_seq": seq,
                              "dicts": {"name": ["x"]}},
                             {"scalar": (1, {"step": seq.to_bytes(8, "little"), "attempt": bytes(4),
                                             "ts": bytes(8), "name": bytes(2), "value": bytes(8)})})


def _shipper(tmp_path, max_bytes=1 << 20):
    client, clock = ScriptedClient(), Clock()
    responses = []
    shipper = Shipper(client, Spool(str(tmp_path), max_bytes), responses.append, retry_min_s=0.5,
                      retry_max_s=10.0, clock=clock)
    return shipper, client, clock, responses


ROWS = {"scalar": 1, "event": 0}


def test_outage_spools_then_replays_in_order_before_new_batches(tmp_path):
    shipper, client, clock, responses = _shipper(tmp_path)
    assert shipper.ship(_batch(0), ROWS) == "sent"
    client.outcome = PostResult("unavailable", reason="refused")
    assert [shipper.ship(_batch(s), ROWS) for s in (1, 2, 3)] == ["spooled"] * 3
    client.outcome = PostResult("ok", 200, {"accepted": 1})
    assert not shipper.pump()  # still inside the backoff window: no attempt
    clock.t += 0.6
    assert shipper.ship(_batch(4), ROWS) == "spooled"  # queued behind the backlog, not sent ahead of it
    assert shipper.pump()
    assert client.received == [0, 1, 2, 3, 4]
    st = shipper.stats
    assert (st.num_batches_sent, st.num_batches_spooled, st.num_batches_replayed) == (1, 4, 4)
    assert st.replayed["scalar"] == 4 and len(responses) == 5
    shipper.close()


def test_backoff_doubles_to_the_cap_and_resets_on_success(tmp_path):
    shipper, client, clock, _ = _shipper(tmp_path)
    client.outcome = PostResult("unavailable", reason="refused")
    shipper.ship(_batch(0), ROWS)
    attempt_ts = [clock.t]
    for _ in range(200):  # 50 s of pumping every 0.25 s
        clock.t += 0.25
        before = client.num_posts
        shipper.pump()
        if client.num_posts > before:
            attempt_ts.append(clock.t)
    gaps = [b - a for a, b in zip(attempt_ts, attempt_ts[1:])]
    assert gaps[:7] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    client.outcome = PostResult("ok", 200, {})
    clock.t += 10.0
    assert shipper.pump() and shipper._backoff_s == 0.5 and client.received == [0]
    shipper.close()


def test_rejected_batches_are_dropped_and_counted_not_retried(tmp_path):
    shipper, client, _, _ = _shipper(tmp_path)
    client.outcome = PostResult("rejected", 400, reason="HTTP 400: bad")
    assert shipper.ship(_batch(0), ROWS) == "rejected"
    assert shipper.pump() and shipper.spool.peek() is None
    assert shipper.stats.num_batches_rejected == 1 and shipper.stats.rejected["scalar"] == 1
    assert shipper.stats.last_error == "HTTP 400: bad"
    shipper.close()


def test_full_spool_drops_and_counts_rows_per_kind(tmp_path):
    shipper, client, _, _ = _shipper(tmp_path, max_bytes=len(_batch(0)) + 8)
    client.outcome = PostResult("unavailable", reason="refused")
    assert [shipper.ship(_batch(s), ROWS) for s in range(3)] == ["spooled", "dropped", "dropped"]
    assert shipper.stats.dropped["scalar"] == 2 and shipper.stats.num_batches_dropped == 2
    shipper.close()


def _sleeping_shipper(tmp_path, **kw):
    """A shipper whose `sleep` advances the scripted clock (drain waits without waiting)."""
    client, clock = ScriptedClient(), Clock()
    clock.t = 100.0

    def sleep(s):
        clock.t += s

    shipper = Shipper(client, Spool(str(tmp_path), 1 << 20), lambda body: None, retry_min_s=0.5, retry_max_s=10.0,
                      clock=clock, sleep=sleep, **kw)
    return shipper, client, clock


def _pending(shipper) -> list[int]:
    out = []
    spool = shipper.spool
    while (payload := spool.peek()) is not None:
        out.append(wire.decode_batch(payload).header["batch_seq"])
        spool.pop()
    return out


def test_a_batch_failing_with_5xx_n_times_in_a_row_is_quarantined_and_the_rest_flows(tmp_path):
    shipper, client, clock = _sleeping_shipper(tmp_path, max_failures=3)
    client.outcome = PostResult("unavailable", 500, reason="HTTP 500: boom")
    assert shipper.ship(_batch(0), ROWS) == "spooled"  # failure 1 of batch 0, now the head of the spool
    assert shipper.ship(_batch(1), ROWS) == "spooled"
    for _ in range(2):  # failures 2 and 3, each after the backoff
        clock.t += 20.0
        assert not shipper.pump()
    assert shipper.stats.num_batches_quarantined == 1 and shipper.stats.quarantined["scalar"] == 1
    assert client.num_posts == 4  # 3 for batch 0, then batch 1 went at once (the collector had answered)
    client.outcome = PostResult("ok", 200, {})
    clock.t += 20.0
    assert shipper.pump() and client.received == [1]
    quarantine = shipper.quarantine
    assert quarantine.directory == str(tmp_path / "quarantine")
    assert wire.decode_batch(quarantine.peek()).header["batch_seq"] == 0  # kept, replayable
    shipper.close()


def test_away_and_busy_answers_never_count_against_a_batch(tmp_path):
    shipper, client, clock = _sleeping_shipper(tmp_path, max_failures=2)
    client.outcome = PostResult("unavailable", reason="ConnectionRefusedError")
    shipper.ship(_batch(0), ROWS)
    answers = [PostResult("unavailable", code, reason=f"HTTP {code}", retry_after_s=1.0)
               for code in (503, 429, 408, 502, 504)]
    answers += [PostResult("unavailable", reason="TimeoutError", timed_out=True),
                PostResult("unavailable", reason="ConnectionResetError")]
    for res in answers * 3:
        client.outcome = res
        clock.t += 20.0
        assert not shipper.pump()
    assert shipper.stats.num_batches_quarantined == 0 and _pending(shipper) == [0]
    shipper.close()


def test_failures_count_in_a_row_per_batch_and_restart_with_the_next_batch(tmp_path):
    shipper, client, clock = _sleeping_shipper(tmp_path, max_failures=2)
    client.outcome = PostResult("unavailable", reason="refused")
    shipper.ship(_batch(0), ROWS)
    shipper.ship(_batch(1), ROWS)
    for outcome in (PostResult("unavailable", 500, reason="HTTP 500"),  # batch 0: 1 of 2
                    PostResult("unavailable", 503, reason="busy", retry_after_s=1.0),  # neither counts nor resets
                    PostResult("ok", 200, {}),  # batch 0 delivered; batch 1 too
                    ):
        client.outcome = outcome
        clock.t += 20.0
        shipper.pump()
    assert client.received == [0, 1]
    client.outcome = PostResult("unavailable", reason="refused")
    shipper.ship(_batch(2), ROWS)
    for outcome in (PostResult("unavailable", 500, reason="HTTP 500"),  # batch 2: 1 of 2, not 2 of 2
                    PostResult("ok", 200, {})):
        client.outcome = outcome
        clock.t += 20.0
        shipper.pump()
    assert client.received == [0, 1, 2] and shipper.stats.num_batches_quarantined == 0
    shipper.close()


def test_spooled_batch_refused_with_409_is_rejected_not_retried(tmp_path):
    shipper, client, clock = _sleeping_shipper(tmp_path)
    client.outcome = PostResult("unavailable", reason="refused")
    shipper.ship(_batch(0), ROWS)
    shipper.ship(_batch(1), ROWS)
    client.outcome = PostResult("rejected", 409, reason="HTTP 409: conflicting duplicate")
    clock.t += 20.0
    before = client.num_posts
    assert shipper.pump()  # both refused for good: the spool is empty
    assert client.num_posts - before == 2
    st = shipper.stats
    assert st.num_batches_rejected == 2 and st.rejected["scalar"] == 2 and st.num_batches_replayed == 0
    assert shipper.spool.peek() is None and "409" in st.last_error
    shipper.close()


def test_full_quarantine_drops_and_counts(tmp_path):
    shipper, client, clock = _sleeping_shipper(tmp_path, max_failures=1, quarantine_bytes=len(_batch(0)) + 8)
    client.outcome = PostResult("unavailable", 500, reason="HTTP 500")
    shipper.ship(_batch(0), ROWS)
    shipper.ship(_batch(1), ROWS)
    for _ in range(3):
        clock.t += 20.0
        shipper.pump()
    st = shipper.stats
    assert (st.num_batches_quarantined, st.num_batches_dropped) == (1, 1)
    assert shipper.spool.peek() is None
    shipper.close()


def test_drain_ignores_backoff_retries_busy_answers_and_stops_when_nobody_answers(tmp_path):
    shipper, client, clock = _sleeping_shipper(tmp_path)
    client.outcome = PostResult("unavailable", reason="refused")
    for seq in range(3):
        shipper.ship(_batch(seq), ROWS)
    shipper._backoff_s = 10.0
    shipper.pump()  # refused again: backing off for 10 s
    script = iter([PostResult("unavailable", 503, reason="busy", retry_after_s=1.0),
                   PostResult("unavailable", reason="timeout", timed_out=True)])
    real_post = client.post

    def post(body, *, timeout_s=None):
        posts.append(timeout_s)
        res = next(script, None)
        if res is None:
            client.outcome = PostResult("ok", 200, {})
            return real_post(body)
        return res

    posts = []
    client.post = post
    start = clock.t
    assert shipper.drain(deadline=clock.t + 30.0)  # at once, despite the backoff; retried busy and slow
    assert client.received == [0, 1, 2] and posts[0] == 30.0  # each request's timeout: what is left
    assert clock.t - start < 30.0

    client.post = real_post
    client.outcome = PostResult("unavailable", reason="ConnectionRefusedError")
    shipper.ship(_batch(3), ROWS)
    before, start = client.num_posts, clock.t
    assert not shipper.drain(deadline=clock.t + 30.0)
    assert client.num_posts - before == 1 and clock.t == start  # nobody there: no waiting
    shipper.close()


def test_drain_gives_up_at_the_deadline(tmp_path):
    shipper, client, clock = _sleeping_shipper(tmp_path)
    client.outcome = PostResult("unavailable", 503, reason="busy", retry_after_s=2.0)
    shipper.ship(_batch(0), ROWS)
    deadline = clock.t + 5.0
    assert not shipper.drain(deadline=deadline)
    assert clock.t <= deadline and _pending(shipper) == [0]
    shipper.close()


def test_close_logs_how_many_batches_stay_in_the_spool_and_where(tmp_path, caplog):
    import logging

    shipper, client, _ = _sleeping_shipper(tmp_path)
    client.outcome = PostResult("unavailable", reason="refused")
    for seq in range(4):
        shipper.ship(_batch(seq), ROWS)
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        shipper.close()
    (msg,) = [r.getMessage() for r in caplog.records if "left in the spool" in r.getMessage()]
    assert msg.startswith("llmwatch agent: 4 undelivered batches left in the spool " + str(tmp_path))
