from __future__ import annotations

import pytest

from dashboard.source import DbSource
from tests.unit.dashboard import synthetic


@pytest.fixture(scope="session")
def synth_db(tmp_path_factory):
    """The path of a closed collector file holding tests/unit/dashboard/synthetic.py's run."""
    return synthetic.build(tmp_path_factory.mktemp("dash") / "synth.duckdb")


@pytest.fixture
def db_source(synth_db):
    src = DbSource(synth_db)
    yield src
    src.close()
