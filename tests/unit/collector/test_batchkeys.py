"""The in-memory mirror of the batches table used for dedupe."""

from __future__ import annotations

import random

import duckdb

from collector.store.dedupe import CONFLICT, DUPLICATE, FRESH, BatchKeys


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


class Lookups:
    """A stand-in for the writer's query of stored hashes, recording its calls."""

    def __init__(self, stored: dict) -> None:
        self.stored = stored
        self.calls: list[list] = []

    def __call__(self, keys: list) -> dict:
        self.calls.append(keys)
        return {k: self.stored[k] for k in keys if k in self.stored}


def test_sort_out_fresh_keys_ask_nothing():
    keys, lookup = BatchKeys(), Lookups({})
    assert keys.sort_out([(key(0), b"a"), (key(1), b"b")], lookup) == [FRESH, FRESH]
    assert lookup.calls == []  # the fast path: no query when no key is taken


def test_sort_out_copies_inside_one_group_compare_in_memory():
    keys, lookup = BatchKeys(), Lookups({})
    got = keys.sort_out([(key(0), b"a"), (key(0), b"a"), (key(0), b"b"), (key(1), b"c")], lookup)
    assert got == [FRESH, DUPLICATE, CONFLICT, FRESH] and lookup.calls == []


def test_sort_out_stored_keys_are_looked_up_once():
    keys = BatchKeys()
    for s in range(3):
        keys.add(key(s))
    lookup = Lookups({key(0): b"a", key(1): b"b", key(2): None})  # key 2: stored before hashes were kept
    got = keys.sort_out([(key(0), b"a"), (key(1), b"x"), (key(2), b"y"), (key(0), b"a"), (key(5), b"z")], lookup)
    assert got == [DUPLICATE, CONFLICT, DUPLICATE, DUPLICATE, FRESH]
    assert lookup.calls == [[key(0), key(1), key(2)]]
    assert key(5) not in keys  # sort_out adds nothing: the writer does after the commit
