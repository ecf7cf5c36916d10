"""Runs: every run side by side, and a few of them compared.

The table has each run's status, size, progress, what went wrong (incidents open
and all, actions) and its goodput (collector/read/goodput.py: the share of wall time
spent on steps that counted). Below, the runs picked (the newest three by default,
`?runs=a,b` in the URL) have their loss curves overlaid on the step axis, each
rollback dashed in the run's colour, and their wall time split into productive,
skipped, superseded (steps a rollback replaced) and outside-steps seconds.

Goodput and the loss curve read every step of a run, so the table asks goodput
for the newest `GOODPUT_RUNS` runs only, and both are remembered for a run that
has not moved since (same step, attempt, incidents, status): a finished run costs
one read per dashboard process, a running one a read per refresh.
"""

from __future__ import annotations

import threading
from typing import Any

import plotly.graph_objects as go
from dash import Input, Output, State, callback, clientside_callback, ctx, dcc, html, no_update

from dashboard import state
from dashboard.components import data_table, legend_below
from dashboard.figures import GRAPH_CONFIG, RANK_COLORS, base_layout, empty, finite, fmt_s, to_datetime
from dashboard.source import Source, SourceError

PAGE = {"path": "/runs", "name": "Runs", "order": 6, "title": "llmwatch · runs"}  # registered by dashboard/app.py
GOODPUT_RUNS = 20  # the newest runs whose goodput the table shows
DEFAULT_PICKED = 3
MAX_POINTS = 500  # loss buckets per run
PARTS = (("productive_s", "productive", "#2ca02c"), ("skipped_s", "skipped", "#f0a30a"),
         ("superseded_s", "superseded", "#6f42c1"), ("outside_steps_s", "outside steps", "#b3b3b3"))
RUN_COLUMNS = (("run_id", "run", "t"), ("status", "status", "t"), ("world_size", "world size", "n"),
               ("mesh", "mesh", "t"), ("last_step", "last step", "n"), ("attempts", "attempts", "n"),
               ("incidents", "incidents (open / all)", "t"), ("num_actions", "actions", "n"),
               ("goodput", "goodput (%)", "n"), ("wall", "wall time", "t"), ("created", "created (UTC)", "t"))

_memo: dict[tuple, Any] = {}
_memo_lock = threading.Lock()


def run_color(k: int) -> str:
    return RANK_COLORS[k % len(RANK_COLORS)]


def mesh_text(mesh: Any) -> str:
    if not isinstance(mesh, dict):
        return "–"
    return " × ".join(f"{k}{mesh[k]}" for k in ("dp", "pp", "tp") if k in mesh) or "–"


def _remembered(src: Source, run: dict, what: str, read: Any) -> Any:
    """`read()`, remembered while the run has not moved (same step, attempt, incidents,
    actions, status and update time): a finished run is read once per process."""
    key = (id(src), what, run.get("run_id"), run.get("updated_ts"), run.get("last_step"), run.get("last_attempt"),
           run.get("num_incidents"), run.get("num_actions"), run.get("status"))
    with _memo_lock:
        hit = _memo.get(key)
    if hit is not None:
        return hit
    value = read()
    with _memo_lock:
        if len(_memo) > 512:
            _memo.clear()
        _memo[key] = value
    return value


def goodput_of(src: Source, run: dict) -> dict:
    g = _remembered(src, run, "goodput", lambda: src.table(run["run_id"], "goodput"))
    return g if isinstance(g, dict) else {}


def run_rows(src: Source, runs: list[dict]) -> list[dict]:
    out = []
    for k, r in enumerate(runs):
        g = goodput_of(src, r) if k < GOODPUT_RUNS else {}
        gp = g.get("goodput")
        out.append({"run_id": r.get("run_id"), "status": r.get("status") or "?", "world_size": r.get("world_size"),
                    "mesh": mesh_text(r.get("mesh")), "last_step": r.get("last_step"),
                    "attempts": None if r.get("last_attempt") is None else int(r["last_attempt"]) + 1,
                    "incidents": f"{r.get('open_incidents') or 0} / {r.get('num_incidents') or 0}",
                    "num_actions": r.get("num_actions") or 0,
                    "goodput": None if gp is None else round(100 * gp, 1),
                    "wall": fmt_s(g.get("wall_s")) if g else "–",
                    "created": (to_datetime(r.get("created_ts")) or "–")[:19]})
    return out


