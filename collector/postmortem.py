"""`collector postmortem RUN_ID --db FILE --out report.html|report.md`: what a run went through.

The report holds: the run (mesh, nodes, span), its goodput, the timeline of its
incidents (kind, steps, culprit, evidence highlights, root cause, status, opened
and closed), the straggler cost, and charts: loss, grad-norm and loss-scale around
each incident (the incident's steps shaded, non-finite steps marked), and a
rank x step heatmap of step time and compute time. The HTML is one file with
plotly.js embedded (no network needed to open it); the Markdown has the tables and
says where the charts are.

Goodput is defined in collector/goodput.py (also in docs/postmortem.md).

The read queries are collector/read.py's; this module only computes and renders.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector import read, read_views
from collector.goodput import Goodput, goodput

WINDOW_STEPS = 20  # steps shown either side of an incident in its chart
GRID_STEPS = 400  # columns of the report's rank x step heatmap
_HIGHLIGHTS = {  # evidence keys worth a column, by incident kind (the rest stays in the JSON)
    "straggler": ("compute_ratio", "cost_s_per_step", "share_of_step", "onset_step", "fired_at_step"),
    "nan": ("origin", "origin_signal", "num_ranks_nonfinite", "num_ranks", "loss", "grad_norm"),
    "loss_spike": ("z", "ratio", "replica", "samples"),
    "grad_spike": ("z", "ratio", "replica"),
    "loss_scale_collapse": ("num_backoffs", "scale", "peak_scale"),
    "hang": ("op", "axis", "group_seq", "stuck_s", "waiting"),
    "crash": ("exit_code", "signal", "silent_for_s", "silent_ranks"),
    "slow_link": ("axis", "link_ratio", "busbw_vs_baseline", "cost_s_per_step", "share_of_step"),
    "data_stall": ("data_share", "cost_s_per_step", "share_of_step", "onset_step", "ranks"),
    "checkpoint_slow": ("checkpoint_step", "write_s", "ratio_vs_peers", "ratio_vs_history", "cost_s_per_checkpoint"),
    "replica_divergence": ("shard", "divergent_ranks", "majority", "caught_within_steps", "why"),
    "device_health": ("cause", "new_errors", "lasted_s", "ecc_uncorrectable", "window_s"),
}


# -- the pure part ------------------------------------------------------------------
def num_steps(inc: dict[str, Any]) -> int:
    lo, hi = inc.get("step_from"), inc.get("step_to")
    if lo is None:
        return 0
    return int((hi if hi is not None else lo) - lo + 1)


def straggler_costs(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per straggler incident: seconds per step and share of the step it cost (its
    evidence), the steps it lasted and the seconds lost over them."""
    out = []
    for inc in incidents:
        ev = inc.get("evidence") or {}
        if inc.get("kind") != "straggler" or ev.get("cost_s_per_step") is None:
            continue
        cost = float(ev["cost_s_per_step"])
        n = num_steps(inc)
        out.append({"id": inc.get("id"), "rank": inc.get("rank"), "node": inc.get("node"),
                    "steps": _steps(inc), "cost_s_per_step": cost, "share_of_step": ev.get("share_of_step"),
                    "num_steps": n, "lost_s": cost * n})
    return out


def highlights(kind: str, evidence: Any, *, limit: int = 5) -> str:
    """A few `key=value` of an incident's evidence: the kind's telling ones first."""
    if not isinstance(evidence, dict):
        return ""
    keys = [k for k in _HIGHLIGHTS.get(kind, ()) if evidence.get(k) is not None]
    keys += [k for k, v in evidence.items() if k not in keys and isinstance(v, (int, float, str)) and v is not None]
    return ", ".join(f"{k}={_short(evidence[k])}" for k in keys[:limit])


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = v if isinstance(v, str) else json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _steps(inc: dict[str, Any]) -> str:
    lo, hi = inc.get("step_from"), inc.get("step_to")
    if lo is None:
        return "-"
    return str(lo) if hi in (None, lo) else f"{lo}-{hi}"


