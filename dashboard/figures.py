"""The figure builders every page shares: one look, one set of colours, one way
to mark incidents and rollbacks.

Pure functions from rows (collector/read/views.py's answers) to plotly figures.
No data is read here. Each time chart takes an `XAxis` (by step or by wall time),
carries the run's incidents and rollbacks as annotations (`annotate`), and sets
`uirevision`, so a live refresh keeps the user's zoom.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

Rows = list[dict[str, Any]]

# One palette for ranks, one for nodes (plotly's D3 and Set2), and one for health and
# severity, used by every page: rank 3 is the same colour on every chart.
RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf")
NODE_COLORS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#b3b3b3")
HEALTH_COLORS = {"healthy": "#2ca02c", "warning": "#f0a30a", "incident": "#d62728", "isolated": "#6c6c6c",
                 "silent": "#1e3a8a"}  # silent (no heartbeat) is not another red: it reads apart from an incident
SEVERITY_COLORS = {"critical": "#d62728", "error": "#d62728", "warning": "#f0a30a", "info": "#1f77b4"}
ACTION_COLOR = "#6f42c1"
ACCENT = "#1f77b4"
BAND = "rgba(31, 119, 180, 0.18)"
# every dcc.Graph's config: no logo, and the modebar only while the pointer is on the chart
# (shown always, it covers the legends and long titles at the top right)
GRAPH_CONFIG = {"displaylogo": False, "displayModeBar": "hover"}
FONT = {"family": "Inter, system-ui, -apple-system, Segoe UI, sans-serif", "size": 12, "color": "#1d2433"}


def rank_color(rank: int | None) -> str:
    return RANK_COLORS[int(rank) % len(RANK_COLORS)] if rank is not None else "#7f7f7f"


def node_color(node: str | None, nodes: Sequence[str]) -> str:
    """A node's colour by its place among the run's nodes (sorted), the same on every page."""
    if node is None or node not in nodes:
        return "#b3b3b3"
    return NODE_COLORS[list(nodes).index(node) % len(NODE_COLORS)]


def severity_color(severity: str | None) -> str:
    return SEVERITY_COLORS.get(severity or "", SEVERITY_COLORS["warning"])


@dataclass(frozen=True, slots=True)
class XAxis:
    """By step or by wall time: which row key is x and how the axis is titled."""

    mode: str = "step"  # "step" | "time"

    @property
    def by_time(self) -> bool:
        return self.mode == "time"

    def of(self, row: dict[str, Any], step_key: str = "step", ts_key: str = "ts") -> Any:
        return to_datetime(row.get(ts_key)) if self.by_time else row.get(step_key)

    def at(self, step: Any, ts: Any) -> Any:
        return to_datetime(ts) if self.by_time else step

    @property
    def title(self) -> str:
        return "wall time (UTC)" if self.by_time else "step"


def to_datetime(ts: float | None) -> str | None:
    """A unix time as the ISO text plotly puts on a date axis (UTC, ms)."""
    if ts is None or not math.isfinite(ts):
        return None
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def finite(v: Any) -> float | None:
    """A value plotly can draw: None for NaN, Inf and missing."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def ema(values: Iterable[float | None], weight: float, *, start: float | None = None) -> list[float | None]:
    """The smoothing slider's exponential moving average (as TensorBoard's, debiased),
    skipping gaps. `weight` 0 returns the values; `start` continues an earlier run."""
    out: list[float | None] = []
    if weight <= 0:
        return [finite(v) for v in values]
    last = start
    for v in values:
        f = finite(v)
        if f is None:
            out.append(last)
            continue
        last = f if last is None else last * weight + (1 - weight) * f
        out.append(last)
    return out


def base_layout(fig: go.Figure, *, title: str | None = None, height: int = 300, uirevision: str = "keep",
                legend: bool = True) -> go.Figure:
    """The look every chart shares, in one layout update. No plotly template: applying
    one deep-copies it per figure (~7 ms) and ships ~10 kB of it per figure; the few
    things it gave (white plot, light grid, the colourway) are set here instead."""
    axis = {"showgrid": True, "gridcolor": "#eef0f4", "zeroline": False, "showline": True, "linecolor": "#cfd5e0",
            "automargin": True}
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 14}} if title else None,
        height=height, margin={"l": 64, "r": 16, "t": 40 if title else 12, "b": 44},
        template="none", font=FONT, uirevision=uirevision, hovermode="x unified", colorway=list(RANK_COLORS),
        showlegend=legend, legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right",
                                   "font": {"size": 11}},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="#ffffff", hoverlabel={"font": {"family": FONT["family"]}},
        xaxis=axis, yaxis=axis)
    return fig


