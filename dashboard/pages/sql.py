"""SQL: a read-only console over the collector's tables, for the questions the pages
do not answer.

The query runs where the data is, behind the collector's fences (one SELECT, an
allow-list of tables and functions, bounded rows, bytes and time:
collector/sql/guard.py); a refusal shows the collector's reason. The result is a
table and a quick chart (the first column as x, the numeric columns as lines, or
as bars when x is a category or there are few rows). The query text is in the URL
(`?q=`), so a pasted link runs the same query. The examples are shortened from
docs/postmortem.md's cookbook, for the selected run.

A query runs when asked (the button, an example, a link, or a new run while the
text is still an unedited example); it is not re-run on every live refresh.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
from typing import Any

import plotly.graph_objects as go
from dash import Input, Output, State, callback, clientside_callback, ctx, dcc, html, no_update

from dashboard import state
from dashboard.components import data_table, legend_below
from dashboard.figures import GRAPH_CONFIG, RANK_COLORS, base_layout, empty
from dashboard.source import Source, SourceError, SqlError

PAGE = {"path": "/sql", "name": "SQL", "order": 5,
        "title": "llmwatch · SQL"}  # registered by dashboard/app.py
MAX_ROWS = 2000  # rows the console fetches: a table and a chart, well under a 1 MB answer
MAX_CELL_CHARS = 400
MAX_SERIES = 8
BAR_MAX_ROWS = 40  # up to this many rows (or a text x), a chart of bars
NUMERIC_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER",
                 "UBIGINT", "UHUGEINT", "FLOAT", "REAL", "DOUBLE", "DECIMAL", "NUMERIC", "INT", "INT4", "INT8")

# name -> (label, query with {run}); the first is the default
EXAMPLES: dict[str, tuple[str, str]] = {
    "slowest_ranks": ("Slowest ranks over the last 100 steps", """\
WITH s AS (
    SELECT * FROM steps
    WHERE run_id = '{run}' AND step > (SELECT max(step) FROM steps WHERE run_id = '{run}') - 100
    QUALIFY attempt = max(attempt) OVER (PARTITION BY step, rank))  -- the effective attempt's
SELECT s.rank, any_value(k.node) AS node,
       round(avg(s.fwd_s + s.bwd_s + s.opt_s), 4) AS compute_s,
       round(avg(s.comm_exposed_s), 4) AS exposed_comm_s,
       round(avg(s.step_s), 4) AS step_s
FROM s JOIN ranks k USING (run_id, rank)
GROUP BY s.rank
ORDER BY compute_s DESC"""),
    "tokens_per_s": ("Throughput per step", """\
WITH s AS (
    SELECT step, tokens, max_step_s AS step_s FROM step_summary WHERE run_id = '{run}'
    QUALIFY attempt = max(attempt) OVER (PARTITION BY step))
SELECT step, round(tokens / step_s) AS tokens_per_s,
       round(avg(tokens / step_s) OVER (ORDER BY step ROWS BETWEEN 9 PRECEDING AND CURRENT ROW)) AS tokens_per_s_10
FROM s
ORDER BY step"""),
    "comm_by_axis": ("Communication by mesh axis and op", """\
SELECT axis || ' ' || op AS axis_op,
       round(sum(wait_s), 3) AS exposed_s,
       round(sum(greatest(duration_s - wait_s, 0)), 3) AS overlapped_s
FROM collectives WHERE run_id = '{run}'
GROUP BY axis, op
ORDER BY exposed_s DESC"""),
    "incidents_by_node": ("Incidents by node", """\
SELECT coalesce(i.node, k.node, '(run-wide)') AS node, count(*) AS num_incidents,
       count(*) FILTER (WHERE i.status = 'open') AS still_open,
       string_agg(DISTINCT i.kind, ', ') AS kinds
FROM incidents i LEFT JOIN ranks k ON k.run_id = i.run_id AND k.rank = i.rank
WHERE i.run_id = '{run}'
GROUP BY ALL
ORDER BY node"""),
    "loss_attempts": ("Loss by attempt (rollback lineage)", """\
SELECT step, avg(loss) FILTER (WHERE effective) AS loss_effective,
       avg(loss) FILTER (WHERE NOT effective) AS loss_replaced
FROM steps_history WHERE run_id = '{run}'
GROUP BY step
ORDER BY step"""),
    "heartbeat_gaps": ("Longest heartbeat gap per rank", """\
