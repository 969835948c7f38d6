"""The gateway's FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.errors import install_handlers
from gateway.routes import health, triton, websocket
from gateway.service import GatewayService


def create_app(service: GatewayService) -> FastAPI:
    """An app that serves through `service`, which it starts and stops with itself."""

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
    )
    app.state.gateway = service
    install_handlers(app)
    app.include_router(triton.router)
    app.include_router(health.router)
    app.include_router(websocket.router)
    return app
