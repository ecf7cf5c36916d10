"""What the framework callback tests share: a collector, its commands, a command posted
at a chosen step and delivered to the rank's mailbox before the callback looks."""

from __future__ import annotations

from agent import AgentConfig
from tests.polling import wait_until


def post_command(col, run_id: str, kind: str, args: dict | None = None) -> dict:
    with col.client() as c:
        r = c.post(f"/v1/runs/{run_id}/commands", json={"kind": kind, "args": args or {}})
        r.raise_for_status()
        return r.json()


def commands(col, run_id: str) -> dict[str, dict]:
    """The run's commands by kind (the last of each)."""
    with col.client() as c:
        r = c.get(f"/v1/runs/{run_id}/commands")
        r.raise_for_status()
        return {cmd["kind"]: cmd for cmd in r.json()}


def deliver(col, agent, run_id: str, kind: str, args: dict | None = None) -> None:
    """Post a command and flush until the agent's mailbox holds it (the next step boundary acts on it).
    A flush first: a command for a run the collector has not stored yet is a 404, and a fit's
    first steps can come before the agent's first batch is committed."""
    assert agent.flush(10.0), "the agent's first rows never reached the collector"
    post_command(col, run_id, kind, args)
    assert wait_until(lambda: agent.flush(2.0) and len(agent._mailbox) > 0, 30.0, 0.05), f"{kind} not delivered"


def settled(col, run_id: str, kinds: tuple[str, ...]) -> dict[str, dict]:
    """Wait until every command of `kinds` has an ack; the commands by kind."""
    got: dict = {}

    def done() -> bool:
        got.update(commands(col, run_id))
        return all(got.get(k, {}).get("acks") for k in kinds)

    assert wait_until(done, 30.0, 0.1), got
    return got


def agent_config(tmp_path) -> AgentConfig:
    return AgentConfig(flush_interval_s=0.2, heartbeat_interval_s=0.5, spool_dir=str(tmp_path / "spool"))
