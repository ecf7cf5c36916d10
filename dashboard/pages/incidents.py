"""Incidents: what was detected in the run, and what the policy did about it.

A wall-time timeline with one row per incident kind (each incident a bar from when
it opened to when it closed, or to now while it is open, coloured by severity) and
the actions as markers on a row of their own; then the incidents and the actions
as tables, the sample windows rollbacks skipped, and a link to the run's
postmortem report (served by the app at /report/<run>). Above them, where the run's
wall time went: one bar split by cause (collector/read/goodput.py CAUSES, the
`goodput` view), each slow-down incident its own part.

Live, every refresh reads the run's incidents and actions (small tables) and
redraws only when something on the page would look different (`signature`), so a
new incident shows within one refresh and an idle page costs four small reads.

"""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any

import plotly.graph_objects as go
from dash import Input, Output, State, callback, dcc, html, no_update

from collector.offline.postmortem import highlights
from collector.read.goodput import CAUSES, cause_label, ordered_causes
from dashboard import state
from dashboard.components import data_table, legend_below
from dashboard.figures import (
    ACTION_COLOR,
    GRAPH_CONFIG,
    Marks,
    XAxis,
    annotate,
    base_layout,
    empty,
    fmt_s,
    fmt_ts,
    severity_color,
    to_datetime,
)
from dashboard.source import Source, SourceError

PAGE = {"path": "/incidents", "name": "Incidents", "order": 3,
        "title": "llmwatch · incidents"}  # registered by dashboard/app.py
NO_INCIDENTS = "no incidents: nothing was detected in this run"
# a marker per action kind (analysis/kinds.py ACTIONS; tests/unit/test_kinds.py keeps them in step)
ACTION_SYMBOLS = {"rollback": "triangle-left", "isolate": "x", "restart": "circle", "stop": "square",
                  "repair": "cross", "checkpoint": "hexagon", "rebalance": "star"}
OPEN_BG = "#fdecec"  # an open incident's row
CAUSE_COLORS = {"productive": "#2ca02c", "slowdown": "#f0a30a", "skipped": "#d62728", "detection": "#e377c2",
                "redone": "#ff7f0e", "recovery": "#6f42c1", "checkpoint": "#1f77b4", "idle": "#b3b3b3"}

INCIDENT_COLUMNS = (("id", "id", "n"), ("kind", "kind", "t"), ("severity", "severity", "t"),
                    ("status", "status", "t"), ("rank", "culprit rank", "n"), ("node", "node", "t"),
                    ("steps", "steps", "t"), ("root_cause", "root cause", "t"), ("confidence", "confidence", "n"),
                    ("opened", "opened (UTC)", "t"), ("closed", "closed (UTC)", "t"), ("evidence", "evidence", "t"))
ACTION_COLUMNS = (("id", "id", "n"), ("kind", "kind", "t"), ("mode", "mode", "t"), ("status", "status", "t"),
                  ("incident_id", "incident", "n"), ("target", "node / rank", "t"), ("attempt", "attempt", "n"),
                  ("requested", "requested (UTC)", "t"), ("recovery", "recovery", "t"),
                  ("caught_up", "caught up after", "t"), ("reason", "reason", "t"),
                  ("outcome", "outcome / error", "t"))
BAD_BATCH_COLUMNS = (("epoch", "epoch", "n"), ("samples", "samples", "t"), ("step", "step", "n"),
                     ("incident_id", "incident", "n"), ("verdict", "verdict", "t"), ("at", "skipped at (UTC)", "t"))


def _steps_text(lo: Any, hi: Any) -> str:
    if lo is None:
        return "–"
    return str(lo) if hi in (None, lo) else f"{lo}–{hi}"


def _short(text: Any, limit: int = 160) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= limit else s[: limit - 1] + "…"


# -- rows ---------------------------------------------------------------------------------
def incident_rows(incidents: list[dict]) -> list[dict]:
    return [{"id": i.get("id"), "kind": i.get("kind"), "severity": i.get("severity"), "status": i.get("status"),
             "rank": i.get("rank"), "node": i.get("node") or ("run-wide" if i.get("rank") is None else "–"),
             "steps": _steps_text(i.get("step_from"), i.get("step_to")),
             "root_cause": i.get("root_cause") or "–",
             "confidence": None if i.get("confidence") is None else round(float(i["confidence"]), 2),
             "opened": fmt_ts(i.get("opened_ts")), "closed": fmt_ts(i.get("closed_ts")),
             "evidence": highlights(i.get("kind") or "", i.get("evidence"))}
            for i in incidents]


def _target(a: dict) -> str:
    parts = [str(a["node"])] if a.get("node") else []
    if a.get("rank") is not None:
        parts.append(f"rank {a['rank']}")
    return " / ".join(parts) or "run"


