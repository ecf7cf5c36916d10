"""The in-memory mirror of the batches table used for dedupe."""

from __future__ import annotations

import random

import duckdb

from collector.batchkeys import BatchKeys


def key(seq: int, rank: int = 0, inc: str = "a") -> tuple[str, int, str, int]:
    return ("run", rank, inc, seq)


def test_in_order_out_of_order_and_gaps_match_a_plain_set():
    keys, plain = BatchKeys(), set()
    rng = random.Random(7)
    seqs = list(range(300)) + [rng.randrange(1000) for _ in range(300)]
    rng.shuffle(seqs)
    for s in seqs:
        k = key(s, rank=s % 3)
        assert (k in keys) == (k in plain)
        keys.add(k)
        plain.add(k)
    for s in range(1100):
        for rank in range(3):
            assert (key(s, rank) in keys) == (key(s, rank) in plain)


def test_senders_are_separate():
    keys = BatchKeys()
    keys.add(key(0, inc="a"))
    assert key(0, inc="a") in keys
    assert key(0, inc="b") not in keys
    assert key(0, rank=1, inc="a") not in keys
    assert ("other", 0, "a", 0) not in keys


def test_load_rebuilds_from_the_table():
    con = duckdb.connect()
    con.execute("CREATE TABLE batches (run_id VARCHAR, rank INTEGER, incarnation VARCHAR, batch_seq BIGINT)")
    stored = [0, 1, 2, 5, 6, 9]
    con.executemany("INSERT INTO batches VALUES ('run', 0, 'a', ?)", [(s,) for s in stored])
    keys = BatchKeys.load(con)
    assert [s for s in range(12) if key(s) in keys] == stored
    keys.add(key(3))
    keys.add(key(4))  # fills the gap: 0..6 is one interval now
    assert [s for s in range(12) if key(s) in keys] == [0, 1, 2, 3, 4, 5, 6, 9]
