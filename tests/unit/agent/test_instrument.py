"""`llmwatch-instrument -- COMMAND` (agent/instrument.py, agent/_bootstrap/sitecustomize.py):
the usage errors and the environment in-process; the exit code, the sitecustomize chain
and a zero-code watch of a plain loop in real processes (no collector: the watch records
into a NoopAgent, and the script says what it found)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.flight import BUFFER_ENV, DEFAULT_BUFFER, NCCL_TIMING_ENV
from agent.instrument import _BOOTSTRAP, INSTRUMENT_ENV, POLICY_ENV, environment, main

INSTRUMENT = Path(sys.executable).parent / "llmwatch-instrument"
_OURS = ("PYTHONPATH", BUFFER_ENV, NCCL_TIMING_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE")


def clean_env(**extra) -> dict[str, str]:
    """This process's environment without llmwatch's variables (so no collector) or a PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMWATCH_") and k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture
def launch(monkeypatch):
    """`launch(argv, environ)`: run `main(argv)` in this process with `environ` as the parent's
    llmwatch/torch variables, the exec caught: (its exit code, the command, the command's environment)."""
    execs = []

    def execvpe(file, args, env):
        execs.append((file, list(args), dict(env)))  # returns: main() then says 0

    monkeypatch.setattr(os, "execvpe", execvpe)

    def run_main(argv: list[str], environ: dict | None = None):
        for k in list(os.environ):
            if k.startswith("LLMWATCH_") or k in _OURS:
                monkeypatch.delenv(k)
        for k, v in (environ or {}).items():
            monkeypatch.setenv(k, v)
        code = main(argv)
        if not execs:
            return code, None, None
        file, args, env = execs.pop()
        assert file == args[0]
        return code, args, env

    return run_main


def env_of(launch, argv: list[str], environ: dict | None = None) -> dict[str, str]:
    return launch(argv, environ)[2]


# -- usage ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [[], ["--"], ["--policy", "auto"], ["--policy", "auto", "--"]])
def test_no_command_is_a_usage_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no command to run" in err and "llmwatch-instrument [options] -- COMMAND" in err


def test_a_command_that_does_not_exist_is_127(capsys):
    assert main(["--", "llmwatch-no-such-command-7f3a", "--flag"]) == 127
    assert "cannot run 'llmwatch-no-such-command-7f3a'" in capsys.readouterr().err


