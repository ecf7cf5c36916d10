"""`NoopAgent`: the agent's methods, doing nothing.

The trainer uses it when telemetry is off, so call sites stay unconditional
(like nanoGPT's DummyWandb). Every method costs one Python call and returns.
"""

from __future__ import annotations

from typing import Callable

from agent.agent import Command


class NoopAgent:
    """Same public methods as `Agent`; records nothing, sends nothing, never raises."""

    def __init__(self, *args, **kwargs) -> None:
        self.attempt = 0
        self.incarnation = ""

    def start(self) -> None:
        return None

    def record_step(self, step, *, loss=None, grad_norm=None, loss_scale=None, lr=None, tokens=None, step_s=None,
                    fwd_s=None, bwd_s=None, opt_s=None, data_s=None, comm_exposed_s=None, mem_bytes=None,
                    skipped=False, local_loss=None, finite_fwd=-1, finite_bwd=-1, sample_epoch=-1, sample_from=-1,
                    sample_to=-1) -> None:
        return None

    def collective(self, step, seq, group_seq, op, axis, group_id, peer, nbytes, start_ts, duration_s,
                   wait_s, attempt=None) -> None:
        return None

    def add_poller(self, fn: Callable[[], object]) -> None:
        return None

    def remove_poller(self, fn: Callable[[], object]) -> None:
        return None

    def clock_offset(self) -> tuple[float, float]:
        return 0.0, 0.0

    def record_scalar(self, step, name, value) -> None:
        return None

    def event(self, kind: str, step: int = -1, *, of_attempt: int | None = None, **data) -> None:
        return None

    def set_phase(self, phase: str, step: int) -> None:
        return None

    def bind_seq_source(self, fn: Callable[[], int | tuple]) -> None:
        return None

    def set_health_overlay(self, fn: Callable[[tuple, int], tuple] | None) -> None:
        return None

    def set_attempt(self, n: int) -> None:
        self.attempt = int(n)

    def commands(self) -> list[Command]:
        return []

    def clean_through(self) -> int | None:
        return None

    def judged_through(self) -> int | None:
        return None

    def end_wait_s(self) -> float | None:
        return None

    def ack(self, command_id: str, status: str, detail: str = "") -> None:
        return None

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        return None

    def stats(self) -> dict:
        return {"enabled": False}
