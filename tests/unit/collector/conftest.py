"""Fixtures for the collector's unit tests: a Storage on a tmp DuckDB file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from collector.settings import Settings, WriterSettings
from collector.storage import Storage


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(db_path=tmp_path / "t.duckdb", token="tok", writer=WriterSettings(linger_s=0.0))


@pytest.fixture
def storage(settings) -> Iterator[Storage]:
    s = Storage(settings)
    yield s
    s.close()
