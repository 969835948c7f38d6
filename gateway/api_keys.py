"""Optional API keys: `Authorization: Bearer <key>` on every route but the probes.

A pure ASGI middleware, in front of everything (a refused request is never
parsed). Without keys configured it is not installed. Health probes and
/metrics stay open: orchestrators and Prometheus call them without keys.
A refused HTTP request gets 401 with `WWW-Authenticate: Bearer` (in OpenAI's
error shape on /v1/...); a refused WebSocket is closed before it opens
(code 1008, policy violation).
"""

from __future__ import annotations

import hmac
import json
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import openai_error_body

UNAUTHORIZED = "Unauthorized"
_OPEN = re.compile(r"^/(health|metrics|v2/health/(live|ready)|v2/models/[^/]+/ready)$")


def open_path(path: str) -> bool:
    """Whether a path is served without a key (the probes and /metrics)."""
    return bool(_OPEN.match(path))


class ApiKeys:
    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self._app = app
        self._keys = [k.encode() for k in keys]

    def _allowed(self, scope: Scope) -> bool:
        if open_path(scope["path"]):
            return True
        authorization = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # Compare with every key, in constant time, so that timing tells nothing about them.
        return any([hmac.compare_digest(key.strip(), k) for k in self._keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self._app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "a valid API key is required"})
        else:
            await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        message = "a valid API key is required: Authorization: Bearer <key>"
        if scope["path"].startswith("/v1/"):
            body = openai_error_body(401, UNAUTHORIZED, message)
        else:
            body = {"error": message, "error_type": UNAUTHORIZED}
        payload = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
