"""NoopAgent mirrors Agent's public methods, so call sites stay unconditional."""

import inspect

from agent import Agent, AgentConfig, Command, NoopAgent


def _public_methods(cls) -> dict:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


def test_noop_has_every_public_method_of_agent_with_the_same_signature():
    agent_methods = _public_methods(Agent)
    assert {"record_step", "collective", "record_scalar", "event", "set_phase", "bind_seq_source", "set_attempt",
            "commands", "ack", "flush", "close", "stats", "start"} <= set(agent_methods)
    assert _public_methods(NoopAgent) == agent_methods


def test_noop_public_attributes_and_calls_do_nothing():
    agent = Agent(AgentConfig(capacity=1), run_id="r", rank=0)
    noop = NoopAgent(AgentConfig(), run_id="r", rank=0)
    assert "attempt" in vars(agent) and "attempt" in vars(noop)
    noop.start()
    noop.record_step(1, loss=1.0)
    noop.record_step(2, loss=1.0, grad_norm=1.0, loss_scale=1.0, lr=1.0, tokens=1, step_s=1.0, fwd_s=1.0, bwd_s=1.0,
                     opt_s=1.0, data_s=1.0, comm_exposed_s=1.0, mem_bytes=1, skipped=False)
    noop.collective(1, 0, 0, "all_reduce", "dp", 0, -1, 8, 1.0, 0.1, 0.1)
    noop.record_scalar(1, "x", 1.0)
    noop.event("restart", step=1, reason="test")
    noop.set_phase("forward", 1)
    noop.bind_seq_source(lambda: 1)
    noop.set_attempt(3)
    noop.ack("c1", "done")
    assert noop.attempt == 3
    assert noop.commands() == [] and noop.flush(0.1) is True and noop.stats() == {"enabled": False}
    noop.close()
    assert Command("c1", "stop").args == {}
