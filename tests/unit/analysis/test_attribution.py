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
