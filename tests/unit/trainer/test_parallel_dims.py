import itertools

from trainer.parallel_dims import Axis, ParallelDims


def dims(rank, dp=2, tp=2, pp=2, nodes=2):
    return ParallelDims(dp=dp, tp=tp, pp=pp, sp=False, nodes=nodes, rank=rank, world_size=dp * tp * pp)


def test_coordinates_cover_the_mesh_once():
    seen = {tuple(dims(r).coords.values()) for r in range(8)}
    assert seen == set(itertools.product(range(2), range(2), range(2)))


def test_tp_innermost_and_never_spans_nodes():
    for r in range(8):
        d = dims(r)
        tp_ranks = d.ranks_in(Axis.TP)
        assert tp_ranks == list(range(tp_ranks[0], tp_ranks[0] + 2))
        assert len({d.node_of(x) for x in tp_ranks}) == 1


def test_groups_are_consistent_across_members():
    for axis in (Axis.DP, Axis.TP, Axis.PP, Axis.EMBED):
        for r in range(8):
            members = dims(r).ranks_in(axis)
            assert r in members
            for m in members:
                assert dims(m).ranks_in(axis) == members


def test_stage_flags_and_embed_group():
    first, last = dims(0), dims(7)
    assert first.is_first_stage and not first.is_last_stage
    assert last.is_last_stage and last.pp_rank == 1
    assert first.ranks_in(Axis.EMBED) == [0, 4]
