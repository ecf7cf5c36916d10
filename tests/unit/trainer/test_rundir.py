"""Run ids: torchrun's `none` is no id; one job agrees on one id, and keeps it after a restart."""

import threading

import torch.distributed as dist

from trainer.rundir import agree_run_id, torchrun_run_id


def test_torchrun_default_id_counts_as_none():
    assert torchrun_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert torchrun_run_id({}) is None
    assert torchrun_run_id({"TORCHELASTIC_RUN_ID": "job-42"}) == "job-42"


def test_ranks_agree_on_rank_0s_id_whoever_asks_first():
    store = dist.HashStore()
    got = {}

    def rank(r):
        got[r] = agree_run_id(store, rank=r, propose=lambda: f"proposed-by-{r}")

    others = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3)]
    for t in others:  # they wait in store.get until rank 0 has set it
        t.start()
    rank(0)
    for t in others:
        t.join(timeout=10)
    assert got == {r: "proposed-by-0" for r in range(4)}


def test_a_restart_in_the_same_store_keeps_the_id():
    store = dist.PrefixStore("default_pg", dist.HashStore())
    first = agree_run_id(store, rank=0, propose=lambda: "first")
    again = agree_run_id(store, rank=0, propose=lambda: "second")  # restart round 1: rank 0 proposes anew
    assert first == again == "first"
    assert agree_run_id(store, rank=1) == "first"


def test_two_jobs_two_stores_two_ids():
    a = agree_run_id(dist.HashStore(), rank=0)
    b = agree_run_id(dist.HashStore(), rank=0)
    assert a != b and a.startswith("run-")