def default_picked(run_ids: list[str], current: str | None) -> list[str]:
    """The newest runs, with the run picked in the header among them."""
    picked = run_ids[:DEFAULT_PICKED]
    if current in run_ids and current not in picked:
        picked = [current, *picked[:DEFAULT_PICKED - 1]]
    return picked


def loss_figure(src: Source, picked: list[str], runs: dict[str, dict]) -> go.Figure:
    """Each picked run's effective loss by step, one colour a run; a rollback's new
    attempt dashed in the run's colour."""
    if not picked:
        return empty("pick runs to compare their loss curves", height=380)
    fig = go.Figure()
    drawn = 0
    for k, run_id in enumerate(picked):
        run = runs.get(run_id, {"run_id": run_id})
        rows = _remembered(src, run, "loss", lambda: [{"step": r.get("step"), "loss": r.get("loss")} for r in
                                                       src.view(run_id, "overview", max_points=MAX_POINTS)])
        if not rows:
            continue
        drawn += 1
        color = run_color(k)
        fig.add_trace(go.Scatter(x=[r.get("step") for r in rows], y=[finite(r.get("loss")) for r in rows],
                                 mode="lines", name=run_id, line={"color": color, "width": 2}, connectgaps=False,
                                 hovertemplate=f"%{{y:.4f}} nats<extra>{run_id}</extra>"))
        for att in _remembered(src, run, "attempts", lambda: src.view(run_id, "attempts"))[1:]:
            if att.get("step_from") is None:
                continue
            fig.add_vline(x=att["step_from"], line={"color": color, "width": 1.2, "dash": "dash"})
            fig.add_annotation(x=att["step_from"], y=0, xref="x", yref="paper", yanchor="bottom", xanchor="left",
                               showarrow=False, text=f"{run_id} attempt {att.get('attempt')}",
                               font={"size": 10, "color": color})
    if not drawn:
        return empty("the runs picked have no steps yet", height=380)
    base_layout(fig, title="Loss by run (nats)", height=380, uirevision=",".join(picked))
    legend_below(fig)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss (nats)")
    return fig


def goodput_figure(picked: list[str], goodputs: dict[str, dict]) -> go.Figure:
    """Each picked run's wall seconds, stacked: productive, skipped, superseded, outside steps."""
    if not picked:
        return empty("pick runs to compare their goodput", height=380)
    runs = [r for r in picked if goodputs.get(r, {}).get("wall_s")]
    if not runs:
        return empty("no goodput yet: the runs picked have no steps", height=380)
    fig = go.Figure()
    for key, name, color in PARTS:
        fig.add_trace(go.Bar(x=runs, y=[float(goodputs[r].get(key) or 0.0) for r in runs], name=name,
                             marker={"color": color},
                             hovertemplate=f"%{{y:.1f}} s<extra>{name}</extra>"))
    for r in runs:
        gp = goodputs[r].get("goodput")
        fig.add_annotation(x=r, y=goodputs[r]["wall_s"], yanchor="bottom", showarrow=False,
                           text="–" if gp is None else f"goodput {100 * gp:.1f}%", font={"size": 11})
    base_layout(fig, title="Wall time by part (s)", height=380, uirevision=",".join(picked))
    legend_below(fig)
    fig.update_layout(barmode="stack", hovermode="x unified", bargap=0.45)
    fig.update_xaxes(title_text="run", type="category")
    fig.update_yaxes(title_text="wall time (s)", rangemode="tozero")
    return fig


