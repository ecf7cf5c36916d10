"""A pass never rereads history: the per-run state stops growing however long the run."""

from analysis import Analyzer
from tests.unit.analysis.sim import Layout, Sim, Straggler


def test_state_stays_bounded_over_a_long_run():
    sim = Sim(layout=Layout(dp=2, tp=2, nodes=2), steps=2400, seed=9, base_s=0.05, flush_s=0.5, tick_s=0.25,
              eval_every=100, ckpt_every=200, faults=(Straggler(rank=1, start=1500, factor=1.5),))
    commits = sim.build()
    analyzer = Analyzer()
    sizes = []
    for i, (now, frames) in enumerate(commits):
        analyzer.feed(frames, now=now)
        if i in (len(commits) // 2, len(commits) - 1):
            sizes.append(analyzer.runs["sim"].footprint())
    middle, end = sizes
    for key, value in end.items():
        assert value <= max(middle[key], 1) * 1.5 + 64, (key, middle[key], value)  # not growing with the run
    assert end["released_memory"] <= 1024 and end["excluded_memory"] <= 1024
    assert end["pending_step_rows"] <= 4 * 64 and end["hang.ops_rows"] <= 4 * 13 * 8
    assert end["open_incidents"] == 1  # the straggler
