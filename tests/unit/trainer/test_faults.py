import json

import pytest

from trainer.config import ConfigError
from trainer.faults import NO_FAULTS, FaultInjector, parse_injection


def test_parse_all_kinds():
    assert parse_injection("nan@step=40,rank=2,mode=transient").mode == "transient"
    assert parse_injection("spike@step=60").rank == -1
    s = parse_injection("straggler@rank=3,from=30,factor=1.5")
    assert (s.rank, s.step, s.factor) == (3, 30, 1.5)
    assert parse_injection("hang@rank=1,step=80").kind == "hang"
    assert parse_injection("crash@rank=1,step=80").step == 80
    assert parse_injection("crash@rank=1,step=80").mode == "once"
    assert parse_injection("crash@rank=1,step=80,mode=every").mode == "every"


@pytest.mark.parametrize("spec", ["nan@step=x,rank=1", "straggler@rank=1,from=3,factor=0.5", "nan@step=1,rank=1,mode=odd",
                                  "spike@when=3", "hang@rank=1", "crash@rank=1,step=3,mode=data"])
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


def rows_of(run_dir):
    return [json.loads(x) for x in (run_dir / "injections.jsonl").read_text().splitlines()]


def test_parse_device_mode():
    assert parse_injection("nan@step=40,rank=2,mode=device").mode == "device"


def test_device_nan_fires_every_step_and_attempt_on_its_rank_only(tmp_path):
    spec = [parse_injection("nan@step=5,rank=1,mode=device")]
    inj = FaultInjector(spec, rank=1, node=0, run_dir=tmp_path)
    other = FaultInjector(spec, rank=0, node=0, run_dir=tmp_path)
    assert [inj.step_faults(s, 0, (0, 8 * s, 8 * s + 8)).nan for s in range(3, 9)] == [False] * 2 + [True] * 4
    assert not any(other.step_faults(s, 0, (0, 8 * s, 8 * s + 8)).nan for s in range(3, 9))
    # a rollback to before step 5, on other samples: it is the device, so it fires again from step 5
    assert [inj.step_faults(s, 1, (1, 8 * s, 8 * s + 8)).nan for s in range(4, 7)] == [False, True, True]
    again = FaultInjector(spec, rank=1, node=0, run_dir=tmp_path)  # a restarted process, same attempt
    assert again.step_faults(7, 1, (1, 0, 8)).nan
    assert [(r["step"], r["attempt"], r["rank"], r["mode"]) for r in rows_of(tmp_path)] == [
        (5, 0, 1, "device"), (5, 1, 1, "device")]


def test_faults_stay_with_the_hardware_after_ranks_are_renumbered(tmp_path):
    spec = [parse_injection("straggler@rank=2,from=1,factor=3"), parse_injection("overflow@rank=2,from=1,to=9"),
            parse_injection("nan@step=5,rank=2,mode=transient"), parse_injection("nan@step=1,rank=2,mode=device")]
    # an elastic restart: the process of original rank 2 is rank 0 now, and rank 2 is someone else
    moved = FaultInjector(spec, rank=0, hw_rank=2, node=0, run_dir=tmp_path)
    newcomer = FaultInjector(spec, rank=2, hw_rank=4, node=1, run_dir=tmp_path)
    f = moved.step_faults(5, 0, (0, 0, 8))
    assert f.nan and f.overflow and f.slowdown == 3.0
    assert newcomer.step_faults(5, 0, (0, 0, 8)) is NO_FAULTS
    rows = rows_of(tmp_path)
    assert {r["kind"] for r in rows} == {"straggler", "overflow", "nan"} and len(rows) == 4
    assert all(r["rank"] == 2 and r["current_rank"] == 0 for r in rows)
    # the state is the hardware's: found again under another rank number, the transient does not come back
    assert (tmp_path / ".faults-state-rank2.json").exists() and not (tmp_path / ".faults-state-rank0.json").exists()
    later = FaultInjector(spec, rank=1, hw_rank=2, node=0, run_dir=tmp_path)
    assert later.step_faults(5, 1, (0, 0, 8)).nan  # the device nan still fires
    assert [r["mode"] for r in rows_of(tmp_path)[4:] if r["kind"] == "nan"] == ["device"]  # no transient row


def test_a_slowdown_on_the_place_stays_with_the_rank_whatever_node_holds_it(tmp_path):
    spec = [parse_injection("straggler@rank=1,from=3,factor=4,on=place"),
            parse_injection("slowlink@rank=1,axis=dp,from=3,factor=2,on=place")]
    first = FaultInjector(spec, rank=1, node=1, run_dir=tmp_path)
    assert (first.step_faults(3, 0, (0, 0, 8)).slowdown, first.step_faults(3, 0, (0, 0, 8)).slow_links) == (
        4.0, (("dp", 2.0),))
    # a spare took node1's place: new hardware (hw rank 2) at the same rank; the old hardware elsewhere is fine
    spare = FaultInjector(spec, rank=1, hw_rank=2, node=2, run_dir=tmp_path)
    assert spare.step_faults(40, 1, (0, 0, 8)).slowdown == 4.0
    assert FaultInjector(spec, rank=0, hw_rank=1, node=0, run_dir=tmp_path).step_faults(40, 1, (0, 0, 8)) is NO_FAULTS
    rows = [r for r in rows_of(tmp_path) if r["kind"] == "straggler"]
    assert [(r["rank"], r["node"], r["step"], r.get("on")) for r in rows] == [(1, 1, 3, "place"), (1, 2, 40, "place")]
    with pytest.raises(ConfigError, match="on must be one of"):
        parse_injection("straggler@rank=1,from=3,factor=4,on=node")