def action_rows(actions: list[dict]) -> list[dict]:
    out = []
    for a in actions:
        d = a.get("detail") if isinstance(a.get("detail"), dict) else {}
        outcome = f"error: {d['error']}" if d.get("error") else (d.get("outcome") or "–")
        out.append({"id": a.get("id"), "kind": a.get("kind"),
                    "mode": (a.get("mode") or "–") + (" (dry run)" if a.get("dry_run") else ""),
                    "status": a.get("status"), "incident_id": a.get("incident_id"), "target": _target(a),
                    "attempt": a.get("attempt"), "requested": fmt_ts(a.get("requested_ts")),
                    "recovery": fmt_s(a.get("recovery_s")), "caught_up": fmt_s(d.get("caught_up_s")),
                    "reason": _short(d.get("reason") or d.get("verdict") or "–"), "outcome": _short(outcome)})
    return out


def bad_batch_rows(rows: list[dict]) -> list[dict]:
    return [{"epoch": b.get("epoch"), "samples": f"{b.get('sample_from')}–{b.get('sample_to')}",
             "step": b.get("step"), "incident_id": b.get("incident_id"), "verdict": b.get("verdict") or "–",
             "at": fmt_ts(b.get("ts"))} for b in rows]


# -- the timeline -------------------------------------------------------------------------
def _culprit(i: dict) -> str:
    if i.get("rank") is not None:
        return f"rank {i['rank']}" + (f" on {i['node']}" if i.get("node") else "")
    return i.get("node") or "run-wide"


def timeline_figure(incidents: list[dict], actions: list[dict], attempts: list[dict], *, now_ts: float | None,
                    uirevision: str = "keep") -> go.Figure:
    """Incidents as bars on a wall-time axis, one row per kind, and actions as markers.
    An open incident's bar runs to `now_ts` (live) or its last update (a closed file)."""
    if not incidents and not actions:
        return empty(NO_INCIDENTS, height=220)
    spans = []
    for i in incidents:
        start = i.get("opened_ts")
        end = i.get("closed_ts") or (now_ts if i.get("status") == "open" and now_ts else None) \
            or i.get("updated_ts") or start
        spans.append((i, start, max(end, start)))
    times = [t for _, s, e in spans for t in (s, e)] + [a["requested_ts"] for a in actions if a.get("requested_ts")]
    lo, hi = min(times), max(times)
    min_width_s = (hi - lo) * 0.006 if hi > lo else 1.0  # an instant incident still shows as a sliver
    kinds = list(dict.fromkeys(i.get("kind") for i, _, _ in sorted(spans, key=lambda x: x[1])))
    fig = go.Figure()
    for severity in dict.fromkeys(i.get("severity") for i, _, _ in spans):
        group = [(i, s, e) for i, s, e in spans if i.get("severity") == severity]
        fig.add_trace(go.Bar(
            orientation="h", y=[i.get("kind") for i, _, _ in group], base=[to_datetime(s) for _, s, _ in group],
            x=[max(e - s, min_width_s) * 1000 for _, s, e in group],  # a date axis measures bars in ms
            name=severity or "?", marker={"color": severity_color(severity),
                                           "line": {"color": ["#1d2433" if i.get("status") == "open" else
                                                              "rgba(0,0,0,0)" for i, _, _ in group],
                                                    "width": 2}},
            opacity=0.85, text=[f"#{i.get('id')} {_culprit(i)}" for i, _, _ in group], textposition="auto",
            insidetextanchor="start", textfont={"size": 11},
            customdata=[[i.get("id"), i.get("kind"), _culprit(i), _steps_text(i.get("step_from"), i.get("step_to")),
                         i.get("status"), _short(i.get("root_cause") or "–", 120), fmt_ts(s), fmt_ts(e)]
                        for i, s, e in group],
            hovertemplate=("<b>#%{customdata[0]} %{customdata[1]}</b><br>culprit: %{customdata[2]}"
                           "<br>steps: %{customdata[3]}<br>status: %{customdata[4]}"
                           "<br>root cause: %{customdata[5]}<br>%{customdata[6]} → %{customdata[7]} UTC"
                           "<extra></extra>")))
    for kind in dict.fromkeys(a.get("kind") for a in actions):
        group = [a for a in actions if a.get("kind") == kind and a.get("requested_ts")]
        fig.add_trace(go.Scatter(
            x=[to_datetime(a["requested_ts"]) for a in group], y=["actions"] * len(group), mode="markers",
            name=f"action: {kind}",
            marker={"symbol": ACTION_SYMBOLS.get(kind, "diamond"), "size": 13, "color": ACTION_COLOR,
                    "line": {"width": 1, "color": "#ffffff"}},
            customdata=[[a.get("id"), kind, a.get("status"), fmt_s(a.get("recovery_s")), _target(a),
                         a.get("incident_id") if a.get("incident_id") is not None else "–"] for a in group],
            hovertemplate=("<b>action #%{customdata[0]} %{customdata[1]}</b> on %{customdata[4]}"
                           "<br>status: %{customdata[2]}<br>recovery: %{customdata[3]}"
                           "<br>incident: %{customdata[5]}<extra></extra>")))
    rows = (["actions"] if actions else []) + kinds[::-1]  # plotly lists categories bottom up
    base_layout(fig, title="Incident timeline (bars: open → closed, by severity; markers: actions)",
                height=190 + 46 * len(rows), uirevision=uirevision)
    fig.update_layout(hovermode="closest", barmode="overlay", bargap=0.35)
    legend_below(fig)
    fig.update_xaxes(type="date", title_text="wall time (UTC)")
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=rows, title_text="incident kind")
    pad = max(hi - lo, 60.0)  # a restart far from any incident would squeeze the bars to slivers
    near = [a for a in attempts[1:] if a.get("ts_from") is not None and lo - pad <= a["ts_from"] <= hi + pad]
    if attempts:
        annotate(fig, Marks(incidents=[], attempts=[attempts[0], *near], actions=[]), XAxis("time"))
    return fig


