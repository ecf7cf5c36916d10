"""`watch(model, optimizer)`: one call, and a training loop we did not write is measured.

    from agent.watch import watch

    w = watch(model, optimizer)      # collector: $LLMWATCH_URL, $LLMWATCH_TOKEN_FILE, $LLMWATCH_RUN_ID
    for batch in loader:
        loss = model(batch).loss     # or F.cross_entropy(model(x), y): the loss is found either way
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
    w.close()                        # or leave it to the interpreter's exit

What it hooks, and what each gives (one `steps` row per optimizer step and rank):

- the optimizer's step hooks: the step boundary (`step` counts from `start_step`
  + 1), `opt_s` (the step itself), `step_s` (between two steps);
- the root module's forward hooks: `fwd_s` (every forward of the step, so
  gradient accumulation is summed), and the loss: the output's `.loss`, its
  `"loss"` key, the output itself or the first 0-dim float tensor of a tuple;
- a torch `DataLoader`'s `__next__` (wrapped): `data_s`, the time blocked
  fetching the step's batches (NULL for a loop without one: the gap between two
  steps holds a framework's logging and its blocking collectives too, no data
  wait to judge);
- `Tensor.backward` (wrapped while a watch is open): `bwd_s`, and the loss when
  the model does not return it (the 0-dim tensor backward is called on);
  `GradScaler.scale` (wrapped): the unscaled loss of an AMP loop; `w.loss(t)`
  where the loop knows better than all of these;
- `torch.nn.utils.clip_grad_norm_` (wrapped): its result is the step's grad norm;
  without it the norm of the local gradients is computed on their device (for
  DTensor gradients, FSDP2's, only their finiteness: a sharded norm is not the
  model's);
- `torch.save` (wrapped): the heartbeat says "checkpoint" while it writes, so a
  long save on one rank is not taken for a hang.

The loss is recorded as `local_loss` (this rank's own: in DDP and FSDP every rank
is its own data-parallel replica) and `loss` is left NULL (the global mean
would take a collective); `finite_fwd` says whether every loss the step saw (the
model's, the one backward ran on, the one told) was finite, `finite_bwd` whether
the gradients were. Forwards without grad or in eval mode (an
eval loop between steps) count for nothing, and set the heartbeat's phase to
"eval" (a long one is not a hang).

No host sync is added: the step's loss, norm and finiteness are stacked on their
device and copied to pinned host memory without blocking, and the row is
recorded once that copy's CUDA event has completed (at a later step, or at
`close()`). On the CPU they are read at once.

Every collective comes from torch's Flight Recorder (agent/flight.py), read on
the agent's thread; each is assigned to the step in progress when it was
enqueued. Commands: `w.commands()` and `w.ack(...)` at a step boundary, as
with the Agent. Nothing here raises into the loop: a hook that fails is logged
once and stops measuring.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import threading
import time
from array import array
from typing import Any, Callable, Iterable

from agent.flight import FlightReader, Groups
from agent.integrations._common import env_rank_world, make_agent

log = logging.getLogger("llmwatch.agent")

_BOUNDS = 4096  # step boundaries kept for placing Flight Recorder entries (a ring)


class _Bounds:
    """Step boundaries (wall ns) written by the training thread, read by the flusher:
    preallocated arrays and a count written last, so a reader needs no lock."""

    __slots__ = ("ns", "step", "attempt", "n")

    def __init__(self) -> None:
        self.ns = array("q", bytes(8 * _BOUNDS))
        self.step = array("q", bytes(8 * _BOUNDS))
        self.attempt = array("i", bytes(4 * _BOUNDS))
        self.n = 0

    def add(self, ns: int, step: int, attempt: int) -> None:
        i = self.n % _BOUNDS
        self.ns[i], self.step[i], self.attempt[i] = ns, step, attempt
        self.n += 1

    def step_of(self, ns: int) -> tuple[int, int]:
        """(step, attempt) in progress at wall time `ns`: that of the newest boundary at or
        before it (0: before the first)."""
        n = self.n
        for j in range(n - 1, max(-1, n - _BOUNDS - 1), -1):
            i = j % _BOUNDS
            if self.ns[i] <= ns:
                return self.step[i], self.attempt[i]
        return 0, self.attempt[(n - 1) % _BOUNDS] if n else 0


def _loss_of(output) -> Any:
    """The loss a module's output carries, or None."""
    import torch

    def scalar(t):
        return isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()

    if scalar(output):
        return output
    got = getattr(output, "loss", None)
    if scalar(got):
        return got
    if isinstance(output, dict) and scalar(output.get("loss")):
        return output["loss"]
    if isinstance(output, (tuple, list)):
        return next((t for t in output if scalar(t)), None)
    return None


