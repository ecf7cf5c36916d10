"""From corpus to batches: epoch order with length grouping, an exact position, a
prefetch thread, held-out eval batches, and the poisoned batch of the spike fault.

Order of epoch `e` (the same on every rank, whatever dp is):

1. a permutation of the training sample ids seeded by (seed, e);
2. consecutive windows of `group_window * micro_batch_size` samples are sorted by
   length and cut into micro-batches, whose order inside the window is shuffled
   (seeded), so a micro-batch holds samples of similar length (little padding)
   while the steps still see a mix of lengths. Each micro-batch is padded to its
   longest sample rounded up to a multiple of 8 (`pad_multiple_for`): a handful of
   widths, kernel-friendly, instead of a new odd one every step.

Micro-batch k of the epoch is samples [k*mbs, (k+1)*mbs) of that order. A step's
global batch is the next `dp * micro_batches` micro-batches; dp rank d takes the
d-th run of `micro_batches` of them. So a single process with
`dp * micro_batches` micro-batches sees the same samples in the same step.
`DataPosition(epoch, index)` counts the samples of the epoch consumed before a
step; an epoch ends when fewer than a global batch remain (that tail is dropped)
and the next one starts at index 0.

Healing moves the data in two ways, both deterministic so that every dp rank
agrees without a collective:

- bad windows (epoch, from, to), in the same sample coordinates as
  `step_window()`: a step whose global batch overlaps one is never served; the
  loader jumps past the window and the same step number gets the next clean
  global batch (a rollback that skips poisoned data, and every later resume);
- a replica swap at one step: dp rank d serves replica (d + shift) % dp's
  micro-batches of the same global batch, so the math of the step is unchanged
  but each sample lands on another device: a rerun that separates a data fault
  (it moves with the samples) from a device fault (it stays on the rank);
- shares: how many of the global batch's `dp * micro_batches` micro-batches each
  replica takes (`rebalance()`, `balanced_shares()`): a slow replica takes fewer
  and the others more, replica d the d-th run of them in order. The global batch,
  its order and the loss's denominator (the global token count) are unchanged, and
  each micro-batch's loss is already divided by that count, so the summed
  gradients equal one process's whatever the split (a rebalance in place: no
  restart, undone by `rebalance(None)`).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trainer.batch import IGNORE_INDEX, DataPosition, MicroBatch, StepBatch
from trainer.corpus import Corpus, build_corpus
from trainer.tokenizer import PAD

__all__ = ["Corpus", "DataLoader", "balanced_shares", "build_corpus", "collate", "epoch_order", "eval_batches",
           "poison", "step_window"]


def balanced_shares(total: int, slowness: Sequence[float]) -> tuple[int, ...]:
    """Micro-batches per replica, `total` of them, each replica at least one, so that the
    slowest replica's time (its share x its slowness, a micro-batch's compute relative to
    a healthy replica's) is the least it can be: one at a time to the replica that would
    finish it soonest (ties to the lower index). `slowness` all 1: the even split, the
    remainder to the first replicas. The policy predicts with the same rule
    (analysis/costmodel.py `balanced_shares`; tests/unit/test_costmodel.py ties them)."""
    n = len(slowness)
    if n < 1 or total < n:
        raise ValueError(f"{total} micro-batches cannot give each of {n} replicas one")
    if any(not (f > 0) for f in slowness):
        raise ValueError(f"slowness must be positive: {list(slowness)}")
    shares = [1] * n
    for _ in range(total - n):
        i = min(range(n), key=lambda d: ((shares[d] + 1) * slowness[d], d))
        shares[i] += 1
    return tuple(shares)


def epoch_order(corpus: Corpus, *, seed: int, epoch: int, micro_batch_size: int, group_window: int) -> np.ndarray:
    """Training sample ids of `epoch` in the order they are served. ~20 ms for
    200k samples; the loader keeps the current epoch's order."""
    mbs = micro_batch_size
    perm = np.random.default_rng([seed, epoch]).permutation(corpus.train_ids)
    shuffle_rng = np.random.default_rng([seed, epoch, 1])
    window = group_window * mbs
    out = np.empty_like(perm)
    for w0 in range(0, len(perm), window):
        chunk = perm[w0:w0 + window]
        chunk = chunk[np.argsort(corpus.lengths[chunk], kind="stable")]
        num_full = len(chunk) // mbs
        full = chunk[:num_full * mbs].reshape(num_full, mbs)[shuffle_rng.permutation(num_full)]
        out[w0:w0 + num_full * mbs] = full.ravel()
        out[w0 + num_full * mbs:w0 + len(chunk)] = chunk[num_full * mbs:]  # last window's remainder
    return out


