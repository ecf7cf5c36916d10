"""`collector postmortem RUN_ID --db FILE --out report.html|report.md`: what a run went through.

The report holds: the run (mesh, nodes, span), its goodput, the timeline of its
incidents (kind, steps, culprit, evidence highlights, root cause, status, opened
and closed), the cost of its slow-downs (stragglers, slow links, data stalls, slow
checkpoint writes: what their evidence says each cost), and charts: loss,
grad-norm and loss-scale around each incident (the incident's steps shaded,
non-finite steps marked), and a rank x step heatmap of step time and compute
time. The HTML is one file with plotly.js embedded (no network needed to open it);
the Markdown has the tables and says where the charts are.

Goodput is defined in collector/read/goodput.py (also in docs/postmortem.md).

The read queries are collector/read/queries.py's; this module only computes and renders.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.kinds import COSTED
from collector.read import queries, views
from collector.read.goodput import CAUSES, Goodput, cause_label, goodput, ordered_causes

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


# the kinds whose evidence states what they cost: per step (they lengthen steps that still
# count, so their seconds are inside the productive time) or per checkpoint (a background write)
PER_CHECKPOINT_KINDS = ("checkpoint_slow",)


def num_checkpoints(inc: dict[str, Any], checkpoints: Sequence[dict[str, Any]]) -> int:
    """The checkpoints a `checkpoint_slow` incident spans: the steps of the run's
    `checkpoints` rows from its first slow checkpoint (`step_from`) to its last one
    (the evidence's `checkpoint_step`, else `step_to`), each step once: a rollback's
    new attempt writes the same steps again, and the incident does not say which
    attempt's were slow. The detector does not store how many were slow: one in
    between that was not counts too."""
    lo = inc.get("step_from")
    ev = inc.get("evidence") or {}
    hi = ev.get("checkpoint_step") if ev.get("checkpoint_step") is not None else inc.get("step_to")
    if lo is None:
        return 0
    hi = lo if hi is None else hi
    return len({c["step"] for c in checkpoints if c.get("step") is not None and lo <= c["step"] <= hi})


def slowdown_costs(incidents: list[dict[str, Any]], checkpoints: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Per incident of COSTED or PER_CHECKPOINT_KINDS whose evidence states its
    cost: the seconds it cost per step (`per` "step") or per checkpoint ("checkpoint"),
    the share of the step (per-step kinds), how many steps or checkpoints it lasted
    (`num_affected`: `num_steps`, `num_checkpoints`) and the seconds lost over them."""
    out = []
    for inc in incidents:
        kind, ev = inc.get("kind"), inc.get("evidence") or {}
        if kind in COSTED and ev.get("cost_s_per_step") is not None:
            per, cost, n = "step", float(ev["cost_s_per_step"]), num_steps(inc)
        elif kind in PER_CHECKPOINT_KINDS and ev.get("cost_s_per_checkpoint") is not None:
            per, cost, n = "checkpoint", float(ev["cost_s_per_checkpoint"]), num_checkpoints(inc, checkpoints)
        else:
            continue
        out.append({"id": inc.get("id"), "kind": kind, "rank": inc.get("rank"), "node": inc.get("node"),
                    "steps": _steps(inc), "per": per, "cost_s": cost,
                    "share_of_step": ev.get("share_of_step") if per == "step" else None,
                    "num_affected": n, "lost_s": cost * n})
    return out


def lost_s(costs: list[dict[str, Any]], *, kinds: tuple[str, ...]) -> float:
    """The seconds `slowdown_costs` rows of `kinds` lost, summed."""
    return sum(c["lost_s"] for c in costs if c["kind"] in kinds)


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
    slowdowns: list[dict[str, Any]]  # slowdown_costs rows
    nodes: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    causes: list[dict[str, Any]] = field(default_factory=list)  # goodput_causes rows: the wall time by cause
    windows: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # incident id -> step_window rows
    grid: list[dict[str, Any]] = field(default_factory=list)  # step_grid rows

    @property
    def step_lost_s(self) -> float:
        """The seconds the per-step slow-downs (stragglers, slow links, data stalls) cost."""
        return lost_s(self.slowdowns, kinds=COSTED)

    @property
    def checkpoint_lost_s(self) -> float:
        """The seconds the slow checkpoint writes took beyond their reference."""
        return lost_s(self.slowdowns, kinds=PER_CHECKPOINT_KINDS)

    @property
    def goodput_without_slowdowns(self) -> float | None:
        """Goodput less the per-step slow-downs' cost: the steps they slowed still counted,
        so it is inside productive_s (as `goodput_without_stragglers` is for stragglers
        alone). Slow checkpoint writes are not subtracted: a write runs in the
        background, outside any step, and is not part of the productive time."""
        g = self.goodput
        return None if g.wall_s <= 0 else max(0.0, g.productive_s - self.step_lost_s) / g.wall_s


def gather(cur: queries.Cursor, run_id: str, *, window_steps: int = WINDOW_STEPS) -> Report:
    run = queries.run(cur, run_id)
    if run is None:
        raise LookupError(f"no run {run_id!r}")
    incidents = queries.incidents(cur, run_id)
    checkpoints = queries.checkpoints(cur, run_id)
    slowdowns = slowdown_costs(incidents, checkpoints)
    span = queries.run_span(cur, run_id)
    g = goodput(queries.step_time_parts(cur, run_id), span, straggler_lost_s=lost_s(slowdowns, kinds=("straggler",)))
    windows = {}
    for inc in incidents:
        if inc.get("step_from") is None:
            continue
        hi = inc["step_to"] if inc.get("step_to") is not None else inc["step_from"]
        windows[inc["id"]] = queries.step_window(cur, run_id, step_from=max(0, inc["step_from"] - window_steps),
                                              step_to=hi + window_steps)
    return Report(run_id=run_id, run=run, span=span, goodput=g, incidents=incidents, slowdowns=slowdowns,
                  nodes=queries.nodes(cur, run_id), checkpoints=checkpoints,
                  causes=ordered_causes(queries.goodput_causes(cur, run_id)), windows=windows,
                  grid=views.step_grid(cur, run_id, max_steps=GRID_STEPS))


GOODPUT_DEFINITION = (
    "Goodput is the share of the run's wall time spent on steps that counted: the summed duration (slowest "
    "rank's step_s) of the steps steps_effective keeps and the optimizer did not skip, over the time from the "
    "run's start to its last step or event. Skipped steps, steps a rollback replaced, and time outside any step "
    "(start-up, checkpoint stalls, restarts) are the rest. Stragglers, slow links and data stalls slow steps that "
    "still count: 'without stragglers' also subtracts the stragglers' cost, 'without slow-downs' the cost of all "
    "three (cost_s_per_step x the incident's steps, from the incidents' evidence). Slow checkpoint writes run in the "
    "background, outside any step: their cost is in the table below but in neither figure.")

SLOWDOWN_NOTES = (
    "Each row's cost is its incident's evidence as last updated (cost_s_per_step or cost_s_per_checkpoint), "
    "times the steps or checkpoints it lasted. Steps: the incident's step range, from its onset to the step it "
    "closed at (the calm steps that closed it included). Checkpoints: the detector does not store how many writes "
    "were slow; the count is the steps of the run's checkpoints from the incident's first slow checkpoint to its "
    "last (its evidence's checkpoint_step), each step once whichever attempts wrote it, so one in between that was "
    "not slow counts too. Incidents that slowed the same steps are added up, which can count a step's delay "
    "twice.")


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
            ["goodput without slow-downs", _pct(r.goodput_without_slowdowns)],
            ["productive steps", f"{g.num_steps} ({g.productive_s:.2f} s)"],
            ["skipped steps", f"{g.num_skipped} ({g.skipped_s:.2f} s)"],
            ["steps replaced by a rollback", f"{g.num_superseded} ({g.superseded_s:.2f} s)"],
            ["outside any step", f"{g.outside_steps_s:.2f} s"],
            ["straggler cost", f"{g.straggler_lost_s:.2f} s"],
            ["slow-down cost in steps", f"{r.step_lost_s:.2f} s"],
            ["slow checkpoint writes (background)", f"{r.checkpoint_lost_s:.2f} s"],
            ["useful tokens", f"{g.useful_tokens} ({_cell(None if g.tokens_per_s is None else round(g.tokens_per_s))}"
                              " tokens/s of wall time)"]]