WITH h AS (
    SELECT rank, node, ts, ts - lag(ts) OVER (PARTITION BY rank ORDER BY ts) AS gap_s
    FROM heartbeats WHERE run_id = '{run}')
SELECT rank, round(max(gap_s), 2) AS max_gap_s, round(median(gap_s), 2) AS median_gap_s,
       any_value(node) AS node
FROM h
GROUP BY rank
ORDER BY rank"""),
}
DEFAULT_EXAMPLE = "slowest_ranks"
NO_RUN_QUERY = ("SELECT run_id, status, world_size, to_timestamp(created_ts) AS created\n"
                "FROM runs ORDER BY created_ts DESC")


def example_query(name: str | None, run_id: str | None) -> str:
    """An example's text for the run (run ids are quoted as SQL strings)."""
    if not run_id:
        return NO_RUN_QUERY
    _, text = EXAMPLES.get(name or DEFAULT_EXAMPLE, EXAMPLES[DEFAULT_EXAMPLE])
    return text.replace("{run}", str(run_id).replace("'", "''"))


# -- the result ---------------------------------------------------------------------------
def _cell(v: Any) -> Any:
    """A value a DataTable shows: numbers and text as they are, the rest as text."""
    if v is None or isinstance(v, str) and len(v) <= MAX_CELL_CHARS:
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat(sep=" ") if isinstance(v, dt.datetime) else v.isoformat()
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…"


