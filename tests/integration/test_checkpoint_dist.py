"""Checkpointer across real processes (torch.multiprocessing, tests/ranks.py, gloo on 127.0.0.1):
sharded saves, dp resharding on load, and agreement on a fallback when one rank's shard is bad."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import ranks
from trainer.checkpoint import MANIFEST, Checkpointer, model_filename, rank_filename, step_dirname
from trainer.comm import Comm
from trainer.config import CheckpointConfig
from trainer.parallel_dims import Axis, ParallelDims

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_state(tp_rank: int, step: int) -> dict:
    """What the (pp 0, tp `tp_rank`) shard holds at `step`: distinct per shard and per step."""
    return {"w": torch.arange(12.0).reshape(3, 4) * (tp_rank + 1) + step, "b": torch.full((5,), 100.0 * tp_rank + step)}


def optim_state(tp_rank: int, step: int) -> dict:
    return {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(3, 4) * tp_rank}},
            "param_groups": [{"lr": 0.1, "params": [0]}]}


def _run(rank: int, world: int, port: int, dp: int, tp: int, root: str, scenario: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dims = ParallelDims(dp=dp, tp=tp, pp=1, sp=False, nodes=1, rank=rank, world_size=world)
        comm = Comm(dims, device=torch.device("cpu"))
        logs: list[str] = []
        ck = Checkpointer(CheckpointConfig(dir=root, keep=3), dims=dims, comm=comm, log=logs.append)
        result = SCENARIOS[scenario](ck, dims, comm, root)
        assert ck.close(timeout=60)
        result["logs"] = logs
        Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _save(ck: Checkpointer, dims: ParallelDims, comm: Comm, root: str) -> dict:
    for step in (1, 2):
        # every rank passes its (replicated) model state; only dp rank 0 writes it
        ck.save(step, model_state=model_state(dims.tp_rank, step), optim_state=optim_state(dims.tp_rank, step),
                rank_state={"rank": dims.rank, "coords": dims.coords},
                meta={"step": step, "mesh": {"dp": dims.dp, "tp": dims.tp}})
    assert ck.wait(60)
    return {"records": [[r.step, r.num_shards, r.finalized] for r in ck.poll()]}


def _summary(loaded, dims: ParallelDims) -> dict:
    assert loaded is not None
    ok = all(torch.equal(loaded.model_state[k], v) for k, v in model_state(dims.tp_rank, loaded.step).items())
    expected_optim = optim_state(dims.tp_rank, loaded.step)["state"][0]
    ok = ok and all(torch.equal(loaded.optim_state["state"][0][k], v) for k, v in expected_optim.items())
    return {"step": loaded.step, "tensors_equal": ok, "rank_state": loaded.rank_state, "meta": loaded.meta}


def _load(ck: Checkpointer, dims: ParallelDims, comm: Comm, root: str) -> dict:
    return {"first": _summary(ck.load_latest(), dims)}


def _load_corrupt_load(ck: Checkpointer, dims: ParallelDims, comm: Comm, root: str) -> dict:
    first = _summary(ck.load_latest(), dims)
    comm.barrier(Axis.WORLD)
    if dims.rank == 0:  # damage the shard that only tp rank 1 reads
        path = Path(root, step_dirname(2), model_filename(0, 1))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    comm.barrier(Axis.WORLD)
    return {"first": first, "second": _summary(ck.load_latest(), dims)}


SCENARIOS = {"save": _save, "load": _load, "load_corrupt_load": _load_corrupt_load}


def spawn(tmp_path: Path, *, dp: int, tp: int, scenario: str, root: Path) -> list[dict]:
    out = tmp_path / f"out-{scenario}-dp{dp}-tp{tp}"
    out.mkdir()
    world = dp * tp
    mp.start_processes(_run, args=(world, free_port(), dp, tp, str(root), scenario, str(out)), nprocs=world, join=True,
                       start_method=ranks.start_method())
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def test_dp2_tp2_save_reloads_at_dp1_and_a_bad_shard_moves_every_rank_back(tmp_path):
    root = tmp_path / "ckpt"
    saved = spawn(tmp_path, dp=2, tp=2, scenario="save", root=root)
    assert saved[0]["records"] == [[1, 2, True], [2, 2, True]]  # rank 0: model + rank file, finalized
    assert saved[2]["records"] == [[1, 1, None], [2, 1, None]]  # dp rank 1: its rank file only
    for step in (1, 2):
        d = root / step_dirname(step)
        expected = {MANIFEST, model_filename(0, 0), model_filename(0, 1), *(rank_filename(r) for r in range(4))}
        assert {p.name for p in d.iterdir()} == expected
        manifest = json.loads((d / MANIFEST).read_text())
        assert manifest["mesh"] == {"dp": 2, "tp": 2, "pp": 1, "sp": False} and manifest["world_size"] == 4
        writers = {s["file"]: s["writer_rank"] for s in manifest["shards"]}
        assert writers[model_filename(0, 0)] == 0 and writers[model_filename(0, 1)] == 1  # dp rank 0 of each tp

    loaded = spawn(tmp_path, dp=1, tp=2, scenario="load_corrupt_load", root=root)
    for rank, res in enumerate(loaded):
        assert res["first"]["step"] == 2 and res["first"]["tensors_equal"]
        assert res["first"]["rank_state"] == {"rank": rank, "coords": {"dp": 0, "tp": rank, "pp": 0}}
        assert res["second"]["step"] == 1 and res["second"]["tensors_equal"]  # all ranks fell back together
    [bad_line] = [m for m in loaded[1]["logs"] if "bad shard" in m]
    assert model_filename(0, 1) in bad_line and "checksum mismatch" in bad_line
    assert any("failed verification on another rank" in m for m in loaded[0]["logs"])
    assert not any("bad shard" in m for m in loaded[0]["logs"])


def test_dp2_save_reloads_at_dp4(tmp_path):
    root = tmp_path / "ckpt"
    spawn(tmp_path, dp=2, tp=1, scenario="save", root=root)
    loaded = spawn(tmp_path, dp=4, tp=1, scenario="load", root=root)
    for rank, res in enumerate(loaded):
        assert res["first"]["step"] == 2 and res["first"]["tensors_equal"]
        assert res["first"]["meta"] == {"step": 2, "mesh": {"dp": 2, "tp": 1}}
    # dp ranks 0 and 1 existed before and get their rank state back; the new replicas reseed
    assert [res["first"]["rank_state"] for res in loaded] == [
        {"rank": 0, "coords": {"dp": 0, "tp": 0, "pp": 0}},
        {"rank": 1, "coords": {"dp": 1, "tp": 0, "pp": 0}},
        None,
        None,
    ]
