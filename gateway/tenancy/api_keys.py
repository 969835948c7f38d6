"""Optional API keys: `Authorization: Bearer <key>` on every route but the probes.

A pure ASGI middleware, in front of everything (a refused request is never
parsed). Without keys configured (--api-keys, or a tenants file) it is not
installed. Health probes and /metrics stay open: orchestrators and Prometheus
call them without keys. A refused HTTP request gets 401 with
`WWW-Authenticate: Bearer` (in OpenAI's error shape on /v1/...); a refused
WebSocket is closed before it opens (code 1008, policy violation).

A key of a tenant (tenants.py) names the tenant in the request's context,
where the gateway's service reads it and every log line of the request
carries it; the answer gets the tenant's x-ratelimit-* headers (quotas.py).
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import openai_error_body
from gateway.tenancy.tenants import Tenants, digest_of

UNAUTHORIZED = "Unauthorized"
_OPEN = re.compile(r"^/(health|metrics|v2/health/(live|ready)|v2/models/[^/]+/ready)$")


def open_path(path: str) -> bool:
    """Whether a path is served without a key (the probes and /metrics)."""
    return bool(_OPEN.match(path))


def current_key_id() -> str | None:
    """The first 12 hex digits of the SHA-256 of the request's API key (usage records name the key by it); None
    when the server takes no keys."""
    return structlog.contextvars.get_contextvars().get("key_id")


def current_tenant() -> str | None:
    """The tenant whose key the request being handled came with; None without a tenants file, or for a key of
    --api-keys (no tenant's)."""
    return structlog.contextvars.get_contextvars().get("tenant")


class ApiKeys:
    def __init__(
        self,
        app: ASGIApp,
        keys: list[str],
        tenants: Tenants | None = None,
        rate_limit_headers: Callable[[str], dict[str, str]] | None = None,
    ) -> None:
        """`rate_limit_headers(tenant)`: the headers an answer to a request of the tenant gets."""
        self._app = app
        self._keys = [k.encode() for k in keys]
        self._tenants = tenants
        self._rate_limit_headers = rate_limit_headers

    def _allowed(self, scope: Scope) -> tuple[bool, str | None, str | None]:
        """Whether the request may in, its key's SHA-256 digest, and the tenant the key belongs to."""
        if open_path(scope["path"]):
            return True, None, None
        authorization = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False, None, None
        key = key.strip()
        digest = digest_of(key)  # once: the tenant's lookup, and the key id of its logs and usage records
        if self._tenants is not None and (tenant := self._tenants.of_digest(digest)) is not None:
            return True, digest, tenant
        # Compare with every key, in constant time, so that timing tells nothing about them.
        return any([hmac.compare_digest(key, k) for k in self._keys]), digest, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self._app(scope, receive, send)
            return
        allowed, digest, tenant = self._allowed(scope)
        if allowed and digest is not None:
            tokens = structlog.contextvars.bind_contextvars(key_id=digest[:12])
            if tenant is not None:
                tokens |= structlog.contextvars.bind_contextvars(tenant=tenant)
                send = self._with_rate_limits(send, tenant)
            try:
                await self._app(scope, receive, send)
            finally:
                structlog.contextvars.reset_contextvars(**tokens)
        elif allowed:
            await self._app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "a valid API key is required"})
        else:
            await self._refuse(scope, send)

    def _with_rate_limits(self, send: Send, tenant: str) -> Send:
        """`send`, adding the tenant's x-ratelimit-* headers, as they stand then, to the start of an answer."""
        if self._rate_limit_headers is None:
            return send

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                added = [(k.encode(), v.encode()) for k, v in self._rate_limit_headers(tenant).items()]
                message = {**message, "headers": [*message.get("headers", ()), *added]}
            await send(message)

        return sending

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
