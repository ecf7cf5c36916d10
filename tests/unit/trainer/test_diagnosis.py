"""The rerun's verdict: the anomaly followed the samples (data), stayed on its rank
(device) or did not come back (transient), from every rank's probe row."""

from __future__ import annotations

import math

import pytest

from trainer.diagnosis import ROW_FIELDS, ProbePlan, ProbeRow, judge

NAN = float("nan")


def layout_rows(*, dp: int, tp: int = 1, pp: int = 1, bad: set[int] = frozenset(), loss: float = 2.0,
                losses: dict[int, float] | None = None) -> list[ProbeRow]:
    """Every rank's row, in rank order (rank = pp*(dp*tp) + dp_rank*tp + tp_rank, as
    ParallelDims numbers them); `bad` ranks saw non-finite values."""
    rows = []
    for rank in range(dp * tp * pp):
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        finite = rank not in bad
        rows.append(ProbeRow(rank=rank, finite_fwd=finite, finite_bwd=finite,
                             local_loss=(losses or {}).get(rank, loss if finite else NAN), dp_rank=dp_rank,
                             stage=pp_rank * tp + tp_rank))
    return rows


def nan_plan(rank: int | None, *, shift: int = 1, step: int = 40) -> ProbePlan:
    return ProbePlan(incident_id=7, kind="nan", step=step, rank=rank, shift=shift)


def judge_nan(rank, bad, *, dp, tp=1, pp=1, shift=1):
    return judge(nan_plan(rank, shift=shift), layout_rows(dp=dp, tp=tp, pp=pp, bad=set(bad)), loss=NAN,
                 grad_norm=NAN, dp=dp)


# -- nan: the swap tells data from device ----------------------------------------

@pytest.mark.parametrize("dp, culprit, holder", [
    (2, 0, 1),  # replica 1 now trains replica 0's samples
    (2, 1, 0),
    (4, 2, 1),  # d trains (d + 1)'s samples: replica 2's went to replica 1
    (4, 0, 3),  # wraps around
])
def test_a_nan_that_moved_to_the_holder_of_the_samples_is_data(dp, culprit, holder):
    v = judge_nan(culprit, {holder}, dp=dp)
    assert (v.verdict, v.reproduced, v.rank, v.anomalous) == ("data", True, holder, (holder,))
    assert v.detail["holder_rank"] == holder and v.detail["incident_rank"] == culprit
    assert not v.apply_step
    assert "followed the samples" in v.evidence


@pytest.mark.parametrize("dp, culprit", [(2, 0), (2, 1), (4, 2), (4, 3)])
def test_a_nan_that_stayed_on_its_rank_is_the_device(dp, culprit):
    v = judge_nan(culprit, {culprit}, dp=dp)
    assert (v.verdict, v.reproduced, v.rank) == ("device", True, culprit)
    assert v.apply_step
    assert "the device" in v.evidence


def test_a_nan_that_moved_and_stayed_is_the_device():
    v = judge_nan(2, {2, 1}, dp=4)  # the culprit and replica 1, which holds its samples
    assert (v.verdict, v.reproduced, v.rank) == ("device", True, 2)
    assert v.anomalous == (1, 2) and v.detail["holder_rank"] == 1
    assert "whatever its data" in v.evidence


def test_a_nan_that_did_not_come_back_is_transient():
    v = judge_nan(1, set(), dp=2)
    assert (v.verdict, v.reproduced, v.anomalous, v.rank) == ("transient", False, (), 1)
    assert v.apply_step
    assert "did not come back" in v.evidence


def test_a_nan_on_neither_the_culprit_nor_the_holder_is_not_a_reproduction():
    v = judge_nan(2, {3}, dp=4)  # holder is replica 1; replica 3 is unrelated
    assert (v.verdict, v.reproduced, v.anomalous) == ("transient", False, (3,))
    assert v.detail["holder_rank"] == 1
    assert v.apply_step


