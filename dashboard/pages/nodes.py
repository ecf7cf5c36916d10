import dash
from dash import html



def layout(**_):
    return html.Div("todo")


dash.register_page(__name__, path="/nodes", name="Nodes", order=9, layout=layout)
