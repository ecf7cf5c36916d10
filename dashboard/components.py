"""Components the pages share besides figures: one look for every table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from dash import dash_table

from dashboard.figures import FONT


def data_table(table_id: str, columns: Sequence[tuple[str, str, str]], *, page_size: int = 15,
               conditional: Sequence[dict] = (), sortable: bool = True, **kwargs: Any) -> dash_table.DataTable:
    """A DataTable with the dashboard's look; `columns` are (id, header, "n"|"t"): a
    numeric column sorts and filters as numbers (`> 2` in its filter box)."""
    return dash_table.DataTable(
        id=table_id, data=[],
        columns=[{"id": c, "name": n, **({"type": "numeric"} if t == "n" else {})} for c, n, t in columns],
        sort_action="native" if sortable else "none", filter_action="native" if sortable else "none",
        page_action="native", page_size=page_size,
        style_table={"overflowX": "auto"},
        style_cell={"fontFamily": FONT["family"], "fontSize": 12, "padding": "5px 8px", "textAlign": "left",
                    "whiteSpace": "normal", "height": "auto", "maxWidth": 460, "color": FONT["color"]},
        style_header={"backgroundColor": "#f3f5f9", "fontWeight": 600, "border": "1px solid #e3e7ef"},
        style_data={"border": "1px solid #eef0f4"},
        style_filter={"backgroundColor": "#fbfcfe"},
        style_data_conditional=list(conditional), **kwargs)


def legend_below(fig: go.Figure) -> go.Figure:
    """The legend under the x axis title: where base_layout puts it (top right), the
    plot's modebar covers it. Make the figure ~40 px taller to keep the plot's size."""
    fig.update_layout(margin={"b": 92}, legend={"orientation": "h", "yref": "container", "y": 0.0,
                                                 "yanchor": "bottom", "x": 0.0, "xanchor": "left"})
    return fig