def step_window(position: DataPosition, n_samples: int) -> tuple[int, int, int]:
    """(epoch, first sample index, end sample index) of the step that starts at
    `position` and takes `n_samples` (the global batch): what data-tied faults and
    a rollback's skip are expressed in."""
    return (position.epoch, position.index, position.index + n_samples)


PAD_ALIGN = 8  # micro-batch widths are rounded up to a multiple of this where seq_len allows


def pad_multiple_for(seq_len: int, split: int = 1) -> int:
    """The multiple a micro-batch's width is padded up to: `PAD_ALIGN` (and `split`, the tp
    size under sequence parallelism, whose shards must be equal) when `seq_len` is a multiple of
    it, else `split` alone.

    Samples vary in length, and padding each micro-batch only to its longest gave every step
    new, odd widths. On CPU (oneDNN's bf16 kernels, SDPA) that cost the dp1 bench 38%: 4 x 4
    samples of mean width 74.5 took 121-131 ms a step, as long as fixed width 128; the same
    widths rounded up to 8 (mean 78) took 88-92 ms. On a GPU, tensor cores want multiples of
    8 as well (HF's `pad_to_multiple_of=8`)."""
    aligned = math.lcm(PAD_ALIGN, split)
    return aligned if seq_len % aligned == 0 else split


