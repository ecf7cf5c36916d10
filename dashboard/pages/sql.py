import dash
from dash import html



def layout(**_):
    return html.Div("todo")


dash.register_page(__name__, path="/sql", name="Sql", order=9, layout=layout)