def test_a_token_file_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    assert main(["--token-file", str(tmp_path / "missing"), "--", "true"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_an_unknown_policy_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--policy", "sometimes", "--", "true"])
    assert e.value.code == 2


def test_the_command_keeps_its_own_arguments_after_the_separator(launch):
    code, args, env = launch(["--run-id", "r", "--", "torchrun", "--nproc-per-node", "2", "t.py", "--run-id", "x"])
    assert args == ["torchrun", "--nproc-per-node", "2", "t.py", "--run-id", "x"]
    assert env["LLMWATCH_RUN_ID"] == "r"
    assert launch(["python", "t.py"])[1] == ["python", "t.py"]  # without the separator too


def test_without_a_collector_the_command_still_runs_and_says_so(launch, capsys):
    code, args, env = launch(["--", "python", "t.py"])
    assert args == ["python", "t.py"] and "LLMWATCH_URL" not in env
    assert "no collector" in capsys.readouterr().err


# -- the command's environment --------------------------------------------------------------
def test_the_environment_arms_every_python_process_of_the_command(launch):
    env = env_of(launch, ["--", "torchrun", "train.py"], {"PYTHONPATH": "/work/src:/opt/lib"})
    assert env[INSTRUMENT_ENV] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [_BOOTSTRAP, "/work/src", "/opt/lib"]  # the bootstrap first
    assert os.path.isfile(os.path.join(env["PYTHONPATH"].split(os.pathsep)[0], "sitecustomize.py"))
    assert env["PATH"] == os.environ["PATH"]  # the rest passes through
    assert (env[BUFFER_ENV], env[NCCL_TIMING_ENV]) == (str(DEFAULT_BUFFER), "1")  # the Flight Recorder, before any group


def test_the_environment_without_a_pythonpath_is_the_bootstrap_alone(launch):
    assert env_of(launch, ["--", "python", "x.py"])["PYTHONPATH"] == _BOOTSTRAP


def test_the_environment_leaves_this_processes_alone(launch):
    env_of(launch, ["--", "x"], {"PYTHONPATH": "/a"})
    assert os.environ["PYTHONPATH"] == "/a" and INSTRUMENT_ENV not in os.environ and BUFFER_ENV not in os.environ
    parent = {"PYTHONPATH": "/a"}
    environment(argparse.Namespace(collector=None, token_file=None, run_id=None, policy=None, command=["x"]), parent)
    assert parent == {"PYTHONPATH": "/a"}


def test_the_run_id_given_wins_then_the_environments_then_a_new_one(launch):
    assert env_of(launch, ["--run-id", "given", "--", "x"], {"LLMWATCH_RUN_ID": "env"})["LLMWATCH_RUN_ID"] == "given"
    env = env_of(launch, ["--", "x"], {"LLMWATCH_RUN_ID": "env"})
    assert env["LLMWATCH_RUN_ID"] == "env" and "LLMWATCH_RUN_ID_GENERATED" not in env
    a, b = env_of(launch, ["--", "x"]), env_of(launch, ["--", "x"])
    assert a["LLMWATCH_RUN_ID"].startswith("run-") and a["LLMWATCH_RUN_ID"] != b["LLMWATCH_RUN_ID"]
    assert a["LLMWATCH_RUN_ID_GENERATED"] == "1"  # a rank may prefer torchrun's rendezvous id


def test_the_policy_is_shadow_unless_asked(launch):
    assert env_of(launch, ["--", "x"])[POLICY_ENV] == "shadow"
    assert env_of(launch, ["--", "x"], {POLICY_ENV: "off"})[POLICY_ENV] == "off"
    assert env_of(launch, ["--policy", "auto", "--", "x"], {POLICY_ENV: "off"})[POLICY_ENV] == "auto"


def test_the_collector_url_is_passed_on(launch):
    url = "http://10.0.0.2:8428"
    assert env_of(launch, ["--collector", url, "--", "x"])["LLMWATCH_URL"] == url
    assert env_of(launch, ["--", "x"], {"LLMWATCH_URL": "http://c:1"})["LLMWATCH_URL"] == "http://c:1"


def test_the_token_files_path_travels_never_the_token(launch, tmp_path, monkeypatch):
    (tmp_path / "ingest").write_text("s3cret-token-value\n")
    monkeypatch.chdir(tmp_path)
    env = env_of(launch, ["--token-file", "ingest", "--", "x"])
    assert env["LLMWATCH_TOKEN_FILE"] == str(tmp_path / "ingest")  # absolute: the ranks may run elsewhere
    assert not any("s3cret" in v for v in env.values())
    assert "LLMWATCH_TOKEN" not in env


def test_the_flight_recorder_settings_the_user_made_stay(launch):
    env = env_of(launch, ["--", "x"], {BUFFER_ENV: "20000", NCCL_TIMING_ENV: "0"})
    assert (env[BUFFER_ENV], env[NCCL_TIMING_ENV]) == ("20000", "0")


# -- finding the model (in this process) ----------------------------------------------------
@pytest.fixture
def discovery(monkeypatch):
    """`arm()`'s discovery with torch imported: the global hooks in, and out again after."""
    from torch.nn.modules import module as module_mod

    from agent.instrument import _Discovery

    for name in ("LLMWATCH_URL", "LLMWATCH_RUN_ID", "LLMWATCH_TOKEN", "LLMWATCH_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)  # no collector: the watch records into a NoopAgent
    hooks_before = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks))
    d = _Discovery()
    d.install()
    yield d
    if d.watch:
        d.watch.close()
    for h in d._handles:
        h.remove()
    assert (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks)) == hooks_before
    import torch.optim.optimizer as optimizer_mod

    assert optimizer_mod._global_optimizer_pre_hooks == {} == optimizer_mod._global_optimizer_post_hooks


def _train(model, opt, steps: int = 3, *, closure: bool = False):
    import torch

    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

        def step():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if closure:
            opt.step(step)
        else:
            step()
            opt.step()


def _hooked(module, w) -> bool:
    return any(getattr(h, "__self__", None) is w for h in module._forward_hooks.values())


def _net():
    from torch import nn

    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("closure", [False, True])
def test_the_first_step_finds_the_outermost_module_and_every_step_is_counted(discovery, closure):
    import torch
    from torch.nn.modules import module as module_mod

    class Wrapper(torch.nn.Module):  # the outermost module called with grad: the one to watch
        def __init__(self):
            super().__init__()
            self.inner = _net()

        def forward(self, x):
            return self.inner(x)

    model = Wrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torch.no_grad():
        _net()(torch.randn(2, 4))  # a forward without grad: never the root
    _train(model, opt, closure=closure)
    w = discovery.watch
    assert w and w.step == 3  # a closure's first step is found at its end, and counted
    assert _hooked(model, w) and not _hooked(model.inner, w)
    assert [id(p) for p in w._params] == [id(p) for p in model.parameters()]
    assert type(w.agent).__name__ == "NoopAgent"
    assert len(discovery._handles) == 2  # its module hooks are out; the optimizer's stay, idle
    assert not any(getattr(h, "__self__", None) is discovery for h in module_mod._global_forward_hooks.values())