def _clip_wrapper(clip):
    """`clip_grad_norm_` that hands its result (the norm before clipping) to the open watch."""

    def watched_clip(*args, **kwargs):
        norm = clip(*args, **kwargs)
        w = _Patches.current()
        if w is not None and w.active:
            w.clipped_norm = norm
        return norm

    watched_clip._llmwatch_wrapped = clip
    return watched_clip


class _Patches:
    """The process-wide wraps (`Tensor.backward`, `clip_grad_norm_`, `torch.save`), put in
    place by the first open watch and taken out with the last; they call the newest one."""

    lock = threading.Lock()
    watches: list[Watch] = []
    saved: dict = {}

    @classmethod
    def add(cls, w: Watch) -> None:
        with cls.lock:
            cls.watches.append(w)
            if len(cls.watches) == 1:
                cls._install()

    @classmethod
    def remove(cls, w: Watch) -> None:
        with cls.lock:
            if w in cls.watches:
                cls.watches.remove(w)
                if not cls.watches:
                    cls._uninstall()

    @classmethod
    def current(cls) -> Watch | None:
        ws = cls.watches
        return ws[-1] if ws else None

    @classmethod
    def _install(cls) -> None:
        import torch
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_mod

        backward, clip, save = torch.Tensor.backward, nn_utils.clip_grad_norm_, torch.save
        scale = torch.amp.GradScaler.scale
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        fetch = _BaseDataLoaderIter.__next__
        cls.saved = {"backward": backward, "clip": clip, "clip_mod": clip_mod.clip_grad_norm_, "save": save,
                     "scale": scale, "fetch": fetch}

        def watched_fetch(self):
            w = cls.current()
            if w is None or not w.active:
                return fetch(self)
            t0 = time.perf_counter()
            try:
                return fetch(self)
            finally:
                w.data_s = (w.data_s or 0.0) + time.perf_counter() - t0

        def watched_scale(self, outputs):
            w = cls.current()
            if w is not None and w.active and isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
                w.loss(outputs)  # the unscaled loss; backward runs on the scaled one
            return scale(self, outputs)

        def watched_backward(self, *args, **kwargs):
            w = cls.current()
            if w is None or not w.active:
                return backward(self, *args, **kwargs)
            t0 = w.on_backward(self)  # None when the watch failed
            try:
                return backward(self, *args, **kwargs)
            finally:
                if t0 is not None:
                    w.bwd_s += w._clock() - t0

        def watched_save(*args, **kwargs):
            w = cls.current()
            if w is None or not w.active:
                return save(*args, **kwargs)
            w._set_phase("checkpoint")
            try:
                return save(*args, **kwargs)
            finally:
                w._set_phase("data")

        watched_backward.__wrapped__ = backward
        torch.Tensor.backward = watched_backward
        if not hasattr(clip, "_llmwatch_wrapped"):  # llmwatch-instrument put it in place for good
            nn_utils.clip_grad_norm_ = clip_mod.clip_grad_norm_ = _clip_wrapper(clip)
        torch.save = watched_save
        torch.amp.GradScaler.scale = watched_scale
        _BaseDataLoaderIter.__next__ = watched_fetch

    @classmethod
    def preinstall_clip(cls) -> None:
        """Wrap `clip_grad_norm_` now, for good: a script that does `from torch.nn.utils
        import clip_grad_norm_` before any watch exists (llmwatch-instrument calls this as
        soon as torch is imported) still hands its norm over. Inactive, it costs one call."""
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_mod

        clip = nn_utils.clip_grad_norm_
        if not hasattr(clip, "_llmwatch_wrapped"):
            nn_utils.clip_grad_norm_ = clip_mod.clip_grad_norm_ = _clip_wrapper(clip)

    @classmethod
    def _uninstall(cls) -> None:
        import torch
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_mod

        s = cls.saved
        if s:
            torch.Tensor.backward = s["backward"]
            if not hasattr(s["clip"], "_llmwatch_wrapped"):  # else it stays: it was there before us
                nn_utils.clip_grad_norm_ = s["clip"]
                clip_mod.clip_grad_norm_ = s["clip_mod"]
            torch.save = s["save"]
            torch.amp.GradScaler.scale = s["scale"]
            from torch.utils.data.dataloader import _BaseDataLoaderIter

            _BaseDataLoaderIter.__next__ = s["fetch"]
        cls.saved = {}


