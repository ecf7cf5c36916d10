"""Checkpointer in one process: a world of 1 with the real Comm (it needs no process group),
and, for the multi-rank protocol, several Checkpointers sharing a directory through a fake
comm that agrees on one session token."""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import checkpoint
from trainer.checkpoint import (
    KNOWN_GOOD_SPAN,
    KNOWN_GOOD_STALE_S,
    MANIFEST,
    Checkpointer,
    model_filename,
    rank_filename,
    step_dirname,
)
from trainer.comm import Comm
from trainer.config import CheckpointConfig
from trainer.parallel_dims import ParallelDims

torch.set_num_threads(1)


def dims_of(*, dp=1, tp=1, pp=1, rank=0) -> ParallelDims:
    return ParallelDims(dp=dp, tp=tp, pp=pp, sp=False, nodes=1, rank=rank, world_size=dp * tp * pp)


class SharedTokenComm:
    """Stands in for the ranks of one job living in one process: they agree on a session
    token and every collective is a no-op (each rank votes alone)."""

    device = torch.device("cpu")

    def broadcast(self, tensor, axis, **_):
        tensor.fill_(42)

    def all_reduce(self, tensor, axis, **_):
        return None

    def barrier(self, axis=None):
        return None


class Gate:
    """A serializer that blocks until released: makes 'the write has not happened yet' observable."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_started = 0

    def __call__(self, obj, f) -> None:
        self.num_started += 1
        assert self.release.wait(10), "gate never released"
        torch.save(obj, f)


@pytest.fixture
def logs() -> list[str]:
    return []


def make(tmp_path: Path, logs: list[str], *, dims=None, comm=None, **kw) -> Checkpointer:
    ckpt_kw = {k: kw.pop(k) for k in ("keep", "persist_dir") if k in kw}
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), **ckpt_kw)
    dims = dims or dims_of()
    comm = comm or Comm(dims, device=torch.device("cpu"))
    return Checkpointer(cfg, dims=dims, comm=comm, log=logs.append, **kw)


def model_and_optim(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def rank_state() -> dict:
    return {"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "note": "per rank"}


def save(ck: Checkpointer, step: int, model=None, opt=None, **meta) -> None:
    ck.save(step, model_state=model.state_dict() if model else {"w": torch.full((4,), float(step))},
            optim_state=opt.state_dict() if opt else None, rank_state=rank_state(),
            meta={"step": step, "data_position": {"epoch": 0, "index": 8 * step}, **meta})


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def test_round_trip_model_optimizer_and_rank_state(tmp_path, logs):
    model, opt = model_and_optim()
    shared = torch.arange(6.0)
    ck = make(tmp_path, logs)
    model_state = {**model.state_dict(), "tied.a": shared, "tied.b": shared}
    rs = rank_state()
    ck.save(7, model_state=model_state, optim_state=opt.state_dict(), rank_state=rs,
            meta={"step": 7, "scaler": {"scale": 1024.0}})
    assert ck.wait(10)
    loaded = ck.load_latest()
    assert loaded is not None and loaded.step == 7 and loaded.path == tmp_path / "ckpt" / step_dirname(7)
    assert_same(model_state, loaded.model_state)
    assert_same(opt.state_dict(), loaded.optim_state)  # int-keyed state, param_groups lists
    assert_same(rs, loaded.rank_state)
    assert loaded.meta == {"step": 7, "scaler": {"scale": 1024.0}}
    # a tensor shared in the state is stored once, as torch.save would
    assert loaded.model_state["tied.a"].data_ptr() == loaded.model_state["tied.b"].data_ptr()
    # and it restores into fresh objects
    model2, opt2 = model_and_optim(seed=1)
    model2.load_state_dict({k: v for k, v in loaded.model_state.items() if not k.startswith("tied")})
    opt2.load_state_dict(loaded.optim_state)
    assert_same(model.state_dict(), model2.state_dict())
    ck.close()


def test_save_returns_before_the_write_and_snapshots_the_state(tmp_path, logs):
    gate = Gate()
    ck = make(tmp_path, logs, serialize=gate)
    state = {"w": torch.zeros(1000)}
    called = time.time()  # the checkpointer's own clock
    ck.save(1, model_state=state, optim_state=None, rank_state={}, meta={"step": 1})
    took = time.time() - called
    # save() has returned: the writer is (or will be) blocked inside the first serialize
    assert not (tmp_path / "ckpt" / step_dirname(1)).exists()
    assert ck.poll() == []
    deadline = time.monotonic() + 10
    while not gate.num_started and time.monotonic() < deadline:
        time.sleep(0.005)
    assert gate.num_started == 1  # the writer is inside the write now, held there
    assert not ck.wait(0.05)
    state["w"].add_(5.0)  # training goes on and mutates the parameters in place
    gate.release.set()
    assert ck.wait(10)
    [rec] = ck.poll()
    assert rec.step == 1 and rec.finalized is True and rec.persisted is None and rec.error is None
    # the write's time counts the 0.05 s it was held; the stall is within the save() call
    assert rec.num_shards == 2 and rec.bytes > 4000 and rec.write_s >= 0.05 and 0 <= rec.stall_s <= took
    assert torch.equal(ck.load_latest().model_state["w"], torch.zeros(1000))  # the state as of save()
    ck.close()


def test_back_pressure_blocks_the_third_save_until_the_writer_takes_one(tmp_path, logs):
    gate = Gate()
    ck = make(tmp_path, logs, serialize=gate)
    save(ck, 1)  # being written (blocked in the gate)
    save(ck, 2)  # queued
    third = threading.Thread(target=save, args=(ck, 3))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a third save while two are in flight must block"
    assert any("in flight" in m for m in logs)
    gate.release.set()
    third.join(10)
    assert not third.is_alive()
    assert ck.wait(10)
    assert [r.step for r in ck.poll()] == [1, 2, 3]
    ck.close()


def test_saving_the_same_step_twice_is_a_no_op(tmp_path, logs):
    ck = make(tmp_path, logs)
    save(ck, 4)
    save(ck, 4)
    assert ck.wait(10)
    assert len(ck.poll()) == 1
    assert any("already saved" in m for m in logs)
    ck.close()


def test_meta_that_is_not_json_fails_in_the_caller(tmp_path, logs):
    ck = make(tmp_path, logs)
    with pytest.raises(TypeError):
        ck.save(1, model_state={}, optim_state=None, rank_state={}, meta={"t": torch.zeros(1)})
    save(ck, 1)  # the failed call left nothing behind
    assert ck.wait(10) and [r.step for r in ck.poll()] == [1]
    ck.close()


def test_manifest_content(tmp_path, logs):
    ck = make(tmp_path, logs)
    save(ck, 3, run_id="r1", mesh={"dp": 1, "tp": 1, "pp": 1, "sp": False})
    assert ck.wait(10)
    [rec] = ck.poll()
    path = tmp_path / "ckpt" / step_dirname(3)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["format"] == 1
    assert manifest["mesh"] == {"dp": 1, "tp": 1, "pp": 1, "sp": False}
    assert manifest["meta"]["run_id"] == "r1" and manifest["meta"]["data_position"] == {"epoch": 0, "index": 24}
    files = {s["file"]: s for s in manifest["shards"]}
    assert set(files) == {model_filename(0, 0), rank_filename(0)}
    assert sorted(p.name for p in path.iterdir()) == sorted([MANIFEST, *files])  # partial manifests removed
    for name, shard in files.items():
        data = (path / name).read_bytes()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest() == rec.checksums[name]
        assert shard["bytes"] == len(data) and shard["writer_rank"] == 0 and 0 <= shard["write_s"] <= rec.write_s
    assert files[model_filename(0, 0)]["coords"] == {"pp": 0, "tp": 0}
    assert files[rank_filename(0)]["coords"] == {"dp": 0, "tp": 0, "pp": 0}
    assert rec.bytes == sum(s["bytes"] for s in files.values())
    ck.close()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("file,damage,reason", [
    (model_filename(0, 0), _flip_byte, "checksum mismatch"),
    (rank_filename(0), _truncate, "truncated"),
    (model_filename(0, 0), Path.unlink, "missing"),
])
def test_a_bad_shard_falls_back_to_the_previous_checkpoint(tmp_path, logs, file, damage, reason):
    ck = make(tmp_path, logs)
    save(ck, 1)
    save(ck, 2)
    assert ck.wait(10)
    damage(tmp_path / "ckpt" / step_dirname(2) / file)
    loaded = ck.load_latest()
    assert loaded.step == 1 and torch.equal(loaded.model_state["w"], torch.full((4,), 1.0))
    [line] = [m for m in logs if "bad shard" in m]
    assert file in line and reason in line and step_dirname(2) in line
    ck.close()


def test_directories_without_a_manifest_are_never_loaded(tmp_path, logs):
    ck = make(tmp_path, logs)
    save(ck, 5)
    assert ck.wait(10)
    root = tmp_path / "ckpt"
    good = root / step_dirname(5)
    for name in (step_dirname(9), f"{step_dirname(12)}.tmp"):  # a final-looking one and a leftover .tmp
        clone = root / name
        clone.mkdir()
        for f in good.iterdir():
            if f.name != MANIFEST:
                (clone / f.name).write_bytes(f.read_bytes())
    (root / f"{step_dirname(13)}.tmp").mkdir()
    (root / f"{step_dirname(13)}.tmp" / MANIFEST).write_text((good / MANIFEST).read_text())  # never renamed
    assert ck.load_latest().step == 5
    assert ck.load_latest().path == good
    ck.close()


def test_no_checkpoint_loads_none(tmp_path, logs):
    ck = make(tmp_path, logs)
    assert ck.load_latest() is None
    ck.close()


def test_keep_k_and_stale_tmp_cleanup(tmp_path, logs):
    ck = make(tmp_path, logs, keep=2)
    root = tmp_path / "ckpt"
    (root / f"{step_dirname(2)}.tmp").mkdir(parents=True)  # a crashed save before step 3
    (root / f"{step_dirname(9)}.tmp").mkdir()  # newer than anything finalized: may still be in use
    for step in (1, 2, 3, 4):
        save(ck, step)
        assert ck.wait(10)
    names = sorted(p.name for p in root.iterdir())
    assert names == [step_dirname(3), step_dirname(4), f"{step_dirname(9)}.tmp"]
    ck.close()


def test_keep_older_than_holds_the_newest_checkpoint_a_later_checksum_vouches_for(tmp_path, logs):
    """Checkpoints every 5 steps, checksums every 10: a divergence caught at step 60
    rolls back to before step 50 (the last agreeing checksum), so a checkpoint at least
    2 x 10 steps older than the newest survives pruning to keep=3: the last 20 steps'
    checkpoints are held, and the newest before them."""
    ck = make(tmp_path, logs, keep=3, keep_older_than=20)
    for step in range(5, 65, 5):
        save(ck, step)
        assert ck.wait(10)
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(s) for s in (40, 45, 50, 55, 60)]
    assert ck.load_latest(before_step=50).step == 45
    ck.close()


def test_the_newest_known_good_checkpoint_and_all_after_it_survive_pruning(tmp_path, logs, monkeypatch):
    """Seen on a tiny model (40 ms a step, checkpoints every 8, keep 3): a spike at step 29,
    its rollback reaching the ranks at step 61, and checkpoints 8-24 already pruned: "no
    verified checkpoint before step 29". The collector's watermark stays at 28 while the
    spike's incident is unsettled: checkpoint 24 is the newest known-good, and it stays."""
    mark = [None]
    ck = make(tmp_path, logs, keep=3, known_good=lambda: mark[0])
    root = tmp_path / "ckpt"
    mark[0] = -1  # the collector keeps a watermark but has vouched for nothing yet: every one may become it
    for step in (8, 16, 24, 32):
        save(ck, step)
        assert ck.wait(10)
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(s) for s in (8, 16, 24, 32)]
    mark[0] = 28
    for step in (40, 48, 56):
        save(ck, step)
        assert ck.wait(10)
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(s) for s in (24, 32, 40, 48, 56)]
    assert ck.load_latest(before_step=29).step == 24
    mark[0] = 50  # settled: the watermark moves on, and keep 3 applies again past the known-good one
    save(ck, 64)
    assert ck.wait(10)
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(s) for s in (48, 56, 64)]
    mark[0] = 48  # lagging: every checkpoint after it stays...
    for step in range(72, 72 + 8 * 14, 8):
        save(ck, step)
        assert ck.wait(10)
    assert len(list(root.iterdir())) == 3 + 14  # 48 itself, 56, 64 and the 14 new ones
    clock = [time.monotonic() + KNOWN_GOOD_STALE_S]  # ...until it has not moved for KNOWN_GOOD_STALE_S
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: clock[0])
    save(ck, 72 + 8 * 14)
    assert ck.wait(10)
    kept = sorted(int(p.name.split("-")[1]) for p in root.iterdir())
    assert kept[0] == 48 and len(kept) == 1 + KNOWN_GOOD_SPAN * 3
    assert any("known-good watermark (step 48) has not moved" in m for m in logs)
    ck.close()