def collate(corpus: Corpus, ids, *, pad_multiple: int = 1, rows: int | None = None) -> MicroBatch:
    """One micro-batch of samples `ids`, right-padded to the longest rounded up to
    `pad_multiple`: inputs = tokens[:-1] (PAD after), targets = tokens[1:]
    (IGNORE_INDEX after). `rows` > len(ids) adds rows that carry no loss."""
    ids = [int(i) for i in ids]
    num_targets = [int(corpus.lengths[i]) - 1 for i in ids]
    width = -(-max(num_targets, default=1) // pad_multiple) * pad_multiple
    rows = len(ids) if rows is None else rows
    inputs = np.full((rows, width), PAD, np.int64)
    targets = np.full((rows, width), IGNORE_INDEX, np.int64)
    for r, (i, n) in enumerate(zip(ids, num_targets)):
        tokens = corpus.sample(i)
        inputs[r, :n] = tokens[:-1]
        targets[r, :n] = tokens[1:]
    return MicroBatch(inputs=torch.from_numpy(inputs), targets=torch.from_numpy(targets),
                      num_tokens=sum(num_targets), sample_ids=tuple(ids))


def eval_batches(corpus: Corpus, domain: str, *, micro_batch_size: int, pad_multiple: int = 1) -> list[MicroBatch]:
    """The held-out samples of `domain` as micro-batches, identical on every rank.

    Sorted by length (least padding). Every micro-batch has `micro_batch_size`
    rows, so engines that fix the batch dimension (pipeline send/recv) need no
    special case: the last one is filled with rows that carry no loss."""
    ids = corpus.eval_ids[domain]
    ids = ids[np.argsort(corpus.lengths[ids], kind="stable")]
    return [collate(corpus, ids[k:k + micro_batch_size], pad_multiple=pad_multiple, rows=micro_batch_size)
            for k in range(0, len(ids), micro_batch_size)]


def poison(batch: StepBatch, seed: int) -> StepBatch:
    """`batch` with every sample replaced by one random non-ASCII byte (0x80-0xFF)
    repeated, drawn from a generator seeded by (seed, step): a corrupted shard of
    the kind real pipelines produce. The corpus is almost all ASCII, so a model
    that has trained a little gives that byte a tiny probability, and every token
    pushes the gradient the same way: the loss and the gradient norm really jump. Shapes, lengths, padding and token counts stay; the input tensors are not
    modified (a copy is returned)."""
    rng = np.random.default_rng([seed, batch.step])
    poisoned = []
    for mb in batch.micro_batches:
        inputs, targets = mb.inputs.clone(), mb.targets.clone()
        for r, n in enumerate((targets != IGNORE_INDEX).sum(dim=1).tolist()):
            if n:
                noise = torch.full((n + 1,), int(rng.integers(128, 256)), dtype=inputs.dtype)
                inputs[r, :n] = noise[:-1]
                targets[r, :n] = noise[1:]
        poisoned.append(dataclasses.replace(mb, inputs=inputs, targets=targets))
    return dataclasses.replace(batch, micro_batches=poisoned, meta={**batch.meta, "poisoned": True})


def _as_window(window) -> tuple[int, int, int]:
    epoch, lo, hi = (int(x) for x in window)
    if epoch < 0 or not 0 <= lo < hi:
        raise ValueError(f"bad window {tuple(window)}: needs epoch >= 0 and 0 <= from < to")
    return (epoch, lo, hi)


@dataclasses.dataclass(frozen=True, slots=True)
class _Failure:
    error: Exception


class DataLoader:
    """StepBatches for one dp rank, prepared by a background thread.

    `prefetch` steps are prepared ahead into a bounded queue (0: prepared inline
    in `next()`). `wait_s` is how long the last `next()` blocked: the step's data
    time. An exception in the thread is re-raised by `next()` (and by every call
    after). `seek()` drops the prepared steps and restarts at a position: resume
    and rollback. `add_bad_window()` and `swap_at()` drop them too, since the
    steps already prepared may be the ones they change. Preparing a step of 8
    micro-batches of 4x128 costs ~0.2 ms.

    Every served StepBatch's meta has `window` (the global batch), `replica_window`
    (the samples this rank got), `skipped_windows` (the bad windows jumped over
    just before this step, usually empty), `swap_shift` (0 unless swapped) and
    `shares` (the micro-batches of each replica; `shares` at construction, or
    `rebalance()`, else `micro_batches` each).

    `slow_fetch(step)` (fault injection, trainer/faults.py `slowio` what=data) says
    how many times slower than this rank consumes them the storage serves its steps:
    a factor F > 1 makes `next()` really wait (F - 1) x the time since the previous
    `next()` returned (the work the prefetch hid the fetch behind), so `wait_s` shows it."""

    def __init__(self, corpus: Corpus, *, seq_len: int, micro_batch_size: int, micro_batches: int, dp_size: int,
                 dp_rank: int, seed: int, position: DataPosition, group_window: int, prefetch: int,
                 pad_multiple: int = 1, start_step: int = 0,
                 bad_windows: Sequence[tuple[int, int, int]] = (),
                 slow_fetch: Callable[[int], float] | None = None,
                 shares: Sequence[int] | None = None) -> None:
        if min(micro_batch_size, micro_batches, dp_size, group_window, pad_multiple) < 1 or prefetch < 0:
            raise ValueError("micro_batch_size, micro_batches, dp_size, group_window, pad_multiple must be >= 1, "
                             "prefetch >= 0")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
        if seq_len % pad_multiple:
            raise ValueError(f"seq_len {seq_len} is not a multiple of pad_multiple {pad_multiple}")
        if corpus.seq_len > seq_len:
            raise ValueError(f"corpus built for seq_len {corpus.seq_len}, longer than the model's {seq_len}")
        self.corpus = corpus
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.group_window = group_window
        self.prefetch = prefetch
        self.pad_multiple = pad_multiple
        self.samples_per_step = dp_size * micro_batches * micro_batch_size  # the global batch
        if len(corpus.train_ids) < self.samples_per_step:
            raise ValueError(f"{len(corpus.train_ids)} training samples are fewer than one global batch "
                             f"of {self.samples_per_step}")
        self.wait_s = 0.0
        self._slow_fetch = slow_fetch
        self._served_at: float | None = None  # when the last next() returned (perf_counter); None after a seek
        # Immutable, replaced whole: the producer thread reads them without a lock, and a
        # change is followed by a restart that drops what the old values prepared.
        self._bad_windows = tuple(_as_window(w) for w in bad_windows)
        self._swap: tuple[int, int] | None = None  # (step, shift), until that step is served
        self._shares = self._checked_shares(shares)  # micro-batches per replica (immutable, replaced whole)
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._closed = False
        self._start(self.normalize(position), start_step)

    # -- positions ---------------------------------------------------------
    @property
    def position(self) -> DataPosition:
        """Where the next step served by `next()` starts, unless a bad window moves it."""
        return self._position

    @property
    def step(self) -> int:
        """The step number the next `next()` returns."""
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        return len(self.corpus.train_ids) // self.samples_per_step

    def normalize(self, position: DataPosition) -> DataPosition:
        """`position`, or the start of the next epoch when fewer than a global
        batch remain in this one."""
        if position.index < 0 or position.index % self.micro_batch_size:
            raise ValueError(f"{position}: index must be a non-negative multiple of "
                             f"micro_batch_size {self.micro_batch_size}")
        if position.index + self.samples_per_step > len(self.corpus.train_ids):
            return DataPosition(position.epoch + 1, 0)
        return position

    def seek(self, position: DataPosition, step: int) -> None:
        """Serve from `position` with step number `step` next; prepared steps are dropped."""
        self._check_open()
        self._stop_thread()
        self._start(self.normalize(position), step)

    def skip_samples(self, n: int) -> DataPosition:
        """Move the next step `n` samples further (rounded up to whole micro-batches;
        past the epoch's last full global batch means the next epoch's start) and
        return the new position. The step number does not change."""
        if n < 0:
            raise ValueError(f"cannot skip {n} samples")
        n = -(-n // self.micro_batch_size) * self.micro_batch_size
        new = self.normalize(DataPosition(self._position.epoch, self._position.index + n))
        self.seek(new, self._step)
        return new

    # -- healing -------------------------------------------------------------
    @property
    def bad_windows(self) -> tuple[tuple[int, int, int], ...]:
        return self._bad_windows

    def add_bad_window(self, window: tuple[int, int, int]) -> None:
        """Never serve a step that overlaps `window` (epoch, from, to), from the next
        step on. Prepared steps are dropped; position and step number stay."""
        window = _as_window(window)
        if window not in self._bad_windows:
            self._bad_windows = (*self._bad_windows, window)
        self.seek(self._position, self._step)

    def swap_at(self, step: int, shift: int) -> None:
        """At step number `step`, serve replica (dp_rank + shift) % dp_size's share of
        the global batch instead of our own. One pending swap (a later call replaces
        it), used up when that step is served, so a later replay of the same step
        number serves the usual share. Prepared steps are dropped; position and step
        number stay."""
        self._swap = (int(step), int(shift))
        self.seek(self._position, self._step)

    @property
    def shares(self) -> tuple[int, ...]:
        """The micro-batches each replica takes from the next step on."""
        return self._shares

    def rebalance(self, shares: Sequence[int] | None) -> tuple[int, ...]:
        """From the next step on, replica d takes `shares[d]` of the global batch's
        micro-batches (None: `micro_batches` each, the even split). Every rank must
        call it with the same shares at the same step. Prepared steps are dropped;
        position and step number stay. Returns the shares now in force."""
        self._shares = self._checked_shares(shares)
        self.seek(self._position, self._step)
        return self._shares

    def _checked_shares(self, shares: Sequence[int] | None) -> tuple[int, ...]:
        if shares is None:
            return (self.micro_batches,) * self.dp_size
        out = tuple(int(x) for x in shares)
        total = self.dp_size * self.micro_batches
        if len(out) != self.dp_size or min(out) < 1 or sum(out) != total:
            raise ValueError(f"shares {list(out)}: one per replica ({self.dp_size}), each >= 1, summing to the "
                             f"global batch's {total} micro-batches")
        return out

    # -- serving -----------------------------------------------------------
    def next(self) -> StepBatch:
        self._check_open()
        if self._error is not None:
            raise self._error
        t0 = time.perf_counter()
        if self._thread is None:
            batch = self._make_step(self._position, self._step)
        else:
            batch = self._get()
        factor = self._slow_fetch(batch.step) if self._slow_fetch is not None else 1.0
        if factor > 1.0 and self._served_at is not None:  # injected slow storage: the fetch really waits
            time.sleep((factor - 1.0) * max(0.0, t0 - self._served_at))
        self._served_at = time.perf_counter()
        self.wait_s = self._served_at - t0
        self._position, self._step = batch.next_position, batch.step + 1
        if self._swap is not None and self._swap[0] == batch.step:
            self._swap = None
        return batch

    def close(self) -> None:
        """Stop and join the prefetch thread. Idempotent; fine with steps left unread."""
        if not self._closed:
            self._stop_thread()
            self._closed = True

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DataLoader is closed")

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = epoch_order(self.corpus, seed=self.seed, epoch=epoch,
                                micro_batch_size=self.micro_batch_size, group_window=self.group_window)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _overlapping_bad_window(self, position: DataPosition) -> tuple[int, int, int] | None:
        lo, hi = position.index, position.index + self.samples_per_step
        return next((w for w in self._bad_windows if w[0] == position.epoch and w[1] < hi and lo < w[2]), None)

    def _past_bad_windows(self, position: DataPosition) -> tuple[DataPosition, list[tuple[int, int, int]]]:
        """The first position at or after `position` whose global batch is clean, and the
        bad windows jumped over to get there. Each jump moves forward (the window ends
        after `position`), and bad windows are finite, so this ends."""
        skipped = []
        while (bad := self._overlapping_bad_window(position)) is not None:
            skipped.append(bad)
            end = -(-bad[2] // self.micro_batch_size) * self.micro_batch_size
            position = self.normalize(DataPosition(position.epoch, end))
        return position, skipped

    def _make_step(self, position: DataPosition, step: int) -> StepBatch:
        position, skipped = self._past_bad_windows(position)
        order = self._order(position.epoch)
        lo, hi = position.index, position.index + self.samples_per_step
        mbs = self.micro_batch_size
        swap = self._swap
        shift = swap[1] if swap is not None and swap[0] == step else 0
        replica = (self.dp_rank + shift) % self.dp_size
        shares = self._shares
        count = shares[replica]
        mine = lo + sum(shares[:replica]) * mbs
        micro = [collate(self.corpus, order[mine + k * mbs:mine + (k + 1) * mbs], pad_multiple=self.pad_multiple)
                 for k in range(count)]
        # Every rank knows every sample's length: the global token count needs no collective.
        global_num_tokens = int((self.corpus.lengths[order[lo:hi]] - 1).sum())
        num_padded = sum(mb.inputs.numel() - mb.num_tokens for mb in micro)
        return StepBatch(step=step, micro_batches=micro, global_num_tokens=global_num_tokens, position=position,
                         next_position=self.normalize(DataPosition(position.epoch, hi)),
                         meta={"window": (position.epoch, lo, hi), "num_pad_tokens": num_padded,
                               # the samples this dp rank got (another replica's under a swap)
                               "replica_window": (position.epoch, mine, mine + count * mbs),
                               "skipped_windows": skipped, "swap_shift": shift, "shares": shares})

    def _start(self, position: DataPosition, step: int) -> None:
        self._position, self._step = position, step
        self._served_at = None
        self._error = None
        if self.prefetch == 0:
            return
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, args=(position, step, self._queue, self._stop),
                                        name=f"data-prefetch-dp{self.dp_rank}", daemon=True)
        self._thread.start()

    def _produce(self, position: DataPosition, step: int, q: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                batch = self._make_step(position, step)
                if not self._put(q, batch, stop):
                    return
                position, step = batch.next_position, step + 1
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised by next()
            self._put(q, _Failure(exc), stop)

    @staticmethod
    def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _get(self) -> StepBatch:
        assert self._queue is not None and self._thread is not None
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data prefetch thread exited without a batch") from None
                continue
            if isinstance(item, _Failure):
                self._error = item.error
                raise item.error
            return item

    def _stop_thread(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        assert self._queue is not None
        while True:  # unblock a producer waiting on a full queue, drop prepared steps
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()
        self._thread = None
        self._queue = None