def _guarded(hook):
    """A hook (or a call the loop makes) that never raises into the loop: a failure is
    logged once and the watch stops measuring; close() still takes it out."""

    @functools.wraps(hook)
    def guarded(self, *args, **kwargs):
        try:
            return hook(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - never raise into the loop
            self._log_once("failed", "llmwatch: watch() failed in %s and stops measuring: %r", hook.__name__, e)
            self.active = False
            return None

    return guarded


class Watch:
    """The hooks on one model and its optimizer(s), recording into one agent (see the
    module docstring). Made by `watch()`; the Agent's loop-side calls (`commands`,
    `ack`, `event`, `record_scalar`, `flush`, `stats`) are forwarded to it."""

    def __init__(self, agent, model=None, optimizers: Iterable = (), *, owns_agent: bool = False,
                 flight_recorder: bool = True, axes: dict | None = None, mesh=None, start_step: int = 0,
                 grad_norm: bool = True, record: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        """`record=False`: a probe for a framework callback that records the step rows itself
        (agent/integrations): each step's values wait for `take(step)`."""
        self.agent = agent
        self._owns_agent = owns_agent
        self._record = record
        self._rows: dict[int, dict] = {}  # record=False: the rows waiting for take()
        self._clock = clock
        self.step = int(start_step)  # optimizer steps done
        self.active = True  # False once closed, or after a failure
        self._closed = False
        self._grad_norm = grad_norm
        self._handles: list = []
        self._params: list = []
        self._bounds = _Bounds()
        self._bounds.add(time.time_ns(), self.step + 1, agent.attempt)
        self._pending: list[tuple] = []  # (step, timings, host tensor, event) waiting for their copy
        self._reset_step()
        self.reader: FlightReader | None = None
        self._logged: set[str] = set()
        optimizers = [o for o in optimizers if o is not None]
        if model is not None:
            self._hook_model(model)
        for i, opt in enumerate(optimizers):
            self._hook_optimizer(opt, primary=i == 0)
        if not optimizers:
            log.warning("llmwatch: watch() without an optimizer: call w.step_boundary() at every step "
                        "boundary")
        elif len(optimizers) > 1:
            log.info("llmwatch: %d optimizers: the first one's step is the step boundary, the others' count "
                     "towards opt_s", len(optimizers))
        _Patches.add(self)
        self._pollers = [self._tell_offset]
        if flight_recorder:
            self.reader = FlightReader.create(agent, step_of=self._bounds.step_of, groups=Groups(axes, mesh),
                                              offset_s=lambda: agent.clock_offset()[0])
            if self.reader is not None:
                self._pollers.insert(0, self.reader.tick)
                agent.bind_seq_source(self.reader.last_entered)
        self._offset_told = math.nan
        for poll in self._pollers:
            agent.add_poller(poll)
        if owns_agent:
            atexit.register(self.close)  # before the agent's own close (atexit runs newest first)

    # -- forwarded to the agent ------------------------------------------------------
    def commands(self):
        return self.agent.commands()

    def clean_through(self) -> int | None:
        return self.agent.clean_through()

    def judged_through(self) -> int | None:
        return self.agent.judged_through()

    def end_wait_s(self) -> float | None:
        return self.agent.end_wait_s()

    def ack(self, command_id: str, status: str, detail: str = "") -> None:
        self.agent.ack(command_id, status, detail)

    def event(self, kind: str, step: int = -1, **data) -> None:
        self.agent.event(kind, step, **data)

    def record_scalar(self, step, name, value) -> None:
        self.agent.record_scalar(step, name, value)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.agent.flush(timeout_s)

    def stats(self) -> dict:
        out = dict(self.agent.stats())
        if self.reader is not None:
            out["flight_recorder"] = self.reader.stats()
        return out

    # -- what the loop may tell ------------------------------------------------------
    @_guarded
    def loss(self, tensor) -> None:
        """This step's loss, when the loop knows it better than the model's output (a
        loss computed outside the model under a GradScaler). Called per micro-batch, the
        step's loss is their mean. No sync: the tensor is read with the step's values."""
        try:
            self._told_losses.append(tensor.detach())
        except AttributeError:
            self._told_losses.append(float(tensor))

    def align(self, steps_done: int) -> None:
        """The loop's own count of optimizer steps done (a framework's global step: it may
        skip an optimizer step under fp16, or resume from a checkpoint)."""
        if steps_done != self.step:
            self.step = int(steps_done)
            self._bounds.add(time.time_ns(), self.step + 1, self.agent.attempt)

    def take(self, step: int) -> dict:
        """record=False: the values measured for `step` (record_step's keywords), once; its
        timings alone while its loss and norm are still on their way from the device."""
        self._drain(wait=False)
        row = self._rows.pop(step, None)
        if row is not None:
            return row
        for pending in self._pending:
            if pending[0] == step:
                return dict(pending[1])
        return {}

    @_guarded
    def step_boundary(self) -> None:
        """A step ended (for a loop without an optimizer watch() could hook)."""
        if self.active:
            self._step_end(opt_s=None)

    def close(self) -> None:
        """Record what is still waiting, take the hooks out, close an agent made here."""
        if self._closed:
            return
        self._closed = True
        self.active = False
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        _Patches.remove(self)
        for poll in self._pollers:
            self.agent.remove_poller(poll)
        try:
            if self.reader is not None:
                self.reader.poll(force=True)  # the last collectives, before the agent's last batch
                self.agent.bind_seq_source(None)
            self._drain(wait=True)
        except Exception as e:  # noqa: BLE001 - never raise into the loop
            self._log_once("failed", "llmwatch: watch() failed in close: %r", e)
        if self._owns_agent:
            atexit.unregister(self.close)
            self.agent.close()
        elif self._record:
            self.agent.flush(timeout_s=5.0)

    # -- hooks -------------------------------------------------------------------------
    def _hook_model(self, model) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._handles.append(model.register_forward_pre_hook(self._fwd_pre))
        self._handles.append(model.register_forward_hook(self._fwd_post))

    def _hook_optimizer(self, opt, *, primary: bool) -> None:
        self._handles.append(opt.register_step_pre_hook(self._opt_pre))
        self._handles.append(opt.register_step_post_hook(self._opt_post if primary else self._opt_post_other))
        if not self._params:
            self._params = [p for g in opt.param_groups for p in g["params"]]

    def _reset_step(self) -> None:
        self.fwd_s = self.bwd_s = self.opt_s = 0.0
        self.data_s = None
        self._fwd_t0 = None
        self._opt_t0 = None
        self._model_losses: list = []
        self._bwd_losses: list = []
        self._told_losses: list = []
        self.clipped_norm = None
        self._in_eval = False

    @_guarded
    def _fwd_pre(self, module, args) -> None:
        if not self.active:
            return
        import torch

        now = self._clock()
        if not torch.is_grad_enabled() or not module.training:
            self._in_eval = True
            self.agent.set_phase("eval", self.step + 1)
            return
        self._in_eval = False  # (an eval forward that raised never reached its post hook)
        self._fwd_t0 = now
        self.agent.set_phase("fwd", self.step + 1)

    @_guarded
    def _fwd_post(self, module, args, output) -> None:
        if not self.active:
            return
        if self._in_eval:
            self._in_eval = False
            self.agent.set_phase("data", self.step + 1)
            return
        if self._fwd_t0 is None:
            return
        self.fwd_s += self._clock() - self._fwd_t0
        self._fwd_t0 = None
        loss = _loss_of(output)
        if loss is not None:
            self._model_losses.append(loss.detach())

    @_guarded
    def on_backward(self, tensor) -> float:
        """Tensor.backward was called on `tensor`: the phase, and a loss candidate; the
        time it starts (None when the watch failed)."""
        if tensor.dim() == 0 and tensor.is_floating_point():
            self._bwd_losses.append(tensor.detach())
        self.agent.set_phase("bwd", self.step + 1)
        return self._clock()

    @_guarded
    def _set_phase(self, phase: str) -> None:
        self.agent.set_phase(phase, self.step + 1)

    @_guarded
    def _opt_pre(self, opt, args, kwargs) -> None:
        if not self.active:
            return
        self._opt_t0 = self._clock()
        self._inner_s = self.fwd_s + self.bwd_s  # a closure (Lightning) runs forward and backward inside step()
        self.agent.set_phase("opt", self.step + 1)

    @_guarded
    def _opt_post_other(self, opt, args, kwargs) -> None:
        if self.active:
            self._add_opt_s()

    def _add_opt_s(self) -> None:
        if self._opt_t0 is not None:
            self.opt_s += self._clock() - self._opt_t0 - (self.fwd_s + self.bwd_s - self._inner_s)

    @_guarded
    def _opt_post(self, opt, args, kwargs) -> None:
        if not self.active:
            return
        self._add_opt_s()
        self._step_end(opt_s=self.opt_s)

    # -- the step's row ------------------------------------------------------------------
    def _step_end(self, *, opt_s: float | None) -> None:
        import torch

        self.step += 1
        step = self.step
        agent = self.agent
        self._bounds.add(time.time_ns(), step + 1, agent.attempt)
        # the loss: what the loop told, else the model's output, else what backward ran on; its
        # finiteness: of all of them (a loop may turn the model's loss into a NaN before backward)
        loss = _mean(self._told_losses or self._model_losses or self._bwd_losses)
        every = self._told_losses + self._model_losses + self._bwd_losses
        finite = _all_finite(every) if every else None
        norm, sharded = self.clipped_norm, False
        if norm is None and self._grad_norm:
            norm, sharded = _grad_norm(self._params)
        timings = {"fwd_s": self.fwd_s if self.fwd_s > 0 else None, "bwd_s": self.bwd_s if self.bwd_s > 0 else None,
                   "opt_s": opt_s, "data_s": self.data_s}
        have = (loss is not None, finite is not None, norm is not None)
        values = [_scalar(v) for v in (loss, finite, norm) if v is not None]
        host, event = None, None
        if values:
            dev = values[0].device
            packed = torch.stack([v.to(dev) for v in values])
            if packed.device.type == "cuda":
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                host.copy_(packed, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                host = packed
        self._pending.append((step, timings, have, sharded, host, event))
        self._drain(wait=False)
        self._reset_step()
        agent.set_phase("data", step + 1)

    def _drain(self, *, wait: bool) -> None:
        """Record the steps whose values reached the host, in order (all, with `wait`)."""
        while self._pending:
            step, timings, have, sharded, host, event = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()  # close(): the loop is over, a sync costs nothing
            self._pending.pop(0)
            vals = host.tolist() if host is not None else []
            loss, finite, norm = (vals.pop(0) if got else None for got in have)
            row = dict(timings, local_loss=loss, grad_norm=None if sharded or norm is None else norm,
                       finite_fwd=-1 if finite is None else int(finite == 1.0),
                       finite_bwd=-1 if norm is None else int(math.isfinite(norm)))
            if self._record:
                self.agent.record_step(step, **row)
            else:
                self._rows[step] = row
                while len(self._rows) > 64:  # never taken (a callback that skips steps)
                    self._rows.pop(next(iter(self._rows)))

    def _tell_offset(self) -> None:
        """Flusher thread: an event when this host's clock offset to the collector is first
        known, and when it moves by more than its error."""
        offset, error = self.agent.clock_offset()
        if math.isfinite(error) and not abs(offset - self._offset_told) <= max(1e-3, error):
            self._offset_told = offset
            self.agent.event("clock_offset", self.step, offset_s=round(offset, 6), error_s=round(error, 6))

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)


def _scalar(v):
    import torch

    if not isinstance(v, torch.Tensor):
        return torch.tensor(float(v))
    to_local = getattr(v, "to_local", None)  # a DTensor (FSDP2's clip_grad_norm_ answers a replicated one)
    if to_local is not None:
        v = to_local()
    return v.detach().float().reshape(())


def _all_finite(values: list):
    """1.0 when every value is finite, else 0.0: on the device, no sync."""
    import torch

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    floats_ok = all(math.isfinite(float(v)) for v in values if not isinstance(v, torch.Tensor))
    if not tensors:
        return 1.0 if floats_ok else 0.0
    dev = tensors[0].device
    ok = torch.stack([torch.isfinite(t.detach().float().reshape(())).to(dev) for t in tensors]).all()
    return ok.float() if floats_ok else ok.float() * 0.0


def _mean(losses: list):
    if not losses:
        return None
    import torch

    if len(losses) == 1:
        return losses[0]
    if all(isinstance(x, torch.Tensor) for x in losses):
        return torch.stack([x.float().reshape(()) for x in losses]).mean()
    return sum(float(x) for x in losses) / len(losses)


def _grad_norm(params: list):
    """(the local gradients' 2-norm on their device, sharded): no host sync. DTensor
    gradients (FSDP2) are read as their local shards; their norm is not the model's."""
    import torch

    grads, sharded = [], False
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = getattr(g, "_local_tensor", None)
        if local is not None:
            g, sharded = local, True
        grads.append(g)
    if not grads:
        return None, sharded
    by_device: dict = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    norms = []
    for gs in by_device.values():
        norms.extend(torch._foreach_norm(gs))
    dev = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.float().to(dev) for n in norms])), sharded


