"""The gateway: HTTP, SSE and WebSocket in front, the message bus behind.

Its top level holds what every part uses: the app (app.py), the service
that is its side of the bus (service.py), errors (errors.py), the access
log and request ids (access_log.py), the OpenAPI document (openapi.py) and
its settings (settings.py). Each concept beside them is a package: routes/
(the APIs), dispatch/ (a request's way to a worker and back), tenancy/
(whose a request is and what it may use), media/, structured/ (structured
output) and bodies/. The layers, from the top: app, routes, service,
tenancy, then dispatch, media, structured and bodies side by side
(pyproject.toml's import contracts hold them).

It may use schemas, bus and telemetry; never workers or tokenrelay.
"""