def empty(message: str, *, height: int = 300) -> go.Figure:
    """A chart with nothing to draw says why, in its middle."""
    fig = base_layout(go.Figure(), height=height, legend=False)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 13, "color": "#6b7280"})
    return fig


# -- curves ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Curve:
    """One overview chart: which columns of views.overview it draws."""

    key: str  # avg column
    title: str
    unit: str
    lo: str | None = None  # min column (the band), None for none
    hi: str | None = None
    log_default: bool = False


def column(rows: Rows, key: str | None) -> np.ndarray:
    """One key of every row as float64, NaN where missing or not finite: what plotly
    draws as a gap. Arrays, not lists: plotly validates a list element by element
    (~0.5 us each, most of a large figure's build time) and ships an array as binary."""
    if key is None:
        return np.full(len(rows), np.nan)
    a = np.array([r.get(key) for r in rows], dtype=np.float64)  # None -> NaN
    a[~np.isfinite(a)] = np.nan
    return a


def plain(values: Any) -> list:
    """An array as a JSON-ready list (None for NaN), for extendData."""
    return [None if isinstance(v, float) and not math.isfinite(v) else v
            for v in (values.tolist() if isinstance(values, np.ndarray) else list(values))]


def extendable(fig: go.Figure) -> dict:
    """The figure as the dict Dash ships, with plain lists for arrays. A go.Figure sends a
    numpy column as a typed array ({dtype, bdata}), which plotly.js keeps as such in the
    graph's data: `extendData` cannot append to it. The live curves go out like this."""
    return {"data": [{k: (plain(v) if isinstance(v, np.ndarray) else v) for k, v in t.to_plotly_json().items()}
                     for t in fig.data],
            "layout": fig.layout.to_plotly_json()}


def curve_traces(rows: Rows, curve: Curve, x: XAxis, *, smoothing: float = 0.0,
                 smooth_start: float | None = None) -> list[go.Scatter]:
    """The traces of one curve, in a fixed order so a live refresh can extend them:
    [band top, band bottom (filled to the top), value (faint when smoothed), smoothed]."""
    xs = [x.of(r) for r in rows] if x.by_time else np.array([r.get("step") for r in rows], dtype=np.int64)
    avg = column(rows, curve.key)
    smoothed = (np.array(ema(avg.tolist(), smoothing, start=smooth_start), dtype=np.float64)
                if smoothing > 0 else np.array([], dtype=np.float64))
    raw_width = 1 if smoothing > 0 else 1.8
    raw_color = "rgba(31, 119, 180, 0.35)" if smoothing > 0 else ACCENT
    return [
        go.Scatter(x=xs, y=column(rows, curve.hi), mode="lines", line={"width": 0}, hoverinfo="skip",
                   showlegend=False, name="max", connectgaps=False),
        go.Scatter(x=xs, y=column(rows, curve.lo), mode="lines", line={"width": 0}, fill="tonexty",
                   fillcolor=BAND, hoverinfo="skip", showlegend=False, name="min-max", connectgaps=False),
        go.Scatter(x=xs, y=avg, mode="lines", line={"width": raw_width, "color": raw_color},
                   name=curve.key if smoothing <= 0 else f"{curve.key} (raw)", connectgaps=False,
                   hovertemplate=f"%{{y:.4g}} {curve.unit}<extra>{curve.key}</extra>"),
        go.Scatter(x=xs if smoothing > 0 else [], y=smoothed, mode="lines", line={"width": 2, "color": ACCENT},
                   name=f"{curve.key} (smoothed)", showlegend=smoothing > 0,
                   hovertemplate=f"%{{y:.4g}} {curve.unit}<extra>smoothed</extra>"),
    ]


def curve_figure(rows: Rows, curve: Curve, x: XAxis, *, smoothing: float = 0.0, log_y: bool = False,
                 marks: Marks | None = None, nonfinite: Rows | None = None, height: int = 240,
                 uirevision: str = "keep") -> go.Figure:
    if not rows:
        return empty(f"no {curve.title.lower()} yet", height=height)
    fig = go.Figure(curve_traces(rows, curve, x, smoothing=smoothing))
    if nonfinite:  # steps whose value was NaN/Inf on some rank: there is no mean to draw, only the mark
        fig.add_trace(go.Scatter(x=[x.of(r) for r in nonfinite], y=[0] * len(nonfinite), yaxis="y2",
                                 mode="markers", marker={"symbol": "x", "size": 9, "color": "#d62728"},
                                 name="NaN/Inf", hovertemplate="%{x}: non-finite on some rank<extra></extra>"))
        fig.update_layout(yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True})
    base_layout(fig, title=f"{curve.title} ({curve.unit})" if curve.unit else curve.title, height=height,
                uirevision=uirevision)
    fig.update_xaxes(title_text=x.title)
    fig.update_yaxes(type="log" if log_y else "linear", title_text=curve.unit or None)
    if marks is not None:
        annotate(fig, marks, x)
    return fig