def _ts(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 10)}Z"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _cell(v: Any) -> str:
    return "-" if v is None or v == "" else str(v)


@dataclass(slots=True)
class Report:
    """What a postmortem shows, read once (`gather`), rendered twice."""

    run_id: str
    run: dict[str, Any]
    span: dict[str, Any]
    goodput: Goodput
    incidents: list[dict[str, Any]]
    stragglers: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    windows: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # incident id -> step_window rows
    grid: list[dict[str, Any]] = field(default_factory=list)  # step_grid rows


def gather(cur: read.Cursor, run_id: str, *, window_steps: int = WINDOW_STEPS) -> Report:
    run = read.run(cur, run_id)
    if run is None:
        raise LookupError(f"no run {run_id!r}")
    incidents = read.incidents(cur, run_id)
    stragglers = straggler_costs(incidents)
    span = read.run_span(cur, run_id)
    g = goodput(read.step_time_parts(cur, run_id), span, straggler_lost_s=sum(s["lost_s"] for s in stragglers))
    windows = {}
    for inc in incidents:
        if inc.get("step_from") is None:
            continue
        hi = inc["step_to"] if inc.get("step_to") is not None else inc["step_from"]
        windows[inc["id"]] = read.step_window(cur, run_id, step_from=max(0, inc["step_from"] - window_steps),
                                              step_to=hi + window_steps)
    return Report(run_id=run_id, run=run, span=span, goodput=g, incidents=incidents, stragglers=stragglers,
                  nodes=read.nodes(cur, run_id), checkpoints=read.checkpoints(cur, run_id), windows=windows,
                  grid=read_views.step_grid(cur, run_id, max_steps=GRID_STEPS))


GOODPUT_DEFINITION = (
    "Goodput is the share of the run's wall time spent on steps that counted: the summed duration (slowest "
    "rank's step_s) of the steps steps_effective keeps and the optimizer did not skip, over the time from the "
    "run's start to its last step or event. Skipped steps, steps a rollback replaced, and time outside any step "
    "(start-up, checkpoint stalls, restarts) are the rest. Stragglers slow steps that still count: "
    "'without stragglers' also subtracts their cost (cost_s_per_step x steps, from the incidents' evidence).")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def esc(v: Any) -> str:
        return _cell(v).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(esc(v) for v in row) + " |" for row in rows]


def _summary_rows(r: Report) -> list[list[Any]]:
    g, run = r.goodput, r.run
    return [["status", run.get("status")], ["world size", run.get("world_size")],
            ["mesh", json.dumps(run.get("mesh")) if run.get("mesh") is not None else None],
            ["code / data", f"{_cell(run.get('code_version'))} / {_cell(run.get('data_version'))}"],
            ["started", _ts(r.span.get("start_ts"))], ["ended", _ts(r.span.get("end_ts"))],
            ["wall time", f"{g.wall_s:.2f} s"],
            ["goodput", _pct(g.goodput)], ["goodput without stragglers", _pct(g.goodput_without_stragglers)],
            ["productive steps", f"{g.num_steps} ({g.productive_s:.2f} s)"],
            ["skipped steps", f"{g.num_skipped} ({g.skipped_s:.2f} s)"],
            ["steps replaced by a rollback", f"{g.num_superseded} ({g.superseded_s:.2f} s)"],
            ["outside any step", f"{g.outside_steps_s:.2f} s"],
            ["straggler cost", f"{g.straggler_lost_s:.2f} s"],
            ["useful tokens", f"{g.useful_tokens} ({_cell(None if g.tokens_per_s is None else round(g.tokens_per_s))}"
                              " tokens/s of wall time)"]]