def causes_figure(good: dict[str, Any], *, uirevision: str = "keep") -> go.Figure:
    """The run's wall time as one horizontal bar split by cause (`run_goodput`'s `causes`)."""
    rows = ordered_causes([c for c in (good.get("causes") or []) if (c.get("seconds") or 0) > 0])
    if not rows:
        return empty("no steps yet: nothing to split", height=150)
    fig = go.Figure()
    for c in rows:
        label = cause_label(c)
        fig.add_trace(go.Bar(
            x=[c["seconds"]], y=["wall time"], orientation="h", name=label,
            marker={"color": CAUSE_COLORS.get(c["cause"], "#7f7f7f")},
            hovertemplate=(f"{label}: %{{x:.2f}} s ({100 * (c.get('share') or 0):.1f}%)"
                           f"<br>{CAUSES.get(c['cause'], '')}<extra></extra>")))
    g = good.get("goodput")
    base_layout(fig, title=f"Where the wall time went (goodput {'–' if g is None else f'{100 * g:.1f}%'})",
                height=170, uirevision=uirevision)
    fig.update_layout(barmode="stack", showlegend=True, xaxis={"ticksuffix": " s"}, yaxis={"visible": False},
                      legend={"orientation": "h", "y": -0.45, "traceorder": "normal"})
    return fig


# -- what the callback computes (also what bench/bench_dashboard.py times) -----------------
def read(src: Source, run_id: str) -> dict[str, Any]:
    """The run's rows and their `signature`: what changes when the page would look different."""
    incidents = src.table(run_id, "incidents")
    actions = src.table(run_id, "actions")
    bad = src.table(run_id, "bad_batches")
    attempts = src.view(run_id, "attempts")
    any_open = any(i.get("status") == "open" for i in incidents)
    now_ts = time.time() if src.live else None
    signature = json.dumps([[(i.get("id"), i.get("status"), i.get("updated_ts"), i.get("root_cause"))
                             for i in incidents],
                            [(a.get("id"), a.get("status"), a.get("updated_ts")) for a in actions],
                            len(bad), len(attempts), round(now_ts) if now_ts and any_open else None], default=str)
    return {"incidents": incidents, "actions": actions, "bad": bad, "attempts": attempts, "now_ts": now_ts,
            "signature": signature}


def render(run_id: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The page from `read`'s rows: {"timeline", "incidents", "actions", "bad_batches", "summary",
    "signature"} (rows ready for the tables)."""
    incidents, actions, bad = raw["incidents"], raw["actions"], raw["bad"]
    num_open = sum(i.get("status") == "open" for i in incidents)
    summary = (f"{len(incidents)} incident{'s' if len(incidents) != 1 else ''} ({num_open} open) · "
               f"{len(actions)} action{'s' if len(actions) != 1 else ''} · "
               f"{len(bad)} skipped sample window{'s' if len(bad) != 1 else ''}")
    return {"timeline": timeline_figure(incidents, actions, raw["attempts"], now_ts=raw["now_ts"],
                                        uirevision=run_id),
            "incidents": incident_rows(incidents), "actions": action_rows(actions),
            "bad_batches": bad_batch_rows(bad), "summary": summary, "signature": raw["signature"]}


def build(src: Source, run_id: str, **_: Any) -> dict[str, Any]:
    """Everything the page shows for one run (what the bench times)."""
    return render(run_id, read(src, run_id))


def report_link(run_id: str) -> html.A:
    """The run's postmortem report (the app serves it), in a new tab."""
    return html.A("postmortem report ↗", href=f"/report/{urllib.parse.quote(run_id, safe='')}", target="_blank",
                  className="llmw-link")