def _numeric(types: list[str], rows: list[list[Any]], j: int) -> bool:
    t = (types[j] if j < len(types) else "") or ""
    if t:
        return t.upper().split("(")[0].strip() in NUMERIC_TYPES
    vals = [r[j] for r in rows if r[j] is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


def chart_figure(columns: list[str], types: list[str], rows: list[list[Any]]) -> go.Figure:
    """The first column as x, the numeric others as lines (bars for a text x or few rows)."""
    if not rows or len(columns) < 2:
        return empty("nothing to chart: it takes a first column as x and a numeric column after it", height=360)
    ys = [j for j in range(1, len(columns)) if _numeric(types, rows, j)][:MAX_SERIES]
    if not ys:
        return empty("nothing to chart: no numeric column after the first", height=360)
    x_numeric = _numeric(types, rows, 0)
    bars = not x_numeric or len(rows) <= BAR_MAX_ROWS
    xs = [_cell(r[0]) for r in rows]
    xs = [x if isinstance(x, (int, float)) or not x_numeric else str(x) for x in xs]
    fig = go.Figure()
    for k, j in enumerate(ys):
        y = [_cell(r[j]) for r in rows]
        y = [v if isinstance(v, (int, float)) else None for v in y]
        color = RANK_COLORS[k % len(RANK_COLORS)]
        if bars:
            fig.add_trace(go.Bar(x=xs, y=y, name=columns[j], marker={"color": color}))
        else:
            fig.add_trace(go.Scatter(x=xs, y=y, name=columns[j], mode="lines", line={"color": color, "width": 1.8}))
    base_layout(fig, title=f"{', '.join(columns[j] for j in ys)} by {columns[0]}", height=360,
                uirevision=json.dumps(columns))
    legend_below(fig)
    if bars:
        fig.update_layout(barmode="group")
    fig.update_xaxes(title_text=columns[0], type=None if x_numeric else "category")
    fig.update_yaxes(title_text=columns[ys[0]] if len(ys) == 1 else "value (see legend)")
    return fig


def build(src: Source, run_id: str | None = None, *, query: str | None = None) -> dict[str, Any]:
    """Run the query (the default example for the run when none): {"columns" (DataTable
    columns), "rows", "message", "error", "chart"}. A refusal is `error`, not an exception."""
    text = query if query and query.strip() else example_query(DEFAULT_EXAMPLE, run_id)
    try:
        r = src.sql(text, max_rows=MAX_ROWS)
    except SqlError as e:
        return {"columns": [], "rows": [], "message": str(e), "error": True,
                "chart": empty("the query was refused: see the message above", height=360)}
    names = [str(c) for c in r["columns"]]
    ids = [f"c{j}" for j in range(len(names))]  # column names may repeat or hold dots: ids are positional
    types = [str(t) for t in (r.get("types") or [])]
    rows = r["rows"]
    table_columns = [{"id": i, "name": n, **({"type": "numeric"} if _numeric(types, rows, j) else {})}
                     for j, (i, n) in enumerate(zip(ids, names))]
    n = len(rows)
    message = f"{n} row{'s' if n != 1 else ''}" + (" (truncated)" if r.get("truncated") else "")
    return {"columns": table_columns, "rows": [{i: _cell(v) for i, v in zip(ids, row)} for row in rows],
            "message": message, "error": False, "chart": chart_figure(names, types, rows)}


# -- layout and callbacks -------------------------------------------------------------------
def layout(q: str | None = None, run: str | None = None, example: str | None = None, **_: Any) -> html.Div:
    auto = example_query(example, run)
    text = q if q else auto
    return html.Div([
        html.Div([
            html.Div([html.Label("examples", className="llmw-label"),
                      dcc.Dropdown(id="sql-example", clearable=True, searchable=False,
                                   value=example if example in EXAMPLES else None,
                                   placeholder="an example query…", style={"minWidth": 340},
                                   options=[{"label": label, "value": k} for k, (label, _) in EXAMPLES.items()])],
                     className="llmw-control"),
            html.Span("one SELECT over the collector's tables (steps, steps_effective, collectives, incidents, "
                      "actions, checkpoints, nodes, ranks, runs, …); read-only, bounded in rows and time",
                      className="llmw-muted"),
        ], className="llmw-controls"),
        dcc.Textarea(id="sql-text", className="llmw-sql", value=text, spellCheck=False,
                     style={"minHeight": "210px"}),
        html.Div([html.Button("Run", id="sql-run", className="llmw-button", n_clicks=0),
                  html.Div(id="sql-message", className="llmw-message")],
                 style={"display": "flex", "gap": "14px", "alignItems": "center"}),
        dcc.Graph(id="sql-chart", className="llmw-card", config=GRAPH_CONFIG,
                  figure=empty("run a query", height=360)),
        html.Div(data_table("sql-table", (), page_size=25), className="llmw-table"),
        # what the editor was last filled with, and from which example: replaced on a run change while unedited
        dcc.Store(id="sql-auto", data={"example": example or DEFAULT_EXAMPLE, "text": auto}),
    ])


def refill(chosen: bool, run_id: str | None, example: str | None, text: str | None,
           auto: dict | None) -> tuple[Any, Any]:
    """What the editor holds next, and what it was auto-filled with: an example chosen
    (`chosen`) fills it; a new run refills it while it is an unedited example."""
    auto = auto or {}
    if not run_id:
        return no_update, no_update  # the run picker fills in a moment
    if chosen:
        if not example:
            return no_update, no_update
        new = example_query(example, run_id)
        return new, {"example": example, "text": new}
    if text and text.strip() and text != auto.get("text"):
        return no_update, no_update  # the user's own query (or one from a link): keep it
    new = example_query(auto.get("example"), run_id)
    if new == text:
        return no_update, no_update
    return new, {**auto, "text": new}


@callback(Output("sql-text", "value"), Output("sql-auto", "data"),
          Input("run", "value"), Input("sql-example", "value"), State("sql-text", "value"), State("sql-auto", "data"))
def _fill(run_id, example, text, auto):
    return refill(ctx.triggered_id == "sql-example", run_id, example, text, auto)


@callback(Output("sql-table", "columns"), Output("sql-table", "data"), Output("sql-message", "children"),
          Output("sql-chart", "figure"),
          Input("sql-run", "n_clicks"), Input("sql-auto", "data"), State("sql-text", "value"), State("run", "value"))
def _run(_clicks, _auto, text, run_id):
    if not text or not text.strip():
        return [], [], html.Span("write a query, or pick an example", className="llmw-muted"), \
            empty("run a query", height=360)
    try:
        out = build(state.source(), run_id, query=text)
    except SourceError as e:
        return [], [], html.Span(str(e), className="llmw-error"), empty(str(e), height=360)
    msg = html.Span(out["message"], className="llmw-error" if out["error"] else "llmw-muted")
    return out["columns"], out["rows"], msg, out["chart"]


# The query in the URL once it ran (a pasted link runs it again), and the example it
# came from; an unedited default stays out of the URL, which then follows the run.
clientside_callback(
    """function(clicks, auto, text) {
        const hasQ = new URL(window.location.href).searchParams.has("q");
        const edited = !auto || text !== auto.text;
        const example = auto && auto.example && auto.example !== "%s" ? auto.example : null;
        return window.llmw.setQuery({q: (edited || clicks > 0 || hasQ) ? (text || null) : null,
                                     example: example});
    }""" % DEFAULT_EXAMPLE,
    Output("url-sink", "data", allow_duplicate=True),
    Input("sql-run", "n_clicks"), Input("sql-auto", "data"), State("sql-text", "value"), prevent_initial_call=True)
