"""Fleet: every run on every node, from the collector's runs and the Parquet archive.

Which nodes fail run after run (fleet memory, analysis/fleet.py). A grid of runs
(columns, oldest first) by nodes (rows, the most fault runs on top): a cell is a
node in a run, coloured by its faults there (incidents of the rules'
`[node_history] fault_kinds` naming it), marked ✕ where the node was isolated;
blank where the node was not in the run. Above it each run's goodput (the share of
its wall time in steps that counted, docs/fleet.md `goodput_per_run`), and below
the nodes' records (runs, fault runs, faults by kind, the latest), a flagged node
first: the next run that starts on it opens a `node_history` incident.

The window is the rules' by default (7 days) or the one picked. A live collector's
page reads its runs and the archive it was started with (`--archive`);
`dashboard --db FILE --archive DIR` reads a file and an archive. The page reads
once per window picked, not on every refresh: the archive is history.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from dash import Input, Output, callback, dcc, html

from dashboard import state
from dashboard.components import data_table
from dashboard.figures import GRAPH_CONFIG, base_layout, empty, to_datetime

PAGE = {"path": "/fleet", "name": "Fleet", "order": 7, "title": "llmwatch · fleet"}  # registered by dashboard/app.py
WINDOWS = (("1 day", 86400.0), ("7 days", 7 * 86400.0), ("30 days", 30 * 86400.0), ("90 days", 90 * 86400.0))
MAX_RUNS, MAX_NODES = 200, 200  # the grid's newest runs and worst nodes (a bigger fleet: collector nodes, SQL)
NODE_COLUMNS = (("flag", "", "t"), ("node", "node", "t"), ("runs", "runs", "n"), ("fault_runs", "fault runs", "n"),
                ("faults", "faults", "n"), ("isolations", "isolated", "n"), ("kinds", "by kind", "t"),
                ("last", "last fault", "t"))
FAULT_SCALE = [[0.0, "#e8f5e9"], [0.001, "#fde2c8"], [0.5, "#f28e2b"], [1.0, "#b3261e"]]


def _when(ts: float | None) -> str:
    """A date and time (UTC, to the minute): a fleet's history spans days."""
    return (to_datetime(ts) or "–")[:16].replace("T", " ")


def node_rows(nodes: list[dict]) -> list[dict]:
    return [{"flag": "!" if n.get("flagged") else "", "node": n.get("node"), "runs": n.get("runs"),
             "fault_runs": n.get("fault_runs"), "faults": n.get("faults"), "isolations": n.get("isolations"),
             "kinds": ", ".join(f"{k} {c}" for k, c in (n.get("by_kind") or {}).items()) or "–",
             "last": (f"{_when(n.get('last_fault_ts'))} {n.get('last_fault_kind')} in {n.get('last_fault_run')}"
                      if n.get("last_fault_ts") is not None else "–")} for n in nodes]


def grid_figure(report: dict[str, Any]) -> go.Figure:
    """Runs x nodes: faults per cell (blank: not in the run), ✕ where isolated."""
    runs = [r["run_id"] for r in report.get("runs") or []][-MAX_RUNS:]
    nodes = [n["node"] for n in report.get("nodes") or []][:MAX_NODES]
    if not runs or not nodes:
        return empty("no runs in this window: nothing has run, or nothing was archived", height=360)
    col = {r: i for i, r in enumerate(runs)}
    row = {n: i for i, n in enumerate(nodes)}
    z: list[list[float | None]] = [[None] * len(runs) for _ in nodes]
    text: list[list[str]] = [[""] * len(runs) for _ in nodes]
    marks_x, marks_y = [], []
    for c in report.get("cells") or []:
        i, j = row.get(c["node"]), col.get(c["run_id"])
        if i is None or j is None:
            continue
        z[i][j] = float(c["faults"])
        kinds = ", ".join(c.get("kinds") or []) or "none"
        text[i][j] = f"faults: {c['faults']} ({kinds})" + ("; isolated" if c.get("isolated") else "")
        if c.get("isolated"):
            marks_x.append(c["run_id"])
            marks_y.append(c["node"])
    top = max([v for r in z for v in r if v is not None] + [1.0])
    fig = go.Figure(go.Heatmap(x=runs, y=nodes, z=z, text=text, zmin=0, zmax=top, colorscale=FAULT_SCALE,
                               xgap=1, ygap=1, colorbar={"title": {"text": "faults"}, "thickness": 12},
                               hovertemplate="run %{x}<br>node %{y}<br>%{text}<extra></extra>"))
    if marks_x:
        fig.add_trace(go.Scatter(x=marks_x, y=marks_y, mode="text", text=["✕"] * len(marks_x), name="isolated",
                                 textfont={"size": 14, "color": "#1f2937"}, hoverinfo="skip", showlegend=False))
    base_layout(fig, title="Faults by run and node (✕: isolated)", height=max(300, 60 + 26 * len(nodes)),
                uirevision="fleet")
    fig.update_xaxes(title_text="run (oldest first)", type="category", tickangle=-40)
    fig.update_yaxes(title_text="node", type="category", autorange="reversed")
    return fig


