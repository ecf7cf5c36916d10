"""Nodes & checkpoints: which machines the run is on and how healthy each is, and
every checkpoint it wrote.

The node table says each node's status (healthy, suspect, isolated: an isolated
node's ranks were taken out of training; spare: a standby node of the launcher's,
with no ranks until it takes an isolated node's place), its ranks, why and when, and a chart
shows the ranks per node in the node colours every page uses. The checkpoint
table and its chart say how long each write took and whether it was verified (an
unverified or partial checkpoint cannot be restored), with the run's incidents and
rollbacks marked on the step axis.
"""

from __future__ import annotations

import json
from typing import Any

import plotly.graph_objects as go
from dash import Input, Output, State, callback, dcc, html, no_update

from dashboard import state
from dashboard.components import data_table
from dashboard.figures import (
    GRAPH_CONFIG,
    HEALTH_COLORS,
    Marks,
    XAxis,
    annotate,
    base_layout,
    empty,
    fmt_bytes,
    fmt_ts,
    node_color,
)
from dashboard.source import Source, SourceError

PAGE = {"path": "/nodes", "name": "Nodes", "order": 4,
        "title": "llmwatch · nodes & checkpoints"}  # registered by dashboard/app.py
STATUS_HEALTH = {"healthy": "healthy", "suspect": "warning", "isolated": "isolated",
                 "spare": "healthy"}  # node status -> HEALTH_COLORS
VERIFIED_COLOR, UNVERIFIED_COLOR = HEALTH_COLORS["healthy"], HEALTH_COLORS["incident"]

NODE_COLUMNS = (("node", "node", "t"), ("status", "status", "t"), ("num_ranks", "ranks", "n"),
                ("ranks", "rank ids", "t"), ("reason", "reason", "t"), ("isolated", "isolated at (UTC)", "t"),
                ("incident_id", "incident", "n"), ("updated", "updated (UTC)", "t"))
CHECKPOINT_COLUMNS = (("step", "step", "n"), ("attempt", "attempt", "n"), ("num_shards", "shards", "n"),
                      ("num_ranks", "ranks reported", "n"), ("size", "size", "t"), ("write_s", "write (s)", "n"),
                      ("verified", "verified", "t"), ("path", "path", "t"), ("at", "written (UTC)", "t"))


def health_color(status: str | None) -> str:
    return HEALTH_COLORS.get(STATUS_HEALTH.get(status or "", "warning"), HEALTH_COLORS["warning"])


