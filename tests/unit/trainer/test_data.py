import re
import threading
import time

import numpy as np
import pytest
import torch

from trainer.batch import IGNORE_INDEX, DataPosition
from trainer.config import DataConfig
from trainer.corpus import Corpus, _build, _cache_key, build_corpus, stdlib_sources
from trainer.data import (
    DataLoader,
    balanced_shares,
    epoch_order,
    eval_batches,
    pad_multiple_for,
    poison,
    step_window,
)
from trainer.tokenizer import BOS, EOS, PAD, decode

SEQ_LEN = 64
SMALL = dict(seq_len=SEQ_LEN, seed=7, max_code_bytes=300_000, math_bytes=150_000)


def small_config(cache_dir, **kw) -> DataConfig:
    return DataConfig(cache_dir=str(cache_dir), eval_samples=8, **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(small_config(tmp_path_factory.mktemp("cache")), **SMALL)


def synthetic_corpus(num_samples=240, seq_len=32, seed=0, cls=Corpus, **kw) -> Corpus:
    """Random-byte samples of random length: the loader's logic without a build."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, seq_len + 2, num_samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 256, offsets[-1]).astype(np.uint16)
    tokens[offsets[:-1]] = BOS
    return cls(tokens, offsets, np.arange(num_samples) % 2, domains=("code", "math"), seq_len=seq_len,
               seed=seed, eval_samples=4, **kw)


def loader(corpus, **kw) -> DataLoader:
    args = dict(seq_len=corpus.seq_len, micro_batch_size=4, micro_batches=2, dp_size=1, dp_rank=0, seed=3,
                position=DataPosition(), group_window=4, prefetch=2)
    args.update(kw)
    return DataLoader(corpus, **args)


def take(dl, n):
    return [dl.next() for _ in range(n)]


def ids_of(step_batch):
    return [i for mb in step_batch.micro_batches for i in mb.sample_ids]


# -- corpus ---------------------------------------------------------------------------


def test_build_is_deterministic_cached_and_has_two_domains(tmp_path, corpus):
    again = build_corpus(small_config(tmp_path / "other"), **SMALL)
    assert again.data_version == corpus.data_version and not again.from_cache
    assert np.array_equal(again.offsets, corpus.offsets)
    cached = build_corpus(small_config(tmp_path / "other"), **SMALL)
    assert cached.from_cache and cached.data_version == corpus.data_version
    other_seed = build_corpus(small_config(tmp_path / "other"), **{**SMALL, "seed": 8})
    assert other_seed.data_version != corpus.data_version
    stats = corpus.stats()
    assert set(stats) == {"code", "math"}
    for name, s in stats.items():
        assert s["num_samples"] > 500 and s["num_eval"] == 8 and s["num_train"] == s["num_samples"] - 8, name
        assert 16 <= s["min_sample_tokens"] and s["max_sample_tokens"] <= SEQ_LEN + 1
    assert stats["code"]["num_files"] > 10 and stats["code"]["num_files_skipped"] == 0
    assert stats["math"]["source_bytes"] >= 150_000


def test_samples_start_with_bos_and_are_cut_at_line_ends(corpus):
    starts = corpus.offsets[:-1]
    assert (np.asarray(corpus.tokens[starts]) == BOS).all()
    assert (np.asarray(corpus.tokens) == BOS).sum() == len(corpus)
    line_ends = [ord("\n"), EOS]
    last = np.asarray(corpus.tokens[corpus.offsets[1:] - 1])
    assert np.isin(last, line_ends).mean() > 0.85
    min_body = DataConfig().min_sample_tokens - 1
    for i in np.flatnonzero(~np.isin(last, line_ends)):  # cut inside a line only when no line end fits
        assert not np.isin(corpus.sample(i)[1:][min_body - 1:], line_ends).any()
    first_file = stdlib_sources(max_bytes=SMALL["max_code_bytes"])[0]
    head = decode(corpus.sample(0))
    assert open(first_file.path, encoding="utf-8").read().startswith(head)


def test_math_is_correct_arithmetic(corpus):
    math_ids = np.flatnonzero(corpus.domain_ids == corpus.domains.index("math"))
    whole_lines = []
    for i in math_ids[1:1000]:
        if corpus.tokens[corpus.offsets[i] - 1] in (ord("\n"), EOS):  # starts at a line start
            whole_lines += decode(corpus.sample(i)).split("\n")[:-1]  # the last piece may be cut
    equations = re.findall(r"[-+*/%()\d]+=-?\d+", "\n".join(whole_lines))
    assert len(equations) > 2000
    for eq in equations:
        lhs, rhs = eq.rsplit("=", 1)
        assert eval(lhs) == int(rhs), eq  # noqa: S307 - digits and operators only (regex above)


def test_sources_skip_tests_site_packages_and_bad_files(tmp_path):
    root = tmp_path / "lib"
    files = {"a.py": "x = 1\n" * 40, "pkg/b.py": "y = 2\n" * 40, "test/t.py": "t\n" * 40,
             "pkg/tests/u.py": "u\n" * 40, "site-packages/s.py": "s\n" * 40, "notes.txt": "n\n" * 40}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin.py").write_bytes(b"# caf\xe9\n" * 40)
    assert [f.relpath for f in stdlib_sources(root)] == ["a.py", "latin.py", "pkg/b.py"]
    assert [f.relpath for f in stdlib_sources(root, max_bytes=300)] == ["a.py"]
    built = build_corpus(DataConfig(cache_dir=str(tmp_path / "c"), domains=("code",), eval_samples=2,
                                    min_sample_tokens=4), seq_len=16, seed=0, code_root=root)
    assert built.stats()["code"]["num_files"] == 2 and built.stats()["code"]["num_files_skipped"] == 1


def test_concurrent_builds_leave_one_complete_copy(tmp_path):
    data = small_config(tmp_path)
    kw = dict(seq_len=SEQ_LEN, seed=1, max_code_bytes=50_000, math_bytes=20_000)
    results = []
    threads = [threading.Thread(target=lambda: results.append(build_corpus(data, **kw).data_version))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    # The loser of the rename discards its copy and keeps the winner's.
    files = stdlib_sources(max_bytes=50_000)
    final = tmp_path / f"corpus-{_cache_key(files, data, seq_len=SEQ_LEN, seed=1, max_code_bytes=50_000, math_bytes=20_000)}"
    _build(final, files, data, seq_len=SEQ_LEN, seed=1, math_bytes=20_000)
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    assert Corpus.load(final, eval_samples=8).data_version == results[0]


def test_eval_samples_are_held_out(corpus):
    train = set(corpus.train_ids.tolist())
    for name in corpus.domains:
        held = corpus.eval_ids[name]
        assert len(held) == 8 and not train & set(held.tolist())
        assert (corpus.domain_ids[held] == corpus.domains.index(name)).all()
    assert len(train) + 16 == len(corpus)
    dl = loader(corpus, micro_batches=4, prefetch=0)
    served = {i for _ in range(dl.steps_per_epoch) for i in ids_of(dl.next())}
    assert served <= train and len(served) == dl.steps_per_epoch * dl.samples_per_step


def test_eval_batches_cover_the_held_out_set(corpus):
    batches = eval_batches(corpus, "math", micro_batch_size=3, pad_multiple=8)
    assert sorted(i for mb in batches for i in mb.sample_ids) == sorted(corpus.eval_ids["math"].tolist())
    assert all(mb.inputs.shape[0] == 3 and mb.seq_len % 8 == 0 for mb in batches)
    assert batches[-1].targets[-1].eq(IGNORE_INDEX).all()  # 8 samples in rows of 3: one filler row
    again = eval_batches(corpus, "math", micro_batch_size=3, pad_multiple=8)
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(batches, again))


# -- order, positions, batches --------------------------------------------------------


def test_epoch_order_is_a_grouped_permutation():
    c = synthetic_corpus()
    order = epoch_order(c, seed=3, epoch=0, micro_batch_size=4, group_window=4)
    assert sorted(order.tolist()) == c.train_ids.tolist()
    assert np.array_equal(order, epoch_order(c, seed=3, epoch=0, micro_batch_size=4, group_window=4))
    assert not np.array_equal(order, epoch_order(c, seed=3, epoch=1, micro_batch_size=4, group_window=4))
    for w0 in range(0, len(order) - 16, 16):  # inside a window, micro-batches hold length-sorted runs
        window = c.lengths[order[w0:w0 + 16]].reshape(4, 4)
        ranked = sorted(window.tolist(), key=lambda mb: mb[0])
        assert all(a[-1] <= b[0] for a, b in zip(ranked, ranked[1:]))


def test_positions_advance_and_roll_over_to_the_next_epoch():
    c = synthetic_corpus()  # 232 training samples, global batch 3*2*4 = 24 -> 9 steps per epoch
    dl = loader(c, dp_size=3, micro_batches=2, start_step=5)
    assert dl.steps_per_epoch == 9
    batches = take(dl, 11)
    dl.close()
    assert [b.step for b in batches] == list(range(5, 16))
    assert [b.position for b in batches[:10]] == [DataPosition(0, 24 * k) for k in range(9)] + [DataPosition(1, 0)]
    assert batches[8].next_position == DataPosition(1, 0) == batches[9].position
    assert dl.position == DataPosition(1, 48) and dl.step == 16
    assert step_window(batches[3].position, dl.samples_per_step) == (0, 72, 96) == batches[3].meta["window"]
    assert dl.normalize(DataPosition(2, 216)) == DataPosition(3, 0)  # 232 - 216 < 24
    with pytest.raises(ValueError, match="multiple"):
        dl.normalize(DataPosition(0, 6))


def test_dp_ranks_see_what_one_process_sees():
    """The batch contract: dp ranks with M micro-batches each == one process with dp*M."""
    c = synthetic_corpus()
    single = loader(c, micro_batches=6, pad_multiple=2, seq_len=32)
    ranks = [loader(c, dp_size=3, dp_rank=d, micro_batches=2, pad_multiple=2, seq_len=32) for d in range(3)]
    for _ in range(12):  # crosses an epoch boundary (9 steps per epoch)
        whole = single.next()
        parts = [r.next() for r in ranks]
        assert [mb.sample_ids for mb in whole.micro_batches] == [mb.sample_ids for p in parts for mb in p.micro_batches]
        for a, b in zip(whole.micro_batches, [mb for p in parts for mb in p.micro_batches]):
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert {p.global_num_tokens for p in parts} == {whole.global_num_tokens}
        assert whole.global_num_tokens == sum(mb.num_tokens for p in parts for mb in p.micro_batches)
        assert {p.position for p in parts} == {whole.position} and {p.step for p in parts} == {whole.step}
    for dl in [single, *ranks]:
        dl.close()


def test_micro_batch_padding_and_targets():
    c = synthetic_corpus(seq_len=32)
    with loader(c, pad_multiple=8, micro_batches=3) as dl:
        for batch in take(dl, 5):
            for mb in batch.micro_batches:
                assert mb.inputs.dtype == torch.int64 and mb.seq_len % 8 == 0 and mb.seq_len <= 32
                for row, i in enumerate(mb.sample_ids):
                    tokens = torch.from_numpy(c.sample(i).astype(np.int64))
                    n = len(tokens) - 1
                    assert torch.equal(mb.inputs[row, :n], tokens[:-1]) and (mb.inputs[row, n:] == PAD).all()
                    assert torch.equal(mb.targets[row, :n], tokens[1:])
                    assert (mb.targets[row, n:] == IGNORE_INDEX).all()
                assert mb.num_tokens == int((mb.targets != IGNORE_INDEX).sum())
                assert mb.seq_len - 8 < max(len(c.sample(i)) - 1 for i in mb.sample_ids)


def test_seek_and_resume_continue_identically():
    c = synthetic_corpus()
    with loader(c) as dl:
        run = take(dl, 40)  # 29 steps per epoch: crosses into epoch 1
    with loader(c, position=run[23].position, start_step=23) as resumed:
        assert [ids_of(b) for b in take(resumed, 17)] == [ids_of(b) for b in run[23:]]
    with loader(c, prefetch=0) as inline:
        inline_run = take(inline, 6)
        inline.seek(run[2].position, 2)
        replay = take(inline, 3)
    assert [ids_of(b) for b in inline_run] == [ids_of(b) for b in run[:6]]
    assert [b.step for b in replay] == [2, 3, 4] and [ids_of(b) for b in replay] == [ids_of(b) for b in run[2:5]]
    with loader(c) as dl:
        take(dl, 3)
        dl.seek(run[30].position, 30)  # drops what the thread had prepared
        after = dl.next()
    assert after.step == 30 and ids_of(after) == ids_of(run[30]) and after.position == run[30].position


def test_skip_samples_moves_past_a_window():
    c = synthetic_corpus()
    with loader(c) as dl:
        run = take(dl, 31)
    with loader(c) as dl:
        take(dl, 4)
        window = step_window(dl.position, 2 * dl.samples_per_step)
        new = dl.skip_samples(window[2] - window[1])
        assert new == run[6].position == dl.position
        nxt = dl.next()
        assert nxt.step == 4 and ids_of(nxt) == ids_of(run[6])
        assert dl.skip_samples(1) == DataPosition(0, 7 * 8 + 4)  # rounded up to a micro-batch
        assert dl.skip_samples(10_000) == DataPosition(1, 0)
        assert ids_of(dl.next()) == ids_of(run[29])


def test_length_grouping_reduces_padding(corpus):
    """Measured on the real (small) corpus: the share of padded positions."""

    def pad_share(group_window):
        with loader(corpus, micro_batch_size=8, micro_batches=4, group_window=group_window, prefetch=0) as dl:
            batches = take(dl, 40)
        padded = sum(b.meta["num_pad_tokens"] for b in batches)
        return padded / sum(mb.inputs.numel() for b in batches for mb in b.micro_batches)

    grouped, ungrouped = pad_share(64), pad_share(1)
    print(f"padding share: grouped {grouped:.3f} vs ungrouped {ungrouped:.3f}")
    assert grouped < 0.1 and grouped < ungrouped / 3


# -- the prefetch thread --------------------------------------------------------------


class FlakyCorpus(Corpus):
    """A corpus whose storage fails after `fail_after` reads, or is slow."""

    fail_after = 10**9
    read_delay_s = 0.0

    def sample(self, i):
        self.reads = getattr(self, "reads", 0) + 1
        if self.reads > self.fail_after:
            raise OSError("disk on fire")
        time.sleep(self.read_delay_s)
        return super().sample(i)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("data-prefetch")]


def test_errors_in_the_prefetch_thread_are_raised_by_next():
    c = synthetic_corpus(cls=FlakyCorpus)
    c.fail_after = 2 * 8  # two steps of 2x4 samples, then the reads fail
    dl = loader(c)
    assert [b.step for b in take(dl, 2)] == [0, 1]
    with pytest.raises(OSError, match="disk on fire"):
        dl.next()
    with pytest.raises(OSError, match="disk on fire"):
        dl.next()  # stays failed
    dl.close()
    assert not prefetch_threads()


def test_close_is_idempotent_and_safe_with_unread_steps():
    c = synthetic_corpus()
    dl = loader(c, prefetch=3)
    dl.next()
    time.sleep(0.05)  # the thread fills the queue and blocks on it
    t0 = time.perf_counter()
    dl.close()
    assert time.perf_counter() - t0 < 1.0 and not prefetch_threads()
    dl.close()
    with pytest.raises(RuntimeError, match="closed"):
        dl.next()


def test_prefetch_hides_data_time_and_wait_s_measures_it():
    c = synthetic_corpus(cls=FlakyCorpus)
    c.read_delay_s = 0.004  # 8 reads per step: >= 32 ms to prepare one
    with loader(c, prefetch=2) as dl:
        dl.next()
        assert dl.wait_s >= 0.025  # nothing was ready yet
        deadline = time.monotonic() + 30  # the thread prepares the next two steps meanwhile
        while dl._queue.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        dl.next()
        assert dl.wait_s < 0.02


def test_loader_rejects_bad_geometry():
    c = synthetic_corpus(seq_len=32)
    with pytest.raises(ValueError, match="pad_multiple"):
        loader(c, pad_multiple=5)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        loader(c, dp_size=8, micro_batches=8)
    with pytest.raises(ValueError, match="longer than the model"):
        loader(c, seq_len=16)


# -- the spike fault ------------------------------------------------------------------


def test_poison_replaces_tokens_but_keeps_shapes():
    c = synthetic_corpus()
    with loader(c, micro_batches=3) as dl:
        batch = dl.next()
    before = [mb.inputs.clone() for mb in batch.micro_batches]
    bad = poison(batch, seed=11)
    assert bad.meta["poisoned"] and bad.global_num_tokens == batch.global_num_tokens and bad.step == batch.step
    changed = total = 0
    for mb, orig, snapshot in zip(bad.micro_batches, batch.micro_batches, before):
        assert torch.equal(orig.inputs, snapshot)  # the original is untouched
        assert mb.inputs.shape == orig.inputs.shape and mb.num_tokens == orig.num_tokens
        valid = orig.targets != IGNORE_INDEX
        assert torch.equal(mb.targets != IGNORE_INDEX, valid)
        assert torch.equal(mb.inputs[~valid], orig.inputs[~valid])  # padding stays padding
        assert mb.inputs[valid].max() < 256 and mb.targets[valid].max() < 256
        assert torch.equal(mb.inputs[:, 1:][valid[:, 1:]], mb.targets[:, :-1][valid[:, 1:]])  # still a shifted stream
        changed += int((mb.inputs[valid] != orig.inputs[valid]).sum())
        total += int(valid.sum())
    assert changed > 0.9 * total
    again = poison(batch, seed=11)
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(bad.micro_batches, again.micro_batches))


# -- healing: bad windows and the replica swap ------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_bad_window_is_never_served_and_the_step_number_stays(prefetch):
    c = synthetic_corpus()  # global batch 8, 29 steps per epoch
    with loader(c, prefetch=prefetch) as dl:
        run = take(dl, 8)
    bad = (0, 18, 21)  # inside step 2's [16, 24): the loader jumps to 24 (21 rounded up to a micro-batch)
    with loader(c, prefetch=prefetch, bad_windows=[bad]) as dl:
        got = take(dl, 7)
    assert [b.step for b in got] == list(range(7))
    assert [ids_of(b) for b in got] == [ids_of(b) for b in run[:2] + run[3:8]]
    assert [b.meta["skipped_windows"] for b in got] == [[], [], [bad], [], [], [], []]
    assert got[2].position == run[3].position and got[2].meta["window"] == (0, 24, 32)
    assert got[1].next_position == run[2].position  # the skip happens when the next step is prepared


def test_bad_windows_round_up_to_micro_batches_and_cross_the_epoch_end():
    c = synthetic_corpus()
    with loader(c) as dl:
        run = take(dl, 31)
    # 231 rounds up to 232 = the epoch's end: the next step is epoch 1's first
    bad = [(0, 225, 231), (1, 0, 3)]  # and epoch 1's first micro-batch too
    with loader(c, position=run[27].position, start_step=27, bad_windows=bad, prefetch=0) as dl:
        got = take(dl, 2)
    assert [b.step for b in got] == [27, 28]
    assert ids_of(got[0]) == ids_of(run[27])
    assert got[1].position == DataPosition(1, 4) and got[1].meta["skipped_windows"] == bad
    # epoch 1 from index 4: not a step of the unskipped run, but the same samples as its order says
    order = epoch_order(c, seed=3, epoch=1, micro_batch_size=4, group_window=4)
    assert ids_of(got[1]) == order[4:12].tolist()


def test_a_window_of_another_epoch_is_not_skipped():
    c = synthetic_corpus()
    with loader(c, prefetch=0) as plain, loader(c, prefetch=0, bad_windows=[(1, 0, 8)]) as dl:
        assert [ids_of(b) for b in take(dl, 3)] == [ids_of(b) for b in take(plain, 3)]


@pytest.mark.parametrize("prefetch", [0, 3])
def test_add_bad_window_drops_prepared_steps_and_keeps_the_step(prefetch):
    c = synthetic_corpus()
    with loader(c) as dl:
        run = take(dl, 6)
    with loader(c, prefetch=prefetch) as dl:
        take(dl, 2)
        dl.add_bad_window(run[2].meta["window"])
        dl.add_bad_window(run[2].meta["window"])  # twice is once
        assert dl.step == 2 and dl.position == run[2].position and dl.bad_windows == (run[2].meta["window"],)
        nxt = dl.next()
        # a seek back before the window (a rollback) still skips it
        dl.seek(run[0].position, 0)
        replay = take(dl, 3)
    assert nxt.step == 2 and ids_of(nxt) == ids_of(run[3]) and nxt.meta["skipped_windows"] == [(0, 16, 24)]
    assert [ids_of(b) for b in replay] == [ids_of(b) for b in (run[0], run[1], run[3])]


def test_every_dp_rank_skips_alike():
    c = synthetic_corpus()
    bad = [(0, 30, 31)]
    single = loader(c, micro_batches=6, bad_windows=bad)
    ranks = [loader(c, dp_size=3, dp_rank=d, micro_batches=2, bad_windows=bad) for d in range(3)]
    for _ in range(4):
        whole = single.next()
        parts = [r.next() for r in ranks]
        assert ids_of(whole) == [i for p in parts for i in ids_of(p)]
        assert {p.position for p in parts} == {whole.position}
        assert all(p.meta["skipped_windows"] == whole.meta["skipped_windows"] for p in parts)
    for dl in [single, *ranks]:
        dl.close()


def test_bad_window_validation():
    c = synthetic_corpus()
    with pytest.raises(ValueError, match="bad window"):
        loader(c, bad_windows=[(0, 8, 8)])
    with loader(c, prefetch=0) as dl, pytest.raises(ValueError, match="bad window"):
        dl.add_bad_window((0, -4, 4))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_swap_moves_replica_windows_and_keeps_the_global_batch(prefetch):
    c = synthetic_corpus()
    plain = [loader(c, dp_size=3, dp_rank=d, prefetch=prefetch) for d in range(3)]
    ranks = [loader(c, dp_size=3, dp_rank=d, prefetch=prefetch) for d in range(3)]
    expected = [take(dl, 4) for dl in plain]
    for dl in ranks:
        dl.next()
        dl.swap_at(2, 7)  # replaced by the next call
        dl.swap_at(2, 1)
    got = [[dl.next() for _ in range(3)] for dl in ranks]  # steps 1, 2, 3
    for d in range(3):
        normal, swapped, after = got[d]
        source = expected[(d + 1) % 3][2]
        assert ids_of(swapped) == ids_of(source) and swapped.meta["replica_window"] == source.meta["replica_window"]
        assert swapped.meta["swap_shift"] == 1 and normal.meta["swap_shift"] == after.meta["swap_shift"] == 0
        assert swapped.meta["window"] == expected[d][2].meta["window"]
        assert swapped.global_num_tokens == expected[d][2].global_num_tokens
        assert swapped.next_position == expected[d][2].next_position
        assert ids_of(normal) == ids_of(expected[d][1]) and ids_of(after) == ids_of(expected[d][3])
    assert sorted(i for d in range(3) for i in ids_of(got[d][1])) == sorted(
        i for d in range(3) for i in ids_of(expected[d][2]))
    # the swap was used up: a replay of step 2 (a later rollback) serves the usual share
    ranks[0].seek(expected[0][2].position, 2)
    replay = ranks[0].next()
    assert ids_of(replay) == ids_of(expected[0][2]) and replay.meta["swap_shift"] == 0
    for dl in plain + ranks:
        dl.close()


def test_swap_after_a_seek_back_applies_to_the_replay():
    c = synthetic_corpus()
    with loader(c, dp_size=2, dp_rank=1) as other:
        theirs = take(other, 3)
    with loader(c, dp_size=2, dp_rank=0) as dl:
        mine = take(dl, 3)
        dl.seek(mine[0].position, 0)  # a rollback, then the rerun swaps step 2
        dl.swap_at(2, 1)
        replay = take(dl, 3)
    assert [ids_of(b) for b in replay] == [ids_of(mine[0]), ids_of(mine[1]), ids_of(theirs[2])]
    assert replay[2].meta["replica_window"] == theirs[2].meta["replica_window"] == (0, 40, 48)


# -- shares (a rebalance) ---------------------------------------------------------------


def test_balanced_shares_give_the_slow_replica_fewer_and_each_at_least_one():
    assert balanced_shares(4, [1.0, 1.0]) == (2, 2) and balanced_shares(5, [1.0, 1.0]) == (3, 2)
    assert balanced_shares(4, [3.0, 1.0]) == (1, 3)  # 3 x 1 = 3 healthy micro-batches' time, the others 3
    assert balanced_shares(8, [1.0, 1.5, 1.0]) == (3, 2, 3)
    assert balanced_shares(2, [100.0, 1.0]) == (1, 1)  # nothing left to move
    with pytest.raises(ValueError, match="cannot give each"):
        balanced_shares(1, [1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        balanced_shares(4, [0.0, 1.0])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_rebalance_moves_micro_batches_between_replicas_and_keeps_the_global_batch(prefetch):
    """From the step after `rebalance((1, 3))`, replica 0 takes 1 micro-batch of the global batch's 4
    and replica 1 the other 3, in order: the same samples, the same window and token count as the even
    split; `rebalance(None)` goes back to it."""
    c = synthetic_corpus()
    even = [loader(c, dp_size=2, dp_rank=d, prefetch=0) for d in range(2)]
    expected = [take(dl, 4) for dl in even]
    ranks = [loader(c, dp_size=2, dp_rank=d, prefetch=prefetch) for d in range(2)]
    for dl in ranks:
        dl.next()  # step 1, even
        assert dl.rebalance((1, 3)) == (1, 3) == dl.shares
    got = [take(dl, 2) for dl in ranks]  # steps 2 and 3
    for i in range(2):
        a, b = got[0][i], got[1][i]
        assert (len(a.micro_batches), len(b.micro_batches)) == (1, 3) and a.meta["shares"] == (1, 3)
        together = ids_of(expected[0][i + 1]) + ids_of(expected[1][i + 1])
        assert ids_of(a) + ids_of(b) == together  # the global batch, in its order
        assert a.global_num_tokens == b.global_num_tokens == expected[0][i + 1].global_num_tokens
        lo, hi = a.meta["window"][1:]
        assert a.meta["replica_window"] == (0, lo, lo + 4) and b.meta["replica_window"] == (0, lo + 4, hi)
        assert a.next_position == expected[0][i + 1].next_position
    for dl in ranks:
        dl.rebalance(None)
    assert [ids_of(dl.next()) for dl in ranks] == [ids_of(e[3]) for e in expected]
    for dl in even + ranks:
        dl.close()


def test_a_swap_under_a_rebalance_serves_the_other_replicas_share():
    c = synthetic_corpus()
    ranks = [loader(c, dp_size=2, dp_rank=d, prefetch=0, shares=(3, 1)) for d in range(2)]
    plain = [take(dl, 1)[0] for dl in ranks]
    for dl in ranks:
        dl.seek(DataPosition(), 1)
        dl.swap_at(1, 1)
    swapped = [dl.next() for dl in ranks]
    assert ids_of(swapped[0]) == ids_of(plain[1]) and ids_of(swapped[1]) == ids_of(plain[0])


@pytest.mark.parametrize("shares", [(2, 1), (0, 4), (1, 1, 2), (1, 2)])
def test_shares_that_do_not_split_the_global_batch_are_refused(shares):
    c = synthetic_corpus()
    with pytest.raises(ValueError, match="one per replica"):
        loader(c, dp_size=2, prefetch=0, shares=shares)


def test_micro_batch_widths_are_rounded_up_to_8_where_seq_len_allows_and_to_the_sp_split_always():
    # odd, ever-new widths cost oneDNN and SDPA 38% of a CPU step (trainer/data.py)
    assert pad_multiple_for(128) == 8 and pad_multiple_for(128, 2) == 8 and pad_multiple_for(96, 3) == 24
    assert pad_multiple_for(20) == 1 and pad_multiple_for(20, 2) == 2  # 20 is no multiple of 8: exact widths
    c = synthetic_corpus(seq_len=32)
    with loader(c, pad_multiple=pad_multiple_for(32), micro_batches=3) as dl:
        widths = [mb.inputs.shape[1] for _ in range(4) for mb in dl.next().micro_batches]
    assert all(w % 8 == 0 and w <= 32 for w in widths), widths
