"""WaitBook: who waited for whom, as decayed averages kept in sorted arrays."""

from __future__ import annotations

import pytest

from analysis.attribution import WaitBook
from analysis.frames import collectives_frame


def _op(step: int, rank: int, start: float, wait: float, *, gseq: int, group: int = 0, peer: int = -1) -> dict:
    return {"run_id": "r", "attempt": 0, "step": step, "rank": rank, "seq": gseq, "group_seq": gseq,
            "op": "all_reduce" if peer < 0 else "send", "axis": "dp" if peer < 0 else "pp", "group_id": group,
            "peer": peer, "start_ts": start, "wait_s": wait}


def test_pairs_merge_new_and_known_waits_with_the_moving_average():
    alpha = 0.5
    book = WaitBook(alpha=alpha)
    # step 1: ranks 0 and 1 wait for rank 2 (entered last, 0.3 s after 0, 0.1 s after 1)
    book.add(collectives_frame([_op(1, 0, 10.0, 0.5, gseq=1), _op(1, 1, 10.2, 0.5, gseq=1),
                                _op(1, 2, 10.3, 0.0, gseq=1)]))
    book.finalize(0, 1)
    assert book.waited_for(0, 2) == pytest.approx(alpha * 0.3)
    assert book.waited_for(1, 2) == pytest.approx(alpha * 0.1)
    assert book.waited_for(2, 0) == 0.0
    # step 2: a known pair again (0 -> 2), a new one (3 -> 1, point to point)
    book.add(collectives_frame([_op(2, 0, 20.0, 0.2, gseq=2), _op(2, 2, 20.2, 0.0, gseq=2),
                                _op(2, 3, 20.0, 0.4, gseq=7, group=1, peer=1)]))
    book.finalize(0, 2)
    assert book.waited_for(0, 2) == pytest.approx(alpha * 0.2 + (1 - alpha) * alpha * 0.3)
    assert book.waited_for(1, 2) == pytest.approx((1 - alpha) * alpha * 0.1)  # decayed, not waited again
    assert book.waited_for(3, 1) == pytest.approx(alpha * 0.4)
    assert book.net_wait(0, 2) > 0 and book.net_wait(2, 0) < 0
    assert book.waits_most_for(0, 0.01) == 2 and book.waits_most_for(2, 0.0) is None
    assert book.footprint()["wait_pairs"] == 3


def test_collectives_group_by_step_axis_group_and_seq_and_name_the_last_to_enter():
    """The packed one-key sort and the lexsort it falls back to (keys too wide to pack) give the
    same collectives and the same last member: the latest start, the later row on a tie."""
    import numpy as np

    from analysis import attribution

    rng = np.random.default_rng(3)
    n = 400
    step = (1 << 40) + rng.integers(5, 8, n)
    axis, gseq = rng.integers(0, 3, n), rng.integers(0, 4, n)
    start = rng.integers(0, 6, n).astype(float)  # many ties
    for gid in (rng.integers(0, 5, n), rng.integers(0, 5, n) << 40):  # the second cannot be packed
        order, starts, last = attribution._collectives(step, axis, gid, gseq, start)
        assert sorted(order.tolist()) == list(range(n))
        keys = list(zip(step[order], axis[order], gid[order], gseq[order]))
        bounds = [*starts.tolist(), n]
        assert len(set(keys)) == len(starts)  # one run per collective
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            rows = order[lo:hi]
            assert len({keys[j] for j in range(lo, hi)}) == 1
            assert rows.tolist() == sorted(rows.tolist())  # given order kept within
            latest = start[rows].max()
            assert order[last[i]] == max(r for r in rows.tolist() if start[r] == latest)
    empty = np.zeros(0, np.int64)
    assert all(len(x) == 0 for x in attribution._collectives(empty, empty, empty, empty, np.zeros(0)))


def test_the_pairs_decay_lazily_across_many_steps_and_stay_exact():
    """The pairs are kept as of an older step and decayed by one factor when read; a long run
    renormalizes them before the factor underflows, and a pair's value is the same EWMA."""
    alpha = 0.5
    book = WaitBook(alpha=alpha)
    expect = expect_1 = 0.0
    for step in range(1, 400):  # (1 - 0.5) ** 400 is far below the renormalizing bar
        waited = 0.1 if step % 3 else 0.0
        rows = [_op(step, 2, 10.0 * step + 0.2, 0.0, gseq=step)]
        if waited:
            rows.append(_op(step, 0, 10.0 * step + 0.1, 0.5, gseq=step))
        else:
            rows.append(_op(step, 1, 10.0 * step, 0.5, gseq=step))
        book.add(collectives_frame(rows))
        book.finalize(0, step)
        expect = alpha * waited + (1 - alpha) * expect
        expect_1 = alpha * (0.0 if waited else 0.2) + (1 - alpha) * expect_1
        assert book.waited_for(0, 2) == pytest.approx(expect, rel=1e-9)
        assert book.waited_for(1, 2) == pytest.approx(expect_1, rel=1e-9)


@pytest.mark.parametrize("cells", [1, 7, 1 << 20])  # a step a block (or fewer ranks than a block holds), or all
def test_many_steps_finalized_at_once_are_each_step_in_turn(monkeypatch, cells):
    """A pass behind a fast job finalizes many steps at once: their per-rank sums are taken in
    blocks of (step, rank) cells, and the averages are those of finalizing each step in turn."""
    import numpy as np

    from analysis import attribution

    rng = np.random.default_rng(5)
    rows = []
    for step in range(1, 41):
        for g, members in enumerate(([0, 1, 2], [3, 4])):
            starts = 10.0 * step + rng.uniform(0, 0.3, len(members))
            rows += [_op(step, r, s, float(rng.uniform(0, 0.4)), gseq=step, group=members[0])
                     for r, s in zip(members, starts)]
        rows.append(_op(step, 5, 10.0 * step, float(rng.uniform(0, 0.2)), gseq=step, group=5, peer=int(step % 5)))
    one = WaitBook(alpha=0.3)
    for step in range(1, 41):
        one.add(collectives_frame([r for r in rows if r["step"] == step]))
        one.finalize(0, step)
    monkeypatch.setattr(attribution, "_CELLS", cells)
    many = WaitBook(alpha=0.3)
    many.add(collectives_frame(rows))
    many.finalize(0, 40)
    assert many.num_final == one.num_final == 40
    for name in ("caused_wait_s", "last_ops", "all_ops"):
        assert np.allclose(getattr(many, name), getattr(one, name), rtol=1e-12, atol=0), name
    assert all(many.waited_for(a, b) == pytest.approx(one.waited_for(a, b), rel=1e-9) for a in range(6) for b in range(6))