def _ranks(value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return sorted(int(r) for r in value) if isinstance(value, (list, tuple)) else []


# -- rows and figures ---------------------------------------------------------------------
def node_rows(nodes: list[dict]) -> list[dict]:
    return [{"node": n.get("node"), "status": n.get("status") or "healthy", "num_ranks": len(_ranks(n.get("ranks"))),
             "ranks": ", ".join(map(str, _ranks(n.get("ranks")))) or "–", "reason": n.get("reason") or "–",
             "isolated": fmt_ts(n.get("isolated_ts")), "incident_id": n.get("incident_id"),
             "updated": fmt_ts(n.get("updated_ts"))} for n in nodes]


def nodes_figure(nodes: list[dict], *, uirevision: str = "keep") -> go.Figure:
    """Ranks per node: one bar per node in its colour, outlined in its health colour,
    hatched when isolated, labelled with its rank ids."""
    if not nodes:
        return empty("no nodes reported yet", height=220)
    names = sorted(n["node"] for n in nodes)
    fig = go.Figure()
    for n in sorted(nodes, key=lambda n: n["node"]):
        ranks, status = _ranks(n.get("ranks")), n.get("status") or "healthy"
        fig.add_trace(go.Bar(
            orientation="h", y=[n["node"]], x=[len(ranks)], name=n["node"], showlegend=False,
            marker={"color": node_color(n["node"], names), "line": {"color": health_color(status), "width": 3},
                    "pattern": {"shape": "/" if status == "isolated" else "", "fgcolor": "#555555"}},
            text=[f"{status} · ranks {', '.join(map(str, ranks)) or '–'}"],
            textposition="inside" if ranks else "outside",  # a spare has no ranks: its label beside the axis
            insidetextanchor="start", textfont={"size": 12, "color": "#1d2433"},
            hovertemplate=(f"<b>{n['node']}</b> ({status})<br>{len(ranks)} ranks: "
                           f"{', '.join(map(str, ranks)) or '–'}<br>{n.get('reason') or ''}<extra></extra>")))
    base_layout(fig, title="Ranks per node (hatched: isolated; a spare has none until it takes a node's place)",
                height=120 + 48 * len(nodes), uirevision=uirevision, legend=False)
    fig.update_layout(hovermode="closest", bargap=0.3)
    fig.update_xaxes(title_text="ranks (count)", dtick=1 if max(len(_ranks(n.get("ranks"))) for n in nodes) <= 16
                     else None, rangemode="tozero")
    fig.update_yaxes(title_text="node", type="category", categoryorder="array", categoryarray=names[::-1])
    return fig


def checkpoint_rows(checkpoints: list[dict]) -> list[dict]:
    return [{"step": c.get("step"), "attempt": c.get("attempt"), "num_shards": c.get("num_shards"),
             "num_ranks": c.get("num_ranks"), "size": fmt_bytes(c.get("bytes")),
             "write_s": None if c.get("write_s") is None else round(float(c["write_s"]), 3),
             "verified": "✓" if c.get("verified") else "✗", "path": c.get("path") or "–",
             "at": fmt_ts(c.get("ts"))}
            for c in checkpoints]


def checkpoint_figure(checkpoints: list[dict], marks: Marks | None, *, uirevision: str = "keep") -> go.Figure:
    """Write seconds per checkpoint on the step axis, green when verified, red when not.
    A step saved by two attempts (a rollback re-ran it) gets two bars side by side."""
    pts = [c for c in checkpoints if c.get("write_s") is not None]
    if not pts:
        return empty("no checkpoints written yet" if not checkpoints else "no checkpoint reported its write time",
                     height=260)
    steps = sorted({c["step"] for c in pts})
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    typical = sorted(gaps)[len(gaps) // 2] if gaps else max(1, steps[0] // 10 or 1)
    by_step: dict[int, list[dict]] = {}
    for c in sorted(pts, key=lambda c: (c["step"], c.get("attempt") or 0)):
        by_step.setdefault(c["step"], []).append(c)
    placed = []  # (checkpoint, offset from its step, width), in steps
    for k, (step, group) in enumerate(by_step.items()):
        near = [g for g in (gaps[k - 1] if k > 0 else None, gaps[k] if k < len(gaps) else None) if g]
        width = 0.8 * min([typical, *near])  # wide bars, but never over a neighbour's
        w = width / len(group)
        placed += [(c, -width / 2 + j * w, w) for j, c in enumerate(group)]
    fig = go.Figure()
    for verified, name, color in ((True, "verified", VERIFIED_COLOR), (False, "not verified", UNVERIFIED_COLOR)):
        group = [p for p in placed if bool(p[0].get("verified")) == verified]
        if not group:
            continue
        fig.add_trace(go.Bar(
            x=[c["step"] for c, _, _ in group], y=[c["write_s"] for c, _, _ in group],
            offset=[o for _, o, _ in group], width=[w for _, _, w in group], name=name,
            marker={"color": color}, opacity=0.85,
            customdata=[[c.get("attempt"), fmt_bytes(c.get("bytes")), c.get("num_shards"), c.get("num_ranks"),
                         c.get("path") or "–"] for c, _, _ in group],
            hovertemplate=(f"<b>step %{{x}}</b> (attempt %{{customdata[0]}}): %{{y:.3f}} s, {name}"
                           "<br>%{customdata[1]}, %{customdata[2]} shards from %{customdata[3]} ranks"
                           "<br>%{customdata[4]}<extra></extra>")))
    base_layout(fig, title="Checkpoint write time per step (s; green: verified, red: not verified)",
                height=280, uirevision=uirevision, legend=False)
    fig.update_layout(barmode="overlay", hovermode="closest")
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="write time (s)", rangemode="tozero")
    if marks is not None:
        annotate(fig, marks, XAxis("step"))
    return fig


# -- what the callback computes (also what bench/bench_dashboard.py times) -----------------
def read(src: Source, run_id: str) -> dict[str, Any]:
    """The run's rows and their `signature`: what changes when the page would look different."""
    nodes = src.table(run_id, "nodes")
    checkpoints = src.table(run_id, "checkpoints")
    marks = Marks(incidents=src.table(run_id, "incidents"), actions=src.table(run_id, "actions"),
                  attempts=src.view(run_id, "attempts"))
    signature = json.dumps([[(n.get("node"), n.get("status"), n.get("updated_ts")) for n in nodes],
                            [(c.get("step"), c.get("attempt"), c.get("verified")) for c in checkpoints],
                            marks.signature], default=str)
    return {"nodes": nodes, "checkpoints": checkpoints, "marks": marks, "signature": signature}


def render(run_id: str, raw: dict[str, Any]) -> dict[str, Any]:
    """{"nodes", "nodes_figure", "checkpoints", "checkpoint_figure", "signature"}."""
    return {"nodes": node_rows(raw["nodes"]), "nodes_figure": nodes_figure(raw["nodes"], uirevision=run_id),
            "checkpoints": checkpoint_rows(raw["checkpoints"]),
            "checkpoint_figure": checkpoint_figure(raw["checkpoints"], raw["marks"], uirevision=run_id),
            "signature": raw["signature"]}


def build(src: Source, run_id: str, **_: Any) -> dict[str, Any]:
    """Everything the page shows for one run (what the bench times)."""
    return render(run_id, read(src, run_id))


# -- layout and callback --------------------------------------------------------------------
_NODE_STYLES = [{"if": {"filter_query": f'{{status}} = "{s}"', "column_id": "status"},
                 "color": health_color(s), "fontWeight": 600} for s in STATUS_HEALTH] + [
    {"if": {"filter_query": '{status} = "isolated"'}, "backgroundColor": "#f1f1f1"}]
_CHECKPOINT_STYLES = [
    {"if": {"filter_query": '{verified} = "✓"', "column_id": "verified"}, "color": VERIFIED_COLOR, "fontWeight": 700},
    {"if": {"filter_query": '{verified} = "✗"', "column_id": "verified"}, "color": UNVERIFIED_COLOR,
     "fontWeight": 700},
]


def layout(**_: Any) -> html.Div:
    return html.Div([
        html.Div("Nodes", className="llmw-section"),
        html.Div(id="nodes-empty", className="llmw-muted"),
        html.Div([
            html.Div(data_table("nodes-table", NODE_COLUMNS, conditional=_NODE_STYLES), className="llmw-card"),
            dcc.Graph(id="nodes-chart", className="llmw-card", config=GRAPH_CONFIG,
                      figure=empty("loading…", height=220)),
        ], className="llmw-row"),
        html.Div("Checkpoints", className="llmw-section"),
        html.Div(id="ckpt-empty", className="llmw-muted"),
        dcc.Graph(id="ckpt-chart", className="llmw-card", config=GRAPH_CONFIG,
                  figure=empty("loading…", height=260)),
        html.Div(data_table("ckpt-table", CHECKPOINT_COLUMNS, conditional=_CHECKPOINT_STYLES, page_size=20),
                 className="llmw-table"),
        dcc.Store(id="nodes-drawn"),
    ])


@callback(Output("nodes-table", "data"), Output("nodes-chart", "figure"), Output("nodes-empty", "children"),
          Output("ckpt-table", "data"), Output("ckpt-chart", "figure"), Output("ckpt-empty", "children"),
          Output("nodes-drawn", "data"),
          Input("run", "value"), Input("tick", "n_intervals"), State("nodes-drawn", "data"))
def _draw(run_id, _tick, drawn):
    if not run_id:
        return [], empty("no run yet", height=220), "", [], empty("no run yet", height=260), "", None
    try:
        raw = read(state.source(), run_id)
    except SourceError as e:
        return ([], empty(str(e), height=220), html.Span(str(e), className="llmw-error"), [],
                empty(str(e), height=260), "", None)
    key = f"{run_id}|{raw['signature']}"
    if drawn == key:
        return (no_update,) * 7  # nothing new: no figure built, nothing sent
    out = render(run_id, raw)
    return (out["nodes"], out["nodes_figure"], "" if out["nodes"] else "no nodes reported yet for this run",
            out["checkpoints"], out["checkpoint_figure"],
            "" if out["checkpoints"] else "no checkpoints: the run has not saved one", key)
