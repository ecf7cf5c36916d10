import json

import pytest

from trainer.config import ConfigError
from trainer.faults import FaultInjector, parse_injection


def test_parse_all_kinds():
    assert parse_injection("nan@step=40,rank=2,mode=transient").mode == "transient"
    assert parse_injection("spike@step=60").rank == -1
    s = parse_injection("straggler@rank=3,from=30,factor=1.5")
    assert (s.rank, s.step, s.factor) == (3, 30, 1.5)
    assert parse_injection("hang@rank=1,step=80").kind == "hang"
    assert parse_injection("crash@rank=1,step=80").step == 80


@pytest.mark.parametrize("spec", ["nan@step=x,rank=1", "straggler@rank=1,from=3,factor=0.5", "nan@step=1,rank=1,mode=odd",
                                  "spike@when=3", "hang@rank=1"])
def test_parse_errors(spec):
    with pytest.raises(ConfigError):
        parse_injection(spec)


def test_data_tied_nan_follows_the_samples(tmp_path):
    inj = FaultInjector([parse_injection("nan@step=5,rank=1")], rank=1, node=0, run_dir=tmp_path)
    assert not inj.step_faults(4, 0, (0, 0, 8)).nan
    assert inj.step_faults(5, 0, (0, 8, 16)).nan
    # a rollback replays the same samples at another step number: the fault comes back
    assert inj.step_faults(3, 1, (0, 8, 16)).nan
    # skipping the window makes it go away, also at the original step number
    assert not inj.step_faults(5, 1, (0, 16, 24)).nan
    rows = [json.loads(x) for x in (tmp_path / "injections.jsonl").read_text().splitlines()]
    assert [(r["step"], r["replay"]) for r in rows] == [(5, False), (3, True)]


def test_transient_nan_fires_once_and_survives_restart(tmp_path):
    spec = [parse_injection("nan@step=5,rank=0,mode=transient")]
    inj = FaultInjector(spec, rank=0, node=0, run_dir=tmp_path)
    assert inj.step_faults(5, 0, (0, 8, 16)).nan
    again = FaultInjector(spec, rank=0, node=0, run_dir=tmp_path)  # a restarted process
    assert not again.step_faults(5, 1, (0, 8, 16)).nan


def test_other_ranks_unaffected(tmp_path):
    inj = FaultInjector([parse_injection("nan@step=5,rank=1"), parse_injection("straggler@rank=1,from=2,factor=3")],
                        rank=0, node=0, run_dir=tmp_path)
    f = inj.step_faults(5, 0, (0, 8, 16))
    assert not f.nan and f.slowdown == 1.0


def test_straggler_window(tmp_path):
    inj = FaultInjector([parse_injection("straggler@rank=0,from=2,factor=3,to=4")], rank=0, node=0, run_dir=tmp_path)
    assert [inj.step_faults(s, 0, (0, s, s + 1)).slowdown for s in range(1, 6)] == [1.0, 3.0, 3.0, 3.0, 1.0]
