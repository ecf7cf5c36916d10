"""The SQL allow-list names only what DuckDB has, and what the docs show passes it."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest

from collector.sql import allow

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def catalog() -> dict[str, set[str]]:
    """function name -> its kinds, in the DuckDB this project runs."""
    con = duckdb.connect()
    kinds: dict[str, set[str]] = {}
    for name, kind in con.execute("SELECT function_name, function_type FROM duckdb_functions()").fetchall():
        kinds.setdefault(name, set()).add(kind)
    con.close()
    return kinds


def test_every_allowed_function_exists(catalog):
    """A typo would allow nothing; a name DuckDB dropped should leave the list."""
    scalars = allow.SCALARS - allow.BINDER_FUNCTIONS
    assert {n for n in scalars if not catalog.get(n, set()) & {"scalar", "macro"}} == set()
    assert {n for n in allow.OPERATORS if "scalar" not in catalog.get(n, set())} == set()
    assert {n for n in allow.AGGREGATES if not catalog.get(n, set()) & {"aggregate", "macro"}} == set()
    assert {n for n in allow.WINDOW_FUNCTIONS if "window" not in catalog.get(n, set())} == set()
    assert {n for n in allow.TABLE_FUNCTIONS if "table" not in catalog.get(n, set())} == set()
    assert set(allow.ARG_RULES) <= allow.SCALARS | allow.AGGREGATES


def test_nothing_that_acts_or_reads_is_allowed(catalog):
    allowed = allow.SCALARS | allow.AGGREGATES | allow.TABLE_FUNCTIONS | allow.WINDOW_FUNCTIONS
    pragmas = {n for n, k in catalog.items() if "pragma" in k}
    assert allowed & pragmas == set()
    assert {n for n in allowed if n.startswith(("read_", "parquet_", "duckdb_", "pragma_", "__internal"))} == set()
    assert (allow.SCALARS | allow.AGGREGATES) & set(allow.WHY_NOT) == set()  # WHY_NOT: refused names


def readme_queries() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [q for block in re.findall(r"```sh\n(.*?)```", text, re.S) if "collector sql" in block
            for q in re.findall(r'"((?:SELECT|WITH|FROM)\b[^"]*)"', block, re.S)]


def test_readme_queries_pass(storage):
    queries = readme_queries()
    assert len(queries) >= 2
    for q in queries:
        storage.sql(q)  # docs/schema.md's cookbook: tests/unit/collector/test_schema_doc.py
