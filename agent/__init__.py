"""llmwatch agent: in-process telemetry for any training loop (stdlib only).

Record from the training thread at the cost of a few array stores; a daemon
thread batches the rows (agent/wire.py format), POSTs them to the collector,
spools them to disk while it is away, heartbeats once a second and brings back
control commands. Example, for any loop:

    from agent import Agent, AgentConfig, NoopAgent

    cfg = AgentConfig(url="http://127.0.0.1:4318", token="secret")
    agent = Agent(cfg, run_id="my-run", rank=0, node="node0", coords={"dp": 0}) if enabled else NoopAgent()
    agent.start()
    for step in range(num_steps):
        agent.set_phase("train", step)
        t0 = time.perf_counter(); loss = train_step(); step_s = time.perf_counter() - t0
        agent.record_step(step, loss, grad_norm, 1.0, lr, tokens, step_s,
                          fwd_s, bwd_s, opt_s, data_s, 0.0, mem_bytes, False)  # Python floats, not tensors
        for cmd in agent.commands():                      # at a step boundary
            agent.ack(cmd.id, "rejected", "not handled")
    agent.record_scalar(num_steps, "eval/loss", eval_loss)
    agent.event("run_finished", step=num_steps)
    agent.close()                                         # final flush; the rest stays in the spool

`Agent.collective(...)` has the signature of `trainer.comm.CommSink`: pass the
agent as the comm layer's sink. Logs go to the "llmwatch.agent" logger.
"""

from agent.agent import Agent, AgentConfig, Command
from agent.noop import NoopAgent

__all__ = ["Agent", "AgentConfig", "Command", "NoopAgent"]
