"""GET /metrics: Prometheus's text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["Metrics"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics() -> Response:
    """This process's metrics: requests by outcome, tokens generated, requests in flight."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
