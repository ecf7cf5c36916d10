"""`collector sql --db` and the CLI's small helpers, in-process."""

from __future__ import annotations

import json

import pytest

from agent import wire
from collector import cli
from collector.ingest.decode import decode
from collector.storage import Storage
from tests.unit.collector.collector_batches import make_batch, steps_section


@pytest.fixture
def closed_db(settings):
    storage = Storage(settings)
    storage.ingest_blocking(decode(make_batch(sections={wire.STEP: steps_section([1, 2, 3], loss=[3.0, 2.5, 2.0])})))
    storage.close()
    return settings.db_path


def test_sql_on_a_closed_file_as_table_json_csv(closed_db, capsys):
    assert cli.main(["sql", "--db", str(closed_db), "SELECT step, loss, node FROM steps ORDER BY step"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "step  loss  node",
        "----  ----  -----",
        "   1   3.0  node0",
        "   2   2.5  node0",
        "   3   2.0  node0",
        "(3 rows)"]
    cli.main(["sql", "--db", str(closed_db), "--format", "json", "--max-rows", "2", "SELECT step FROM steps ORDER BY 1"])
    assert json.loads(capsys.readouterr().out) == {"columns": ["step"], "types": ["BIGINT"], "rows": [[1], [2]],
                                                   "truncated": True}
    cli.main(["sql", "--db", str(closed_db), "--format", "csv", "SELECT step, loss FROM steps WHERE step = 2"])
    assert capsys.readouterr().out.splitlines() == ["step,loss", "2,2.5"]


@pytest.mark.parametrize("sql", ["DROP TABLE steps", "SELECT * FROM read_csv('/etc/passwd')",
                                 "SELECT 1; DELETE FROM steps"])
def test_sql_refusals_exit_with_the_reason(closed_db, sql):
    with pytest.raises(SystemExit) as info:
        cli.main(["sql", "--db", str(closed_db), sql])
    assert str(info.value).startswith("collector sql: ")


def test_table_alignment_handles_nulls_and_text():
    text = cli._format_table(["a", "name"], [[1, None], [100, "xy"]])
    assert text.splitlines() == ["  a  name", "---  ----", "  1  NULL", "100  xy"]
