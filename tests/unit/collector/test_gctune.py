"""The collector's garbage-collector settings (collector/gctune.py): start-up's objects are
frozen out of every collection, and a full collection waits for many young ones."""

from __future__ import annotations

import gc

from collector import gctune


def test_tune_freezes_what_exists_and_makes_full_collections_rare():
    before = gc.get_threshold()
    try:
        survivor = [object() for _ in range(1000)]  # tracked: lists are
        gctune.tune()
        assert gc.get_freeze_count() >= len(survivor)
        young, middle, full = gc.get_threshold()
        assert (young, middle) == before[:2] and full == gctune.FULL_AFTER > before[2]
        cycle: list = []
        cycle.append(cycle)  # new garbage with a cycle is still collected, by a young collection
        del cycle
        assert gc.collect(0) >= 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
