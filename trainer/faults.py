"""Fault injection for demos and tests.

    --inject nan@step=40,rank=2[,mode=data|transient|device]
    --inject spike@step=60[,mode=data|step]
    --inject straggler@rank=3,from=30,factor=1.5[,to=80][,on=hardware|place]
    --inject slowlink@rank=3,axis=tp,from=30,factor=4[,to=80][,on=hardware|place]
    --inject slowio@rank=2,from=30,factor=3,what=data|ckpt[,to=80][,on=hardware|place]
    --inject hang@rank=1,step=80
    --inject crash@rank=1,step=80[,mode=once|every]
    --inject bitflip@rank=1,step=25[,target=param|optim]
    --inject devhealth@rank=1,from=30,what=ecc|thermal|memory[,to=80]   (no to for ecc)
    --inject overflow@rank=1,from=40,to=46
    --inject jitter@pct=10[,seed=S]

Every fault really happens: a NaN propagates through the forward and backward
passes, a spike is a batch of random bytes, a straggler's compute really takes
`factor` times as long, a slow link's communication on its axis really takes
`factor` times as long (the comm layer waits inside the op, trainer/comm.py: its
compute is untouched), a slow storage's data fetch or checkpoint shard writes
really take `factor` times as long (`slowio`, below), a hung rank stops entering
collectives, a crashed rank's process exits, an overflowing rank's gradients
really go infinite (the fp16 scaler skips the step and backs off), and jitter
really stretches every rank's compute by a random factor each step.

`bitflip` is silent data corruption: after step S's update one bit of one element
of that rank's parameters (or optimizer state, `target=optim`) really flips on the
device (`FaultInjector.after_update`, trainer/integrity.py), once; its replica
then differs from its dp peers, which only their checksums show.

`slowio` is a slow storage node under one rank. `what=data`: its data loader
(trainer/data.py) serves each step F times slower than the rank consumes it: the
fetch that the prefetch hid behind the rank's work since the previous step now
takes F times that long, so `next()` really waits (F - 1) x that time and the
step's `data_s` shows it (a share of about 1 - 1/F of the step). `what=ckpt`: each
of its checkpoint shard writes (trainer/checkpoint.py) really takes F times as
long, in the background writer, and the shard's `write_s` shows it. One
ground-truth row at the first step of the window (`what`, `factor`).

`devhealth` is a failing device or host, seen only in the agent's device-health
samples (agent/device_health.py: one per heartbeat, on the agent's flusher
thread): from step S on (to E), the injector rewrites the samples of the rank
(`FaultInjector.device_health`, installed with `agent.set_health_overlay` in
trainer/worker.py) on their way into the agent's buffer, so the collector
receives them like any other sample. It is a *simulated* device: training itself
is untouched, and on a CPU host, whose GPU columns are NULL, the injector supplies
them (a healthy device before S: 60 C, no throttle reason, no ECC error).
`what=ecc`: from S on the volatile uncorrectable ECC count is 2 above the
device's, and one more page is retired; it never goes back (a rollback to before
S does not undo errors that happened, nor does a restart: only a driver reload
resets the count), so `to` is refused for it. `thermal`: the throttle reasons
add HW thermal slowdown (0x40) and the temperature is at least 95 C. `memory`:
the host's MemAvailable is 1% of MemTotal. Memory is the host's, so `memory`
shows in the samples of every rank on the named rank's node (the detector judges
a node by its lowest reporting rank). One ground-truth row, from the named rank,
at the first step of the window (`what`).

`jitter` is background noise, not a fault: each rank's compute is stretched by a
factor drawn uniformly from [1, 1 + pct/100] per step (seeded by `seed`, the rank,
the attempt and the step: reproducible, independent across ranks), by the same
waiting as a straggler's. Its one row in the ground truth (kind `jitter`, at the
first step) records that it was on; it is nothing to detect.

`nan` has three modes, the three verdicts the healing logic must tell apart:
`transient` fires once (a cosmic ray: a replay is clean), `device` fires on its
rank on every step from `step` on, in every attempt, whatever the data (broken
hardware: only removing the rank helps), and `data` (the default) is data-tied.

Data-tied faults (`spike`, `nan` with `mode=data`) are attached to the *samples*
of the step where they first fire, not to the step number: replaying that batch
reproduces them, and a rollback that skips the window makes them go away. That is
the difference the root-cause logic tests for (data vs hardware). A data `nan`
poisons the samples of the injected rank's dp replica only; afterwards it fires on
whichever rank holds any of them (after a replica swap, another replica) at the
injected rank's (tp, pp) stage, and not on the injected rank when it holds other
samples. `spike` poisons the whole global batch on every rank. A `spike` with
`mode=step` is not the data's: it fires at its step in every attempt, whatever
the batch (an optimizer's instability): the rerun reproduces it, a data verdict
skips a batch that was never the cause, and it comes back.

A `crash` fires once (`mode=once`, the default: a node that failed), or every time
its rank reaches its step (`mode=every`: a software bug, or data no skip removes;
each restart from a checkpoint before it crashes there again, and only a stop ends
the loop).

Injections name ranks of the *original* layout: after an elastic restart with
fewer dp replicas the rank numbers change, but a fault belongs to hardware, so
each injector knows its process's original rank (`hw_rank`) and rank-bound faults
follow it. Ground-truth rows say `rank` = that original rank (and `current_rank`
when the two differ).

A slow-down (`straggler`, `slowlink`, `slowio`) with `on=place` is the place's,
not the hardware's: it follows the rank of the *current* layout (its data
shard, its stage, its links), so whatever node holds that rank after a restart,
a spare that took the isolated node's place included, is as slow there. That is
the fault a replacement cannot fix, and the policy must stop rather than loop
(docs/healing.md). Its ground-truth row says `rank` = the current rank and
`on` = `place`; the node that holds it writes its own row.

The ground truth goes to `<run dir>/injections.jsonl`. Nothing in the product
reads it; only tests and offline scoring do. Each rank's injector keeps its own
state (which windows are poisoned, which one-shot faults fired) in
`<run dir>/.faults-state-rank<R>.json` (R the original rank), one file per rank
so that no two processes write one file, and on disk so that it survives a
restart, also one that renumbers the ranks.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from agent.device_health import FIELDS as HEALTH_FIELDS
from trainer.config import ConfigError

_KEYS: dict[str, dict[str, type]] = {
    "nan": {"step": int, "rank": int, "mode": str},
    "spike": {"step": int, "mode": str},
    "straggler": {"rank": int, "from": int, "factor": float, "to": int, "on": str},
    "slowlink": {"rank": int, "axis": str, "from": int, "factor": float, "to": int, "on": str},
    "slowio": {"rank": int, "from": int, "factor": float, "what": str, "to": int, "on": str},
    "hang": {"rank": int, "step": int},
    "crash": {"rank": int, "step": int, "mode": str},
    "overflow": {"rank": int, "from": int, "to": int},
    "jitter": {"pct": float, "seed": int},
    "bitflip": {"rank": int, "step": int, "target": str},
    "devhealth": {"rank": int, "from": int, "what": str, "to": int},
}
_NAN_MODES = ("data", "transient", "device")
_SPIKE_MODES = ("data", "step")  # spike: tied to the samples, or to the step whatever its batch
_CRASH_MODES = ("once", "every")  # crash: one failure, or at its step in every attempt
_FLIP_TARGETS = ("param", "optim")  # bitflip: a parameter or an optimizer-state element
_LINK_AXES = ("dp", "tp", "pp")  # slowlink: the axis whose ops are stretched
_IO_WHATS = ("data", "ckpt")  # slowio: the data fetch or the checkpoint shard writes
_HEALTH_WHATS = ("ecc", "thermal", "memory")  # devhealth: what the device-health samples show
_ONS = ("hardware", "place")  # a slow-down follows the original rank's hardware, or the current rank's place
_REQUIRED = {
    "nan": ("step", "rank"),
    "spike": ("step",),
    "straggler": ("rank", "from", "factor"),
    "slowlink": ("rank", "axis", "from", "factor"),
    "slowio": ("rank", "from", "factor", "what"),
    "hang": ("rank", "step"),
    "crash": ("rank", "step"),
    "overflow": ("rank", "from", "to"),
    "jitter": ("pct",),
    "bitflip": ("rank", "step"),
    "devhealth": ("rank", "from", "what"),
}


@dataclass(frozen=True, slots=True)
class Injection:
    kind: str
    step: int = -1  # nan, spike, hang, crash; `from` for straggler
    rank: int = -1  # -1: every rank (spike)
    mode: str = "data"  # nan: data | transient | device; spike: data | step; crash: once | every
    factor: float = 1.0  # straggler, slowlink; jitter: 1 + pct / 100
    to_step: int = 1 << 62  # straggler, slowlink, slowio, overflow, devhealth: last affected step
    seed: int = 0  # jitter
    axis: str = ""  # slowlink: dp | tp | pp
    what: str = ""  # slowio: data | ckpt; devhealth: ecc | thermal | memory
    target: str = ""  # bitflip: param | optim
    on: str = "hardware"  # straggler, slowlink, slowio: the original rank's hardware, or the current rank's place

    @property
    def name(self) -> str:
        return (f"{self.kind}@step={self.step},rank={self.rank}" + (f",axis={self.axis}" if self.axis else "")
                + (f",what={self.what}" if self.what else ""))


def parse_injection(spec: str, *, world_size: int | None = None) -> Injection:
    kind, sep, rest = spec.partition("@")
    kind = kind.strip()
    if kind not in _KEYS:
        raise ConfigError(f"--inject {spec!r}: unknown kind {kind!r} (known: {', '.join(_KEYS)})")
    if not sep and _REQUIRED[kind]:
        raise ConfigError(f"--inject {spec!r}: needs {', '.join(k + '=' for k in _REQUIRED[kind])}")
    values: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or key not in _KEYS[kind]:
            raise ConfigError(f"--inject {spec!r}: bad field {item!r} (fields of {kind}: {', '.join(_KEYS[kind])})")
        try:
            values[key] = _KEYS[kind][key](raw)
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: {key}={raw!r} is not a {_KEYS[kind][key].__name__}") from None
    missing = [k for k in _REQUIRED[kind] if k not in values]
    if missing:
        raise ConfigError(f"--inject {spec!r}: missing {', '.join(missing)}")
    rank = int(values.get("rank", -1))
    if world_size is not None and rank >= world_size:
        raise ConfigError(f"--inject {spec!r}: rank {rank} outside world of {world_size}")
    mode = str(values.get("mode", "once" if kind == "crash" else "data"))
    modes = {"spike": _SPIKE_MODES, "crash": _CRASH_MODES}.get(kind, _NAN_MODES)
    if mode not in modes:
        raise ConfigError(f"--inject {spec!r}: mode must be one of {', '.join(modes)}")
    factor = float(values.get("factor", 1.0))
    axis = str(values.get("axis", ""))
    if kind == "slowlink" and axis not in _LINK_AXES:
        raise ConfigError(f"--inject {spec!r}: axis must be one of {', '.join(_LINK_AXES)}")
    what = str(values.get("what", ""))
    if kind == "slowio" and what not in _IO_WHATS:
        raise ConfigError(f"--inject {spec!r}: what must be one of {', '.join(_IO_WHATS)}")
    if kind == "devhealth" and what not in _HEALTH_WHATS:
        raise ConfigError(f"--inject {spec!r}: what must be one of {', '.join(_HEALTH_WHATS)}")
    if kind == "devhealth" and what == "ecc" and "to" in values:
        raise ConfigError(f"--inject {spec!r}: what=ecc takes no to (an ECC error count never goes back)")
    if kind in ("straggler", "slowlink", "slowio") and factor < 1.0:
        raise ConfigError(f"--inject {spec!r}: factor must be >= 1")
    if kind == "jitter":
        pct = float(values["pct"])
        if not 0.0 <= pct <= 100.0:
            raise ConfigError(f"--inject {spec!r}: pct must be within 0..100")
        factor = 1.0 + pct / 100.0
    step = int(values.get("from", values.get("step", 0 if kind == "jitter" else -1)))
    if step < 0:
        raise ConfigError(f"--inject {spec!r}: step must be >= 0")
    to_step = int(values.get("to", 1 << 62))
    if kind in ("overflow", "slowlink", "slowio", "devhealth") and to_step < step:
        raise ConfigError(f"--inject {spec!r}: to must be >= from")
    on = str(values.get("on", "hardware"))
    if on not in _ONS:
        raise ConfigError(f"--inject {spec!r}: on must be one of {', '.join(_ONS)}")
    target = str(values.get("target", "param" if kind == "bitflip" else ""))
    if kind == "bitflip" and target not in _FLIP_TARGETS:
        raise ConfigError(f"--inject {spec!r}: target must be one of {', '.join(_FLIP_TARGETS)}")
    return Injection(kind=kind, step=step, rank=rank, mode=mode, factor=factor, to_step=to_step,
                     seed=int(values.get("seed", 0)), axis=axis, what=what, target=target, on=on)


def parse_injections(specs, *, world_size: int | None = None) -> list[Injection]:
    return [parse_injection(s, world_size=world_size) for s in specs]


@dataclass(frozen=True, slots=True)
class StepFaults:
    """What the engine must do to this rank in this step."""

    nan: bool = False  # poison this rank's activations (first micro-batch)
    slowdown: float = 1.0  # compute takes this many times as long
    spike: bool = False  # the batch was replaced by random bytes (already applied)
    overflow: bool = False  # this rank's gradients go infinite (the fp16 scaler skips and backs off)
    slow_links: tuple[tuple[str, float], ...] = ()  # (axis, factor): that axis's ops take factor x as long


NO_FAULTS = StepFaults()

# devhealth: where the sample (agent/device_health.py FIELDS) holds what a fault changes
_TEMP, _REASONS, _ECC, _RETIRED, _AVAIL, _TOTAL = (HEALTH_FIELDS.index(f) for f in (
    "temperature_c", "throttle_reasons", "ecc_uncorrectable", "retired_pages", "mem_available_bytes",
    "mem_total_bytes"))
_HEALTHY_GPU = ((_TEMP, 60.0), (_REASONS, 0), (_ECC, 0), (_RETIRED, 0))  # the simulated GPU's columns
HW_THERMAL_SLOWDOWN = 0x40  # NVML clock event reason
HOT_C = 95.0
ECC_ERRORS = 2  # what=ecc: new uncorrectable errors from the first affected step on
MEM_AVAILABLE_SHARE = 0.01  # what=memory: MemAvailable / MemTotal
_SIMULATED_MEM_TOTAL = 64 << 30  # a host whose /proc/meminfo says nothing


def _jitter_factor(inj: Injection, rank: int, attempt: int, step: int) -> float:
    """A reproducible draw from [1, inj.factor], independent per (seed, rank, attempt, step)."""
    u = random.Random(f"jitter/{inj.seed}/{rank}/{attempt}/{step}").random()
    return 1.0 + (inj.factor - 1.0) * u


class FaultInjector:
    """Decides, per step and rank, which faults fire; writes the ground truth.

    `rank` and `tp`/`pp`/`dp` are this process's place in the current layout;
    `hw_rank` (default: `rank`) and `orig_dp` (default: `dp`) describe the original
    layout, in which the injections name their ranks (tp and pp never change)."""

    def __init__(self, injections: list[Injection], *, rank: int, node: int, run_dir: str | os.PathLike | None,
                 clock=time.time, hw_rank: int | None = None, tp: int = 1, pp: int = 1, dp: int = 1,
                 orig_dp: int | None = None, ranks_per_node: int = 1) -> None:
        self.injections = injections
        self.rank = rank
        self.hw_rank = rank if hw_rank is None else hw_rank
        self.node = node
        self.ranks_per_node = ranks_per_node  # a devhealth memory fault is its node's: every rank there shows it
        self.clock = clock
        self.tp, self.pp, self.dp = tp, pp, dp
        self.orig_dp = dp if orig_dp is None else orig_dp
        self.run_dir = Path(run_dir) if run_dir else None
        self._state = {"windows": {}, "fired": []}  # windows: injection name -> [epoch, lo, hi]
        if self.run_dir is not None and self._state_path.exists():
            try:
                self._state = json.loads(self._state_path.read_text())
            except (OSError, json.JSONDecodeError):
                pass

    @property
    def _state_path(self) -> Path:
        assert self.run_dir is not None
        return self.run_dir / f".faults-state-rank{self.hw_rank}.json"

    def __bool__(self) -> bool:
        return bool(self.injections)

    def _save_state(self) -> None:
        if self.run_dir is None:
            return
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state))
        os.replace(tmp, self._state_path)

    def _mark_fired(self, key: str) -> bool:
        """Record a one-shot event; False if it was recorded before (also by an earlier process)."""
        if key in self._state["fired"]:
            return False
        self._state["fired"].append(key)
        self._save_state()
        return True

    # -- link times (trainer/comm.py `link_memory`) -----------------------------
    def link_times(self) -> dict[tuple[str, str, int], float]:
        """The healthy link times this hardware's rank saw before a slow link began (an
        earlier round's), for a restarted rank to stretch by: its own measures are all
        slowed ones, which hold the waits for peers."""
        out = {}
        for key, s in (self._state.get("links") or {}).items():
            op, axis, nbytes = key.split("/")
            out[(op, axis, int(nbytes))] = float(s)
        return out

    def remember_links(self, links: dict[tuple[str, str, int], float]) -> None:
        known = self._state.setdefault("links", {})
        for (op, axis, nbytes), s in links.items():
            k = f"{op}/{axis}/{nbytes}"
            known[k] = min(float(s), known.get(k, float(s)))
        self._save_state()

    # Set by the loop around a rollback's rerun of the suspect step (trainer/diagnosis.py):
    # what fires then is the diagnosis reproducing the fault, and its ground truth row
    # says so ("probe": true), so scoring does not count it as a fault of its own.
    probing: bool = False

    def _truth(self, inj: Injection, step: int, attempt: int, **extra) -> None:
        if self.run_dir is None:
            return
        place = inj.on == "place"
        row = {"kind": inj.kind, "rank": (self.rank if place else self.hw_rank) if inj.rank >= 0 else -1,
               "node": self.node, "step": step, "attempt": attempt, "ts": self.clock(), "spec": inj.name, **extra}
        if self.probing:
            row["probe"] = True
        if place:
            row["on"] = "place"
        elif self.rank != self.hw_rank:
            row["current_rank"] = self.rank
        if inj.kind == "nan":
            row["mode"] = inj.mode
        if inj.kind in ("straggler", "slowlink", "slowio"):
            row["factor"] = inj.factor
        if inj.kind == "slowlink":
            row["axis"] = inj.axis
        if inj.kind in ("slowio", "devhealth"):
            row["what"] = inj.what
        with open(self.run_dir / "injections.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _mine(self, inj: Injection) -> bool:
        return inj.rank < 0 or inj.rank == (self.rank if inj.on == "place" else self.hw_rank)

    # -- layout ------------------------------------------------------------
    def _stage(self) -> tuple[int, int]:
        """(tp_rank, pp_rank) of this process in the current layout."""
        return self.rank % self.tp, self.rank // (self.tp * self.dp)

    def _orig_coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of `rank` in the original layout."""
        return rank % self.tp, (rank // self.tp) % self.orig_dp, rank // (self.tp * self.orig_dp)

    def _replica_of(self, inj: Injection, window: tuple[int, int, int]) -> tuple[int, int, int]:
        """The samples of `window` (a global batch) that the injected rank's replica holds:
        replica d holds [lo + d*n, lo + (d+1)*n), n = (hi - lo) // dp. Its dp index in the
        current layout is the original one; after an elastic restart that renumbered it
        away (index >= dp) it wraps around, which every rank computes alike."""
        epoch, lo, hi = window
        d = self._orig_coords(inj.rank)[1] % self.dp
        n = (hi - lo) // self.dp
        return (epoch, lo + d * n, lo + (d + 1) * n)

    def _in_window(self, inj: Injection, window: tuple[int, int, int]) -> bool:
        w = self._state["windows"].get(inj.name)
        if w is None:
            return False
        epoch, lo, hi = window
        return w[0] == epoch and lo < w[2] and w[1] < hi

    # -- per step ----------------------------------------------------------
    def step_faults(self, step: int, attempt: int, window: tuple[int, int, int], *,
                    replica_window: tuple[int, int, int] | None = None) -> StepFaults:
        """Faults of this step. `window` is (epoch, first sample, end sample) of the
        step's global batch, `replica_window` the part this rank was served
        (meta["replica_window"]): data-tied faults follow those samples. Without
        `replica_window` a data `nan` poisons the global window on the injected rank."""
        if not self.injections:
            return NO_FAULTS
        nan = spike = overflow = False
        slowdown = jitter = 1.0
        links: dict[str, float] = {}
        for inj in self.injections:
            if inj.kind == "spike" and inj.mode == "step":
                if step == inj.step and self._mark_fired(f"{inj.name}/attempt={attempt}"):
                    self._truth(inj, step, attempt)  # one row per attempt
                spike |= step == inj.step
            elif inj.kind == "spike":
                spike |= self._data_tied(inj, step, attempt, window, None)
            elif inj.kind == "nan":
                nan |= self._nan(inj, step, attempt, window, replica_window)
            elif inj.kind == "straggler" and self._mine(inj) and inj.step <= step <= inj.to_step:
                if self._mark_fired(inj.name):
                    self._truth(inj, step, attempt)
                slowdown = max(slowdown, inj.factor)
            elif inj.kind == "slowlink" and self._mine(inj) and inj.step <= step <= inj.to_step:
                if self._mark_fired(inj.name):
                    self._truth(inj, step, attempt)
                links[inj.axis] = max(links.get(inj.axis, 1.0), inj.factor)
            elif inj.kind in ("slowio", "devhealth") and self._mine(inj) and inj.step <= step <= inj.to_step:
                # the fault itself: slowio_factor (data, checkpoint), device_health (the agent's samples)
                if self._mark_fired(inj.name):
                    self._truth(inj, step, attempt)
            elif inj.kind == "overflow" and self._mine(inj) and inj.step <= step <= inj.to_step:
                if self._mark_fired(inj.name):
                    self._truth(inj, step, attempt, to=inj.to_step)
                overflow = True
            elif inj.kind == "jitter" and step >= inj.step:
                if self._mark_fired(inj.name):
                    self._truth(inj, step, attempt, pct=round(100.0 * (inj.factor - 1.0), 6), seed=inj.seed)
                jitter = max(jitter, _jitter_factor(inj, self.rank, attempt, step))
        if not (nan or spike or overflow or links) and slowdown == jitter == 1.0:
            return NO_FAULTS
        return StepFaults(nan=nan, slowdown=slowdown * jitter, spike=spike, overflow=overflow,
                          slow_links=tuple(sorted(links.items())))

    def preflight_factors(self) -> tuple[float, float]:
        """(compute, link): how many times as long this rank's pre-flight matmuls and its
        node's pre-flight link ops take (trainer/preflight.py): the straggler and slowlink
        injections that start at step 0 (1.0: none). Pure: the ground truth is written
        by `step_faults` at the first step, as for every slow-down."""
        compute = link = 1.0
        for inj in self.injections:
            if inj.step == 0 and self._mine(inj) and inj.kind == "straggler":
                compute = max(compute, inj.factor)
            elif inj.step == 0 and self._mine(inj) and inj.kind == "slowlink":
                link = max(link, inj.factor)
        return compute, link

    def preflight_hang(self) -> bool:
        """Whether this rank stops answering the pre-flight checks (a hang at step 0: a peer
        that never answers, trainer/preflight.py). Writes the ground truth when it does."""
        for inj in self.injections:
            if inj.kind == "hang" and inj.step == 0 and self._mine(inj) and self._mark_fired(inj.name):
                self._truth(inj, 0, 0, pid=os.getpid())
                return True
        return False

    def slowio_factor(self, what: str, step: int) -> float:
        """How many times as long this rank's data fetch (`what="data"`) or checkpoint
        shard writes (`"ckpt"`) take at `step` (1.0: no slowio). Pure: the ground truth
        is written by `step_faults` (every rank calls it each step). The data loader
        and the checkpoint writer call it, the writer from its background thread."""
        factor = 1.0
        for inj in self.injections:
            if inj.kind == "slowio" and inj.what == what and self._mine(inj) and inj.step <= step <= inj.to_step:
                factor = max(factor, inj.factor)
        return factor

    # -- device health ---------------------------------------------------------
    def _health_faults(self) -> list[Injection]:
        """The devhealth injections this process's samples show: its own rank's, and a
        `memory` one of any rank on its node (the host's memory is every rank's there)."""
        return [inj for inj in self.injections if inj.kind == "devhealth" and (
            self._mine(inj) or (inj.what == "memory" and inj.rank // self.ranks_per_node == self.node))]

    def shows_device_faults(self) -> bool:
        """This process's device-health samples show an injected fault: install
        `device_health` as the agent's overlay (trainer/worker.py)."""
        return bool(self._health_faults())

    def device_health(self, sample: tuple, step: int) -> tuple:
        """The agent's device-health overlay (`Agent.set_health_overlay`): `sample`, the
        values of agent/device_health.py FIELDS, as this rank's devhealth faults make it
        at `step` (the module doc). A simulated device: GPU columns the host has not
        (None) are a healthy GPU's for an ecc or thermal fault. Called on the agent's
        flusher thread: it only reads (the ground truth is `step_faults`'s, on the
        training thread; its fired list says an ECC fault started, also in an earlier
        process)."""
        out = list(sample)
        for inj in self._health_faults():
            if inj.what in ("ecc", "thermal"):
                for i, healthy in _HEALTHY_GPU:
                    if out[i] is None:
                        out[i] = healthy
            if inj.what == "ecc":
                if step >= inj.step or inj.name in self._state["fired"]:  # errors that happened stay counted
                    out[_ECC] = int(out[_ECC]) + ECC_ERRORS
                    out[_RETIRED] = int(out[_RETIRED]) + 1
            elif not inj.step <= step <= inj.to_step:
                continue
            elif inj.what == "thermal":
                out[_REASONS] = int(out[_REASONS]) | HW_THERMAL_SLOWDOWN
                out[_TEMP] = max(float(out[_TEMP]), HOT_C)
            else:  # memory
                total = out[_TOTAL] or _SIMULATED_MEM_TOTAL
                out[_TOTAL], out[_AVAIL] = total, int(total * MEM_AVAILABLE_SHARE)
        return tuple(out)

    def _nan(self, inj: Injection, step: int, attempt: int, window: tuple[int, int, int],
             replica_window: tuple[int, int, int] | None) -> bool:
        if inj.mode == "device":
            if not (self._mine(inj) and step >= inj.step):
                return False
            if self._mark_fired(f"{inj.name}/attempt={attempt}"):  # one row per attempt, not per step
                self._truth(inj, step, attempt)
            return True
        if inj.mode == "transient":
            # every rank marks it at the step, so that no rank fires it in a later attempt
            if step != inj.step or not self._mark_fired(inj.name) or not self._mine(inj):
                return False
            self._truth(inj, step, attempt, samples=list(window), replay=False)
            return True
        return self._data_tied(inj, step, attempt, window, replica_window)

    def _data_tied(self, inj: Injection, step: int, attempt: int, window: tuple[int, int, int],
                   replica_window: tuple[int, int, int] | None) -> bool:
        """Record the poisoned samples at the first firing (every rank, into its own state,
        so that each decides alone later), then fire wherever they are served again.
        With `replica_window` the samples are the injected replica's and the fault goes
        with them to any rank of the injected stage; without, the global window on the
        injected rank (spike: every rank)."""
        first = step == inj.step and inj.name not in self._state["windows"]
        if first:
            poisoned = window if replica_window is None else self._replica_of(inj, window)
            self._state["windows"][inj.name] = list(poisoned)
            self._save_state()
            fires = self._mine(inj)
        elif replica_window is None:
            fires = self._mine(inj) and self._in_window(inj, window)
        else:
            tp_rank, _, pp_rank = self._orig_coords(inj.rank)
            fires = self._stage() == (tp_rank, pp_rank) and self._in_window(inj, replica_window)
        if fires:
            served = window if replica_window is None else replica_window
            self._truth(inj, step, attempt, samples=list(served), replay=not first)
        return fires

    # -- silent data corruption -----------------------------------------------
    def after_update(self, step: int, attempt: int, tensors) -> None:
        """`bitflip`: after step `step`'s optimizer update, flip one bit of one element of
        this rank's parameters (`target=param`) or optimizer state (`optim`), on the
        device (trainer/integrity.py: the top mantissa bit, a finite change). One-shot:
        a later attempt that replays the step does not flip it again (a memory error is
        not in the data). `tensors(target)` lists (name, tensor) of that kind; the
        element is drawn reproducibly from (rank, step). Ground truth: the tensor's
        name, the flat index, the bit, and the bits before and after."""
        for inj in self.injections:
            if inj.kind != "bitflip" or inj.step != step or not self._mine(inj) or not self._mark_fired(inj.name):
                continue
            from trainer.integrity import flip_bit

            candidates = [(n, t) for n, t in tensors(inj.target) if t.numel()]
            if not candidates:
                continue
            rng = random.Random(f"bitflip/{self.hw_rank}/{step}")
            name, t = candidates[rng.randrange(len(candidates))]
            index = rng.randrange(t.numel())
            bit, before, after = flip_bit(t, index)
            self._truth(inj, step, attempt, target=inj.target, tensor=name, index=index, bit=bit,
                        bits_before=before, bits_after=after)

    def before_step(self, step: int, attempt: int) -> None:
        """One-shot process faults: hang or crash this rank at the start of `step`."""
        for inj in self.injections:
            if inj.kind not in ("hang", "crash") or inj.step != step or not self._mine(inj):
                continue
            every = inj.kind == "crash" and inj.mode == "every"
            if not self._mark_fired(f"{inj.name}/attempt={attempt}" if every else inj.name):
                continue
            self._truth(inj, step, attempt, pid=os.getpid())
            if inj.kind == "crash":
                os._exit(17)
            while True:  # hang: stop entering collectives, keep the process (and its heartbeats) alive
                time.sleep(3600)
