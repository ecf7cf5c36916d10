"""Optional bridges to the ecosystem, fed by the flusher from the drained rows.

Each bridge imports its SDK only when constructed, so an agent without bridges
never loads opentelemetry or prometheus_client. They run on the flusher thread
(OpenTelemetry exports on its own BatchSpanProcessor thread, Prometheus serves
scrapes on its own HTTP thread), never on the training thread. A bridge that
cannot start is logged and left out; one that fails while running is logged
once by the agent and keeps being called.

- `OtelBridge`: per step row, a span "step" with children "forward",
  "backward", "communication" (exposed) and "optimizer", laid end to end after
  the data wait; times rebuilt from the row's end timestamp and its durations.
  Resource attributes run_id, rank, node. Exported by OTLP/HTTP to
  `<otlp_endpoint>/v1/traces`. Cost: ~5 spans per step, tens of microseconds
  each, off the hot path.
- `PrometheusBridge`: gauges of the last step of this rank on their own
  registry, served on 127.0.0.1:`prometheus_port` (0 = any free port).
"""

from __future__ import annotations

import logging
import math
import struct

from agent.ring import BufferSet
from agent.wire import NULL_F64_BITS

_NULL_TOKENS = -1  # tokens / mem_bytes not measured (agent/wire.py)
_NULL_BYTES = struct.pack("<q", NULL_F64_BITS)


def _seconds(x: float) -> float:
    """A duration for a span: NULL (not measured, a NaN) or a real NaN count as 0."""
    return x if x == x else 0.0


def _is_null(x: float) -> bool:
    """`x` is the float NULL (not measured), not a NaN the loop measured."""
    return x != x and struct.pack("<d", x) == _NULL_BYTES

log = logging.getLogger("llmwatch.agent")

_PHASES = ("forward", "backward", "communication", "optimizer")


class OtelBridge:
    def __init__(self, endpoint: str, resource: dict, *, timeout_s: float = 2.0, exporter=None) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=timeout_s)
        # A provider of our own, not the global one: the host program's tracing stays its own.
        self._provider = TracerProvider(resource=Resource.create({"service.name": "llmwatch", **resource}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("llmwatch.agent")
        self._in_context = trace.set_span_in_context

    def on_drain(self, bufs: BufferSet, stats: dict) -> None:
        b = bufs.step
        col = b.column
        steps, attempts, ts, step_s = col("step"), col("attempt"), col("ts"), col("step_s")
        data_s, loss, tokens, skipped = col("data_s"), col("loss"), col("tokens"), col("skipped")
        phases = [col("fwd_s"), col("bwd_s"), col("comm_exposed_s"), col("opt_s")]
        for i in range(b.n):
            end_ns = int(ts[i] * 1e9)
            start_ns = end_ns - max(0, int(_seconds(step_s[i]) * 1e9))
            attributes = {"step": steps[i], "attempt": attempts[i], "skipped": bool(skipped[i])}
            if not _is_null(loss[i]):  # a NaN loss is kept, NULL left out
                attributes["loss"] = loss[i]
            if tokens[i] != _NULL_TOKENS:
                attributes["tokens"] = tokens[i]
            span = self._tracer.start_span("step", start_time=start_ns, attributes=attributes)
            ctx = self._in_context(span)
            t_ns = min(end_ns, start_ns + max(0, int(_seconds(data_s[i]) * 1e9)))
            for name, seconds in zip(_PHASES, phases):
                child_end = min(end_ns, t_ns + max(0, int(_seconds(seconds[i]) * 1e9)))
                self._tracer.start_span(name, context=ctx, start_time=t_ns).end(end_time=child_end)
                t_ns = child_end
            span.end(end_time=end_ns)

    def close(self) -> None:
        self._provider.shutdown()  # exports what the batch processor still holds


class PrometheusBridge:
    def __init__(self, port: int, resource: dict) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self._registry = CollectorRegistry()
        label_names = tuple(resource)
        label_values = tuple(str(v) for v in resource.values())

        def gauge(name: str, doc: str):
            return Gauge(name, doc, label_names, registry=self._registry).labels(*label_values)

        self._step = gauge("llmwatch_step", "Last step recorded by this rank")
        self._attempt = gauge("llmwatch_attempt", "Attempt (rollback lineage) of the last step")
        self._loss = gauge("llmwatch_loss", "Training loss of the last step")
        self._grad_norm = gauge("llmwatch_grad_norm", "Gradient norm of the last step")
        self._loss_scale = gauge("llmwatch_loss_scale", "Loss scale of the last step")
        self._lr = gauge("llmwatch_lr", "Learning rate of the last step")
        self._tokens_per_s = gauge("llmwatch_tokens_per_s", "Tokens per second of the last step on this rank")
        self._step_s = gauge("llmwatch_step_seconds", "Wall time of the last step")
        self._mem = gauge("llmwatch_memory_bytes", "Memory in use after the last step")
        self._dropped = gauge("llmwatch_agent_dropped_total", "Records the agent dropped (buffer or spool full)")
        self._spool_bytes = gauge("llmwatch_agent_spool_bytes", "Bytes waiting in the agent's spool")
        self._batches_sent = gauge("llmwatch_agent_batches_sent_total", "Batches delivered to the collector")
        self._server, self._thread = start_http_server(port, addr="127.0.0.1", registry=self._registry)
        self.port = self._server.server_port

    def on_drain(self, bufs: BufferSet, stats: dict) -> None:
        b = bufs.step
        if b.n:
            i = b.n - 1
            col = b.column
            self._step.set(col("step")[i])
            self._attempt.set(col("attempt")[i])
            self._loss.set(col("loss")[i])
            self._grad_norm.set(col("grad_norm")[i])
            self._loss_scale.set(col("loss_scale")[i])
            self._lr.set(col("lr")[i])
            step_s, tokens, mem = col("step_s")[i], col("tokens")[i], col("mem_bytes")[i]
            # NULL (not measured): NaN, Prometheus's "no value"; comparisons with NaN are False
            self._tokens_per_s.set(tokens / step_s if step_s > 0 and tokens != _NULL_TOKENS else math.nan)
            self._step_s.set(step_s)
            self._mem.set(mem if mem != _NULL_TOKENS else math.nan)
        self._dropped.set(sum(stats["dropped"].values()))
        self._spool_bytes.set(stats["spool_bytes"])
        self._batches_sent.set(stats["batches"]["sent"] + stats["batches"]["replayed"])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def open_bridges(config, resource: dict) -> list:
    """The bridges `config` asks for; one that cannot start is logged and skipped."""
    bridges = []
    if config.otlp_endpoint:
        try:
            bridges.append(OtelBridge(config.otlp_endpoint, resource, timeout_s=config.timeout_s))
        except Exception as e:  # noqa: BLE001 - an optional bridge must not stop training
            log.warning("llmwatch agent: OpenTelemetry bridge disabled: %r", e)
    if config.prometheus_port is not None:
        try:
            bridges.append(PrometheusBridge(config.prometheus_port, resource))
        except Exception as e:  # noqa: BLE001
            log.warning("llmwatch agent: Prometheus bridge on port %s disabled: %r", config.prometheus_port, e)
    return bridges