def test_rows_have_no_current_rank_when_the_layout_is_original(tmp_path):
    inj = FaultInjector([parse_injection("straggler@rank=1,from=1,factor=2")], rank=1, node=0, run_dir=tmp_path)
    inj.step_faults(1, 0, (0, 0, 8))
    [row] = rows_of(tmp_path)
    assert row["rank"] == 1 and "current_rank" not in row


def replica(window, d, dp):
    epoch, lo, hi = window
    n = (hi - lo) // dp
    return (epoch, lo + d * n, lo + (d + 1) * n)


def test_data_nan_follows_its_samples_to_another_replica(tmp_path):
    """dp=2, tp=2: rank = dp_rank*2 + tp_rank. The nan is injected on rank 3 (tp 1 of replica 1)."""
    spec = [parse_injection("nan@step=5,rank=3")]
    ranks = [FaultInjector(spec, rank=r, node=0, run_dir=tmp_path, tp=2, dp=2) for r in range(4)]
    window = (0, 40, 56)

    def fired(step, attempt, shift=0):
        return [r for r, inj in enumerate(ranks)
                if inj.step_faults(step, attempt, window,
                                   replica_window=replica(window, ((r // 2) + shift) % 2, 2)).nan]

    assert fired(4, 0) == []
    assert fired(5, 0) == [3]
    for r in range(4):  # every rank recorded the injected replica's samples, not the global batch
        state = json.loads((tmp_path / f".faults-state-rank{r}.json").read_text())
        assert state["windows"]["nan@step=5,rank=3"] == [0, 48, 56]
    assert fired(5, 1) == [3]  # a plain replay: the same samples on the same rank
    assert fired(5, 2, shift=1) == [1]  # swapped: replica 0 holds them now, at the injected rank's stage tp 1
    assert fired(5, 3, shift=1) == [1]  # and keeps doing so: it is the data
    assert [(r["rank"], r["attempt"], r["replay"], r["samples"]) for r in rows_of(tmp_path)] == [
        (3, 0, False, [0, 48, 56]), (3, 1, True, [0, 48, 56]), (1, 2, True, [0, 48, 56]),
        (1, 3, True, [0, 48, 56])]


def test_data_nan_stays_off_the_injected_rank_when_it_holds_other_samples(tmp_path):
    spec = [parse_injection("nan@step=5,rank=1")]
    inj = FaultInjector(spec, rank=1, node=0, run_dir=tmp_path, dp=2)
    assert inj.step_faults(5, 0, (0, 0, 16), replica_window=(0, 8, 16)).nan
    assert not inj.step_faults(5, 1, (0, 0, 16), replica_window=(0, 0, 8)).nan  # swapped away
    assert not inj.step_faults(5, 2, (0, 16, 32), replica_window=(0, 24, 32)).nan  # skipped by a rollback
    assert inj.step_faults(9, 3, (0, 4, 20), replica_window=(0, 12, 20)).nan  # any overlap counts


def test_data_nan_survives_an_elastic_restart_with_fewer_replicas(tmp_path):
    spec = [parse_injection("nan@step=5,rank=1")]
    before = FaultInjector(spec, rank=1, node=0, run_dir=tmp_path, dp=2)
    assert before.step_faults(5, 0, (0, 0, 16), replica_window=(0, 8, 16)).nan
    # dp 2 -> 1: hw rank 1 is rank 0 now and serves whole global batches of 8
    after = FaultInjector(spec, rank=0, hw_rank=1, node=0, run_dir=tmp_path, dp=1, orig_dp=2)
    assert not after.step_faults(5, 1, (0, 0, 8), replica_window=(0, 0, 8)).nan
    assert after.step_faults(6, 1, (0, 8, 16), replica_window=(0, 8, 16)).nan
    assert rows_of(tmp_path)[-1]["current_rank"] == 0


def test_spike_stays_global(tmp_path):
    spec = [parse_injection("spike@step=5")]
    ranks = [FaultInjector(spec, rank=r, node=0, run_dir=tmp_path, dp=2) for r in range(2)]
    assert all(inj.step_faults(5, 0, (0, 0, 16), replica_window=replica((0, 0, 16), r, 2)).spike
               for r, inj in enumerate(ranks))
    # swapped halves or not, the whole global batch is poisoned
    assert all(inj.step_faults(5, 1, (0, 0, 16), replica_window=replica((0, 0, 16), 1 - r, 2)).spike
               for r, inj in enumerate(ranks))


def test_a_step_spike_fires_at_its_step_in_every_attempt_whatever_the_batch(tmp_path):
    """`mode=step`: an optimizer's spike, not the data's: skipping its batch does not help."""
    inj = FaultInjector([parse_injection("spike@step=5,mode=step")], rank=0, node=0, run_dir=tmp_path, dp=2)
    assert inj.step_faults(5, 0, (0, 0, 16)).spike
    assert not inj.step_faults(6, 0, (0, 16, 32)).spike
    assert inj.step_faults(5, 1, (0, 0, 16)).spike  # the rerun
    assert inj.step_faults(5, 1, (0, 16, 32)).spike  # the same step on the next batch
    assert not inj.step_faults(6, 1, (0, 0, 16)).spike  # its first batch elsewhere: nothing
    assert [(r["kind"], r["step"], r["attempt"]) for r in rows_of(tmp_path)] == [("spike", 5, 0), ("spike", 5, 1)]
    with pytest.raises(ConfigError, match="mode must be one of data, step"):
        parse_injection("spike@step=5,mode=device")
