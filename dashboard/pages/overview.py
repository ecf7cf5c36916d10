"""Overview: the run's curves (loss, grad-norm, loss scale, lr, tokens/s, eval loss
per domain) with its incidents and rollbacks marked, and the rollback lineage.

Live, every refresh asks only for the steps after the last one drawn and appends
them with `extendData`; the figures are redrawn only when a control changes, when
an incident or a rollback would be marked differently, or after many appends (the
appended points are not downsampled). `uirevision` keeps the user's zoom either way.
"""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import ALL, ClientsideFunction, Input, Output, State, callback, clientside_callback, dcc, html, no_update

from dashboard import state
from dashboard.figures import (
    GRAPH_CONFIG,
    Curve,
    Marks,
    XAxis,
    annotate,
    base_layout,
    curve_figure,
    curve_traces,
    empty,
    extendable,
    finite,
    plain,
    rank_color,
)
from dashboard.source import Source, SourceError

PAGE = {"path": "/", "name": "Overview", "order": 0, "title": "llmwatch · overview"}  # registered by dashboard/app.py
CURVES = (
    Curve("loss", "Training loss", "nats", lo="loss_min", hi="loss_max"),
    Curve("grad_norm", "Gradient norm", "L2", lo="grad_norm_min", hi="grad_norm_max"),
    Curve("loss_scale", "Loss scale", "×", log_default=True),
    Curve("lr", "Learning rate", "1/step"),
    Curve("tokens_per_s", "Throughput", "tokens/s", lo="tokens_per_s_min", hi="tokens_per_s_max"),
)
MAX_POINTS = 1000  # buckets per curve on a full draw
MAX_APPENDED = 600  # points appended live before the next full draw
ATTEMPT_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def layout(x: str = "step", smooth: str = "0", log: str | None = None, **query: Any) -> html.Div:
    """`?x=time&smooth=0.6&log=loss,lr&from=100&to=400` restores a pasted view."""
    if log is None:  # no `log` in the URL: the curves that read best on a log scale
        log_on = [c.key for c in CURVES if c.log_default]
    else:  # "none": the user turned every one off
        log_on = [m for m in str(log).split(",") if m and m != "none"]
    return html.Div([
        html.Div([
            html.Div([html.Label("x axis", className="llmw-label"),
                      dcc.RadioItems(id="ov-x", value="time" if x == "time" else "step", inline=True,
                                     options=[{"label": "step", "value": "step"},
                                              {"label": "wall time", "value": "time"}])], className="llmw-control"),
            html.Div([html.Label("smoothing", className="llmw-label"),
                      dcc.Slider(id="ov-smooth", min=0, max=0.99, step=0.01, value=state.as_float(smooth, 0.0),
                                 marks={0: "0", 0.5: "0.5", 0.9: "0.9", 0.99: ".99"},
                                 tooltip={"placement": "bottom"})], className="llmw-control llmw-slider"),
            html.Div([html.Label("log scale", className="llmw-label"),
                      dcc.Checklist(id="ov-log", value=log_on, inline=True,
                                    options=[{"label": c.key, "value": c.key} for c in CURVES])],
                     className="llmw-control"),
        ], className="llmw-controls"),
        html.Div([dcc.Graph(id={"type": "ov-curve", "name": c.key}, className="llmw-sync llmw-card",
                            config=GRAPH_CONFIG, figure=empty("loading…", height=240))
                  for c in CURVES]
                 + [dcc.Graph(id={"type": "ov-extra", "name": "eval"}, className="llmw-sync llmw-card",
                              config=GRAPH_CONFIG, figure=empty("loading…", height=240))],
                 className="llmw-grid"),
        dcc.Graph(id={"type": "ov-extra", "name": "lineage"}, className="llmw-sync llmw-card llmw-wide",
                  config=GRAPH_CONFIG, figure=empty("loading…", height=300)),
        html.Details([html.Summary("run configuration"), html.Pre(id="ov-config", className="llmw-pre")],
                     className="llmw-card llmw-details"),
        dcc.Store(id="ov-drawn"),
        # the steps the synced zoom shows (from assets/llmwatch.js): refetched at full resolution
        dcc.Store(id="ov-range", data=_range(query.get("from"), query.get("to"))),
    ])


# -- what the callbacks compute (also what bench/bench_dashboard.py times) ------------------
def marks(src: Source, run_id: str) -> Marks:
    return Marks(incidents=src.table(run_id, "incidents"), actions=src.table(run_id, "actions"),
                 attempts=src.view(run_id, "attempts"))


