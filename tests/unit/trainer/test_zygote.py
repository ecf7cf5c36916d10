"""Ranks forked from the zygote (trainer/zygote.py) look, from the launcher, like the
Popen'd processes they replace: their own argv and environment, the fds passed, the
exit code or -signal as Popen reports it, a ps line naming what they run. Without
torch: the zygote here preloads nothing, so each test takes a fraction of a second."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.zygote import LOST_CODE, ForkedRank, Zygote

ROOT = Path(__file__).resolve().parents[3]
CHILD = "tests.unit.trainer.zygote_child"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote forks: Linux only")


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZYGOTE_TEST")}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def argv(out: Path, mode: str) -> list[str]:
    return [sys.executable, "-m", CHILD, str(out), mode]


def read_when_written(path: Path, bound_s: float = 20.0) -> dict:
    deadline = time.monotonic() + bound_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return json.loads(path.read_text())


@pytest.fixture
def zygote():
    z = Zygote(base_env(ZYGOTE_TEST_SHARED="zygote-only"), preload=(), warm_optimizer=False)
    yield z
    z.close()


def test_a_forked_rank_gets_its_argv_and_exactly_its_environment_and_its_exit_code(zygote, tmp_path):
    out = tmp_path / "seen.json"
    rank = zygote.spawn(argv(out, "exit:7"), base_env(ZYGOTE_TEST_OWN="rank-3"))
    assert isinstance(rank, ForkedRank), zygote.failed
    assert rank.wait(timeout=20) == 7
    assert rank.poll() == 7 and rank.returncode == 7
    seen = json.loads(out.read_text())
    assert seen["argv"][1:] == [str(out), "exit:7"]
    assert seen["env"]["ZYGOTE_TEST_OWN"] == "rank-3"
    assert "ZYGOTE_TEST_SHARED" not in seen["env"]  # the zygote's own environment is not the rank's
    assert seen["cmdline"] == f"{sys.executable} -m {CHILD} {out} exit:7"  # ps shows what it runs
    assert seen["pid"] == rank.pid


def test_a_signalled_rank_reports_minus_the_signal_and_wait_times_out_before(zygote, tmp_path):
    out = tmp_path / "seen.json"
    rank = zygote.spawn(argv(out, "sleep"), base_env())
    read_when_written(out)
    assert rank.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(timeout=0.2)
    rank.send_signal(signal.SIGTERM)
    assert rank.wait(timeout=20) == -signal.SIGTERM
    rank.kill()  # after its exit: a no-op, as Popen's is


def test_a_rank_that_raises_exits_1_with_its_traceback(tmp_path):
    out = tmp_path / "seen.json"
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        z = Zygote(base_env(), preload=(), warm_optimizer=False, stderr=f)
    try:
        rank = z.spawn(argv(out, "raise"), base_env())
        assert rank.wait(timeout=20) == 1
    finally:
        z.close()
    assert "RuntimeError: the stand-in rank failed" in err.read_text()


def test_the_passed_fds_reach_the_ranks(tmp_path):
    r, w = os.pipe()
    try:
        z = Zygote(base_env(), pass_fds=(r,), preload=(), warm_optimizer=False)
        try:
            out = tmp_path / "seen.json"
            rank = z.spawn(argv(out, "exit:0"), base_env(CHILD_FD=str(r)))
            assert rank.wait(timeout=20) == 0
            assert json.loads(out.read_text())["fd_open"]
        finally:
            z.close()
    finally:
        os.close(r)
        os.close(w)


def test_ranks_are_popened_when_the_zygote_cannot_serve(tmp_path):
    z = Zygote(base_env(), preload=("no_such_module_anywhere",), warm_optimizer=False)
    try:
        out = tmp_path / "seen.json"
        rank = z.spawn(argv(out, "exit:3"), base_env(ZYGOTE_TEST_OWN="popen"), popen_kwargs={"cwd": ROOT})
        assert isinstance(rank, subprocess.Popen)
        assert "no_such_module_anywhere" in z.failed
        assert rank.wait(timeout=20) == 3
        assert json.loads(out.read_text())["env"]["ZYGOTE_TEST_OWN"] == "popen"
    finally:
        z.close()


def test_a_rank_whose_zygote_died_is_reported_lost_once_gone(tmp_path):
    z = Zygote(base_env(), preload=(), warm_optimizer=False)
    try:
        out = tmp_path / "seen.json"
        rank = z.spawn(argv(out, "sleep"), base_env())
        read_when_written(out)
        z._proc.kill()  # the zygote dies: PDEATHSIG ends its rank, and nobody reports the exit
        assert rank.wait(timeout=20) == LOST_CODE
    finally:
        z.close()


def test_closing_the_zygote_ends_it(tmp_path):
    z = Zygote(base_env(), preload=(), warm_optimizer=False)
    assert z.wait_ready(20)
    z.close(timeout_s=10)
    assert z._proc.returncode == 0


def test_an_environment_past_the_pipe_buffer_reaches_the_rank_whole(zygote, tmp_path):
    out = tmp_path / "seen.json"
    big = "x" * 200_000  # past a pipe's 64 KiB: the request is written in several parts
    rank = zygote.spawn(argv(out, "exit:0"), base_env(ZYGOTE_TEST_BIG=big))
    assert isinstance(rank, ForkedRank), zygote.failed
    assert rank.wait(timeout=20) == 0
    assert json.loads(out.read_text())["env"]["ZYGOTE_TEST_BIG"] == big
