"""`watch(model, optimizer)` (agent/watch.py) on CPU torch: plain loops written the ways
users write them, recording into a real Agent with no collector; rows read from its
step buffer. Timings with a clock that ticks once per reading."""

from __future__ import annotations

import io
import logging
import math
import struct
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from agent import Agent, AgentConfig, wire  # noqa: E402
from agent.watch import _BOUNDS, Watch, _Bounds, _Patches, watch  # noqa: E402


class Tick:
    """A clock that moves one second each time it is read."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@dataclass
class Output:
    """What a Hugging Face model returns: an object with `.loss` (and more)."""

    loss: object
    logits: object


class Net(nn.Module):
    """A tiny regressor; `returns` what its forward gives back: "loss" (a 0-dim tensor),
    "logits" (the loss is the loop's), "hf" (`.loss`), "dict" ({"loss": ...}), "tuple"
    ((logits, loss))."""

    def __init__(self, returns: str = "loss"):
        super().__init__()
        self.returns = returns
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, y=None):
        out = self.body(x)
        if self.returns == "logits":
            return out
        loss = F.mse_loss(out, y)
        return {"loss": loss, "hf": Output(loss, out), "dict": {"logits": out, "loss": loss},
                "tuple": (out, loss)}[self.returns]


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


@pytest.fixture
def agent():
    a = Agent(AgentConfig(url=None, device_health=False, capacity=256), run_id="watch-test", rank=0)
    yield a
    a.close()


@pytest.fixture(autouse=True)
def no_watch_left_open():
    yield
    for w in list(_Patches.watches):  # a failed test's watch must not hook the next test
        w.close()
    assert not _Patches.watches and not _Patches.saved


def steps(agent) -> list[dict]:
    """The step rows recorded so far (before a flush swaps them out)."""
    buf = agent._active.step
    out = []
    for i in range(buf.n):
        r = {c.name: col[i] for c, col in zip(wire.SCHEMA[buf.kind], buf.cols)}
        r["local_loss"] = r["local_loss"] if r.pop("local_loss_valid") else None
        out.append(r)
    return out


def is_null(x: float) -> bool:
    """`x` is the float NULL (not measured), bit for bit, not some other NaN."""
    return struct.pack("<d", x) == struct.pack("<q", wire.NULL_F64_BITS)


def make(agent, returns="loss", *, lr=0.05, clock=None, **kw):
    torch.manual_seed(0)
    model = Net(returns)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if clock is not None:
        w = Watch(agent, model, [opt], flight_recorder=False, clock=clock, **kw)
    else:
        w = watch(model, opt, agent=agent, flight_recorder=False, **kw)
    return model, opt, w


def true_grad_norm(model) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


# -- one row per step, the loss wherever it is ----------------------------------------------
@pytest.mark.parametrize("returns", ["loss", "hf", "dict", "tuple", "logits"])
def test_one_row_per_optimizer_step_with_the_loss_the_loop_computed(agent, returns):
    model, opt, w = make(agent, returns)
    losses, norms = [], []
    for x, y in batches(4):
        opt.zero_grad()
        out = model(x, y)
        loss = {"loss": lambda: out, "hf": lambda: out.loss, "dict": lambda: out["loss"], "tuple": lambda: out[1],
                "logits": lambda: F.mse_loss(out, y)}[returns]()
        loss.backward()
        losses.append(loss.item())
        norms.append(true_grad_norm(model))
        opt.step()
    got = steps(agent)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["local_loss"] for r in got] == losses
    assert [r["grad_norm"] for r in got] == pytest.approx(norms, rel=1e-5)
    assert [(r["finite_fwd"], r["finite_bwd"]) for r in got] == [(1, 1)] * 4
    assert all(is_null(r["loss"]) for r in got)  # the global mean would take a collective
    assert w.step == 4
    w.close()


def test_steps_count_from_start_step(agent):
    model, opt, w = make(agent, start_step=100)
    for x, y in batches(2):
        model(x, y).backward()
        opt.step()
    assert [r["step"] for r in steps(agent)] == [101, 102]


def test_timings_come_from_the_hooks_on_the_injected_clock(agent):
    model, opt, w = make(agent, clock=Tick())
    for x, y in batches(3):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    got = steps(agent)
    # one tick from each phase's start to its end
    assert [(r["fwd_s"], r["bwd_s"], r["opt_s"]) for r in got] == [(1.0, 1.0, 1.0)] * 3
    assert all(is_null(r["data_s"]) for r in got)  # no DataLoader: no data wait to judge


def test_data_s_is_the_time_blocked_in_a_dataloader(agent):
    from torch.utils.data import DataLoader, TensorDataset

    model, opt, w = make(agent)
    x, y = torch.randn(12, 4), torch.randn(12, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    for xb, yb in loader:
        opt.zero_grad()
        model(xb, yb).backward()
        opt.step()
    got = steps(agent)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert all(0.0 < r["data_s"] < 5.0 for r in got)


def test_gradient_accumulation_sums_the_times_and_averages_the_loss(agent):
    model, opt, w = make(agent, clock=Tick())
    data = batches(6)
    means = []
    for i in range(3):
        opt.zero_grad()
        micro = []
        for x, y in data[2 * i:2 * i + 2]:
            loss = model(x, y)
            (loss / 2).backward()
            micro.append(loss.item())
        means.append(torch.tensor(micro).mean().item())
        opt.step()
    got = steps(agent)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["local_loss"] for r in got] == pytest.approx(means, rel=1e-6)
    assert [(r["fwd_s"], r["bwd_s"], r["opt_s"]) for r in got] == [(2.0, 2.0, 1.0)] * 3


# -- finiteness and the grad norm -----------------------------------------------------------
def test_a_loss_the_loop_turns_into_nan_before_backward_is_not_finite(agent):
    model, opt, w = make(agent)
    (x, y), (x2, y2) = batches(2)
    loss = model(x, y)
    model_loss = loss.item()
    (loss * float("nan")).backward()
    opt.step()
    opt.zero_grad()
    model(x2, y2).backward()
    opt.step()
    first, second = steps(agent)
    assert first["local_loss"] == model_loss  # the model's own loss, finite
    assert (first["finite_fwd"], first["finite_bwd"]) == (0, 0)  # what backward ran on was not; nor the grads
    assert math.isnan(first["grad_norm"]) and not is_null(first["grad_norm"])
    assert agent.num_urgent >= 1  # a detector must see it now


def test_nan_gradients_from_a_finite_loss_are_finite_fwd_but_not_finite_bwd(agent):
    model, opt, w = make(agent)
    model.body[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    (row,) = steps(agent)
    assert (row["finite_fwd"], row["finite_bwd"]) == (1, 0)
    assert math.isnan(row["grad_norm"])


def test_the_grad_norm_is_clip_grad_norms_result_when_the_loop_clips(agent):
    model, opt, w = make(agent)
    clipped = []
    for x, y in batches(3):
        opt.zero_grad()
        model(x, y).backward()
        clipped.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item())
        assert true_grad_norm(model) == pytest.approx(1e-3, rel=1e-3)  # the loop's clip still clips
        opt.step()
    assert [r["grad_norm"] for r in steps(agent)] == clipped  # the norm before clipping, not 1e-3
    assert all(n > 1e-2 for n in clipped)


def test_the_clip_module_path_is_wrapped_too(agent):
    from torch.nn.utils import clip_grad

    model, opt, w = make(agent)
    x, y = batches(1)[0]
    model(x, y).backward()
    norm = clip_grad.clip_grad_norm_(model.parameters(), 1e-3).item()
    opt.step()
    assert steps(agent)[0]["grad_norm"] == norm


def test_a_clip_bound_before_the_watch_hands_its_norm_over_once_preinstalled(agent, monkeypatch):
    from torch.nn.utils import clip_grad

    from agent.watch import _Patches

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
    monkeypatch.setattr(clip_grad, "clip_grad_norm_", clip_grad.clip_grad_norm_)
    _Patches.preinstall_clip()  # what llmwatch-instrument does once torch is imported
    bound = torch.nn.utils.clip_grad_norm_  # the script's `from torch.nn.utils import clip_grad_norm_`
    model, opt, w = make(agent)
    x, y = batches(1)[0]
    model(x, y).backward()
    norm = bound(model.parameters(), 1e-3).item()
    opt.step()
    assert steps(agent)[0]["grad_norm"] == norm
    w.close()
    assert torch.nn.utils.clip_grad_norm_ is bound  # it stays (inert without a watch)
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert torch.isclose(bound(model.parameters(), 1.0), want)  # the real norm, as without a watch


def test_no_grad_norm_when_asked_and_none_clipped(agent):
    model, opt, w = make(agent, grad_norm=False)
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    (row,) = steps(agent)
    assert is_null(row["grad_norm"]) and row["finite_bwd"] == -1 and row["finite_fwd"] == 1


# -- eval, phases ---------------------------------------------------------------------------
def test_an_eval_loop_between_steps_adds_nothing_and_its_phase_is_eval(agent):
    model, opt, w = make(agent, clock=Tick())
    seen = []
    model.body[0].register_forward_hook(lambda *a: seen.append(agent._phase) and None)
    data = batches(3)
    for i, (x, y) in enumerate(data[:2]):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        if i == 0:
            model.eval()
            with torch.no_grad():
                for xe, ye in data[2:]:
                    model(xe, ye)
            model.train()
            assert agent._phase == "data"  # between the eval loop's forwards and after it
    got = steps(agent)
    assert [r["step"] for r in got] == [1, 2]
    assert [r["fwd_s"] for r in got] == [1.0, 1.0]  # the eval forward is not the step's
    assert seen == ["fwd", "eval", "fwd"]


def test_a_forward_without_grad_in_train_mode_is_eval_too(agent):
    model, opt, w = make(agent)
    (x, y), (x2, y2) = batches(2)
    with torch.no_grad():
        model(x2, y2)
    loss = model(x, y)
    loss.backward()
    opt.step()
    (row,) = steps(agent)
    assert row["local_loss"] == loss.item()  # the no-grad forward's loss is not averaged in


def test_phases_of_a_step(agent):
    model, opt, w = make(agent)
    seen = {}

    def note(what):
        def hook(*args):
            seen.setdefault(what, agent._phase)  # returns None: the hook changes nothing

        return hook

    model.body[0].register_forward_hook(note("forward"))
    model.body[0].weight.register_hook(note("backward"))
    opt.register_step_pre_hook(note("step"))

    class File(io.BytesIO):
        def write(self, b):
            note("save")()
            return super().write(b)

    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    assert agent._phase == "data" and agent._hb_step == 2  # waiting for step 2's data
    torch.save(model.state_dict(), File())
    assert seen == {"forward": "fwd", "backward": "bwd", "step": "opt", "save": "checkpoint"}
    assert agent._phase == "data"


# -- loops without one optimizer ------------------------------------------------------------
def test_without_an_optimizer_a_warning_and_step_boundary_makes_the_rows(agent, caplog):
    torch.manual_seed(0)
    model = Net()
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        w = watch(model, None, agent=agent, flight_recorder=False)
    (warning,) = [m for m in caplog.messages if "without an optimizer" in m]
    assert "step_boundary()" in warning
    losses = []
    for x, y in batches(3):
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
        w.step_boundary()
    got = steps(agent)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["local_loss"] for r in got] == losses
    assert all(is_null(r["opt_s"]) for r in got) and all(r["grad_norm"] > 0 for r in got)


def test_with_two_optimizers_the_first_ones_steps_are_the_rows(agent):
    torch.manual_seed(0)
    model = Net()
    first = torch.optim.SGD(model.body[0].parameters(), lr=0.05)
    second = torch.optim.Adam(model.body[2].parameters(), lr=1e-3)
    w = watch(model, [first, second], agent=agent, flight_recorder=False)
    for x, y in batches(3):
        first.zero_grad()
        second.zero_grad()
        model(x, y).backward()
        first.step()
        second.step()
    assert [r["step"] for r in steps(agent)] == [1, 2, 3]
    assert w.step == 3


# -- what the loop tells --------------------------------------------------------------------
def test_the_loss_the_loop_tells_wins(agent):
    model, opt, w = make(agent)
    told = []
    for x, y in batches(2):
        loss = model(x, y)
        w.loss(loss.detach() * 0 + 7.5)
        w.loss(8.5)  # a float too; per micro-batch: the mean
        told.append(8.0)
        loss.backward()
        opt.step()
    assert [r["local_loss"] for r in steps(agent)] == told


def test_a_grad_scalers_input_is_the_loss(agent):
    model, opt, w = make(agent, "logits")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    losses = []
    for x, y in batches(3):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()  # backward runs on 1024 x the loss
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    got = steps(agent)
    assert [r["local_loss"] for r in got] == losses
    assert [(r["finite_fwd"], r["finite_bwd"]) for r in got] == [(1, 1)] * 3


# -- close, failures ------------------------------------------------------------------------
def _patched():
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_,
            torch.save, torch.amp.GradScaler.__dict__["scale"], _BaseDataLoaderIter.__dict__["__next__"])


def test_close_takes_every_hook_out_and_restores_torch(agent):
    before = _patched()
    model, opt, w = make(agent)
    assert all(a is not b for a, b in zip(before, _patched()))
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    w.close()
    assert all(a is b for a, b in zip(before, _patched()))
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    recorded = agent.stats()["recorded"]["step"]
    assert recorded == 1
    model(x, y).backward()
    opt.step()
    assert agent.stats()["recorded"]["step"] == recorded  # nothing new
    w.close()  # idempotent


def test_two_watches_share_the_patches_until_the_last_closes(agent):
    before = _patched()
    _, _, w1 = make(agent)
    _, _, w2 = make(agent)
    assert _Patches.current() is w2
    w2.close()
    assert _Patches.current() is w1 and torch.Tensor.backward is not before[0]
    w1.close()
    assert all(a is b for a, b in zip(before, _patched()))


class FailingAgent(Agent):
    """An agent whose setters and record calls raise (a bug, a full disk): the loop must not see it."""

    def set_phase(self, phase, step):
        raise RuntimeError("set_phase broke")

    def record_step(self, step, **kw):
        raise RuntimeError("record_step broke")


def test_a_hook_failure_never_raises_into_the_loop(caplog):
    agent = FailingAgent(AgentConfig(url=None, device_health=False, capacity=16), run_id="r", rank=0)
    model, opt, w = make(agent)
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        for x, y in batches(3):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            w.loss(loss)
            w.step_boundary()
        torch.save({}, io.BytesIO())
        w.close()
    assert w.active is False
    assert len([m for m in caplog.messages if "stops measuring" in m]) == 1
    agent.close()


def test_a_failing_record_step_stops_measuring_and_the_loop_runs_on(caplog):
    class Broken(Agent):
        def record_step(self, step, **kw):
            raise RuntimeError("record_step broke")

    agent = Broken(AgentConfig(url=None, device_health=False, capacity=16), run_id="r", rank=0)
    model, opt, w = make(agent)
    with caplog.at_level(logging.WARNING, logger="llmwatch.agent"):
        for x, y in batches(3):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
    assert w.active is False and w.step == 1
    assert len([m for m in caplog.messages if "stops measuring" in m]) == 1
    before = torch.Tensor.backward
    w.close()  # a watch that stopped measuring is still taken out
    assert _Patches.current() is None and torch.Tensor.backward is not before
    assert not model._forward_hooks and not opt._optimizer_step_post_hooks
    agent.close()


# -- the agent's side -----------------------------------------------------------------------
def test_the_clock_offset_is_told_once_known_and_when_it_moves(agent):
    model, opt, w = make(agent)
    offset = [(0.0, math.inf)]
    agent.clock_offset = lambda: offset[0]
    w._tell_offset()
    assert agent._active.events == []  # unknown yet
    offset[0] = (0.25, 0.002)
    w._tell_offset()
    offset[0] = (0.251, 0.002)  # within its error
    w._tell_offset()
    offset[0] = (0.3, 0.002)
    w._tell_offset()
    got = [(e["kind"], e["data"]) for e in agent._active.events]
    assert got == [("clock_offset", {"offset_s": 0.25, "error_s": 0.002}),
                   ("clock_offset", {"offset_s": 0.3, "error_s": 0.002})]


def test_the_flight_recorder_is_polled_by_the_agent(agent):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = watch(model, opt, agent=agent)
    assert w.reader is not None
    assert w.reader.tick in agent._pollers and agent._seq_source == w.reader.last_entered
    assert "flight_recorder" in w.stats()


# -- step boundaries ------------------------------------------------------------------------
def test_bounds_step_of_is_the_step_in_progress_at_a_time():
    b = _Bounds()
    assert b.step_of(123) == (0, 0)  # before any boundary
    b.add(100, 1, 0)
    b.add(200, 2, 0)
    b.add(300, 3, 1)  # a rollback: the next step is of attempt 1
    assert b.step_of(99) == (0, 1)
    assert b.step_of(100) == (1, 0)
    assert b.step_of(250) == (2, 0)
    assert b.step_of(300) == (3, 1)
    assert b.step_of(10**18) == (3, 1)


def test_bounds_keep_the_newest_when_they_wrap():
    b = _Bounds()
    for i in range(_BOUNDS + 10):
        b.add(1000 + 10 * i, i + 1, 0)
    assert b.step_of(1000 + 10 * (_BOUNDS + 9) + 5) == (_BOUNDS + 10, 0)
    assert b.step_of(1000 + 10 * 20 + 5) == (21, 0)  # still held
    assert b.step_of(1000 + 10 * 5) == (0, 0)  # older than the ring holds
