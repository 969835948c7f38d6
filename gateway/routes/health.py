"""Liveness and readiness, as MindIE and KServe v2 clients probe them."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from gateway.errors import ErrorBody, unavailable
from gateway.service import GatewayService

router = APIRouter(tags=["Health"])


class GatewayReady(BaseModel):
    """What a 200 from /v2/health/ready says (MindIE's 200 is empty; probes read only the status)."""

    ready: bool = True
    models: list[str]  # every name some live worker answers to, aliases included


class ModelReady(BaseModel):
    """What a 200 from /v2/models/{model}/ready says."""

    model: str  # the canonical name of the model asked for (the name asked may be an alias)
    ready: bool = True
    workers: int  # live workers serving it, as this gateway hears them


@router.get("/health", response_class=Response)
@router.get("/v2/health/live", response_class=Response)
async def live() -> Response:
    """The gateway process answers."""
    return Response(status_code=200)


@router.get("/v2/health/ready", responses={503: {"model": ErrorBody}})
async def ready(request: Request) -> GatewayReady:
    """Some worker is serving some model, and the gateway is not shutting down."""
    service: GatewayService = request.app.state.gateway
    if service.draining:
        raise unavailable("this gateway is shutting down")
    if not service.directory.any_live():
        raise unavailable(service.bus_trouble() or "no worker is serving any model yet")
    return GatewayReady(models=service.directory.served_names())


@router.get("/v2/models/{model}/ready", responses={404: {"model": ErrorBody}, 503: {"model": ErrorBody}})
async def model_ready(model: str, request: Request) -> ModelReady:
    """A live worker serves this model: 200; 503 while none does (or none has announced any model yet); 404 if
    none ever announced it, naming those that were."""
    service: GatewayService = request.app.state.gateway
    served = service.resolve(model)
    return ModelReady(model=served.name, workers=service.directory.live_workers(served.name))