_CAUSE_HEADER = ["cause", "seconds", "share of wall time", "steps", "what it is"]
CAUSE_NOTES = ("The wall time split by cause (the `goodput` view in SQL): the causes add up to the wall time. "
               "A step lasts as long as its slowest rank; a slow-down's cost is its evidence's cost_s_per_step "
               "times the effective steps in its range.")


def _cause_rows(r: Report) -> list[list[Any]]:
    return [[cause_label(c), f"{c['seconds']:.2f}", _pct(c.get("share")), c.get("num_steps"),
             CAUSES.get(c.get("cause"), "")] for c in r.causes]


def _incident_rows(r: Report) -> list[list[Any]]:
    return [[i.get("id"), i.get("kind"), i.get("severity"), _steps(i), i.get("rank"), i.get("node"),
             highlights(i.get("kind", ""), i.get("evidence")), i.get("root_cause"), i.get("status"),
             _ts(i.get("opened_ts")), _ts(i.get("closed_ts"))] for i in r.incidents]


_INCIDENT_HEADER = ["id", "kind", "severity", "steps", "rank", "node", "evidence", "root cause", "status",
                    "opened", "closed"]
_SLOWDOWN_HEADER = ["incident", "kind", "rank", "node", "steps", "cost s", "per", "share of step", "affected",
                    "lost s"]