def watch(model=None, optimizer=None, *, agent=None, run_id: str | None = None, url: str | None = None,
          token: str | None = None, token_file: str | None = None, node: str | None = None, config=None,
          axes: dict | None = None, mesh=None, flight_recorder: bool = True, start_step: int = 0,
          grad_norm: bool = True, run_info: dict | None = None) -> Watch:
    """Watch `model` and `optimizer` (or a list of optimizers; the first one's step is the
    step boundary). `agent`: one to record into (yours to close); else one is made from
    `run_id`, `url`, `token`/`token_file` (default $LLMWATCH_RUN_ID, $LLMWATCH_URL,
    $LLMWATCH_TOKEN / $LLMWATCH_TOKEN_FILE) for this torch.distributed rank, closed by
    `Watch.close()`. `axes`/`mesh`: names of process groups for the collectives
    (agent/flight.py); `flight_recorder=False` records no collectives; `grad_norm=False`
    computes no norm where the loop does not clip (its finiteness is then unknown too)."""
    owns = agent is None
    if owns:
        rank, world = env_rank_world()
        agent = make_agent(run_id=run_id, rank=rank, world_size=world, node=node, url=url, token=token,
                           token_file=token_file, config=config,
                           run_info={"config": {"framework": "pytorch", "source": "watch", **(run_info or {})}})
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    try:
        return Watch(agent, model, optimizers, owns_agent=owns, flight_recorder=flight_recorder, axes=axes, mesh=mesh,
                     start_step=start_step, grad_norm=grad_norm)
    except Exception:
        if owns:
            agent.close()
        raise