def test_saving_an_older_step_replaces_it_and_drops_the_abandoned_newer_ones(tmp_path, logs):
    ck = make(tmp_path, logs, keep=5)
    for step in (1, 2, 3):
        save(ck, step)
    assert ck.wait(10)
    ck.load_latest()  # a rollback would load step 1 and train on: step 2 is saved again
    ck.save(2, model_state={"w": torch.full((4,), -2.0)}, optim_state=None, rank_state={}, meta={"step": 2})
    assert ck.wait(10)
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(1), step_dirname(2)]
    assert any(step_dirname(3) in m and "abandoned" in m for m in logs)
    loaded = ck.load_latest()
    assert loaded.step == 2 and torch.equal(loaded.model_state["w"], torch.full((4,), -2.0))
    ck.close()


def test_persist_tier_copies_prunes_and_serves_loads(tmp_path, logs):
    persist = tmp_path / "persist"
    ck = make(tmp_path, logs, keep=2, persist_dir=str(persist))
    for step in (1, 2, 3):
        save(ck, step)
        assert ck.wait(10)
    records = ck.poll()
    assert [(r.step, r.finalized, r.persisted) for r in records] == [(1, True, True), (2, True, True), (3, True, True)]
    assert sorted(p.name for p in persist.iterdir()) == [step_dirname(2), step_dirname(3)]
    local = tmp_path / "ckpt" / step_dirname(3)
    for f in local.iterdir():  # byte-identical copy, manifest included
        assert (persist / step_dirname(3) / f.name).read_bytes() == f.read_bytes()
    # the local copy of the newest step is corrupt: the persisted copy of the same step is next
    _flip_byte(local / model_filename(0, 0))
    loaded = ck.load_latest()
    assert loaded.step == 3 and loaded.path == persist / step_dirname(3)
    ck.close()


