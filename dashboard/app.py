"""The Dash app: a header (run picker, pages, the run's status) around the pages.

`create_app(source)` builds it for one data source (dashboard/source.py). Pages
live in dashboard/pages/, one file each with its layout, its callbacks and its
`PAGE` (path, name, order, title); they are registered here, after the app exists
(Dash's page registry needs the app), so a page module imports without an app (the
bench and the tests call its builders), and they read nothing until a callback runs.

Page state is in the URL: the run (`?run=`) and each page's controls are written
back with `history.replaceState` (assets/llmwatch.js), so a link pasted into an
incident channel opens the same view, and nothing re-renders when it changes.

Besides the pages, the Flask server answers `/healthz` (the launcher polls it) and
`/report/<run>` (the run's postmortem report, from the source).
"""

from __future__ import annotations

import html as html_text
import importlib
from pathlib import Path

import dash
from dash import ALL, Dash, Input, Output, State, callback, clientside_callback, ctx, dcc, html, no_update
from flask import Response

from collector.read.goodput import cause_label
from dashboard import state
from dashboard.figures import fmt_ts
from dashboard.source import Source, SourceError

REFRESH_MS = 2000  # the live pages' polling interval
PAGES = ("overview", "ranks", "comm", "incidents", "nodes", "sql", "runs", "fleet")  # dashboard/pages/<name>.py, in nav order
_HERE = Path(__file__).parent


def create_app(source: Source, *, refresh_ms: int = REFRESH_MS) -> Dash:
    state.set_source(source)
    app = Dash(__name__, use_pages=True, pages_folder="", assets_folder=str(_HERE / "assets"),
               title="llmwatch", update_title=None, suppress_callback_exceptions=True,
               serve_locally=True)  # plotly.js and React from the installed packages: no CDN
    for name in PAGES:  # a page module declares PAGE; registering is the app's (Dash needs the app first)
        module = importlib.import_module(f"dashboard.pages.{name}")
        if hasattr(module, "PAGE"):
            dash.register_page(module.__name__, layout=module.layout, **module.PAGE)
    app.layout = _layout(source, refresh_ms)
    _routes(app)
    return app


def _layout(source: Source, refresh_ms: int) -> html.Div:
    nav = [dcc.Link(p["name"], href=p["relative_path"], id={"type": "nav", "page": p["module"]},
                    className="llmw-nav")
           for p in sorted(dash.page_registry.values(), key=lambda p: p.get("order", 99))]
    return html.Div([
        dcc.Location(id="url"),
        dcc.Interval(id="tick", interval=refresh_ms, disabled=not source.live),
        dcc.Store(id="url-sink"),
        html.Header([
            html.Div([html.Span("llmwatch", className="llmw-brand"),
                      html.Span(source.describe(), className="llmw-source", id="source-desc")],
                     className="llmw-brand-box"),
            html.Nav(nav, className="llmw-navbar"),
            html.Div([html.Label("run", htmlFor="run", className="llmw-label"),
                      dcc.Dropdown(id="run", clearable=False, searchable=True, className="llmw-run",
                                   placeholder="no run yet")], className="llmw-run-box"),
        ], className="llmw-header"),
        html.Div(id="run-status", className="llmw-status"),
        html.Main(dash.page_container, className="llmw-main"),
    ], className="llmw-app")


def _routes(app: Dash) -> None:
    server = app.server

    @server.get("/healthz")
    def healthz():
        return {"ok": True}

    @server.get("/report/<run_id>")
    def report(run_id: str):
        try:
            text = state.source().report_html(run_id)
        except SourceError as e:
            return Response(f"<p>No report for run {html_text.escape(run_id)}: {html_text.escape(str(e))}</p>",
                            status=404, mimetype="text/html")
        return Response(text, mimetype="text/html")


@callback(Output("run", "options"), Output("run", "value"),
          Input("url", "search"), Input("tick", "n_intervals"), State("run", "options"), State("run", "value"))
def _runs(search, _tick, options, current):
    """The run picker: every run, newest first; the URL's run on load, else the newest."""
    try:
        rows = state.source().runs()
    except SourceError:
        return no_update, no_update
    ids = [r["run_id"] for r in rows]
    new_options = [{"label": f"{r['run_id']}  ·  {r.get('status') or '?'}", "value": r["run_id"]} for r in rows]
    wanted = state.query(search).get("run") if ctx.triggered_id in (None, "url") else current
    value = wanted if wanted in ids else (current if current in ids else (ids[0] if ids else None))
    return (new_options if new_options != options else no_update), (value if value != current else no_update)


@callback(Output("run-status", "children"), Input("run", "value"), Input("tick", "n_intervals"))
def _status(run_id, _tick):
    if not run_id:
        return html.Span("waiting for a run to report…", className="llmw-muted")
    try:
        run = state.source().run(run_id)
        good = state.goodput(run_id, run)
    except SourceError as e:
        return html.Span(str(e), className="llmw-error")
    if run is None:
        return html.Span(f"run {run_id} not found", className="llmw-error")
    mesh = run.get("mesh") or {}
    shape = " × ".join(f"{k}{mesh[k]}" for k in ("dp", "pp", "tp") if isinstance(mesh, dict) and k in mesh)
    g = good.get("goodput") if isinstance(good, dict) else None
    items = [("status", run.get("status") or "?", f"llmw-pill llmw-{run.get('status') or 'unknown'}"),
             ("mesh", shape or "–", None),
             ("ranks", run.get("num_ranks"), None),
             ("step", run.get("last_step") if run.get("last_step") is not None else "–", None),
             ("attempt", run.get("last_attempt") if run.get("last_attempt") is not None else "–", None),
             ("open incidents", run.get("open_incidents") or 0,
              "llmw-pill llmw-alert" if run.get("open_incidents") else None),
             ("goodput", "–" if g is None else f"{100 * g:.1f}%", None),
             ("updated", fmt_ts(run.get("updated_ts")), None)]
    spans = [html.Span([html.Span(k, className="llmw-key"), html.Span(str(v), className=cls or "llmw-val")],
                       className="llmw-stat", **({"title": _lost_to(good)} if k == "goodput" else {}))
             for k, v, cls in items]
    lost = _lost_to(good, limit=2)
    return spans + ([html.Span(lost, className="llmw-stat llmw-muted", id="run-goodput-lost")] if lost else [])


def _lost_to(good: dict, *, limit: int | None = None) -> str:
    """Where the wall time went that did not count (collector/read/goodput.py CAUSES), the
    largest first: the goodput stat's tooltip lists all, the header the `limit` largest."""
    if not isinstance(good, dict):
        return ""
    rows = [c for c in (good.get("causes") or []) if c.get("cause") != "productive" and (c.get("share") or 0) >= 0.001]
    rows.sort(key=lambda c: -(c.get("share") or 0))
    parts = [f"{cause_label(c)} {100 * c['share']:.1f}%" for c in rows[:limit]]
    return ("lost to " + ", ".join(parts)) if parts else ""




# The nav links keep the run; the URL keeps the run without a reload.
clientside_callback(
    """function(run, pathname, hrefs) {
        const q = run ? "?run=" + encodeURIComponent(run) : "";
        if (run) { window.llmw.setQuery({run: run}); }
        return hrefs.map(h => (h || "").split("?")[0] + q);
    }""",
    Output({"type": "nav", "page": ALL}, "href"),
    Input("run", "value"), Input("url", "pathname"), State({"type": "nav", "page": ALL}, "href"))