def _incident_rows(r: Report) -> list[list[Any]]:
    return [[i.get("id"), i.get("kind"), i.get("severity"), _steps(i), i.get("rank"), i.get("node"),
             highlights(i.get("kind", ""), i.get("evidence")), i.get("root_cause"), i.get("status"),
             _ts(i.get("opened_ts")), _ts(i.get("closed_ts"))] for i in r.incidents]


_INCIDENT_HEADER = ["id", "kind", "severity", "steps", "rank", "node", "evidence", "root cause", "status",
                    "opened", "closed"]
_STRAGGLER_HEADER = ["incident", "rank", "node", "steps", "s/step", "share of step", "steps affected", "lost s"]


def _straggler_rows(r: Report) -> list[list[Any]]:
    return [[s["id"], s["rank"], s["node"], s["steps"], f"{s['cost_s_per_step']:.4f}", _pct(s["share_of_step"]),
             s["num_steps"], f"{s['lost_s']:.2f}"] for s in r.stragglers]


def render_markdown(r: Report) -> str:
    out = [f"# Postmortem: run {r.run_id}", "", *_table(["", ""], _summary_rows(r)), "", "## Goodput", "",
           GOODPUT_DEFINITION, "", "## Incidents", ""]
    out += _table(_INCIDENT_HEADER, _incident_rows(r)) if r.incidents else ["No incidents."]
    out += ["", "## Straggler cost", ""]
    out += _table(_STRAGGLER_HEADER, _straggler_rows(r)) if r.stragglers else ["No straggler incidents."]
    if r.nodes:
        out += ["", "## Nodes", ""] + _table(["node", "ranks", "status", "reason"], [
            [n.get("node"), json.dumps(n.get("ranks")), n.get("status"), n.get("reason")] for n in r.nodes])
    if r.checkpoints:
        out += ["", "## Checkpoints", ""] + _table(["step", "attempt", "shards", "bytes", "write s", "verified"], [
            [c.get("step"), c.get("attempt"), c.get("num_shards"), c.get("bytes"),
             None if c.get("write_s") is None else f"{c['write_s']:.3f}", c.get("verified")] for c in r.checkpoints])
    out += ["", "## Charts", "", "The loss, grad-norm and loss-scale charts around each incident and the rank x "
            f"step heatmap of step time are in the HTML report: `collector postmortem {r.run_id} --db FILE "
            "--out report.html`.", ""]
    return "\n".join(out)


# -- charts (plotly, imported only to render HTML) -------------------------------------
def incident_figure(inc: dict[str, Any], rows: list[dict[str, Any]]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("loss", "grad-norm", "loss scale"))
    x = [row["step"] for row in rows]
    for i, name in enumerate(("loss", "grad_norm", "loss_scale"), start=1):
        fig.add_trace(go.Scatter(x=x, y=[row[name] for row in rows], mode="lines+markers", name=name,
                                 marker={"size": 4}), row=i, col=1)
    bad = [row["step"] for row in rows if row["num_nonfinite"]]
    if bad:
        finite = [row["loss"] for row in rows if row["loss"] is not None]
        y = min(finite) if finite else 0
        fig.add_trace(go.Scatter(x=bad, y=[y] * len(bad), mode="markers", name="non-finite",
                                 marker={"symbol": "x", "size": 10, "color": "red"}), row=1, col=1)
    lo = inc["step_from"]
    hi = inc["step_to"] if inc.get("step_to") is not None else lo
    for i in (1, 2, 3):
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor="red", opacity=0.12, line_width=0, row=i, col=1)
    fig.update_layout(height=520, margin={"l": 50, "r": 20, "t": 50, "b": 30}, showlegend=False,
                      title=f"incident {inc['id']}: {inc['kind']} (steps {_steps(inc)})")
    fig.update_xaxes(title_text="step", row=3, col=1)
    return fig


