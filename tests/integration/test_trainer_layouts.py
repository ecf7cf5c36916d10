"""The correctness anchor: every hybrid layout trains exactly like one process.

Batch semantics are a contract: --micro-batch-size and --micro-batches are per
data-parallel replica, so a dp=N run with M micro-batches sees the same global
batch as a single process with N*M micro-batches, and reports the same loss;
so does one whose replicas split those N*M unevenly (--dp-shares, a rebalance):
each micro-batch's loss is divided by the global token count and the DP
all-reduce is a sum, so the gradients are weighted by samples.
"""

import pytest

from tests.integration.trainer_run import assert_close, run_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = ["--steps", "5"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Single-process references with 2 and 4 micro-batches per step."""
    out = {}
    for m in (2, 4):
        r = run_trainer(tmp_path_factory.mktemp(f"single-m{m}"), *STEPS, "--micro-batches", str(m))
        assert r.returncode == 0, r.stderr[-3000:]
        out[m] = r.losses()
    return out


@pytest.mark.parametrize("layout, ref_m", [
    (["--dp", "2", "--pp", "2", "--tp", "2", "--micro-batches", "2"], 4),
    (["--pp", "2", "--tp", "2", "--micro-batches", "2"], 2),
    (["--dp", "2", "--micro-batches", "2"], 4),
    (["--tp", "2", "--sp", "--micro-batches", "2"], 2),
    # a rebalance's split (trainer/control.py): the global batch's 4 micro-batches 1/3 and 3/1 over the replicas
    (["--dp", "2", "--micro-batches", "2", "--dp-shares", "1,3"], 4),
    (["--dp", "2", "--pp", "2", "--micro-batches", "2", "--dp-shares", "3,1"], 4),
], ids=["dp2xpp2xtp2", "pp2xtp2", "dp2", "tp2-sp", "dp2-shares-1-3", "dp2xpp2-shares-3-1"])
def test_layout_matches_single_process(tmp_path, single, layout, ref_m):
    r = run_trainer(tmp_path / "run", *STEPS, *layout)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(r.losses(), single[ref_m], range(1, 6))
    # the run really trained: the loss went down from the first step
    assert r.losses()[5] < r.losses()[1]