def _range(lo: Any, hi: Any) -> dict[str, int] | None:
    lo, hi = state.as_int(lo), state.as_int(hi)
    return {"from": lo, "to": hi} if lo is not None and hi is not None and lo <= hi else None


def build(src: Source, run_id: str, *, x: str = "step", smoothing: float = 0.0, log: tuple[str, ...] = (),
          step_from: int | None = None, step_to: int | None = None) -> dict[str, Any]:
    """Every figure of the page, drawn in full: {"curves": [...], "eval", "lineage", "drawn"}.
    With a step range (the synced zoom), the curves are read at full resolution there:
    a zoom into a long run shows every step, not the buckets of the whole run."""
    xa = XAxis(x)
    zoomed = step_from is not None and step_to is not None and not xa.by_time
    rows = src.view(run_id, "overview", max_points=MAX_POINTS, **({"step_from": max(0, step_from - 1),
                                                                 "step_to": step_to + 1} if zoomed else {}))
    m = marks(src, run_id)
    nonfinite = [r for r in rows if r.get("num_nonfinite")]
    curves = [curve_figure(rows, c, xa, smoothing=smoothing, log_y=c.key in log, marks=m,
                           nonfinite=nonfinite if c.key in ("loss", "grad_norm") else None, uirevision=run_id)
              for c in CURVES]
    eval_fig = eval_figure(src.view(run_id, "scalars", prefix="eval/"), xa, m, run_id)
    lineage_fig = lineage_figure(src.view(run_id, "lineage"), xa, m, run_id)
    if zoomed:  # a redraw resets what Plotly.relayout set: the range is the figure's own
        for fig in (*curves, eval_fig, lineage_fig):
            fig.update_xaxes(range=[step_from, step_to])
    last = rows[-1] if rows else {}
    drawn = {"run": run_id, "x": x, "smoothing": smoothing, "log": sorted(log), "marks": repr(m.signature),
             "last_step": last.get("step_to"), "appended": 0,
             "smooth_last": {c.key: _smoothed_end(f.data) for c, f in zip(CURVES, curves)}}
    return {"curves": curves, "eval": eval_fig, "lineage": lineage_fig, "drawn": drawn}