def heatmap_figure(grid: list[dict[str, Any]]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = sorted({g["step"] for g in grid})
    ranks = sorted({g["rank"] for g in grid})
    col = {s: i for i, s in enumerate(steps)}
    row = {k: i for i, k in enumerate(ranks)}
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=("step time (s)", "compute time: fwd + bwd + opt, without waiting (s)"))
    for i, name in enumerate(("step_s", "compute_s"), start=1):
        z = [[None] * len(steps) for _ in ranks]
        for g in grid:
            z[row[g["rank"]]][col[g["step"]]] = g[name]
        fig.add_trace(go.Heatmap(x=steps, y=[f"rank {k}" for k in ranks], z=z, colorscale="Viridis", name=name,
                                 colorbar={"len": 0.45, "y": 0.78 if i == 1 else 0.22}), row=i, col=1)
    fig.update_layout(height=260 + 40 * len(ranks), margin={"l": 70, "r": 20, "t": 50, "b": 30},
                      title="rank x step")
    fig.update_xaxes(title_text="step", row=2, col=1)
    return fig


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;
vertical-align:top;font-size:13px}th{background:#f4f4f4}.kind{font-weight:600}"""


def _html_table(header: list[str], rows: list[list[Any]], *, cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def render_html(r: Report) -> str:
    from plotly.offline import get_plotlyjs

    def fig_html(fig) -> str:
        return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})

    parts = [f"<h1>Postmortem: run {html.escape(r.run_id)}</h1>",
             _html_table(["", ""], _summary_rows(r)),
             f"<h2>Goodput</h2><p>{html.escape(GOODPUT_DEFINITION)}</p>",
             "<h2>Incidents</h2>",
             _html_table(_INCIDENT_HEADER, _incident_rows(r), cls="incidents") if r.incidents else "<p>No incidents.</p>",
             "<h2>Straggler cost</h2>",
             _html_table(_STRAGGLER_HEADER, _straggler_rows(r)) if r.stragglers else "<p>No straggler incidents.</p>"]
    if r.incidents:
        parts.append("<h2>Around each incident</h2>")
        for inc in r.incidents:
            rows = r.windows.get(inc["id"])
            if rows:
                parts.append(f'<div class="incident-chart" id="incident-{inc["id"]}">'
                             f"{fig_html(incident_figure(inc, rows))}</div>")
    if r.grid:
        parts.append(f'<h2>Step time by rank</h2><div class="heatmap">{fig_html(heatmap_figure(r.grid))}</div>')
    if r.checkpoints:
        parts.append("<h2>Checkpoints</h2>" + _html_table(
            ["step", "attempt", "shards", "bytes", "write s", "verified"],
            [[c.get("step"), c.get("attempt"), c.get("num_shards"), c.get("bytes"),
              None if c.get("write_s") is None else f"{c['write_s']:.3f}", c.get("verified")] for c in r.checkpoints]))
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>Postmortem {html.escape(r.run_id)}</title>'
            f'<style>{_CSS}</style><script type="text/javascript">{get_plotlyjs()}</script></head>'
            f"<body>{''.join(parts)}</body></html>")


def main(args: argparse.Namespace) -> int:
    import duckdb

    from collector.storage import connect

    out = Path(args.out)
    if out.suffix.lower() not in (".html", ".htm", ".md"):
        print(f"collector postmortem: --out {out}: the suffix says the format: .html or .md", file=sys.stderr)
        return 2
    try:
        con = connect(args.db, read_only=True)
    except duckdb.Error as e:
        print(f"collector postmortem: cannot open {args.db}: {e}", file=sys.stderr)
        return 2
    try:
        report = gather(con, args.run_id)
    except LookupError as e:
        print(f"collector postmortem: {e} in {args.db}", file=sys.stderr)
        return 2
    finally:
        con.close()
    text = render_markdown(report) if out.suffix.lower() == ".md" else render_html(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    g = report.goodput
    print(f"collector postmortem: {out} ({len(report.incidents)} incidents, goodput {_pct(g.goodput)})")
    return 0