def _slowdown_rows(r: Report) -> list[list[Any]]:
    return [[s["id"], s["kind"], s["rank"], s["node"], s["steps"], f"{s['cost_s']:.4f}", s["per"],
             _pct(s["share_of_step"]), f"{s['num_affected']} {s['per']}{'s' if s['num_affected'] != 1 else ''}",
             f"{s['lost_s']:.2f}"] for s in r.slowdowns]


def render_markdown(r: Report) -> str:
    out = [f"# Postmortem: run {r.run_id}", "", *_table(["", ""], _summary_rows(r)), "", "## Goodput", "",
           GOODPUT_DEFINITION, ""]
    if r.causes:
        out += ["### Where the wall time went", "", *_table(_CAUSE_HEADER, _cause_rows(r)), "", CAUSE_NOTES, ""]
    out += ["## Incidents", ""]
    out += _table(_INCIDENT_HEADER, _incident_rows(r)) if r.incidents else ["No incidents."]
    out += ["", "## Cost of slow-downs", ""]
    out += _table(_SLOWDOWN_HEADER, _slowdown_rows(r)) + ["", SLOWDOWN_NOTES] if r.slowdowns else \
        ["No slow-down incidents (straggler, slow_link, data_stall, checkpoint_slow) with a cost."]
    if r.nodes:
        out += ["", "## Nodes", ""] + _table(["node", "ranks", "status", "reason"], [
            [n.get("node"), json.dumps(n.get("ranks")), n.get("status"), n.get("reason")] for n in r.nodes])
    if r.checkpoints:
        out += ["", "## Checkpoints", ""] + _table(["step", "attempt", "shards", "bytes", "write s", "verified", "known good"], [
            [c.get("step"), c.get("attempt"), c.get("num_shards"), c.get("bytes"),
             None if c.get("write_s") is None else f"{c['write_s']:.3f}", c.get("verified"), c.get("known_good")]
             for c in r.checkpoints])
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
             ("<h3>Where the wall time went</h3>" + _html_table(_CAUSE_HEADER, _cause_rows(r), cls="causes")
              + f"<p>{html.escape(CAUSE_NOTES)}</p>") if r.causes else "",
             "<h2>Incidents</h2>",
             _html_table(_INCIDENT_HEADER, _incident_rows(r), cls="incidents") if r.incidents else "<p>No incidents.</p>",
             "<h2>Cost of slow-downs</h2>",
             _html_table(_SLOWDOWN_HEADER, _slowdown_rows(r), cls="slowdowns")
             + f"<p>{html.escape(SLOWDOWN_NOTES)}</p>" if r.slowdowns else
             "<p>No slow-down incidents (straggler, slow_link, data_stall, checkpoint_slow) with a cost.</p>"]
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
            ["step", "attempt", "shards", "bytes", "write s", "verified", "known good"],
            [[c.get("step"), c.get("attempt"), c.get("num_shards"), c.get("bytes"),
              None if c.get("write_s") is None else f"{c['write_s']:.3f}", c.get("verified"), c.get("known_good")]
             for c in r.checkpoints]))
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
