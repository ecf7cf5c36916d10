"""llmwatch agent: in-process telemetry for any training loop (stdlib only).

Record from the training thread at the cost of a few array stores; a daemon
thread batches the rows (agent/wire.py format), POSTs them to the collector,
spools them to disk while it is away, heartbeats once a second and brings back
control commands. Example, for any loop:

    from agent import Agent, AgentConfig, NoopAgent

    cfg = AgentConfig(url="https://collector:4318", token=os.environ["LLMWATCH_TOKEN"], ca_file="ca.pem")
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

The token goes only into the Authorization header: never into a log line, the
spool or a batch (`run_info` is scrubbed of secret-looking keys). https:// URLs
are verified against `ca_file`, or the system's trust store.

`Agent.collective(...)` has the signature of `trainer.comm.CommSink`: pass the
agent as the comm layer's sink. Logs go to the "llmwatch.agent" logger.
"""

from agent.agent import Agent, AgentConfig, Command
from agent.noop import NoopAgent

__all__ = ["Agent", "AgentConfig", "Command", "NoopAgent"]
