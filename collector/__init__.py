"""The collector: ingest, DuckDB storage, control commands, read-only SQL, metrics.

Public face: `Settings`, `Storage` (open a database, queue writes such as
`issue_command` and `record_findings`, subscribe to commits, query), `read` (the
queries, on any DuckDB cursor) and `create_app` (the ASGI app around a Storage).
The CLI is `collector serve` / `collector sql` (collector/cli.py).
"""

from collector.server import create_app
from collector.settings import Settings
from collector.storage import Storage

__all__ = ["Settings", "Storage", "create_app"]
