"""The collector: ingest, DuckDB storage, detection and healing, alerts, read-only SQL.

Its folders follow a batch through it:

- `http/`: the ASGI app (`server.py`), the gate every request passes first
  (`gate.py`), tokens by role (`auth.py`), the bounded HTTP protocol, the routes;
- `ingest/`: a body into a validated batch (`decode.py`), batches into Arrow tables
  (`columns.py`), OTLP metrics into scalars (`otlp.py`);
- `store/`: the one writer (`writer.py`) and what a group commit is made of: the
  schema and its migrations, the projections (duplicates, liveness, run info,
  commands, incidents, actions) and the post-commit feed (`feed.py`);
- `live/`: what reads that feed: detection (`detection.py`, the analysis) and
  healing (`policy.py`, the policy's decisions carried out and followed);
- `alerts/`: the payloads and their signature, the outbox written in each
  incident's transaction, the delivery lanes;
- `read/`: the queries, the dashboard's views and goodput, over any DuckDB cursor;
- `sql/`: read-only SQL: the guard, its allow-list, the slots it runs on;
- `offline/`: what runs on a file: replay, postmortem, archive, retention.

`storage.py` composes them around one open database (`Storage`), `settings.py`
holds the configuration, `metrics.py` the Prometheus instruments, and `cli.py` is
`collector serve | sql | replay | postmortem | archive | rollup | compact`.

Public face: `Settings`, `Storage` (open a database, queue writes such as
`issue_command` and `record_findings`, subscribe to commits, query) and
`create_app` (the ASGI app around a Storage).
"""

from collector.http.server import create_app
from collector.settings import Settings
from collector.storage import Storage

__all__ = ["Settings", "Storage", "create_app"]
