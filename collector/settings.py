"""The collector's configuration: one dataclass, filled by the CLI or by a caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from collector.http.auth import Tokens

MiB = 1 << 20


@dataclass(kw_only=True, slots=True)
class Settings:
    db_path: Path
    host: str = "127.0.0.1"
    port: int = 8428
    # Bearer tokens by role (collector/http/auth.py). `token`, when given, is one token with
    # every role and is folded into `tokens` (it is not kept in the clear).
    tokens: Tokens = field(default_factory=Tokens)
    token: str = field(default="", repr=False)
    public_metrics: bool = False  # GET /metrics without a token (a scraper on a trusted network)
    # The gate (collector/http/gate.py): bounds checked before a route runs.
    max_batch_bytes: int = 32 * MiB  # one ingest or OTLP request body (413 above)
    max_sql_request_bytes: int = 1 * MiB
    max_command_request_bytes: int = 64 * 1024
    max_inflight_requests: int = 2048  # past this, 503 + Retry-After (/healthz exempt)
    body_timeout_s: float = 30.0  # a body not received by then is a 408
    # /v1/ingest bodies up to this size are decoded on the event loop (~70 us; a hop to a
    # worker thread costs ~60 us more); larger ones on a worker thread, so that a big batch
    # (its header JSON, its hash) never stalls the loop.
    inline_decode_max_bytes: int = 64 * 1024
    # OTLP/HTTP (POST /v1/metrics): the body, compressed and decompressed (413 above; parsed
    # protobuf holds ~30x its bytes in memory), and the data points it may carry (413 above,
    # counted before the parse; each quantile of a summary counts as one).
    otlp_max_bytes: int = 8 * MiB
    otlp_max_points: int = 100_000
    # Group commit: the writer takes queued requests until either budget is reached.
    group_max_rows: int = 2_000_000
    group_max_bytes: int = 256 * MiB
    # ... and, while a group is smaller than group_min_rows and requests keep arriving
    # (no gap longer than group_gap_s), waits up to group_linger_s for more.
    group_min_rows: int = 131_072
    group_linger_s: float = 0.05
    group_gap_s: float = 0.005
    # ... and starts a commit at most this often (each costs ~5 ms of fixed DuckDB work,
    # whatever its size): a trickle of small requests shares one; acks wait up to this long.
    group_min_interval_s: float = 0.5
    # Back-pressure: requests beyond this many queued bytes get 503 + Retry-After.
    queue_max_bytes: int = 512 * MiB
    sql_timeout_s: float = 10.0
    sql_max_rows: int = 10_000
    sql_max_concurrent: int = 4
    # POST /v1/sql: an answer's rows stop (truncated) before their JSON text (or Arrow
    # buffers) passes this; a request waits at most sql_queue_timeout_s for one of the
    # sql_max_concurrent slots, and at most sql_max_waiting wait at once (else 503 + Retry-After).
    sql_max_bytes: int = 8 * MiB
    sql_queue_timeout_s: float = 5.0
    sql_max_waiting: int = 64
    command_ttl_s: float = 3600.0
    live_run_s: float = 600.0  # a run without data this long leaves the /metrics gauges
    # DuckDB: worker threads, memory cap of its buffer pool, WAL size that triggers a checkpoint.
    duckdb_threads: int = 2
    duckdb_memory_limit: str = "2GB"
    duckdb_checkpoint_threshold: str = "64MB"
    duckdb_max_temp_size: str = "4GB"  # what queries may spill to disk (DuckDB: 90% of the disk)
    # Alerts (collector/alerts/outbox.py). URLs and the secret are credentials: kept out of
    # repr, tables and logs (receivers are named webhook:<n> / alertmanager:<n> there).
    webhooks: tuple[str, ...] = field(default=(), repr=False)
    alertmanagers: tuple[str, ...] = field(default=(), repr=False)
    webhook_secret: str = field(default="", repr=False)  # HMAC key of X-Signature-256 (required with webhooks)
    external_url: str = ""  # how people reach this collector: the alerts' generatorURL and externalURL
    alert_timeout_s: float = 5.0  # one delivery attempt (connect, and each read)
    alert_retry_base_s: float = 1.0  # the first retry's delay (doubling, with jitter) ...
    alert_retry_cap_s: float = 300.0  # ... up to this
    alert_max_age_s: float = 86400.0  # give up ('failed') on an alert this old ...
    alert_max_attempts: int = 0  # ... or tried this often (0: no limit but the age)
    alert_firing_hold_s: float = 86400.0  # a firing alert's endsAt in Alertmanager unless resolved sooner
    # Retention (collector/offline/retention.py): every rollup_every_s, collectives rows older than
    # rollup_after_s (0: never; at least retention.MIN_ROLLUP_AGE_S) become per-step
    # summaries, about rollup_chunk_rows raw rows per writer job.
    rollup_after_s: float = 0.0
    rollup_every_s: float = 3600.0
    rollup_chunk_rows: int = 500_000

    def __post_init__(self) -> None:
        if self.token:
            extra = Tokens.build(all_roles=[self.token])
            self.tokens = Tokens({r: tuple(dict.fromkeys(self.tokens.digests.get(r, ()) + extra.digests[r]))
                                  for r in extra.digests})
            self.token = ""