# -- what the callbacks compute (also what bench/bench_dashboard.py times) -----------------
def build(src: Source, run_id: str | None = None, *, picked: list[str] | None = None) -> dict[str, Any]:
    """{"table" (rows), "run_ids", "picked", "loss", "goodput"}; `picked` None: the default."""
    runs = src.runs()
    ids = [r["run_id"] for r in runs]
    picked = [r for r in (picked if picked is not None else default_picked(ids, run_id)) if r in ids]
    rows = run_rows(src, runs)
    by_id = {r["run_id"]: r for r in runs}
    goodputs = {r: goodput_of(src, by_id[r]) for r in picked}
    return {"table": rows, "run_ids": ids, "picked": picked, "loss": loss_figure(src, picked, by_id),
            "goodput": goodput_figure(picked, goodputs)}


# -- layout and callbacks -------------------------------------------------------------------
_RUN_STYLES = [
    {"if": {"filter_query": '{status} = "running"', "column_id": "status"}, "color": "#1e40af", "fontWeight": 600},
    {"if": {"filter_query": '{status} = "completed" || {status} = "finished"', "column_id": "status"},
     "color": "#166534", "fontWeight": 600},
    {"if": {"filter_query": '{status} = "failed" || {status} = "crashed" || {status} = "stopped"',
            "column_id": "status"}, "color": "#991b1b", "fontWeight": 600},
    {"if": {"filter_query": '{incidents} contains "/" && {incidents} != "0 / 0"', "column_id": "incidents"},
     "fontWeight": 600},
]


def layout(runs: str | None = None, **_: Any) -> html.Div:
    picked = [r for r in str(runs or "").split(",") if r]
    return html.Div([
        html.Div("Runs", className="llmw-section"),
        html.Div(id="runs-empty", className="llmw-muted"),
        data_table("runs-table", RUN_COLUMNS, conditional=_RUN_STYLES, page_size=20),
        html.Div([html.Label("compare", className="llmw-label"),
                  dcc.Dropdown(id="runs-pick", multi=True, value=picked or None, placeholder="pick runs…",
                               style={"minWidth": 420})], className="llmw-controls", style={"marginTop": 14}),
        html.Div([dcc.Graph(id="runs-loss", className="llmw-card", config=GRAPH_CONFIG,
                            figure=empty("loading…", height=380)),
                  dcc.Graph(id="runs-goodput", className="llmw-card", config=GRAPH_CONFIG,
                            figure=empty("loading…", height=380))], className="llmw-row"),
    ])


def draw(src: Source, run_id: str | None, picked: list[str] | None, options: list | None, *,
         triggered: Any = None) -> tuple:
    """The callback's answer. No runs picked on a first draw (or a new header run): the
    default pick; a live refresh or the user's own change keeps an emptied pick empty."""
    use_default = not picked and triggered not in ("tick", "runs-pick")
    try:
        out = build(src, run_id, picked=None if use_default else list(picked or []))
    except SourceError as e:
        return ([], no_update, no_update, empty(str(e), height=380), empty(str(e), height=380),
                html.Span(str(e), className="llmw-error"))
    new_options = [{"label": r, "value": r} for r in out["run_ids"]]
    value = out["picked"] if out["picked"] != (picked or []) else no_update
    return (out["table"], new_options if new_options != options else no_update, value, out["loss"],
            out["goodput"], "" if out["table"] else "no runs yet: nothing has reported here")


@callback(Output("runs-table", "data"), Output("runs-pick", "options"), Output("runs-pick", "value"),
          Output("runs-loss", "figure"), Output("runs-goodput", "figure"), Output("runs-empty", "children"),
          Input("run", "value"), Input("tick", "n_intervals"), Input("runs-pick", "value"),
          State("runs-pick", "options"))
def _draw(run_id, _tick, picked, options):
    return draw(state.source(), run_id, picked, options, triggered=ctx.triggered_id)


clientside_callback(
    """function(picked) { return window.llmw.setQuery({runs: picked && picked.length ? picked : null}); }""",
    Output("url-sink", "data", allow_duplicate=True), Input("runs-pick", "value"), prevent_initial_call=True)
