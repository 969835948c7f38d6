"""Triton-compatible text generation: /v2/models/{model}/generate and generate_stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.errors import ApiError, ErrorBody
from gateway.inflight import InFlight
from gateway.service import GatewayService
from schemas.messages import TokenEvent
from schemas.triton import (
    GenerateRequest,
    GenerateResponse,
    GenerateStreamRequest,
    StreamEvent,
)

router = APIRouter(tags=["Triton-compatible"])

_ERRORS = {status: {"model": ErrorBody} for status in (404, 422, 424, 500, 503, 504)}


def _error(event: TokenEvent) -> ApiError:
    assert event.error is not None
    return ApiError(event.error.status, event.error.error_type, event.error.message)


def stream_event(client_id: str, model_name: str, event: TokenEvent, details: bool) -> dict:
    """One generate_stream event, keys in the order of MindIE's examples."""
    body: dict = {"id": client_id, "model_name": model_name, "model_version": None, "text_output": event.text}
    if details:
        body["details"] = {
            **({"finish_reason": event.finish_reason.value} if event.finish_reason else {}),
            "generated_tokens": event.index + len(event.token_ids),
            "first_token_cost": None,
            "decode_cost": None,
            "batch_size": event.batch_size,
            "queue_wait_time": event.queue_wait_us,
        }
    body["prefill_time"] = event.prefill_time_ms
    body["decode_time"] = event.decode_time_ms
    return body


async def start_stream(
    service: GatewayService, model_name: str, body: GenerateStreamRequest
) -> tuple[InFlight, AsyncIterator[dict]]:
    """Submit a generate_stream request and wait for its first event.

    Errors known before the first token (unknown model, prompt too long,
    timeout) raise ApiError, so that they can still be answered with their
    status; later ones become the stream's last object, {"error", "error_type"}.
    """
    parameters = body.parameters
    inflight = await service.submit(
        service.resolve(model_name),
        parameters.sampling(seed=service.draw_seed()),
        prompt_text=body.text_input,
        priority=parameters.priority,
        timeout_s=parameters.timeout,
    )
    client_id = body.id or inflight.request.request_id
    events = inflight.events()
    try:
        first = await anext(events)
    except BaseException:
        await service.finish(inflight)
        raise
    if first.error is not None:
        await service.finish(inflight)
        raise _error(first)

    async def objects() -> AsyncIterator[dict]:
        try:
            yield stream_event(client_id, model_name, first, bool(parameters.details))
            async for event in events:
                if event.error is not None:
                    yield ErrorBody(error=event.error.message, error_type=event.error.error_type).model_dump()
                else:
                    yield stream_event(client_id, model_name, event, bool(parameters.details))
        finally:
            await service.finish(inflight)

    return inflight, objects()


@router.post("/v2/models/{model}/generate", response_model=GenerateResponse, responses=_ERRORS)
async def generate(model: str, body: GenerateRequest, request: Request) -> JSONResponse:
    """Generate text for a prompt and answer with all of it at once."""
    service: GatewayService = request.app.state.gateway
    inflight = await service.submit(
        service.resolve(model),
        body.parameters.sampling(seed=service.draw_seed()),
        prompt_text=body.text_input,
    )
    pieces: list[str] = []
    last: TokenEvent | None = None
    try:
        async for event in inflight.events():
            if event.error is not None:
                raise _error(event)
            pieces.append(event.text)
            last = event
    finally:
        await service.finish(inflight)
    assert last is not None and last.finish_reason is not None
    answer: dict = {
        "id": body.id or inflight.request.request_id,
        "model_name": model,
        "model_version": None,
        "text_output": "".join(pieces),
    }
    if body.parameters.details:
        answer["details"] = {
            "finish_reason": last.finish_reason.value,
            "generated_tokens": last.index + len(last.token_ids),
            "first_token_cost": None,
            "decode_cost": None,
        }
    return JSONResponse(answer)


@router.post(
    "/v2/models/{model}/generate_stream",
    responses={200: {"content": {"text/event-stream": {"schema": StreamEvent.model_json_schema()}}}, **_ERRORS},
)
async def generate_stream(model: str, body: GenerateStreamRequest, request: Request) -> StreamingResponse:
    """Generate text for a prompt and stream it as server-sent events, `data:{...}` per token."""
    _, objects = await start_stream(request.app.state.gateway, model, body)

    async def frames() -> AsyncIterator[str]:
        async with aclosing(objects):  # closing it tells the worker to stop, if it has not ended
            async for obj in objects:
                yield "data:" + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream")
