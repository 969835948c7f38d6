"""Liveness and readiness, as MindIE and KServe v2 clients probe them."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.errors import ErrorBody, unavailable
from gateway.service import GatewayService

router = APIRouter(tags=["Health"])


@router.get("/health", response_class=Response)
@router.get("/v2/health/live", response_class=Response)
async def live() -> Response:
    """The gateway process answers."""
    return Response(status_code=200)


@router.get("/v2/health/ready", response_class=Response, responses={503: {"model": ErrorBody}})
async def ready(request: Request) -> Response:
    """Some worker is serving some model, and the gateway is not shutting down."""
    service: GatewayService = request.app.state.gateway
    if service.draining:
        raise unavailable("this gateway is shutting down")
    if not service.directory.any_live():
        raise unavailable("no worker is serving any model yet")
    return Response(status_code=200)


@router.get(
    "/v2/models/{model}/ready",
    response_class=Response,
    responses={404: {"model": ErrorBody}, 503: {"model": ErrorBody}},
)
async def model_ready(model: str, request: Request) -> Response:
    """A live worker serves this model: 200; 503 while none does (or none has announced any model yet); 404 if
    none ever announced it, naming those that were."""
    service: GatewayService = request.app.state.gateway
    service.resolve(model)
    return Response(status_code=200)