def test_a_tp_group_moves_as_a_whole_to_the_same_stage_coordinate():
    # dp=2, tp=2: ranks 0,1 are replica 0 (tp 0,1), ranks 2,3 replica 1
    rows = layout_rows(dp=2, tp=2, bad={0, 1})
    assert [(r.dp_rank, r.stage) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    v = judge(nan_plan(3), rows, loss=NAN, grad_norm=NAN, dp=2)  # rank 3: dp 1, stage 1 -> holder rank 1
    assert (v.verdict, v.rank, v.detail["holder_rank"]) == ("data", 1, 1)
    v = judge(nan_plan(3), layout_rows(dp=2, tp=2, bad={2, 3}), loss=NAN, grad_norm=NAN, dp=2)
    assert (v.verdict, v.rank, v.detail["holder_rank"]) == ("device", 3, 1)


def test_the_holder_is_found_by_stage_with_pipeline_and_tensor_parallelism():
    # dp=2, tp=2, pp=2: rank 6 is pp 1, dp 1, tp 0 (stage 2); its samples went to rank 4 (pp 1, dp 0, tp 0)
    rows = layout_rows(dp=2, tp=2, pp=2, bad={4})
    assert (rows[6].dp_rank, rows[6].stage) == (1, 2) and (rows[4].dp_rank, rows[4].stage) == (0, 2)
    v = judge(nan_plan(6), rows, loss=NAN, grad_norm=NAN, dp=2)
    assert (v.verdict, v.rank, v.detail["holder_rank"]) == ("data", 4, 4)
    v = judge(nan_plan(6), layout_rows(dp=2, tp=2, pp=2, bad={6}), loss=NAN, grad_norm=NAN, dp=2)
    assert (v.verdict, v.rank) == ("device", 6)
    # a fault on rank 5 (same replica as the holder, other tp coordinate) is neither
    v = judge(nan_plan(6), layout_rows(dp=2, tp=2, pp=2, bad={5}), loss=NAN, grad_norm=NAN, dp=2)
    assert v.verdict == "transient"


def test_a_non_finite_loss_alone_is_anomalous_for_a_nan():
    rows = layout_rows(dp=2, losses={1: math.inf})
    v = judge(nan_plan(0), rows, loss=math.inf, grad_norm=1.0, dp=2)
    assert (v.verdict, v.anomalous) == ("data", (1,))
    rows[0] = ProbeRow(rank=0, finite_fwd=True, finite_bwd=False, local_loss=2.0, dp_rank=0, stage=0)
    assert judge(nan_plan(0), rows[:1] + layout_rows(dp=2)[1:], loss=2.0, grad_norm=1.0, dp=2).verdict == "device"


def test_one_replica_cannot_move_samples_so_a_reproduction_is_data():
    v = judge_nan(0, {0}, dp=1, shift=0)
    assert (v.verdict, v.reproduced, v.rank) == ("data", True, 0)
    assert "single replica" in v.evidence
    assert not v.apply_step
    assert judge_nan(0, set(), dp=1, shift=0).verdict == "transient"
    # a shift that lands every replica on its own samples moves nothing either
    assert judge_nan(0, {0}, dp=2, shift=2).verdict == "data"


def test_an_incident_without_a_rank_is_data_blamed_on_the_first_anomalous_rank():
    v = judge_nan(None, {3, 1}, dp=4)
    assert (v.verdict, v.reproduced, v.rank, v.anomalous) == ("data", True, 1, (1, 3))
    assert "named no rank" in v.evidence
    # a rank that is not among the rows cannot be compared either
    assert judge_nan(9, {1}, dp=2).verdict == "data"


# -- spikes: judged on the loss every replica sees --------------------------------

def spike_plan(kind: str, **kw) -> ProbePlan:
    return ProbePlan(incident_id=3, kind=kind, step=12, rank=0, shift=1, **kw)


def test_a_loss_spike_above_loss_above_reproduces_as_data():
    rows = layout_rows(dp=2, losses={0: 9.0, 1: 8.5})
    v = judge(spike_plan("loss_spike", loss_above=5.0), rows, loss=8.75, grad_norm=1.0, dp=2)
    assert (v.verdict, v.reproduced, v.anomalous) == ("data", True, (0, 1))
    assert "loss_spike" in v.evidence and not v.apply_step


def test_a_loss_spike_below_loss_above_is_transient():
    rows = layout_rows(dp=2, losses={0: 5.0, 1: 2.0})  # at the bar is not above it
    v = judge(spike_plan("loss_spike", loss_above=5.0), rows, loss=3.5, grad_norm=1.0, dp=2)
    assert (v.verdict, v.reproduced) == ("transient", False)


def test_a_nan_loss_counts_as_above_the_bar():
    rows = layout_rows(dp=2, losses={0: 2.0, 1: NAN})
    v = judge(spike_plan("loss_spike", loss_above=5.0), rows, loss=NAN, grad_norm=1.0, dp=2)
    assert (v.verdict, v.anomalous) == ("data", (1,))


def test_a_loss_spike_without_a_bar_never_reproduces():
    rows = layout_rows(dp=2, losses={0: 1e9, 1: 1e9})
    assert judge(spike_plan("loss_spike"), rows, loss=1e9, grad_norm=1.0, dp=2).verdict == "transient"


def test_a_grad_spike_is_judged_on_the_global_grad_norm():
    rows = layout_rows(dp=2)
    v = judge(spike_plan("grad_spike", grad_norm_above=10.0), rows, loss=2.0, grad_norm=50.0, dp=2)
    assert (v.verdict, v.anomalous) == ("data", (0, 1))
    assert judge(spike_plan("grad_spike", grad_norm_above=10.0), rows, loss=2.0, grad_norm=10.0,
                 dp=2).verdict == "transient"
    assert judge(spike_plan("grad_spike", grad_norm_above=10.0), rows, loss=2.0, grad_norm=NAN,
                 dp=2).verdict == "data"
    assert judge(spike_plan("grad_spike"), rows, loss=2.0, grad_norm=50.0, dp=2).verdict == "transient"


def test_an_unknown_kind_reproduces_on_a_non_finite_loss():
    rows = layout_rows(dp=2)
    assert judge(spike_plan("other"), rows, loss=NAN, grad_norm=1.0, dp=2).verdict == "data"
    assert judge(spike_plan("other"), rows, loss=2.0, grad_norm=1.0, dp=2).verdict == "transient"


def test_the_detail_names_what_was_judged():
    v = judge(nan_plan(0), layout_rows(dp=2, bad={1}), loss=3.0, grad_norm=1.5, dp=2)
    assert v.detail == {"kind": "nan", "step": 40, "dp": 2, "shift": 1, "incident_rank": 0, "anomalous_ranks": [1],
                        "loss": 3.0, "grad_norm": 1.5, "holder_rank": 1}


# -- rows ------------------------------------------------------------------------

def test_a_row_from_the_gathered_values():
    assert ROW_FIELDS == ("finite_fwd", "finite_bwd", "local_loss", "dp_rank", "stage")
    row = ProbeRow.from_values(5, [1.0, 0.0, 2.5, 1.0, 3.0])
    assert row == ProbeRow(rank=5, finite_fwd=True, finite_bwd=False, local_loss=2.5, dp_rank=1, stage=3)
    assert isinstance(row.dp_rank, int) and isinstance(row.stage, int)
    assert ProbeRow.from_values(0, [0.0, 1.0, NAN, 0.0, 0.0]).finite_fwd is False
    with pytest.raises(ValueError):
        ProbeRow.from_values(0, [1.0, 1.0, 2.0])
