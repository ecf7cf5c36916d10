"""The llmwatch dashboard: a Dash app over a live collector or a finished run's file.

    dashboard --collector http://127.0.0.1:8428   (the read token in LLMWATCH_TOKEN or --token-file)
    dashboard --db runs/demo/telemetry.duckdb      (postmortem, read-only)

`create_app(source)` builds the app for a `HttpSource` or a `DbSource`
(dashboard/source.py). Importing this package imports neither Dash nor DuckDB.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dash import Dash

    from dashboard.source import Source

__all__ = ["create_app"]


def create_app(source: "Source", **kwargs) -> "Dash":
    from dashboard.app import create_app as _create

    return _create(source, **kwargs)
