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

    def post(self, body):
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
