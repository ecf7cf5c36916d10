"""Ranks: where the time of a step goes, rank by rank, and which rank is holding the
others up.

- a rank x step heatmap of step time (views.step_grid), ranks grouped by node,
  incidents and rollbacks marked, its zoom synced and written to the URL;
- per rank, a step cut into compute, data loading, exposed communication and the rest
  (views.rank_time): a straggler has more compute, the ranks waiting for it more
  exposed communication;
- the slowest ranks as a table, with their compute against the median rank's of their
  restart round (views.rank_rounds): after a restart on fewer nodes each replica's step
  carries more micro-batches, and only ranks of one layout compare;
- the mesh (views.mesh): one cell per rank, a tile per data-parallel replica
  (pipeline stages as rows, tensor shards as columns), coloured by health, with a band
  under the cells naming their node.

A rank filter (`ranks=0,3`) narrows the heatmap and the bars; `metric=compute` colours
the heatmap by each rank's own compute instead of its step (in lockstep every rank's
step is as slow as the slowest: a straggler is a column of step time but a row of
compute). `from`/`to` set the steps read (heatmap, bars, table) and the heatmap's x
range; zooming the heatmap reads its steps again at full resolution and writes them to
the URL, a double click goes back to all. Live, a refresh redraws only when the run
moved (its last step, its marks, its ranks' health): the grid is the costly read.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np
import plotly.graph_objects as go
from dash import (
    ALL,
    ClientsideFunction,
    Input,
    Output,
    State,
    callback,
    clientside_callback,
    dash_table,
    dcc,
    html,
    no_update,
)

from dashboard import state
from dashboard.figures import (
    ACTION_COLOR,
    GRAPH_CONFIG,
    HEALTH_COLORS,
    Marks,
    XAxis,
    annotate,
    base_layout,
    column,
    empty,
    finite,
    node_color,
    rank_color,
    severity_color,
)
from dashboard.source import Source, SourceError

PAGE = {"path": "/ranks", "name": "Ranks", "order": 1, "title": "llmwatch · ranks"}  # registered by dashboard/app.py
# heatmap columns (64 ranks x 240: ~1.9 MB of JSON from the collector); a zoom refetches at full resolution
MAX_STEPS = 240
SILENT_AFTER_S = 30.0  # a running rank whose last heartbeat is older than this is drawn silent...
SILENT_AFTER_BEATS = 3.0  # ...or than this many of its agent's heartbeat intervals, when longer
TOP_SLOWEST = 8
PARTS = (("compute_s", "compute (fwd+bwd+opt)", "#4e79a7"), ("data_s", "data loading", "#59a14f"),
         ("comm_exposed_s", "exposed comm", "#e15759"), ("other_s", "other", "#bab0ac"))
TABLE_COLUMNS = [{"name": "rank", "id": "rank", "type": "numeric"}, {"name": "round", "id": "round", "type": "numeric"},
                 {"name": "node", "id": "node"},
                 {"name": "mesh (dp·pp·tp)", "id": "coords"},
                 {"name": "step (ms)", "id": "step_ms", "type": "numeric"},
                 {"name": "compute (ms)", "id": "compute_ms", "type": "numeric"},
                 {"name": "compute ÷ median", "id": "compute_ratio", "type": "numeric"}]


def layout(ranks: str | None = None, metric: str = "step", **query: Any) -> html.Div:
    """`?ranks=0,3&metric=compute&from=100&to=400` restores a pasted view."""
    chosen = state.as_ranks(ranks)
    return html.Div([
        html.Div([
            html.Div([html.Label("ranks", className="llmw-label", htmlFor="rk-ranks"),
                      dcc.Dropdown(id="rk-ranks", multi=True, value=chosen, options=[{"label": f"r{r}", "value": r}
                                                                                   for r in chosen],
                                   placeholder="all ranks (search a node name, then Select All)",
                                   style={"minWidth": "380px"})], className="llmw-control"),
            html.Div([html.Label("colour by", className="llmw-label"),
                      dcc.RadioItems(id="rk-metric", value="compute" if metric == "compute" else "step", inline=True,
                                     options=[{"label": "step time", "value": "step"},
                                              {"label": "compute (fwd+bwd+opt)", "value": "compute"}])],
                     className="llmw-control"),
            html.Span(id="rk-range-text", className="llmw-muted"),
        ], className="llmw-controls"),
        html.Div(id="rk-msg", className="llmw-message"),
        dcc.Graph(id={"type": "rk-sync", "name": "heatmap"}, className="llmw-sync llmw-card",
                  config=GRAPH_CONFIG, figure=empty("loading…", height=320)),
        html.Div([dcc.Graph(id={"type": "rk-graph", "name": "bars"}, className="llmw-card",
                            config=GRAPH_CONFIG, figure=empty("loading…")),
                  dcc.Graph(id={"type": "rk-graph", "name": "mesh"}, className="llmw-card",
                            config={"displayModeBar": False}, figure=empty("loading…"))], className="llmw-row"),
        html.Div("Slowest ranks (compute against the median of their restart round, over the range)",
                 className="llmw-section"),
        dash_table.DataTable(id="rk-table", columns=TABLE_COLUMNS, data=[], sort_action="native",
                             style_table={"overflowX": "auto"}, style_as_list_view=True,
                             style_cell={"fontFamily": "inherit", "fontSize": 13, "padding": "4px 10px",
                                         "textAlign": "left"},
                             style_header={"fontWeight": 600, "backgroundColor": "#f5f7fb"},
                             style_data_conditional=[{"if": {"filter_query": "{compute_ratio} >= 1.2",
                                                             "column_id": "compute_ratio"},
                                                      "color": "#d62728", "fontWeight": 600}],
                             css=[{"selector": ".dash-spreadsheet", "rule": "max-width: 900px"}]),
        # the steps shown: the URL's, then the heatmap's zoom (assets/llmwatch.js), read again at full resolution
        dcc.Store(id="rk-range", data=_range(query.get("from"), query.get("to"))),
        dcc.Store(id="rk-drawn"),
    ])


# -- what the callbacks compute (also what bench/bench_dashboard.py times) ------------------
def _range(lo: Any, hi: Any) -> dict[str, int | None] | None:
    lo, hi = state.as_int(lo), state.as_int(hi)
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    return None if lo is None and hi is None else {"from": lo, "to": hi}


def marks(src: Source, run_id: str) -> Marks:
    return Marks(incidents=src.table(run_id, "incidents"), actions=src.table(run_id, "actions"),
                 attempts=src.view(run_id, "attempts"))


def signature(src: Source, run_id: str, *, now: float | None = None) -> str:
    """What a redraw depends on, cheaply read: the run's progress, its marks and its ranks'
    health. While it runs, the clock (10 s buckets) too: a rank goes silent by time alone."""
    run = src.run(run_id) or {}
    now = time.time() if now is None else now
    mesh_rows = src.view(run_id, "mesh")
    health = tuple(health_of(r, run.get("status"), now)[0] for r in mesh_rows)
    clock = int(now // 10) if run.get("status") == "running" else None
    return repr((run.get("last_step"), run.get("last_attempt"), run.get("updated_ts"), run.get("status"),
                 run.get("open_incidents"), health, marks(src, run_id).signature, clock))


def build(src: Source, run_id: str, *, ranks: list[int] | tuple[int, ...] = (), metric: str = "step",
          step_from: int | None = None, step_to: int | None = None, now: float | None = None) -> dict[str, Any]:
    """Every figure and table of the page: {"heatmap", "bars", "mesh", "table", "rank_options", "range"}."""
    run = src.run(run_id) or {}
    now = time.time() if now is None else now
    mesh_rows = src.view(run_id, "mesh")
    grid = src.view(run_id, "grid", step_from=step_from, step_to=step_to, max_steps=MAX_STEPS)
    times = src.view(run_id, "rank_time", step_from=step_from, step_to=step_to)
    info = {r["rank"]: r for r in [*times, *mesh_rows]}  # mesh rows last: every known rank with its node
    wanted = set(ranks or ())
    shown = [r for r in times if not wanted or r["rank"] in wanted]
    steps = [g["step"] for g in grid]
    return {
        "heatmap": heatmap_figure([g for g in grid if not wanted or g["rank"] in wanted], info, marks(src, run_id),
                                  metric=metric, step_from=step_from, step_to=step_to, uirevision=run_id),
        "bars": bars_figure(shown, uirevision=run_id),
        "mesh": mesh_figure(mesh_rows, run.get("status"), now, uirevision=run_id),
        "table": slowest_table(src.view(run_id, "rank_rounds", step_from=step_from, step_to=step_to)),
        "rank_options": rank_options(info),
        "range": (min(steps), max(steps)) if steps else None,
    }


def rank_order(info: dict[int, dict]) -> list[int]:
    """Ranks grouped by node, the nodes in the order of their first rank."""
    first: dict[Any, int] = {}
    for r in sorted(info):
        first.setdefault(info[r].get("node"), r)
    return sorted(info, key=lambda r: (first[info[r].get("node")], r))


def rank_label(rank: int, info: dict[int, dict]) -> str:
    node = (info.get(rank) or {}).get("node")
    return f"r{rank} · {node}" if node else f"r{rank}"


def rank_options(info: dict[int, dict]) -> list[dict]:
    return [{"label": rank_label(r, info), "value": r} for r in rank_order(info)]


def _colored(text: str, rank: int) -> str:
    return f"<span style='color:{rank_color(rank)}'>{text}</span>"


def heatmap_figure(grid: list[dict], info: dict[int, dict], m: Marks, *, metric: str = "step",
                   step_from: int | None = None, step_to: int | None = None, uirevision: str = "keep") -> go.Figure:
    """`metric` "step": each cell the ranks' step time (in lockstep, a straggler slows every
    rank's step, so it shows as a column); "compute": its own fwd+bwd+opt (it shows as a row)."""
    if not grid:
        return empty("no steps yet for these ranks" if info else "no steps yet", height=320)
    steps = sorted({g["step"] for g in grid})
    width = min((b - a for a, b in zip(steps, steps[1:])), default=1)
    present = {g["rank"] for g in grid}
    order = [r for r in rank_order({r: info.get(r, {}) for r in present})]
    row_of = {r: i for i, r in enumerate(order)}
    col_of = {s: j for j, s in enumerate(steps)}
    # numpy, not nested lists: plotly validates and copies a list cell by cell (0.5 s at 64 x 300),
    # and sends an array as base64 (float32: half of float64's bytes, exact for steps below 2**24);
    # NaN is a gap
    key = "compute_s" if metric == "compute" else "step_s"
    i = np.fromiter((row_of[g["rank"]] for g in grid), dtype=np.int64, count=len(grid))
    j = np.fromiter((col_of[g["step"]] for g in grid), dtype=np.int64, count=len(grid))
    z = np.full((len(order), len(steps)), np.nan, dtype=np.float32)
    z[i, j] = column(grid, key) * 1e3  # ms
    cd = None
    if width > 1:  # a bucket of steps: which, and its slowest step
        cd = np.full((len(order), len(steps), 3), np.nan, dtype=np.float32)
        first = np.asarray(steps, dtype=np.float32)[j]
        cd[i, j, 0], cd[i, j, 1] = first, first + (width - 1)
        if metric != "compute":
            cd[i, j, 2] = column(grid, "step_s_max") * 1e3
    values = np.sort(z[np.isfinite(z)])
    zmin = float(values[0]) if len(values) else None  # a first slow step or two must not wash out the rest:
    zmax = float(values[min(len(values) - 1, int(0.98 * len(values)))]) if len(values) else None  # p98 is the top
    labels = [rank_label(r, info) for r in order]
    xs = [s + (width - 1) / 2 for s in steps]  # a cell is centred on its bucket of steps
    what = "compute time" if metric == "compute" else "step time"
    where = "step %{x}" if width == 1 else "steps %{customdata[0]}–%{customdata[1]}"
    fig = go.Figure(go.Heatmap(
        x=xs, y=labels, z=z, customdata=cd, colorscale="YlOrRd", zmin=zmin, zmax=zmax if zmax != zmin else None,
        colorbar={"title": {"text": "ms", "side": "top"}, "thickness": 12, "len": 0.9}, hoverongaps=False,
        hovertemplate="%{y}<br>" + where + f"<br>{what} %{{z:.1f}} ms"
                      + ("" if width == 1 or metric == "compute" else " (slowest %{customdata[2]:.1f} ms)")
                      + "<extra></extra>"))
    per = "" if width == 1 else f", each cell the mean of {width} steps"
    row_px = max(10, min(44, 600 // len(order)))  # 44 px a rank at 4 ranks, 10 at 64
    base_layout(fig, title=f"{what.capitalize()} by rank (ms{per})", uirevision=uirevision, legend=False,
                height=max(260, min(820, 110 + len(order) * row_px)))
    fig.update_layout(hovermode="closest", margin={"t": 68})
    x_range = None
    if step_from is not None or step_to is not None:
        x_range = [(step_from if step_from is not None else steps[0]) - 0.5,
                   (step_to if step_to is not None else steps[-1] + width - 1) + 0.5]
    fig.update_xaxes(title_text="step", range=x_range, showgrid=False)
    fig.update_yaxes(title_text=None, type="category", categoryorder="array", categoryarray=labels,
                     autorange="reversed", tickvals=labels,
                     ticktext=[_colored(lab, r) for lab, r in zip(labels, order)], showgrid=False,
                     automargin=True, tickfont={"size": 11 if len(order) <= 24 else 9})
    annotate(fig, m, XAxis("step"), label=False)
    rules = [dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=i - 0.5, y1=i - 0.5, layer="above",
                  line={"color": "#ffffff", "width": 3})  # where one node's ranks end and the next's begin
             for i in range(1, len(order))
             if info.get(order[i], {}).get("node") != info.get(order[i - 1], {}).get("node")]
    fig.layout.shapes = (*fig.layout.shapes, *rules, *_marks_as_strip(fig, m))  # one update, not one a shape
    return fig


def _marks_as_strip(fig: go.Figure, m: Marks) -> list[dict]:
    """An opaque heatmap hides the shading annotate() puts below the data: the incidents
    become a dotted outline over it and (returned, to add) a labelled strip above it."""
    strips = []
    for shape in fig.layout.shapes:
        if shape.type == "rect" and shape.fillcolor and shape.layer == "below":
            shape.update(layer="above", fillcolor="rgba(0,0,0,0)", opacity=1,
                         line={"color": shape.fillcolor, "width": 1.2, "dash": "dot"})
            strips.append(dict(type="rect", xref="x", yref="paper", x0=shape.x0, x1=shape.x1, y0=1.01, y1=1.075,
                               fillcolor=shape.line.color, opacity=0.85, line={"width": 0}, layer="above"))
    incidents = [i for i in m.incidents if i.get("step_from") is not None]
    for strip, inc in zip(strips, incidents):
        who = f" r{inc['rank']}" if inc.get("rank") is not None else (f" {inc['node']}" if inc.get("node") else "")
        strip["label"] = {"text": f"{inc.get('kind')}{who}", "font": {"size": 10, "color": "#ffffff"},
                          "textposition": "middle left"}
        strip["fillcolor"] = severity_color(inc.get("severity"))
    why = {a.get("attempt"): a.get("kind") for a in m.actions if a.get("attempt") is not None}
    starts: dict[int, list[str]] = {}  # named as annotate() names them, one label a step: "rollback → attempt 1"
    for att in m.attempts[1:]:
        if att.get("step_from") is not None:
            cause = why.get(att.get("attempt"))
            name = f"attempt {att.get('attempt')}"
            starts.setdefault(att["step_from"], []).append(f"{cause} → {name}" if cause else name)
    for step, names in starts.items():
        fig.add_annotation(x=step, y=1.0, xref="x", yref="paper", yanchor="bottom", xanchor="left",
                           showarrow=False, yshift=22, font={"size": 10, "color": ACTION_COLOR},
                           text=", ".join(names))
    return strips


def bars_figure(rows: list[dict], *, uirevision: str = "keep") -> go.Figure:
    """One stacked bar per rank: where its mean step went, in seconds."""
    if not rows:
        return empty("no steps yet")
    ranks = [r["rank"] for r in rows]
    xs = [f"r{r}" for r in ranks]
    fig = go.Figure()
    for key, name, color in PARTS:
        fig.add_trace(go.Bar(
            x=xs, y=[finite(r.get(key)) or 0.0 for r in rows], name=name, marker={"color": color},
            customdata=[[r.get("node") or "?", 1e3 * (finite(r.get(key)) or 0.0)] for r in rows],
            hovertemplate=f"%{{x}} · %{{customdata[0]}}<br>{name}: %{{customdata[1]:.1f}} ms/step<extra></extra>"))
    base_layout(fig, title="Where each rank's step goes (mean s per step)", uirevision=uirevision, height=340)
    fig.update_layout(barmode="stack", hovermode="closest", bargap=0.25 if len(rows) > 16 else 0.4,
                      margin={"b": 96}, legend={"orientation": "h", "traceorder": "normal", "x": 0, "xanchor": "left",
                                                "y": -0.3, "yanchor": "top"})
    fig.update_xaxes(title_text="rank", type="category", tickvals=xs,
                     ticktext=[_colored(x, r) for x, r in zip(xs, ranks)],
                     tickfont={"size": 11 if len(xs) <= 32 else 8})
    fig.update_yaxes(title_text="s per step", rangemode="tozero")
    return fig


def slowest_table(rows: list[dict]) -> list[dict]:
    """The slowest ranks (views.rank_rounds: a row per restart round and rank), by compute over
    the median rank's of the same round (with lockstep collectives every rank's step is as long
    as the slowest: step time breaks ties), slowest first. Rows without `round` are one round."""
    by_round: dict[Any, list[float]] = {}
    for r in rows:
        c = finite(r.get("compute_s"))
        if c is not None:
            by_round.setdefault(r.get("round"), []).append(c)
    medians = {k: statistics.median(v) for k, v in by_round.items()}

    def ratio(r: dict) -> float | None:
        c, m = finite(r.get("compute_s")), medians.get(r.get("round"))
        return c / m if c is not None and m else None

    ordered = sorted(rows, key=lambda r: (-(ratio(r) or 0.0), -(finite(r.get("step_s")) or 0.0), r["rank"]))
    out = []
    for r in ordered[:TOP_SLOWEST]:
        step_s, compute_s, q = finite(r.get("step_s")), finite(r.get("compute_s")), ratio(r)
        out.append({"rank": r["rank"], "round": r.get("round") or 0, "node": r.get("node") or "?",
                    "coords": _coords(r), "step_ms": None if step_s is None else round(step_s * 1e3, 1),
                    "compute_ms": None if compute_s is None else round(compute_s * 1e3, 1),
                    "compute_ratio": None if q is None else round(q, 2)})
    return out


def _coords(r: dict) -> str:
    return " · ".join(f"{k}{r[k]}" for k in ("dp", "pp", "tp") if r.get(k) is not None) or "–"


# -- the mesh ------------------------------------------------------------------------------
def health_of(r: dict, run_status: str | None, now: float) -> tuple[str, str]:
    """(health, why) of one mesh row: an isolated node, an open incident, a heartbeat gone
    quiet while the run is running (for `SILENT_AFTER_S`, or `SILENT_AFTER_BEATS` of the
    rank's heartbeat interval when its agent beats more rarely), else healthy."""
    if r.get("node_status") == "isolated":
        return "isolated", f"{r.get('node')} isolated" + (f": {r['reason']}" if r.get("reason") else "")
    if r.get("open_incidents"):
        return "incident", f"open incident: {r.get('incident_kinds') or '?'}"
    hb = finite(r.get("heartbeat_ts"))
    age = None if hb is None else now - hb
    beat_s = finite(r.get("heartbeat_interval_s"))
    quiet_s = SILENT_AFTER_S if beat_s is None else max(SILENT_AFTER_S, SILENT_AFTER_BEATS * beat_s)
    if run_status == "running" and (age is None or age > quiet_s):
        return "silent", "no heartbeat yet" if age is None else f"no heartbeat for {age:.0f} s"
    return "healthy", "healthy" + ("" if age is None else f", last heartbeat {max(0.0, age):.0f} s ago") + (
        f" ({r['phase']})" if r.get("phase") else "")


def _tiles_per_row(num_dp: int, num_pp: int, num_tp: int, *, gap_x: float, gap_y: float, row_h: float) -> int:
    """How many replica tiles side by side make the mesh about twice as wide as tall, with
    the rows of tiles as even as can be (4 tiles as 2 + 2 or 4, never 3 + 1)."""
    def aspect(c: int) -> float:
        rows = math.ceil(num_dp / c)
        return (c * num_tp + (c - 1) * gap_x + 1) / (rows * num_pp * row_h + (rows - 1) * gap_y + 1.2)
    even = {math.ceil(num_dp / rows) for rows in range(1, num_dp + 1)}
    return min(sorted(even), key=lambda c: abs(aspect(c) - 2.2))


def mesh_figure(rows: list[dict], run_status: str | None, now: float, *, uirevision: str = "keep") -> go.Figure:
    """Each data-parallel replica a tile (pipeline stages as rows, tensor shards as
    columns), each rank a cell coloured by health, a band under the cells naming the node."""
    if not rows:
        return empty("no ranks yet")
    has_coords = all(r.get(k) is not None for r in rows for k in ("dp", "tp", "pp"))
    coords = {r["rank"]: (r["dp"], r["pp"], r["tp"]) if has_coords else (r["rank"], 0, 0) for r in rows}
    num_dp, num_pp, num_tp = (max(c[i] for c in coords.values()) + 1 for i in range(3))
    gap_x, gap_y, row_h = 0.6, 0.9, 1.35
    per_row = _tiles_per_row(num_dp, num_pp, num_tp, gap_x=gap_x, gap_y=gap_y, row_h=row_h)
    nodes = sorted({r.get("node") for r in rows if r.get("node")})

    def xy(dp: int, pp: int, tp: int) -> tuple[float, float]:
        return (dp % per_row) * (num_tp + gap_x) + tp, (dp // per_row) * (num_pp * row_h + gap_y) + pp * row_h

    fig = go.Figure()
    rows = [dict(r) for r in rows]  # the cells, with their place and health added
    shapes = []
    for r in rows:
        x, y = xy(*coords[r["rank"]])
        health, why = health_of(r, run_status, now)
        shapes.append(dict(type="rect", x0=x - 0.45, x1=x + 0.45, y0=y - 0.45, y1=y + 0.45, line={"width": 0},
                           fillcolor=HEALTH_COLORS[health], layer="below"))
        r["_health"], r["_why"], r["_x"], r["_y"] = health, why, x, y
    # node bands: under each row of cells, one band per run of neighbouring cells on the same node
    for y in sorted({r["_y"] for r in rows}):
        line = sorted((r for r in rows if r["_y"] == y), key=lambda r: r["_x"])
        start = 0
        for i in range(1, len(line) + 1):
            if (i == len(line) or line[i].get("node") != line[start].get("node")
                    or line[i]["_x"] - line[i - 1]["_x"] > 1):
                node = line[start].get("node")
                band = dict(type="rect", x0=line[start]["_x"] - 0.45, x1=line[i - 1]["_x"] + 0.45, y0=y + 0.5,
                            y1=y + 0.72, line={"width": 0}, fillcolor=node_color(node, nodes), layer="below")
                if i - start >= 2 or len(nodes) <= 1 or num_tp == 1:
                    band["label"] = {"text": node or "?", "font": {"size": 9, "color": "#1d2433"}}
                shapes.append(band)
                start = i
    size = 11 if len(rows) <= 32 else 9
    fig.add_trace(go.Scatter(
        x=[r["_x"] for r in rows], y=[r["_y"] for r in rows], mode="text", text=[f"r{r['rank']}" for r in rows],
        textfont={"color": "#ffffff", "size": size}, showlegend=False,
        customdata=[[r.get("node") or "?", _coords(r), r["_why"]] for r in rows],
        hovertemplate="rank %{text} · %{customdata[0]}<br>%{customdata[1]}<br>%{customdata[2]}<extra></extra>"))
    for health in ("healthy", "incident", "silent", "isolated"):  # a legend of the colours in use
        if any(r["_health"] == health for r in rows):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=health,
                                     marker={"symbol": "square", "size": 12, "color": HEALTH_COLORS[health]}))
    annotations = []
    if num_tp * num_pp > 1 and has_coords:
        for dp in range(num_dp):
            x0, y0 = xy(dp, 0, 0)
            annotations.append(dict(x=x0 + (num_tp - 1) / 2, y=y0 - 0.55, text=f"dp{dp}", showarrow=False,
                                    yanchor="bottom", font={"size": 10, "color": "#6b7280"}))
    if num_pp > 1 and has_coords:
        for pp in range(num_pp):
            annotations.append(dict(x=-0.55, y=xy(0, pp, 0)[1], text=f"pp{pp}", showarrow=False, xanchor="right",
                                    font={"size": 10, "color": "#6b7280"}))
    xs, ys = [r["_x"] for r in rows], [r["_y"] for r in rows]
    width_u, height_u = max(xs) - min(xs) + 1.6, max(ys) - min(ys) + 1.9
    px = min(70.0, 560.0 / width_u)
    shape = " × ".join(f"{k}{n}" for k, n in (("dp", num_dp), ("pp", num_pp), ("tp", num_tp))) if has_coords else \
        f"{len(rows)} ranks (no mesh coordinates)"
    base_layout(fig, title=f"Mesh {shape} (cell: health, band: node)", uirevision=uirevision,
                height=int(max(240, min(720, height_u * px + 90))))
    fig.update_layout(shapes=shapes, annotations=annotations, hovermode="closest",
                      legend={"y": 0, "x": 0.5, "xanchor": "center", "yanchor": "top"})
    fig.update_xaxes(visible=False, range=[min(xs) - 0.9, max(xs) + 0.7], constrain="domain", fixedrange=True)
    fig.update_yaxes(visible=False, range=[max(ys) + 0.85, min(ys) - 0.95], scaleanchor="x", scaleratio=1,
                     constrain="domain", fixedrange=True)
    return fig


