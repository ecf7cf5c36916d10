"""llmwatch agent: in-process telemetry for any training loop (stdlib only).

Record from the training thread at the cost of a few array stores; a daemon
thread batches the rows (agent/wire.py format), POSTs them to the collector,
spools them to disk while it is away, heartbeats once a second and brings back
control commands. Example, for any loop:

    from agent import Agent, AgentConfig, NoopAgent

    cfg = AgentConfig(url="http://127.0.0.1:8428", token=os.environ["LLMWATCH_TOKEN"])
    agent = Agent(cfg, run_id="my-run", rank=rank, world_size=world) if enabled else NoopAgent()
    agent.start()
    for step in range(1, num_steps + 1):
        loss, grad_norm = train_step()
        agent.record_step(step, loss=loss, grad_norm=grad_norm, lr=lr)  # Python floats, not tensors
        for cmd in agent.commands():                      # at a step boundary
            agent.ack(cmd.id, "rejected", "not handled")
    agent.close()                                         # final flush; the rest stays in the spool

Every `record_step` value is optional and by keyword (what is not given is
NULL, "not measured"; `step_s` not given is the time since the previous step's
call). Hugging Face and Lightning loops: agent/integrations (docs/integrations.md).

The token goes only into the Authorization header: never into a log line, the
spool or a batch (`run_info` is scrubbed of secret-looking keys). https:// URLs
are verified against `ca_file`, or the system's trust store.

`Agent.collective(...)` has the signature of `trainer.comm.CommSink`: pass the
agent as the comm layer's sink. Logs go to the "llmwatch.agent" logger.
"""

from agent.agent import Agent, AgentConfig, Command
from agent.noop import NoopAgent

__all__ = ["Agent", "AgentConfig", "Command", "NoopAgent"]
