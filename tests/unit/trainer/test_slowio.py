"""`slowio` injections: parsed and validated, ground truth written once, and the stretch really waits
inside the data loader (its wait_s shows it) only for the injected rank, what and steps."""

import json
import time

import pytest

from tests.unit.trainer.test_data import loader, synthetic_corpus
from trainer.batch import DataPosition
from trainer.config import ConfigError
from trainer.faults import NO_FAULTS, FaultInjector, parse_injection


def test_parse_slowio():
    inj = parse_injection("slowio@rank=2,from=30,factor=3,what=data,to=80", world_size=4)
    assert (inj.kind, inj.rank, inj.step, inj.factor, inj.what, inj.to_step) == ("slowio", 2, 30, 3.0, "data", 80)
    assert inj.name == "slowio@step=30,rank=2,what=data"
    assert parse_injection("slowio@rank=0,from=1,factor=2,what=ckpt").what == "ckpt"


@pytest.mark.parametrize("spec, message", [
    ("slowio@rank=2,from=30,factor=3", "missing what"),
    ("slowio@rank=2,from=30,factor=3,what=disk", "what must be one of data, ckpt"),
    ("slowio@rank=2,from=30,factor=0.5,what=data", "factor must be >= 1"),
    ("slowio@rank=2,from=30,factor=2,what=data,to=10", "to must be >= from"),
    ("slowio@rank=9,from=30,factor=2,what=data", "outside world of 4"),
    ("slowio@rank=2,from=30,factor=2,what=data,axis=tp", "bad field"),
])
def test_bad_slowio_specs_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_injection(spec, world_size=4)


def test_factor_and_ground_truth(tmp_path):
    inj = [parse_injection("slowio@rank=1,from=5,factor=4,what=ckpt,to=8")]
    mine = FaultInjector(inj, rank=1, node=0, run_dir=tmp_path)
    other = FaultInjector(inj, rank=0, node=0, run_dir=tmp_path)
    assert [mine.slowio_factor("ckpt", s) for s in (4, 5, 8, 9)] == [1.0, 4.0, 4.0, 1.0]
    assert mine.slowio_factor("data", 6) == 1.0 and other.slowio_factor("ckpt", 6) == 1.0
    for step in range(1, 10):
        for fi in (mine, other):
            assert fi.step_faults(step, 0, (0, 0, 8)) is NO_FAULTS  # nothing for the engine to do
    rows = [json.loads(x) for x in (tmp_path / "injections.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"], r["step"], r["what"], r["factor"]) for r in rows] == [("slowio", 1, 5, "ckpt", 4.0)]


def test_the_loader_really_waits_for_a_slow_fetch():
    factors = {3: 5.0}
    dl = loader(synthetic_corpus(), slow_fetch=lambda step: factors.get(step, 1.0))
    try:
        dl.next()  # step 0
        dl.next()  # step 1
        dl.next()  # step 2
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:  # the rank's work between two fetches (busy: no sleep to trust)
            pass
        dl.next()  # step 3: the fetch takes 5x the 0.05 s the prefetch hid it behind
        assert dl.wait_s >= 4 * 0.05
        dl.next()  # step 4: the storage is fast again
        assert dl.wait_s < 4 * 0.05
    finally:
        dl.close()


def test_the_loader_after_a_seek_does_not_count_the_gap():
    dl = loader(synthetic_corpus(), slow_fetch=lambda step: 1000.0)
    try:
        dl.seek(DataPosition(), 0)
        dl.next()  # first fetch after a seek: no previous one to measure the work from
        assert dl.wait_s < 1.0
    finally:
        dl.close()