# -- layout -------------------------------------------------------------------------------
_STATUS_STYLES = [
    {"if": {"filter_query": '{status} = "open"'}, "backgroundColor": OPEN_BG, "fontWeight": 600},
    {"if": {"filter_query": '{severity} = "critical" || {severity} = "error"', "column_id": "severity"},
     "color": severity_color("critical"), "fontWeight": 600},
    {"if": {"filter_query": '{severity} = "warning"', "column_id": "severity"}, "color": severity_color("warning"),
     "fontWeight": 600},
]
_ACTION_STYLES = [
    {"if": {"filter_query": '{status} = "failed" || {status} = "error"'}, "backgroundColor": OPEN_BG},
    {"if": {"filter_query": '{outcome} contains "error"', "column_id": "outcome"}, "color": severity_color("error")},
]


def layout(**_: Any) -> html.Div:
    return html.Div([
        html.Div([html.Span(id="inc-report"), html.Span(id="inc-summary", className="llmw-muted")],
                 className="llmw-controls"),
        dcc.Graph(id="inc-timeline", className="llmw-card", config=GRAPH_CONFIG,
                  figure=empty("loading…", height=220)),
        dcc.Graph(id="inc-causes", className="llmw-card", config=GRAPH_CONFIG, figure=empty("loading…", height=150)),
        dcc.Store(id="inc-causes-drawn"),
        html.Div("Incidents", className="llmw-section"),
        html.Div(id="inc-incidents-empty", className="llmw-muted"),
        data_table("inc-table", INCIDENT_COLUMNS, conditional=_STATUS_STYLES, sort_by=[]),
        html.Div("Actions", className="llmw-section"),
        html.Div(id="inc-actions-empty", className="llmw-muted"),
        data_table("inc-actions", ACTION_COLUMNS, conditional=_ACTION_STYLES),
        html.Div("Skipped sample windows (bad batches)", className="llmw-section"),
        html.Div(id="inc-bad-empty", className="llmw-muted"),
        html.Div(data_table("inc-bad", BAD_BATCH_COLUMNS, page_size=10), id="inc-bad-box"),
        dcc.Store(id="inc-drawn"),
    ])


@callback(Output("inc-timeline", "figure"), Output("inc-table", "data"), Output("inc-actions", "data"),
          Output("inc-bad", "data"), Output("inc-bad-box", "style"), Output("inc-summary", "children"),
          Output("inc-incidents-empty", "children"), Output("inc-actions-empty", "children"),
          Output("inc-bad-empty", "children"), Output("inc-report", "children"), Output("inc-drawn", "data"),
          Input("run", "value"), Input("tick", "n_intervals"), State("inc-drawn", "data"))
def _draw(run_id, _tick, drawn):
    if not run_id:
        return (empty("no run yet", height=220), [], [], [], {"display": "none"}, "", "no run yet", "no run yet",
                "", None, None)
    try:
        raw = read(state.source(), run_id)
    except SourceError as e:
        return (empty(str(e), height=220), [], [], [], {"display": "none"},
                html.Span(str(e), className="llmw-error"), "", "", "", no_update, None)
    key = f"{run_id}|{raw['signature']}"
    if drawn == key:
        return (no_update,) * 11  # nothing new: no figure built, nothing sent
    out = render(run_id, raw)
    bad = out["bad_batches"]
    return (out["timeline"], out["incidents"], out["actions"], bad, {} if bad else {"display": "none"},
            out["summary"], "" if out["incidents"] else NO_INCIDENTS,
            "" if out["actions"] else "no actions: the policy did nothing in this run",
            "" if bad else "no sample windows were skipped",
            report_link(run_id), key)


@callback(Output("inc-causes", "figure"), Output("inc-causes-drawn", "data"),
          Input("run", "value"), Input("tick", "n_intervals"), State("inc-causes-drawn", "data"))
def _draw_causes(run_id, _tick, drawn):
    """Its own callback: the split moves with every step of a live run, the tables do not."""
    if not run_id:
        return empty("no run yet", height=150), None
    try:
        src = state.source()
        run = src.run(run_id)
        good = state.goodput(run_id, run)
    except SourceError as e:
        return empty(str(e), height=150), None
    key = json.dumps([run_id, [(c.get("cause"), c.get("incident_id"), round(c.get("seconds") or 0, 1))
                               for c in (good.get("causes") or [])] if isinstance(good, dict) else None])
    if drawn == key:
        return no_update, no_update
    return causes_figure(good if isinstance(good, dict) else {}, uirevision=run_id), key
