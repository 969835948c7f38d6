"""The access log and request ids: one line per HTTP request, and an id that follows the request through the logs.

A pure ASGI middleware, the outermost, so that it sees every answer, the
refusals of the other middlewares (401, 413) and of routing (404, 405)
included.
- Request id: the client's `X-Request-Id` when it is sane (1-128 printable
  ASCII characters, no spaces), else a fresh one. It is sent back as
  `X-Request-Id` on every answer, errors and streams included, and on a
  WebSocket's handshake; kept at `request.state.request_id`; and bound to
  structlog's context while the request is handled, so that every line
  logged for it carries it.
- One line per HTTP request once its answer is sent (a stream's when it
  ends): event `http_request` of the logger `gateway.access`, at info below
  400, warning for 4xx and 503 (a state, not a fault), error for other 5xx;
  with `ignored_fields` when the body had fields no document lists
  (gateway/bodies/ignored_fields.py). It replaces uvicorn's access log (off: see
  tokenrelay/http_server.py).
- Every answer counted in `tokenrelay_gateway_http_responses_total`, by
  route template and status: refusals are counted too, which the request
  metrics (telemetry/metrics.py) cannot see. A mounted app's requests are
  labelled with its mount's template (`/docs-assets/{path}`) when it is
  mounted as a `LabelledMount`.
A WebSocket's streams have lines of their own, from gateway/routes/websocket.py.
"""

from __future__ import annotations

import re
import time
import uuid

import structlog
from prometheus_client import Counter
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import error_response

REQUEST_ID_HEADER = b"x-request-id"
_SANE_REQUEST_ID = re.compile(rb"[!-~]{1,128}")  # printable ASCII less space: it goes into log lines and headers
UNMATCHED = "unmatched"  # the route label of a path no route serves (its raw path would be unbounded)
CLIENT_CLOSED = 499  # the status logged when the client left before any answer (nginx's convention)
INTERNAL_ERROR = "Internal Server Error"

HTTP_RESPONSES = Counter(
    "tokenrelay_gateway_http_responses",
    "HTTP answers of the gateway, by route template and status: refusals (4xx) included.",
    ["route", "status"],
)
access = structlog.get_logger("gateway.access")


def request_id_of(scope: Scope) -> str:
    """The client's X-Request-Id if it is sane, else a new id."""
    for name, value in scope["headers"]:
        if name == REQUEST_ID_HEADER and _SANE_REQUEST_ID.fullmatch(value):
            return value.decode()
    return uuid.uuid4().hex


def current_request_id() -> str | None:
    """The request id of the HTTP request or WebSocket stream being handled (bound to structlog's context)."""
    return structlog.contextvars.get_contextvars().get("request_id")


def route_template(scope: Scope) -> str | None:
    """The path template of the route that served (or refused, by method) this request; None if none did.

    Read after the request is handled: routing records its route in the scope (which the middlewares between
    change in place rather than copy, for this).
    """
    return getattr(scope.get("route"), "path_format", None)


class LabelledMount(Mount):
    """A Mount that records itself as the request's route, as FastAPI's routes do (FastAPI records no mount): its
    requests are then labelled with its template, e.g. /docs-assets/{path}, rather than `unmatched`."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child_scope = super().matches(scope)
        if match is Match.FULL:
            child_scope["route"] = self
        return match, child_scope


def client_of(scope: Scope) -> str | None:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


def level_of(status: int) -> str:
    """info below 400; warning for 4xx, and for 503, a state (starting, draining, the broker away) rather than
    a fault of the gateway's; error for the other 5xx."""
    return "info" if status < 400 else "warning" if status < 500 or status == 503 else "error"


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self._app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        tokens = structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            if scope["type"] == "http":
                await self._http(scope, receive, send, request_id)
            else:
                await self._app(scope, receive, _header_on(send, "websocket.accept", request_id))
        finally:
            structlog.contextvars.reset_contextvars(**tokens)

    async def _http(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        started = time.perf_counter()
        method = scope["method"]  # as the client sent it (HeadAsGet, in gateway/app.py, answers HEAD as GET)
        status: int | None = None
        sent_bytes = 0
        with_id = _header_on(send, "http.response.start", request_id)

        async def sending(message: Message) -> None:
            nonlocal status, sent_bytes
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent_bytes += len(message.get("body", b""))
            await with_id(message)

        try:
            await self._app(scope, receive, sending)
        except Exception:
            if status is None:  # the contract's 500, with the id, rather than Starlette's plain text
                message = f"an internal error; the gateway's log tells more under request id {request_id}"
                await error_response(scope["path"], 500, INTERNAL_ERROR, message)(scope, receive, sending)
            raise  # for the server to log the traceback
        finally:
            status = status or CLIENT_CLOSED
            route = route_template(scope)
            HTTP_RESPONSES.labels(route or UNMATCHED, str(status)).inc()
            ignored = scope["state"].get("ignored_fields")
            getattr(access, level_of(status))(
                "http_request",
                method=method,
                route=route or scope["path"],
                path=scope["path"],
                status=status,
                latency_ms=round((time.perf_counter() - started) * 1000, 1),
                request_id=request_id,
                client=client_of(scope),
                bytes_sent=sent_bytes,
                **({"ignored_fields": ignored} if ignored else {}),
            )


def _header_on(send: Send, message_type: str, request_id: str) -> Send:
    """`send`, adding X-Request-Id to the message of `message_type` that starts the answer."""

    async def sending(message: Message) -> None:
        if message["type"] == message_type:
            message = {**message, "headers": [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id.encode())]}
        await send(message)

    return sending
