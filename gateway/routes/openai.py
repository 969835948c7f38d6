"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streams are server-sent events of OpenAI's chunks, ended by `data: [DONE]`;
errors, before or during a stream, are in OpenAI's error shape (see
`gateway.errors`). finish_reason is `length` at max_tokens (or the server's
limits), else `stop` (EOS, a stop string or a stop token).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from gateway.errors import openai_error_body
from gateway.generation import check_prompt_tokens, complete, stream
from gateway.inflight import InFlight
from gateway.openapi import event_stream
from gateway.service import GatewayService
from schemas.messages import FinishReason, TokenEvent
from schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    OpenAIError,
    Usage,
)

router = APIRouter(tags=["OpenAI-compatible"])

_ERRORS = {status: {"model": OpenAIError} for status in (400, 404, 424, 429, 500, 503, 504)}


def _finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == FinishReason.LENGTH else "stop"


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


async def _submit(request: Request, body: CompletionRequest | ChatCompletionRequest) -> InFlight:
    service: GatewayService = request.app.state.gateway
    model = service.resolve(body.model)
    prompt: dict = {}
    if isinstance(body, ChatCompletionRequest):
        prompt["chat_messages"] = [m.as_message() for m in body.messages]
    elif isinstance(body.prompt, str) or isinstance(body.prompt[0], str):
        prompt["prompt_text"] = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    else:
        check_prompt_tokens(model, body.prompt)
        prompt["prompt_token_ids"] = body.prompt
    return await service.submit(
        model,
        body.sampling(service.draw_seed(), model.max_iter_times),
        priority=body.priority,
        **prompt,
    )


def _sse(obj: dict | str) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


async def _chunks(
    request: Request, inflight: InFlight, render, include_usage: bool, first: dict | None = None
) -> StreamingResponse:
    """The request's events as OpenAI chunks (`render(event)` makes one), `[DONE]` last."""
    service: GatewayService = request.app.state.gateway
    events = await stream(service, inflight, request)  # an error before the first token raises here

    async def frames() -> AsyncIterator[str]:
        prompt_tokens, generated = 0, 0
        if first is not None:
            yield _sse(first)
        async for event in events:
            if event.error is not None:
                yield _sse(openai_error_body(event.error.status, event.error.error_type, event.error.message))
                break
            prompt_tokens = event.prompt_tokens or prompt_tokens
            generated += len(event.token_ids)
            yield _sse(render(event))
        if include_usage:
            yield _sse(render(None) | {"choices": [], "usage": _usage(prompt_tokens, generated).model_dump()})
        yield _sse("[DONE]")

    return StreamingResponse(frames(), media_type="text/event-stream")


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={200: event_stream(Completion, "With `stream`: `data: {chunk}` events, then `data: [DONE]`."), **_ERRORS},
)
async def completions(body: CompletionRequest, request: Request):
    """Complete a prompt (OpenAI's legacy completions), at once or as a stream."""
    inflight = await _submit(request, body)
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(event: TokenEvent | None) -> dict:
        text = event.text if event else ""
        reason = _finish_reason(event.finish_reason) if event else None
        choice = CompletionChoice(index=0, text=text, finish_reason=reason)
        return Completion(id=completion_id, created=created, model=body.model, choices=[choice]).model_dump()

    if body.stream:
        return await _chunks(request, inflight, chunk, body.include_usage)
    done = await complete(request.app.state.gateway, inflight, request)
    choice = CompletionChoice(index=0, text=done.text, finish_reason=_finish_reason(done.finish_reason))
    usage = _usage(done.prompt_tokens, len(done.token_ids))
    return Completion(id=completion_id, created=created, model=body.model, choices=[choice], usage=usage)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        200: event_stream(ChatCompletionChunk, "With `stream`: `data: {chunk}` events, then `data: [DONE]`."),
        **_ERRORS,
    },
)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Answer a conversation, rendered with the model's chat template, at once or as a stream."""
    inflight = await _submit(request, body)
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(event: TokenEvent | None, delta: Delta | None = None) -> dict:
        if delta is None:
            delta = Delta(content=event.text) if event else Delta()
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=_finish_reason(event and event.finish_reason))
        return ChatCompletionChunk(id=completion_id, created=created, model=body.model, choices=[choice]).model_dump(
            exclude_none=True
        )

    if body.stream:
        role = chunk(None, Delta(role="assistant", content=""))
        return await _chunks(request, inflight, chunk, body.include_usage, first=role)
    done = await complete(request.app.state.gateway, inflight, request)
    choice = ChatChoice(
        index=0, message=AssistantMessage(content=done.text), finish_reason=_finish_reason(done.finish_reason)
    )
    usage = _usage(done.prompt_tokens, len(done.token_ids))
    return ChatCompletion(id=completion_id, created=created, model=body.model, choices=[choice], usage=usage)


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    """Every name a live worker serves, aliases included."""
    service: GatewayService = request.app.state.gateway
    created = int(time.time())
    return ModelList(data=[ModelCard(id=name, created=created) for name in service.directory.served_names()])