def goodput_figure(report: dict[str, Any]) -> go.Figure:
    runs = [r for r in (report.get("runs") or [])[-MAX_RUNS:] if r.get("goodput") is not None]
    if not runs:
        return empty("no goodput: the runs in this window have no steps", height=240)
    fig = go.Figure(go.Bar(x=[r["run_id"] for r in runs], y=[100.0 * min(1.0, r["goodput"]) for r in runs],
                           marker={"color": "#2ca02c"}, hovertemplate="%{x}: %{y:.1f}%<extra>goodput</extra>",
                           showlegend=False))
    base_layout(fig, title="Goodput by run (% of wall time in steps that counted)", height=240, uirevision="fleet")
    fig.update_xaxes(type="category", tickangle=-40)
    fig.update_yaxes(title_text="goodput (%)", range=[0, 100])
    return fig


def build(src, since_s: float | None) -> dict[str, Any]:
    """{"summary", "goodput", "grid", "nodes"} for the window (None: the rules')."""
    report = src.fleet(since_s)
    nodes = report.get("nodes") or []
    flagged = sum(1 for n in nodes if n.get("flagged"))
    summary = (f"{len(nodes)} node(s) in {report.get('num_runs', 0)} run(s) since {_when(report.get('since_ts'))} "
               f"UTC; "
               f"{flagged} flagged (a fault in {report.get('flag_runs')}+ runs: the next run on it opens a "
               f"node_history incident)")
    return {"summary": summary, "goodput": goodput_figure(report), "grid": grid_figure(report),
            "nodes": node_rows(nodes)}


def layout(**_: Any) -> html.Div:
    return html.Div([
        html.Div([html.Label("window", className="llmw-label"),
                  dcc.Dropdown(id="fleet-window", options=[{"label": n, "value": s} for n, s in WINDOWS],
                               value=None, placeholder="the rules' window", clearable=True,
                               style={"minWidth": 200})], className="llmw-controls"),
        html.Div(id="fleet-summary", className="llmw-muted", style={"margin": "8px 0"}),
        dcc.Graph(id="fleet-goodput", className="llmw-card", config=GRAPH_CONFIG, figure=empty("loading…", height=240)),
        dcc.Graph(id="fleet-grid", className="llmw-card", config=GRAPH_CONFIG, figure=empty("loading…", height=360)),
        html.Div("Nodes, worst first", className="llmw-section"),
        data_table("fleet-nodes", NODE_COLUMNS, page_size=20,
                   conditional=[{"if": {"filter_query": '{flag} = "!"'}, "backgroundColor": "#fdecea",
                                 "fontWeight": 600}]),
    ])


@callback(Output("fleet-summary", "children"), Output("fleet-goodput", "figure"), Output("fleet-grid", "figure"),
          Output("fleet-nodes", "data"), Input("fleet-window", "value"))
def _draw(since_s):
    from dashboard.source import SourceError

    try:
        out = build(state.source(), since_s)
    except SourceError as e:
        return html.Span(str(e), className="llmw-error"), empty(str(e), height=240), empty(str(e), height=360), []
    return out["summary"], out["goodput"], out["grid"], out["nodes"]
