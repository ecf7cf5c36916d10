"""The HTTP side: the ASGI app, the gate every request passes, tokens by role, the bounded protocol, the routes."""
