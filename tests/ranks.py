"""Rank processes for tests that run a torch.distributed job inside pytest (the engine's
equivalence, the checkpointer across processes, the comm layer, tensor parallel).

`context()` is a multiprocessing forkserver that imported torch and the trainer once: each
rank is forked from it, ready, instead of a fresh interpreter importing torch again (~2.5 s
of CPU a rank, 8 ranks on 2 cores for one layout). The server is single-threaded and
started before any process group exists, so a fork from it is as clean as a spawn (the
reason torch advises against forking a process that already ran collectives or CUDA).
Off Linux (no forkserver) it is plain spawn.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

# what the ranks import anyway: loaded once in the server
PRELOAD = ["torch", "torch.distributed", "trainer.engine", "trainer.comm", "trainer.checkpoint"]


def start_method() -> str:
    """The start method of rank processes ("forkserver" on Linux, its preload set)."""
    if sys.platform != "linux":
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # used when the server starts (the first rank)
    return "forkserver"


def context():
    """The multiprocessing context rank processes are started with."""
    return mp.get_context(start_method())
