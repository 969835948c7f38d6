"""MindIE's native routes: POST /infer_token (token ids) and POST /infer (text), one handler.

They name no model: they serve the gateway's default model (--default-model,
or the only model served).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import HTTPConnection

from gateway.dispatch.inflight import InFlight
from gateway.errors import GENERATION_ERRORS, ErrorBody
from gateway.media.prompts import multimodal_prompt
from gateway.openapi import event_stream
from gateway.routes.generation import complete, error_object, sse_response, start, stream
from gateway.service import GatewayService
from schemas.messages import FinishReason
from schemas.mindie import InferTokenRequest, InferTokenResponse, InferTokenStreamEvent

router = APIRouter(tags=["MindIE native"])

_STREAM = event_stream(InferTokenStreamEvent, "", ErrorBody)["content"]  # with "stream": true
_RESPONSES = {
    200: {
        "model": InferTokenResponse,
        "description": "One JSON answer; with `stream`, one `data: {...}` event per token.",
        "content": _STREAM,
    },
    **GENERATION_ERRORS,
}


def _details(finish_reason: FinishReason, generated_tokens: int, seed: int) -> dict:
    return {"finish_reason": finish_reason.value, "generated_tokens": generated_tokens, "seed": seed}


async def _start(connection: HTTPConnection, body: InferTokenRequest) -> InFlight:
    service: GatewayService = connection.app.state.gateway
    model = service.default_model_name()
    if body.input_id is not None:
        return await start(service, model, body.parameters, token_ids=body.input_id)
    prompt = await multimodal_prompt(body.inputs, service.resolve(model), connection.app.state.media)
    return await start(service, model, body.parameters, prompt=prompt)


async def stream_objects(connection: HTTPConnection, body: InferTokenRequest) -> AsyncIterator[dict]:
    """Submit the body and render its events as streamed objects (an ApiError raises before the first)."""
    service: GatewayService = connection.app.state.gateway
    inflight = await _start(connection, body)
    seed = inflight.request.sampling.seed
    events = await stream(service, inflight, connection)

    async def render() -> AsyncIterator[dict]:
        so_far = ""
        async with aclosing(events):  # closing it tells the worker to stop, if it has not ended
            async for event in events:
                if event.error is not None:
                    yield error_object(event)
                    continue
                so_far += event.text
                obj: dict = {"prefill_time": event.prefill_time_ms, "decode_time": event.decode_time_ms}
                if event.finish_reason is None:
                    text = so_far if service.settings.full_text else event.text
                    obj["token"] = {"id": event.token_ids, "text": text}
                else:  # the last event: the whole text, details, and a token whose text is null
                    obj["generated_text"] = so_far
                    generated = event.index + len(event.token_ids)
                    wanted = body.parameters.wants_details
                    obj["details"] = _details(event.finish_reason, generated, seed) if wanted else None
                    obj["token"] = {"id": event.token_ids, "text": None}
                yield obj

    return render()


@router.post("/infer_token", response_model=None, responses=_RESPONSES)
@router.post("/infer", response_model=None, responses=_RESPONSES)
async def infer_token(body: InferTokenRequest, request: Request) -> JSONResponse | StreamingResponse:
    """Generate from token ids (`input_id`) or text (`inputs`); one answer, or events with `stream`."""
    if body.stream:
        return sse_response(await stream_objects(request, body), space=True)
    service: GatewayService = request.app.state.gateway
    inflight = await _start(request, body)
    done = await complete(service, inflight, request)
    answer: dict = {"generated_text": done.text}
    if body.parameters.wants_details:
        answer["details"] = _details(done.finish_reason, done.generated_tokens, inflight.request.sampling.seed)
    return JSONResponse(answer)
