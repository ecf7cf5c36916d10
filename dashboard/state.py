"""The dashboard's process-wide state: its data source, and the URL's page state.

One dashboard process serves one source (`create_app` sets it); callbacks ask for
it here when they run, so importing a page loads no data.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from dashboard.source import Source

_source: Source | None = None


def set_source(source: Source) -> None:
    global _source
    _source = source


def source() -> Source:
    if _source is None:
        raise RuntimeError("the dashboard has no data source: start it with create_app(source)")
    return _source


_GOODPUT: dict[tuple, dict] = {}  # (run, last step, attempt, status, updated) -> goodput: read again only when it moved


def goodput(run_id: str, run: dict | None) -> dict:
    """The run's goodput and its causes (collector/read/views.py run_goodput), for the status
    line of every page and the Incidents page on every refresh: ~50 ms of DuckDB on a big run,
    so asked again only when the run moved."""
    if run is None:
        return {}
    key = (run_id, run.get("last_step"), run.get("last_attempt"), run.get("status"), run.get("updated_ts"))
    if key not in _GOODPUT:
        if len(_GOODPUT) > 64:
            _GOODPUT.clear()
        _GOODPUT[key] = source().table(run_id, "goodput")
    return _GOODPUT[key]


def query(search: str | None) -> dict[str, str]:
    """A URL's query string as {name: last value}."""
    return {k: v[-1] for k, v in parse_qs((search or "").lstrip("?")).items() if v}


def as_int(value: Any) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def as_float(value: Any, default: float) -> float:
    try:
        return float(value) if value not in (None, "") else default
    except (TypeError, ValueError):
        return default


def as_ranks(value: Any) -> list[int]:
    """`ranks=0,3,7` (or a list) as sorted unique ints; anything else is dropped."""
    items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
    out = {as_int(v) for v in items}
    return sorted(v for v in out if v is not None and v >= 0)
