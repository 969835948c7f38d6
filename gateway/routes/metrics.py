"""GET /metrics: Prometheus's text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["Metrics"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    """This process's metrics (and its engine process's, under `tokenrelay serve`): requests by outcome, tokens
    generated, requests in flight."""
    text = generate_latest()
    if request.app.state.more_metrics is not None:
        text += await request.app.state.more_metrics()
    return Response(text, media_type=CONTENT_TYPE_LATEST)
