"""The gateway's FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import openapi
from gateway.api_keys import ApiKeys, open_path
from gateway.errors import install_handlers
from gateway.media import MediaLoader
from gateway.request_body import RequestBodies
from gateway.routes import health, metrics, mindie, openai, tgi, triton, websocket
from gateway.service import GatewayService


def create_app(
    service: GatewayService,
    media: MediaLoader,
    max_request_bytes: int,
    api_keys: list[str] | None = None,
    more_metrics: Callable[[], Awaitable[bytes]] | None = None,
) -> FastAPI:
    """An app that serves through `service`, which it starts and stops with itself.

    Request bodies over `max_request_bytes` are refused (413) before they are
    parsed; with `api_keys`, requests without one of them are refused (401) first.
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
    )
    app.state.gateway = service
    app.state.media = media
    app.state.more_metrics = more_metrics
    app.add_middleware(RequestBodies, max_bytes=max_request_bytes)
    if api_keys:
        app.add_middleware(ApiKeys, keys=api_keys)  # added last: it runs first
    install_handlers(app)
    openapi.install(app, keys_required=lambda path: bool(api_keys) and not open_path(path))
    app.include_router(mindie.router)
    app.include_router(triton.router)
    app.include_router(openai.router)
    app.include_router(tgi.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(websocket.router)
    return app
