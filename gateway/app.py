"""The gateway's FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import openapi
from gateway.access_log import AccessLog
from gateway.bodies.ignored_fields import IgnoredFields
from gateway.bodies.request_body import RequestBodies
from gateway.errors import install_handlers
from gateway.media.loader import MediaLoader
from gateway.routes import (
    embeddings,
    health,
    lora,
    metrics,
    mindie,
    openai,
    responses,
    tgi,
    tokenize,
    triton,
    websocket,
)
from gateway.service import GatewayService
from gateway.tenancy.api_keys import ApiKeys, open_path


def create_app(
    service: GatewayService,
    media: MediaLoader,
    max_request_bytes: int,
    api_keys: list[str] | None = None,
    more_metrics: Callable[[], Awaitable[bytes]] | None = None,
) -> FastAPI:
    """An app that serves through `service`, which it starts and stops with itself.

    Request bodies over `max_request_bytes` are refused (413) before they are
    parsed; with `api_keys` or a tenants file, requests without one of them (or of a tenant's, or of the admin
    keys, which may load LoRA adapters: routes/lora.py) are refused (401) first.
    `more_metrics()`: Prometheus text that GET /metrics adds (another process's, as serve's engine).
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="tokenrelay",
        summary="LLM inference behind a message bus: MindIE's API in front, Kafka behind.",
        lifespan=lifespan,
        # /docs and /redoc are served by openapi.install, from local assets.
        docs_url=None,
        redoc_url=None,
        # A path with a trailing slash is answered 404 naming the path without it (gateway/errors.py), not
        # redirected: a 307 has an empty body, and clients that do not follow it (curl, a POST) see nothing
        # useful. Not served as is either: one spelling per route keeps the API keys' open paths, the access
        # log's and the metrics' route labels and the OpenAPI document to one form.
        redirect_slashes=False,
    )
    app.state.gateway = service
    app.state.media = media
    app.state.more_metrics = more_metrics
    # Each middleware added runs before those added earlier.
    app.add_middleware(RequestBodies, max_bytes=max_request_bytes)
    app.add_middleware(IgnoredFields, reject=service.settings.reject_unknown_fields)
    app.add_middleware(HeadAsGet)
    keys_required = bool(api_keys) or service.tenants is not None
    if keys_required:
        app.add_middleware(
            ApiKeys,
            keys=[*(api_keys or ()), *service.settings.admin_api_keys],
            tenants=service.tenants,
            rate_limit_headers=service.rate_limit_headers,
        )
    app.add_middleware(AccessLog)  # first: it logs and counts every answer, the others' refusals included
    install_handlers(app)
    openapi.install(app, keys_required=lambda path: keys_required and not open_path(path))
    app.include_router(mindie.router)
    app.include_router(triton.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(embeddings.router)
    app.include_router(tgi.router)
    app.include_router(tokenize.router)
    app.include_router(lora.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(websocket.router)
    return app


class HeadAsGet:
    """HEAD answered wherever GET is, as GET would be less the body (RFC 9110, 9.3.2): probes and uptime
    checks often send HEAD.

    Here rather than as a method of each route, which would list every GET twice in the OpenAPI document.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self._app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        scope["method"] = "GET"  # in place, as routing records the route there for the access log to read
        await self._app(scope, receive, headers_only)