def test_the_module_holding_most_of_the_optimizers_parameters_is_the_model(discovery):
    import torch

    teacher, student = _net(), _net()
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(8, 4, generator=g)
        target = teacher(x).detach()  # a root called with grad that holds none of the optimizer's parameters
        loss = torch.nn.functional.mse_loss(student(x), target)
        opt.zero_grad()
        loss.backward()
        teacher(x)  # the newest root called: still not the model
        opt.step()
    w = discovery.watch
    assert _hooked(student, w) and not _hooked(teacher, w)


def test_no_module_called_before_the_first_step_watches_the_optimizer_alone(discovery, caplog):
    import logging

    import torch

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        for _ in range(2):
            opt.zero_grad()
            (p ** 2).sum().backward()
            opt.step()
    w = discovery.watch
    assert w and w.step == 2  # found at the end of the first step, which is counted
    assert any("no module called before the first optimizer step" in m for m in caplog.messages)
    assert [id(x) for x in w._params] == [id(p)]


# -- in real processes ----------------------------------------------------------------------
def run(argv: list[str], *, cwd=None, env=None, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env if env is not None else clean_env(), capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.integration
@pytest.mark.slow
def test_the_commands_exit_code_is_passed_through():
    got = run([sys.executable, "-m", "agent.instrument", "--", sys.executable, "-c", "import sys; sys.exit(3)"])
    assert got.returncode == 3, got.stderr
    assert "no collector" in got.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_the_bootstrap_arms_only_when_asked_and_runs_the_next_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    probe = ("import os, sys; print(os.environ.get('CHAINED'), 'agent.instrument' in sys.modules, "
             "os.environ.get('TORCH_FR_BUFFER_SIZE'))")
    path = os.pathsep.join([_BOOTSTRAP, str(other)])
    armed = run([sys.executable, "-c", probe], env=clean_env(PYTHONPATH=path, LLMWATCH_INSTRUMENT="1"))
    assert armed.stdout.split() == ["yes", "True", str(DEFAULT_BUFFER)], armed.stderr
    unarmed = run([sys.executable, "-c", probe], env=clean_env(PYTHONPATH=path))
    assert unarmed.stdout.split() == ["yes", "False", "None"], unarmed.stderr


LOOP = textwrap.dedent("""
    # A plain training script: no llmwatch import until it reports what the instrument found.
    import json
    import sys

    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torch.no_grad():
        model(torch.randn(2, 4))  # a forward without grad before training
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    import agent.watch

    w = agent.watch._Patches.current()
    print(json.dumps({
        "watches": len(agent.watch._Patches.watches),
        "steps": w.step if w else None,
        "agent": type(w.agent).__name__ if w else None,
        "root_hooked": bool(w) and any(getattr(h, "__self__", None) is w for h in model._forward_hooks.values()),
        "params": bool(w) and [id(p) for p in w._params] == [id(p) for p in model.parameters()],
        "optimizer_hooked": bool(w) and any(getattr(h, "__self__", None) is w
                                            for h in opt._optimizer_step_post_hooks.values()),
        "inner_hooked": any(getattr(h, "__self__", None) is w for h in model[0]._forward_hooks.values()),
    }))
""")


@pytest.mark.integration
@pytest.mark.slow
def test_a_plain_loop_is_watched_with_no_change_to_its_code(tmp_path):
    (tmp_path / "train.py").write_text(LOOP)
    got = run([str(INSTRUMENT), "--", sys.executable, "train.py"], cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    found = json.loads(got.stdout.strip().splitlines()[-1])
    assert found == {"watches": 1, "steps": 3, "agent": "NoopAgent", "root_hooked": True, "params": True,
                     "optimizer_hooked": True, "inner_hooked": False}, got.stderr
    assert "no collector" in got.stderr  # said once by the command, once by the rank


def test_the_llmwatch_trainer_is_left_alone_and_a_job_that_imported_it_is_not(monkeypatch):
    import trainer.comm  # noqa: F401 - imported, as a test process or a user's tool may
    from agent.instrument import _is_llmwatch_trainer

    monkeypatch.delenv("LLMWATCH_EMBEDDED", raising=False)
    assert not _is_llmwatch_trainer()
    monkeypatch.setenv("LLMWATCH_EMBEDDED", "1")  # a rank the trainer's launcher started
    assert _is_llmwatch_trainer()
