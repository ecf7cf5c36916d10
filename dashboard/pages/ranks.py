import dash
from dash import html



def layout(**_):
    return html.Div("todo")


dash.register_page(__name__, path="/ranks", name="Ranks", order=9, layout=layout)
