"""MindIE's native routes: POST /infer_token (token ids) and POST /infer (text), one handler.

They name no model: they serve the gateway's default model (--default-model,
or the only model served).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.errors import ErrorBody
from gateway.generation import complete, error_object, prompt_text, sse, start, stream
from gateway.openapi import event_stream
from gateway.service import GatewayService
from schemas.messages import FinishReason
from schemas.mindie import InferTokenRequest, InferTokenResponse, InferTokenStreamEvent

router = APIRouter(tags=["MindIE native"])

_STREAM = event_stream(InferTokenStreamEvent, "")["content"]  # with "stream": true
_RESPONSES = {
    200: {
        "model": InferTokenResponse,
        "description": "One JSON answer; with `stream`, one `data: {...}` event per token.",
        "content": _STREAM,
    },
    **{status: {"model": ErrorBody} for status in (404, 413, 422, 424, 500, 503, 504)},
}


def _details(finish_reason: FinishReason, generated_tokens: int, seed: int) -> dict:
    return {"finish_reason": finish_reason.value, "generated_tokens": generated_tokens, "seed": seed}


@router.post("/infer_token", response_model=None, responses=_RESPONSES)
@router.post("/infer", response_model=None, responses=_RESPONSES)
async def infer_token(body: InferTokenRequest, request: Request) -> JSONResponse | StreamingResponse:
    """Generate from token ids (`input_id`) or text (`inputs`); one answer, or events with `stream`."""
    service: GatewayService = request.app.state.gateway
    model = service.default_model_name()
    parameters = body.parameters
    if body.input_id is not None:
        inflight = await start(service, model, parameters, token_ids=body.input_id)
    else:
        text = await prompt_text(body.inputs, model, request.app.state.media)
        inflight = await start(service, model, parameters, text=text)
    seed = inflight.request.sampling.seed

    if not body.stream:
        done = await complete(service, inflight, request)
        answer: dict = {"generated_text": done.text}
        if parameters.wants_details:
            answer["details"] = _details(done.finish_reason, done.generated_tokens, seed)
        return JSONResponse(answer)

    events = await stream(service, inflight, request)

    async def frames() -> AsyncIterator[str]:
        so_far = ""
        async with aclosing(events):  # closing it tells the worker to stop, if it has not ended
            async for event in events:
                if event.error is not None:
                    yield sse(error_object(event), space=True)
                    continue
                so_far += event.text
                obj: dict = {"prefill_time": event.prefill_time_ms, "decode_time": event.decode_time_ms}
                if event.finish_reason is None:
                    text = so_far if service.settings.full_text else event.text
                    obj["token"] = {"id": event.token_ids, "text": text}
                else:  # the last event: the whole text, details, and a token whose text is null
                    obj["generated_text"] = so_far
                    generated = event.index + len(event.token_ids)
                    obj["details"] = (
                        _details(event.finish_reason, generated, seed) if parameters.wants_details else None
                    )
                    obj["token"] = {"id": event.token_ids, "text": None}
                yield sse(obj, space=True)

    return StreamingResponse(frames(), media_type="text/event-stream")
