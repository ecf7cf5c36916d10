"""The collector's garbage collector, set for a large heap that lives for the whole run.

CPython's cyclic collector runs a full collection (every tracked object) once ten
young-generation collections have passed and the objects promoted since the last
one reach a quarter of the old generation. A collector of a 100,000-rank job holds
~800,000 tracked objects (the detectors' and the liveness state of every rank),
and the batches waiting up to a second for their group commit outlive the young
collections, so they are promoted and die old: full collections came about once a
second, ~0.3 s each with the GIL held. A third of the process's time, and every
acknowledgement waited behind them (`bench/bench_ingest.py --ranks 100000
--step-hz 0.2 --collectives 200 --summaries 3 --flush-s 30 --per-node 8`: 243 of
417 requests/s held, ack p50 4.2 s; with this, 388 held, p50 2.1 s).

So, once the collector is built and before it serves:

- what start-up made (modules, the app, the rules, pydantic's and polars' tables)
  is frozen out of every later collection (`gc.freeze`): it is never garbage;
- a full collection waits for `FULL_AFTER` young-generation collections instead of
  10 (the quarter rule still holds), so cyclic garbage that reaches the old
  generation is reclaimed within minutes instead of within a second. The young
  generations keep CPython's thresholds.
"""

from __future__ import annotations

import gc

FULL_AFTER = 1000


def tune() -> None:
    """Freeze what exists now, and make full collections rare. Call once, from the main
    thread, when start-up is done."""
    gc.collect()  # what start-up left as garbage goes now, not into the frozen set
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_AFTER)