def test_persist_skips_a_waiting_checkpoint_superseded_by_a_newer_one(tmp_path, logs):
    gate = threading.Event()
    ck = make(tmp_path, logs, persist_dir=str(tmp_path / "persist"))
    persist = ck._persist

    def slow_persist(step):
        assert gate.wait(10)
        persist(step)

    ck._persist = slow_persist
    for step in (1, 2, 3):  # 1 is being copied; 2 waits and is superseded by 3
        save(ck, step)
    deadline = time.time() + 10
    while not any("superseded" in m for m in logs) and time.time() < deadline:
        time.sleep(0.01)
    gate.set()
    assert ck.wait(10)
    assert sorted((r.step, r.persisted) for r in ck.poll()) == [(1, True), (2, False), (3, True)]
    assert sorted(p.name for p in (tmp_path / "persist").iterdir()) == [step_dirname(1), step_dirname(3)]
    ck.close()


def test_rank0_finalizes_only_when_every_rank_has_written(tmp_path, logs):
    comm = SharedTokenComm()
    r0 = make(tmp_path, logs, dims=dims_of(dp=2, rank=0), comm=comm)
    r1 = make(tmp_path, logs, dims=dims_of(dp=2, rank=1), comm=comm)
    save(r0, 10)
    assert not r0.wait(0.3)  # rank 1 has not written its shards yet
    assert not (tmp_path / "ckpt" / step_dirname(10)).exists()
    save(r1, 10)  # passes its (identical) model state too: dp rank 1 must not write it
    assert r1.wait(10) and r0.wait(10)
    [rec1], [rec0] = r1.poll(), r0.poll()
    assert rec1.finalized is None and set(rec1.checksums) == {rank_filename(1)}
    assert rec0.finalized is True and set(rec0.checksums) == {model_filename(0, 0), rank_filename(0)}
    manifest = json.loads((tmp_path / "ckpt" / step_dirname(10) / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["mesh"]["dp"] == 2
    assert {(s["file"], s["writer_rank"]) for s in manifest["shards"]} == {
        (model_filename(0, 0), 0), (rank_filename(0), 0), (rank_filename(1), 1)}
    # dp resharding: a dp=1 run maps onto the same model file and rank 0's rank file
    solo = make(tmp_path, logs)
    loaded = solo.load_latest()
    assert loaded.step == 10 and loaded.rank_state["note"] == "per rank"
    for ck in (r0, r1, solo):
        ck.close()


def test_partials_of_another_session_are_ignored_and_finalize_times_out(tmp_path, logs):
    tmp = tmp_path / "ckpt" / f"{step_dirname(10)}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "rank-00001.json").write_text(json.dumps({"session": 7, "step": 10, "rank": 1, "write_s": 0, "shards": []}))
    r0 = make(tmp_path, logs, dims=dims_of(dp=2, rank=0), comm=SharedTokenComm(), finalize_timeout_s=0.3)
    save(r0, 10)
    assert r0.wait(10)
    [rec] = r0.poll()
    assert rec.finalized is False and "ranks [1]" in rec.error
    assert not (tmp_path / "ckpt" / step_dirname(10)).exists()
    r0.close()


def test_a_different_tp_is_a_clear_error(tmp_path, logs):
    ck = make(tmp_path, logs)
    save(ck, 1)
    assert ck.wait(10)
    ck.close()
    other = make(tmp_path, logs, dims=dims_of(tp=2, rank=0), comm=SharedTokenComm())
    with pytest.raises(ValueError, match="cannot reshard tp/pp"):
        other.load_latest()
    other.close()


def test_load_latest_before_a_step_picks_the_newest_earlier_checkpoint(tmp_path, logs):
    ck = make(tmp_path, logs, keep=0)
    for step in (2, 4, 6):
        save(ck, step)
    assert ck.wait(10)
    assert ck.load_latest(before_step=6).step == 4  # the bad step's own checkpoint is not a candidate
    assert ck.load_latest(before_step=5).step == 4
    assert ck.load_latest(before_step=100).step == 6
    assert ck.load_latest(before_step=2) is None
    _flip_byte(tmp_path / "ckpt" / step_dirname(4) / model_filename(0, 0))
    assert ck.load_latest(before_step=6).step == 2  # a bad one falls back, still before the step
    # the rollback trains on from step 2: the next save drops the abandoned lineage
    ck.load_latest(before_step=3)
    save(ck, 3)
    assert ck.wait(10)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [step_dirname(2), step_dirname(3)]
    assert ck.load_latest().step == 3
    ck.close()