# -- callbacks ---------------------------------------------------------------------------
@callback(Output({"type": "rk-sync", "name": "heatmap"}, "figure"),
          Output({"type": "rk-graph", "name": "bars"}, "figure"),
          Output({"type": "rk-graph", "name": "mesh"}, "figure"),
          Output("rk-table", "data"), Output("rk-ranks", "options"), Output("rk-msg", "children"),
          Output("rk-range-text", "children"), Output("rk-drawn", "data"),
          Input("run", "value"), Input("tick", "n_intervals"), Input("rk-ranks", "value"), Input("rk-metric", "value"),
          Input("rk-range", "data"), State("rk-drawn", "data"))
def _draw(run_id, _tick, ranks, metric, step_range, drawn):
    if not run_id:
        msg = empty("no run yet")
        return msg, msg, msg, [], no_update, "", "", None
    src = state.source()
    step_range = step_range or {}
    ranks = state.as_ranks(ranks or [])
    try:
        sig = signature(src, run_id)
        key = {"run": run_id, "ranks": ranks, "metric": metric, "range": step_range, "sig": sig}
        if drawn == key:
            return (no_update,) * 8
        out = build(src, run_id, ranks=ranks, metric=metric, step_from=step_range.get("from"),
                    step_to=step_range.get("to"))
    except SourceError as e:
        msg = empty(str(e))
        return msg, msg, msg, [], no_update, html.Span(str(e), className="llmw-error"), "", None
    lo_hi = out["range"]
    note = "" if lo_hi else html.Span("This run has no steps yet: the charts fill in as the ranks report.",
                                      className="llmw-muted")
    text = f"steps {lo_hi[0]}–{lo_hi[1]} of the effective attempt" if lo_hi else ""
    if lo_hi and step_range:
        text += " (double-click the heatmap for all)"
    return out["heatmap"], out["bars"], out["mesh"], out["table"], out["rank_options"], note, text, key


clientside_callback(ClientsideFunction("llmw", "syncZoom"), Output("rk-range", "data"),
                    Input({"type": "rk-sync", "name": ALL}, "relayoutData"), prevent_initial_call=True)

clientside_callback(
    """function(ranks, metric) {
        return window.llmw.setQuery({ranks: ranks && ranks.length ? ranks.slice().sort((a, b) => a - b) : null,
                                     metric: metric === "compute" ? metric : null});
    }""",
    Output("url-sink", "data", allow_duplicate=True), Input("rk-ranks", "value"), Input("rk-metric", "value"),
    prevent_initial_call=True)