# -- incidents and rollbacks on every time chart ------------------------------------------
@dataclass(slots=True)
class Marks:
    """What every time chart marks: incident step ranges (shaded, coloured by severity)
    and where a rollback or restart began a new attempt (a dashed line)."""

    incidents: Rows
    attempts: Rows
    actions: Rows

    @property
    def signature(self) -> tuple:
        """Changes when a mark would be drawn differently: a live page redraws then."""
        return (tuple((i.get("id"), i.get("status"), i.get("step_to"), i.get("root_cause")) for i in self.incidents),
                tuple((a.get("attempt"), a.get("step_from")) for a in self.attempts),
                tuple((a.get("id"), a.get("status")) for a in self.actions))


def annotate(fig: go.Figure, marks: Marks, x: XAxis, *, label: bool = True) -> go.Figure:
    """Shade each incident's steps (or its open time) and draw a dashed line where each
    later attempt began. All shapes and labels go in one layout update: plotly's
    add_vrect/add_vline cost ~1 ms each in axis bookkeeping, and a page draws dozens."""
    shapes: list[dict] = []
    labels: list[dict] = []
    for inc in marks.incidents:
        if inc.get("step_from") is None and not x.by_time:
            continue
        color = severity_color(inc.get("severity"))
        if x.by_time:
            x0 = to_datetime(inc.get("opened_ts"))
            x1 = to_datetime(inc.get("closed_ts") or inc.get("updated_ts") or inc.get("opened_ts"))
        else:
            x0 = inc["step_from"] - 0.5
            x1 = (inc.get("step_to") if inc.get("step_to") is not None else inc["step_from"]) + 0.5
        who = f" r{inc['rank']}" if inc.get("rank") is not None else (f" {inc['node']}" if inc.get("node") else "")
        shapes.append({"type": "rect", "xref": "x", "yref": "y domain", "x0": x0, "x1": x1, "y0": 0, "y1": 1,
                       "fillcolor": color, "opacity": 0.14, "line": {"width": 0}, "layer": "below"})
        if label:
            labels.append({"x": x0, "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom", "xanchor": "left",
                           "showarrow": False, "text": f"{inc.get('kind')}{who}", "font": {"size": 10, "color": color}})
    why = {a.get("attempt"): a.get("kind") for a in marks.actions if a.get("attempt") is not None}
    starts: dict[Any, list[str]] = {}  # x -> the attempts that began there (a restart and a rollback may)
    for att in marks.attempts[1:]:  # the first attempt is the run's start, not a rollback
        xv = x.at(att.get("step_from"), att.get("ts_from"))
        if xv is None:
            continue
        cause = why.get(att.get("attempt"))  # "rollback → attempt 2" when an action made it
        starts.setdefault(xv, []).append(f"{cause} → attempt {att.get('attempt')}" if cause
                                         else f"attempt {att.get('attempt')}")
    for i, (xv, names) in enumerate(starts.items()):
        shapes.append({"type": "line", "xref": "x", "yref": "y domain", "x0": xv, "x1": xv, "y0": 0, "y1": 1,
                       "line": {"color": ACTION_COLOR, "width": 1.2, "dash": "dash"}})
        if label:  # one label a line, every other one higher: lines close together stay readable
            labels.append({"x": xv, "y": 0.13 * (i % 2), "xref": "x", "yref": "paper", "yanchor": "bottom",
                           "xanchor": "left", "showarrow": False, "text": ", ".join(names),
                           "font": {"size": 10, "color": ACTION_COLOR}, "bgcolor": "rgba(255,255,255,0.75)"})
    if shapes or labels:
        fig.update_layout(shapes=[*fig.layout.shapes, *shapes], annotations=[*fig.layout.annotations, *labels])
    return fig


def fmt_s(v: float | None) -> str:
    """Seconds for a person: 0.42 ms, 12.3 ms, 1.25 s, 3 min 2 s."""
    if v is None or not math.isfinite(v):
        return "–"
    if v < 1e-3:
        return f"{v * 1e6:.0f} µs"
    if v < 1:
        return f"{v * 1e3:.1f} ms"
    if v < 120:
        return f"{v:.2f} s"
    return f"{int(v // 60)} min {int(v % 60)} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_ts(ts: float | None) -> str:
    return "–" if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%H:%M:%S")