def extend(src: Source, run_id: str, drawn: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
    """The steps after the last drawn one as `extendData` per curve, and the new drawn
    state; None when a full draw is due instead (marks changed, or too much appended)."""
    m = marks(src, run_id)
    if repr(m.signature) != drawn.get("marks"):
        return None
    rows = src.view(run_id, "overview", step_from=(drawn.get("last_step") or 0) + 1, max_points=MAX_POINTS)
    if not rows:
        return [no_update] * len(CURVES), drawn
    if any(r.get("num_nonfinite") for r in rows) or drawn.get("appended", 0) + len(rows) > MAX_APPENDED:
        return None
    xa = XAxis(drawn.get("x", "step"))
    out, smooth_last = [], dict(drawn.get("smooth_last") or {})
    for c in CURVES:
        traces = curve_traces(rows, c, xa, smoothing=drawn.get("smoothing", 0.0),
                              smooth_start=smooth_last.get(c.key))
        out.append([{"x": [plain(t.x) for t in traces], "y": [plain(t.y) for t in traces]},
                    list(range(len(traces)))])
        smooth_last[c.key] = _smoothed_end(traces)
    return out, {**drawn, "last_step": rows[-1].get("step_to"), "appended": drawn.get("appended", 0) + len(rows),
                 "smooth_last": smooth_last}


def _smoothed_end(traces) -> float | None:
    """Where the smoothed trace (curve_traces' 4th; empty without smoothing) ends: the
    next append continues the average from there."""
    if len(traces) < 4 or len(traces[3].y) == 0:
        return None
    return finite(traces[3].y[-1])


def eval_figure(rows: list[dict], xa: XAxis, m: Marks, uirevision: str) -> go.Figure:
    if not rows:
        return empty("no eval yet (the trainer's --eval-every)", height=240)
    fig = go.Figure()
    for i, name in enumerate(sorted({r["name"] for r in rows})):
        pts = [r for r in rows if r["name"] == name]
        label = name.removeprefix("eval/").removesuffix("_loss")
        fig.add_trace(go.Scatter(x=[xa.of(r) for r in pts], y=[finite(r["value"]) for r in pts], name=label,
                                 mode="lines+markers", line={"color": rank_color(i + 4), "width": 2},
                                 hovertemplate=f"%{{y:.4f}} nats<extra>{label}</extra>"))
    base_layout(fig, title="Eval loss by domain (nats)", height=240, uirevision=uirevision)
    fig.update_xaxes(title_text=xa.title)
    return annotate(fig, m, xa, label=False)


def lineage_figure(rows: list[dict], xa: XAxis, m: Marks, uirevision: str) -> go.Figure:
    """Every attempt's loss: the effective curve solid, what a rollback replaced dotted."""
    if not rows:
        return empty("no steps yet", height=300)
    fig = go.Figure()
    for att in sorted({r["attempt"] for r in rows}):
        color = ATTEMPT_COLORS[att % len(ATTEMPT_COLORS)]
        for effective in (True, False):
            pts = [r for r in rows if r["attempt"] == att and bool(r["effective"]) == effective]
            if not pts:
                continue
            fig.add_trace(go.Scatter(
                x=[xa.of(r) for r in pts], y=[finite(r["loss"]) for r in pts], mode="lines",
                name=f"attempt {att}" + ("" if effective else " (replaced)"),
                line={"color": color, "width": 2 if effective else 1.5, "dash": "solid" if effective else "dot"},
                opacity=1 if effective else 0.75, connectgaps=False,
                hovertemplate=f"%{{y:.4f}} nats<extra>attempt {att}{'' if effective else ' replaced'}</extra>"))
    base_layout(fig, title="Rollback lineage: loss by attempt (solid: the effective curve; dotted: replaced)",
                height=300, uirevision=uirevision)
    fig.update_xaxes(title_text=xa.title)
    fig.update_yaxes(title_text="nats")
    return annotate(fig, m, xa)


def config_text(run: dict | None) -> str:
    import json

    if not run:
        return ""
    cfg = run.get("config") or {}
    return json.dumps({"mesh": run.get("mesh"), "world_size": run.get("world_size"),
                       "code_version": run.get("code_version"), "data_version": run.get("data_version"),
                       "config": cfg}, indent=2, default=str)


# -- callbacks ---------------------------------------------------------------------------
_CURVE_IDS = {"type": "ov-curve", "name": ALL}
_EXTRA_IDS = {"type": "ov-extra", "name": ALL}


@callback(Output(_CURVE_IDS, "figure"), Output(_CURVE_IDS, "extendData"), Output(_EXTRA_IDS, "figure"),
          Output("ov-drawn", "data"), Output("ov-config", "children"),
          Input("run", "value"), Input("tick", "n_intervals"), Input("ov-x", "value"), Input("ov-smooth", "value"),
          Input("ov-log", "value"), Input("ov-range", "data"), State("ov-drawn", "data"))
def _draw(run_id, _tick, x, smoothing, log, zoom, drawn):
    n = len(CURVES)
    if not run_id:
        msg = empty("no run yet", height=240)
        return [msg] * n, [no_update] * n, [msg, empty("no run yet", height=300)], None, ""
    src = state.source()
    smoothing = float(smoothing or 0.0)
    controls = {"run": run_id, "x": x, "smoothing": smoothing, "log": sorted(log or [])}
    try:
        if drawn and all(drawn.get(k) == v for k, v in controls.items()) and dash.ctx.triggered_id == "tick":
            ext = extend(src, run_id, drawn)
            if ext is not None:
                data, new = ext
                if all(d is no_update for d in data):
                    return [no_update] * n, data, [no_update, no_update], no_update, no_update
                return [no_update] * n, data, [no_update, no_update], new, no_update
        zoom = zoom or {}
        out = build(src, run_id, x=x, smoothing=smoothing, log=tuple(log or ()), step_from=zoom.get("from"),
                    step_to=zoom.get("to"))
        run_cfg = config_text(src.run(run_id))
    except SourceError as e:
        msg = empty(str(e), height=240)
        return [msg] * n, [no_update] * n, [msg, empty(str(e), height=300)], None, no_update
    curves = [extendable(f) for f in out["curves"]]  # extended live: their arrays go out as lists
    return curves, [no_update] * n, [out["eval"], out["lineage"]], out["drawn"], run_cfg


clientside_callback(ClientsideFunction("llmw", "syncZoom"), Output("ov-range", "data"),
                    Input({"type": "ov-curve", "name": ALL}, "relayoutData"),
                    Input({"type": "ov-extra", "name": ALL}, "relayoutData"), prevent_initial_call=True)

clientside_callback(
    """function(x, smooth, log) {
        return window.llmw.setQuery({x: x === "step" ? null : x, smooth: smooth ? smooth : null,
                                     log: log && log.length ? log : "none"});
    }""",
    Output("url-sink", "data", allow_duplicate=True),
    Input("ov-x", "value"), Input("ov-smooth", "value"), Input("ov-log", "value"), prevent_initial_call=True)

