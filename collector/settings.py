"""The collector's configuration: one dataclass per concern, filled by the CLI
(collector/cli.py maps each flag onto its field) or by a caller.

    Settings(db_path=path, writer=WriterSettings(linger_s=0.0), sql=SqlSettings(max_rows=100))

Each concern's defaults hold when it is not given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from collector.http.auth import Tokens

MiB = 1 << 20


@dataclass(kw_only=True, slots=True, frozen=True)
class GateSettings:
    """What the gate (collector/http/gate.py) checks before a route runs."""

    max_batch_bytes: int = 32 * MiB  # one ingest or OTLP request body (413 above)
    # POST /v1/ingest/bundle (a node relay's batches, collector/relay.py): the whole body, and
    # how many batches it may hold (each also within max_batch_bytes)
    max_bundle_bytes: int = 64 * MiB
    max_bundle_items: int = 1024
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


@dataclass(kw_only=True, slots=True, frozen=True)
class WriterSettings:
    """The writer's group commits (collector/store/writer.py) and its back-pressure."""

    # the writer takes queued requests until either budget is reached ...
    max_rows: int = 2_000_000
    max_bytes: int = 256 * MiB
    # ... and, while a group is smaller than min_rows and requests keep arriving (no gap
    # longer than gap_s), waits up to linger_s for more ...
    min_rows: int = 131_072
    linger_s: float = 0.05
    gap_s: float = 0.005
    # ... and starts a commit at most this often (each costs ~5 ms of fixed DuckDB work,
    # whatever its size): a trickle of small requests shares one; acks wait up to this long.
    min_interval_s: float = 0.5
    # requests beyond this many queued bytes get 503 + Retry-After
    queue_max_bytes: int = 512 * MiB


@dataclass(kw_only=True, slots=True, frozen=True)
class SqlSettings:
    """POST /v1/sql and `collector sql` (collector/sql/)."""

    timeout_s: float = 10.0
    max_rows: int = 10_000
    # an answer's rows stop (truncated) before their JSON text (or Arrow buffers) passes this
    max_bytes: int = 8 * MiB
    # a request waits at most queue_timeout_s for one of the max_concurrent slots, and at
    # most max_waiting wait at once (else 503 + Retry-After)
    max_concurrent: int = 4
    queue_timeout_s: float = 5.0
    max_waiting: int = 64


@dataclass(kw_only=True, slots=True, frozen=True)
class DuckDBSettings:
    """DuckDB's worker threads, the memory cap of its buffer pool, the WAL size that
    triggers a checkpoint, and what queries may spill to disk (DuckDB: 90% of the disk)."""

    threads: int = 2
    memory_limit: str = "2GB"
    checkpoint_threshold: str = "64MB"
    max_temp_size: str = "4GB"


@dataclass(kw_only=True, slots=True, frozen=True)
class AlertSettings:
    """Alerts (collector/alerts/). URLs and the secret are credentials: kept out of
    repr, tables and logs (receivers are named webhook:<n> / alertmanager:<n> there)."""

    webhooks: tuple[str, ...] = field(default=(), repr=False)
    alertmanagers: tuple[str, ...] = field(default=(), repr=False)
    webhook_secret: str = field(default="", repr=False)  # HMAC key of X-Signature-256 (required with webhooks)
    external_url: str = ""  # how people reach this collector: the alerts' generatorURL and externalURL
    timeout_s: float = 5.0  # one delivery attempt (connect, and each read)
    retry_base_s: float = 1.0  # the first retry's delay (doubling, with jitter) ...
    retry_cap_s: float = 300.0  # ... up to this
    max_age_s: float = 86400.0  # give up ('failed') on an alert this old ...
    max_attempts: int = 0  # ... or tried this often (0: no limit but the age)
    firing_hold_s: float = 86400.0  # a firing alert's endsAt in Alertmanager unless resolved sooner


@dataclass(kw_only=True, slots=True, frozen=True)
class RetentionSettings:
    """Retention (collector/offline/retention.py): every rollup_every_s, collectives rows
    older than rollup_after_s (0: never; at least retention.MIN_ROLLUP_AGE_S) become
    per-step summaries, about rollup_chunk_rows raw rows per writer job."""

    rollup_after_s: float = 0.0
    rollup_every_s: float = 3600.0
    rollup_chunk_rows: int = 500_000


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
    command_ttl_s: float = 3600.0  # a command no rank took by then expires
    live_run_s: float = 600.0  # a run without data this long leaves the /metrics gauges
    gate: GateSettings = field(default_factory=GateSettings)
    writer: WriterSettings = field(default_factory=WriterSettings)
    sql: SqlSettings = field(default_factory=SqlSettings)
    duckdb: DuckDBSettings = field(default_factory=DuckDBSettings)
    alerts: AlertSettings = field(default_factory=AlertSettings)
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    # the Parquet archive (`collector archive`'s output) read with the file's own runs for the
    # history of a new run's nodes (analysis/detectors/node_history.py); None: the file's runs only
    archive_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.token:
            extra = Tokens.build(all_roles=[self.token])
            self.tokens = Tokens({r: tuple(dict.fromkeys(self.tokens.digests.get(r, ()) + extra.digests[r]))
                                  for r in extra.digests})
            self.token = ""
