"""Communication: what the collectives cost, on which mesh axis, and who waited for whom.

- time per (axis, op), exposed (the compute thread blocked on it) vs overlapped
  (hidden behind compute), in seconds per rank-step, and the mean message size per op
  (views.comm_ops);
- the latency distribution of each group's op as a box (views.comm_latency's
  precomputed quantiles: p5/p25/p50/p75/p99), coloured by axis: a slow link is one
  group's box above its axis's others;
- who waited for whom (views.comm_waits): the rank that entered a collective last
  is the one the others waited for; one sentence names the rank most waited for.

By default the last views.DEFAULT_COMM_STEPS steps; `from`/`to` in the URL (and
the two fields) choose another range. These are aggregates: a live refresh redraws
them (uirevision keeps the zoom), and only when the run moved.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import plotly.graph_objects as go
from dash import Input, Output, State, callback, clientside_callback, dcc, html, no_update

from collector.read.views import DEFAULT_COMM_STEPS
from dashboard import state
from dashboard.figures import GRAPH_CONFIG, base_layout, empty, finite, fmt_bytes, fmt_s
from dashboard.source import Source, SourceError

PAGE = {"path": "/comm", "name": "Communication", "order": 2,
        "title": "llmwatch · communication"}  # registered by dashboard/app.py
MIB = 1024 * 1024
# Mesh axes get their own palette (Tableau 10), apart from the rank colours.
AXIS_COLORS = {"dp": "#4e79a7", "tp": "#f28e2b", "pp": "#59a14f", "sp": "#76b7b2", "cp": "#76b7b2",
               "ep": "#edc948", "world": "#9c755f"}
OTHER_AXIS_COLORS = ("#b07aa1", "#ff9da7", "#e15759", "#bab0ac")
EXPOSED_COLOR, OVERLAPPED_COLOR = "#e15759", "#a0cbe8"
NO_COMM = "no collectives recorded for this run yet"


def axis_color(axis: str | None) -> str:
    if axis in AXIS_COLORS:
        return AXIS_COLORS[axis]
    return OTHER_AXIS_COLORS[sum(map(ord, axis or "")) % len(OTHER_AXIS_COLORS)]


def layout(**query: Any) -> html.Div:
    """`?from=100&to=400` restores a pasted view; without them, the last DEFAULT_COMM_STEPS steps."""
    lo, hi = state.as_int(query.get("from")), state.as_int(query.get("to"))
    return html.Div([
        html.Div([
            html.Div([html.Label("steps", className="llmw-label", htmlFor="cm-from"),
                      dcc.Input(id="cm-from", type="number", value=lo, placeholder="from", debounce=True,
                                min=0, step=1, style={"width": "110px"}),
                      html.Span("–"),
                      dcc.Input(id="cm-to", type="number", value=hi, placeholder="to", debounce=True,
                                min=0, step=1, style={"width": "110px"})], className="llmw-control"),
            html.Span(id="cm-range-text", className="llmw-muted"),
        ], className="llmw-controls"),
        html.Div(id="cm-msg", className="llmw-message"),
        html.Div([dcc.Graph(id={"type": "cm-graph", "name": "ops"}, className="llmw-card",
                            config=GRAPH_CONFIG, figure=empty("loading…", height=340)),
                  dcc.Graph(id={"type": "cm-graph", "name": "bytes"}, className="llmw-card",
                            config=GRAPH_CONFIG, figure=empty("loading…", height=340))],
                 className="llmw-row"),
        dcc.Graph(id={"type": "cm-graph", "name": "latency"}, className="llmw-card llmw-wide",
                  config=GRAPH_CONFIG, figure=empty("loading…", height=360)),
        html.Div([dcc.Graph(id={"type": "cm-graph", "name": "waits"}, className="llmw-card",
                            config=GRAPH_CONFIG, figure=empty("loading…", height=380)),
                  html.Div([html.Div("Who waited for whom", className="llmw-section"),
                            html.P(id="cm-caption"),
                            html.Ol(id="cm-top", className="llmw-muted"),
                            html.P("For every collective instance, the rank that entered it last is the one its "
                                   "group waited for; each other rank waited from its own entry until then.",
                                   className="llmw-muted")], className="llmw-card", style={"padding": "6px 16px"})],
                 className="llmw-row"),
        dcc.Store(id="cm-drawn"),
    ])


# -- what the callbacks compute (also what bench/bench_dashboard.py times) ------------------
def signature(src: Source, run_id: str) -> str:
    """A redraw is due when the run moved: its last step, attempt or last report."""
    run = src.run(run_id) or {}
    return repr((run.get("last_step"), run.get("last_attempt"), run.get("updated_ts"), run.get("status")))


def build(src: Source, run_id: str, *, step_from: int | None = None, step_to: int | None = None) -> dict[str, Any]:
    """Every figure of the page: {"ops", "bytes", "latency", "waits", "caption", "top_waited", "range"}; `range`
    is the (first, last) step the collectives read cover, None when there are none."""
    params = {"step_from": step_from, "step_to": step_to, "last_steps": DEFAULT_COMM_STEPS}
    ops = src.view(run_id, "comm_ops", **params)
    if not ops:
        where = "" if step_from is None and step_to is None else " in these steps"
        msg = NO_COMM + where
        return {"ops": empty(msg, height=340), "bytes": empty(msg, height=340), "latency": empty(msg, height=360),
                "waits": empty(msg, height=380), "caption": msg + ".", "top_waited": [], "range": None}
    latency = src.view(run_id, "comm_latency", **params)
    waits = src.view(run_id, "comm_waits", **params)
    nodes = {r["rank"]: r.get("node") for r in src.view(run_id, "mesh")}
    steps = [s for r in ops for s in (r.get("step_from"), r.get("step_to")) if s is not None]
    return {"ops": ops_figure(ops, uirevision=run_id), "bytes": bytes_figure(ops, uirevision=run_id),
            "latency": latency_figure(latency, uirevision=run_id), "waits": waits_figure(waits, uirevision=run_id),
            "caption": waits_caption(waits, nodes), "top_waited": top_waited(waits, nodes),
            "range": (min(steps), max(steps)) if steps else None}


def _op_label(r: dict) -> str:
    return f"{r.get('axis') or '?'} · {r.get('op') or '?'}"


def _two_line_ticks(fig: go.Figure) -> None:
    """"axis · op" on two lines, upright: slanted labels of a narrow chart ran into its legend."""
    xs = list(dict.fromkeys(x for t in fig.data for x in (t.x or ())))
    fig.update_xaxes(title_text="mesh axis · op", type="category", tickangle=0, tickvals=xs,
                     ticktext=[str(x).replace(" · ", "<br>") for x in xs])


def ops_figure(ops: list[dict], *, uirevision: str = "keep") -> go.Figure:
    """Stacked per "axis · op": the exposed part (what it cost the step) and the overlapped rest."""
    rows = sorted(ops, key=lambda r: -(finite(r.get("duration_s")) or 0.0))
    xs = [_op_label(r) for r in rows]
    fig = go.Figure()
    for key, name, color in (("exposed_s", "exposed (blocked compute)", EXPOSED_COLOR),
                             ("overlapped_s", "overlapped with compute", OVERLAPPED_COLOR)):
        vals = [finite(r.get(key)) or 0.0 for r in rows]
        fig.add_trace(go.Bar(x=xs, y=vals, name=name, marker={"color": color},
                             customdata=[[fmt_s(v), r.get("num_ops"), fmt_s(finite(r.get("duration_s")))]
                                         for v, r in zip(vals, rows)],
                             hovertemplate="%{x}<br>" + name + ": %{customdata[0]} per rank-step"
                                           "<br>in all %{customdata[2]} per rank-step, %{customdata[1]} ops"
                                           "<extra></extra>"))
    base_layout(fig, title="Time in collectives by axis and op (s per rank-step)", height=340, uirevision=uirevision)
    fig.update_layout(barmode="stack", hovermode="closest", margin={"b": 96},
                      legend={"orientation": "h", "traceorder": "normal", "x": 0, "xanchor": "left", "y": -0.3,
                              "yanchor": "top"})
    _two_line_ticks(fig)
    fig.update_yaxes(title_text="s per rank-step", rangemode="tozero")
    return fig


def bytes_figure(ops: list[dict], *, uirevision: str = "keep") -> go.Figure:
    """The mean message of each (axis, op) in MiB, coloured by axis; the total in the hover."""
    rows = sorted(ops, key=lambda r: -(finite(r.get("duration_s")) or 0.0))
    xs = [_op_label(r) for r in rows]
    per_op = [(finite(r.get("bytes")) or 0.0) / r["num_ops"] if r.get("num_ops") else 0.0 for r in rows]
    fig = go.Figure(go.Bar(
        x=xs, y=[b / MIB for b in per_op], marker={"color": [axis_color(r.get("axis")) for r in rows]},
        customdata=[[fmt_bytes(b), fmt_bytes(finite(r.get("bytes"))), r.get("num_ops")] for b, r in zip(per_op, rows)],
        hovertemplate="%{x}<br>%{customdata[0]} per op<br>%{customdata[1]} over %{customdata[2]} ops"
                      "<extra></extra>", showlegend=False))
    base_layout(fig, title="Message size by axis and op (MiB per op)", height=340, uirevision=uirevision, legend=False)
    fig.update_layout(hovermode="closest")
    _two_line_ticks(fig)
    fig.update_yaxes(title_text="MiB per op", rangemode="tozero")
    return fig


def latency_figure(rows: list[dict], *, uirevision: str = "keep") -> go.Figure:
    """One box per (axis, group, op) from the precomputed quantiles: whiskers p5 and p99,
    box p25-p75, line the median, on a log axis in ms."""
    if not rows:
        return empty("no group latencies in this range", height=360)
    ordered = sorted(rows, key=lambda r: (r.get("axis") or "", r.get("op") or "", r.get("group_id") or 0))
    fig = go.Figure()
    for axis in dict.fromkeys(r.get("axis") for r in ordered):
        pts = [r for r in ordered if r.get("axis") == axis]
        ms = {k: [1e3 * (finite(r.get(k)) or 0.0) or None for r in pts]
              for k in ("p5_s", "p25_s", "p50_s", "p75_s", "p99_s")}
        xs = [f"{axis} · g{r.get('group_id')} · {r.get('op')}" for r in pts]
        fig.add_trace(go.Box(
            x=xs, name=axis or "?", lowerfence=ms["p5_s"], q1=ms["p25_s"], median=ms["p50_s"], q3=ms["p75_s"],
            upperfence=ms["p99_s"], marker={"color": axis_color(axis)}, line={"width": 1.5}, boxpoints=False,
            hoverinfo="skip", legendgroup=axis))
        # a box's own hover calls its whiskers min and max (here p5 and p99): an invisible point
        # on each median says what they are
        fig.add_trace(go.Scatter(x=xs, y=ms["p50_s"], mode="markers", marker={"size": 22, "opacity": 0},
                                 showlegend=False, legendgroup=axis, text=[_box_text(r) for r in pts],
                                 hovertemplate="%{text}<extra></extra>", hoverlabel={"bgcolor": axis_color(axis)}))
    base_layout(fig, title="Latency per group and op (ms, log; box p25–p75, whiskers p5–p99)", height=360,
                uirevision=uirevision)
    fig.update_layout(hovermode="closest", boxmode="overlay")
    fig.update_xaxes(title_text="axis · group · op", type="category", tickangle=-30 if len(rows) > 12 else 0,
                     tickfont={"size": 11 if len(rows) <= 24 else 9})
    fig.update_yaxes(title_text="ms (log)", type="log", dtick="D2")
    return fig


def _box_text(r: dict) -> str:
    q = " · ".join(f"{name} {fmt_s(finite(r.get(k)))}" for name, k in
                   (("p5", "p5_s"), ("p25", "p25_s"), ("median", "p50_s"), ("p75", "p75_s"), ("p99", "p99_s")))
    head = f"{r.get('axis')} · group {r.get('group_id')} · {r.get('op')}"
    return f"{head}<br>{q}<br>max {fmt_s(finite(r.get('max_s')))} over {r.get('num_ops')} ops"


def _wait_matrix(waits: list[dict]) -> tuple[list[int], dict[tuple[int, int], dict]]:
    ranks = sorted({r["waiter"] for r in waits} | {r["waited_for"] for r in waits})
    return ranks, {(r["waiter"], r["waited_for"]): r for r in waits}


def waits_figure(waits: list[dict], *, uirevision: str = "keep") -> go.Figure:
    if not waits:
        return empty("no rank waited for another in this range", height=380)
    ranks, cells = _wait_matrix(waits)
    labels = [f"r{r}" for r in ranks]
    z = [[None if (w, f) not in cells else round(finite(cells[(w, f)].get("wait_s")) or 0.0, 5) for f in ranks]
         for w in ranks]
    n_ops = [[(cells.get((w, f)) or {}).get("num_ops") or 0 for f in ranks] for w in ranks]
    fig = go.Figure(go.Heatmap(
        x=labels, y=labels, z=z, customdata=n_ops, colorscale="Blues", zmin=0, hoverongaps=False,
        colorbar={"title": {"text": "s/step", "side": "top"}, "thickness": 12},
        hovertemplate="%{y} waited for %{x}: %{z:.3f} s per step<br>over %{customdata} ops<extra></extra>"))
    height = max(320, min(760, 120 + 14 * len(ranks)))
    base_layout(fig, title="Waiting rank (y) by the rank it waited for (x), s per step", height=height,
                uirevision=uirevision, legend=False)
    fig.update_layout(hovermode="closest")
    size = 11 if len(ranks) <= 24 else 8
    fig.update_xaxes(title_text="waited for (rank)", type="category", showgrid=False, tickfont={"size": size})
    fig.update_yaxes(title_text="waiter (rank)", type="category", autorange="reversed", showgrid=False,
                     tickfont={"size": size})
    return fig


def top_waited(waits: list[dict], nodes: dict[int, str | None], *, limit: int = 5) -> list[dict]:
    """The ranks the others waited for, most first: {rank, node, wait_s (per step, summed over
    the waiters), share (of all the waiting)}; ranks nobody waited for left out."""
    total: dict[int, float] = defaultdict(float)
    for r in waits:
        total[r["waited_for"]] += finite(r.get("wait_s")) or 0.0
    whole = sum(total.values())
    ranked = sorted((k for k in total if total[k] > 0), key=lambda k: (-total[k], k))
    return [{"rank": k, "node": nodes.get(k), "wait_s": total[k], "share": total[k] / whole} for k in ranked[:limit]]


def waits_caption(waits: list[dict], nodes: dict[int, str | None]) -> str:
    """One sentence: the rank the others waited for most, in seconds per step."""
    top = top_waited(waits, nodes, limit=1)
    if not top:
        return "No rank waited for another in this range."
    t = top[0]
    where = f" ({t['node']})" if t["node"] else ""
    return (f"Most waiting is for rank {t['rank']}{where}: {t['wait_s']:.2f} s/step, "
            f"{100 * t['share']:.0f}% of all the waiting.")


def _top_items(top: list[dict]) -> list:
    return [html.Li(f"rank {t['rank']}" + (f" ({t['node']})" if t["node"] else "")
                    + f": {t['wait_s']:.3f} s/step, {100 * t['share']:.0f}%") for t in top]


# -- callbacks ---------------------------------------------------------------------------
_GRAPHS = ("ops", "bytes", "latency", "waits")


@callback(*[Output({"type": "cm-graph", "name": n}, "figure") for n in _GRAPHS],
          Output("cm-caption", "children"), Output("cm-top", "children"), Output("cm-range-text", "children"),
          Output("cm-msg", "children"),
          Output("cm-drawn", "data"),
          Input("run", "value"), Input("tick", "n_intervals"), Input("cm-from", "value"), Input("cm-to", "value"),
          State("cm-drawn", "data"))
def _draw(run_id, _tick, step_from, step_to, drawn):
    if not run_id:
        msg = empty("no run yet")
        return msg, msg, msg, msg, "", [], "", "", None
    src = state.source()
    step_from, step_to = state.as_int(step_from), state.as_int(step_to)
    if step_from is not None and step_to is not None and step_from > step_to:
        step_from, step_to = step_to, step_from  # a range typed backwards
    try:
        key = {"run": run_id, "from": step_from, "to": step_to, "sig": signature(src, run_id)}
        if drawn == key:
            return (no_update,) * 9
        out = build(src, run_id, step_from=step_from, step_to=step_to)
    except SourceError as e:
        msg = empty(str(e))
        return msg, msg, msg, msg, "", [], "", html.Span(str(e), className="llmw-error"), None
    lo_hi = out["range"]
    if lo_hi is None:
        text = ""
    elif step_from is None and step_to is None:
        text = f"showing steps {lo_hi[0]}–{lo_hi[1]} (the last {DEFAULT_COMM_STEPS} steps; leave empty for those)"
    else:
        text = f"showing steps {lo_hi[0]}–{lo_hi[1]}"
    note = html.Span(out["caption"], className="llmw-muted") if lo_hi is None else ""
    return (out["ops"], out["bytes"], out["latency"], out["waits"], out["caption"], _top_items(out["top_waited"]),
            text, note, key)


clientside_callback(
    """function(lo, hi) {
        const step = v => (typeof v === "number" && isFinite(v)) ? v : null;  /* a cleared field is NaN */
        return window.llmw.setQuery({from: step(lo), to: step(hi)});
    }""",
    Output("url-sink", "data", allow_duplicate=True), Input("cm-from", "value"), Input("cm-to", "value"),
    prevent_initial_call=True)

