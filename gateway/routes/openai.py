"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streams are server-sent events of OpenAI's chunks, ended by `data: [DONE]`;
errors, before or during a stream, are in OpenAI's error shape (see
`gateway.errors`). finish_reason is `length` at max_tokens (or the server's
limits), else `stop` (EOS, a stop string or a stop token).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.requests import HTTPConnection

from gateway.access_log import current_request_id
from gateway.dispatch.inflight import InFlight
from gateway.errors import OPENAI_ERRORS, openai_error_body
from gateway.media.prompts import chat_prompt
from gateway.openapi import event_stream
from gateway.routes.generation import Completion as Answer
from gateway.routes.generation import (
    check_prompt_tokens,
    check_token_ids,
    complete_all,
    sse_response,
    start_each,
    streams,
)
from gateway.service import GatewayService
from gateway.structured.grammars import json_object_grammar, json_schema_grammar
from gateway.structured.tool_calls import call_id, calls_in, tools_grammar
from schemas.messages import FinishReason, TokenEvent
from schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    OpenAIError,
    Usage,
)
from schemas.openai_tools import FunctionCallDelta, ToolCallDelta

router = APIRouter(tags=["OpenAI-compatible"])

_STREAMED = "With `stream`: `data: {chunk}` events, then `data: [DONE]` (not JSON: the end of the stream)."


def _finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == FinishReason.LENGTH else "stop"


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _answers_usage(body: CompletionRequest | ChatCompletionRequest, answers: list[Answer]) -> Usage:
    """Each prompt's tokens once (its choices' first answer counts them), and every choice's generated tokens."""
    generated = 0 if body.scores_only else sum(len(done.token_ids) for done in answers)
    return _usage(sum(done.prompt_tokens for done in answers[:: body.n]), generated)


_SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i draws with seed + i x this: apart, and choice 0 as n=1 draws


async def _submit(connection: HTTPConnection, body: CompletionRequest | ChatCompletionRequest) -> list[InFlight]:
    """One request per choice (`n`) of each prompt, prompt-major as OpenAI orders the choices, each prompt's
    seeds derived from the request's as a request of that prompt alone derives them; a prompt's twins wait for
    the first's KV in a worker's prefix cache (workers/engine/scheduler.py)."""
    service: GatewayService = connection.app.state.gateway
    model = service.resolve(body.model)
    check_token_ids(model, body.stop_token_ids or (), field="stop_token_ids")
    check_token_ids(model, map(int, body.logit_bias or {}), field="logit_bias")
    grammar = _grammar(body)
    if isinstance(body, ChatCompletionRequest):
        prompt = await chat_prompt(body.messages, model, connection.app.state.media)
        if body.calls_tools != "none":
            prompt["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
            grammar = grammar or tools_grammar(body)
        prompts = [prompt]
    else:
        for index, token_ids in enumerate(body.prompts if not body.prompts_are_text else ()):
            check_prompt_tokens(model, token_ids, field=f"prompt item {index}" if len(body.prompts) > 1 else None)
        field = "prompt_text" if body.prompts_are_text else "prompt_token_ids"
        prompts = [{field: prompt} for prompt in body.prompts]
    sampling = body.sampling(service.draw_seed(), model.max_iter_times, grammar)

    def choice(which: int) -> Awaitable[InFlight]:
        prompt, nth = divmod(which, body.n)
        seeded = sampling.model_copy(update={"seed": (sampling.seed + nth * _SEED_STRIDE) % 2**64})
        return service.submit(model, seeded, priority=body.priority, **prompts[prompt])

    return await start_each(service, len(prompts) * body.n, choice)


def _grammar(body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """What response_format asks the text to match, as a grammar (gateway/structured/grammars.py)."""
    answer = body.response_format
    if answer is None or answer.type == "text":
        return None
    if answer.type == "json_object":
        return json_object_grammar("response_format")
    return json_schema_grammar(answer.json_schema.schema_, "response_format.json_schema.schema")


async def _chunks(
    connection: HTTPConnection,
    inflights: list[InFlight],
    render,
    body: CompletionRequest | ChatCompletionRequest,
    opening=None,
) -> AsyncIterator[dict]:
    """The choices' events as OpenAI chunks (`render(choice, event)` makes one; `render(None, None)` one without
    a choice), each choice's led by `opening(choice)` if given; usage as the body's stream_options ask. An
    error before the first event raises."""
    service: GatewayService = connection.app.state.gateway
    events = await streams(service, inflights, connection)

    async def chunks() -> AsyncIterator[dict]:
        prompt_tokens: dict[int, int] = {}  # prompt -> its tokens, as the first event of one of its choices says
        generated, opened = 0, set()

        def usage() -> dict:
            return _usage(sum(prompt_tokens.values()), generated).model_dump()

        def counted(chunk: dict) -> dict:
            if body.continuous_usage:
                chunk["usage"] = usage()
            return chunk

        async with aclosing(events):
            async for choice, event in events:
                if event.error is not None:
                    yield openai_error_body(event.error.status, event.error.error_type, event.error.message)
                    return
                if event.prompt_tokens:
                    prompt_tokens[choice // body.n] = event.prompt_tokens
                if opening is not None and choice not in opened:  # once the first event tells the prompt's length
                    opened.add(choice)
                    yield counted(opening(choice))
                generated += 0 if body.scores_only else len(event.token_ids)
                yield counted(render(choice, event))
        if body.include_usage:
            yield render(None, None) | {"choices": [], "usage": usage()}

    return chunks()


def _with_done(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """OpenAI's SSE: the chunks, then `data: [DONE]`."""

    async def objects() -> AsyncIterator[dict | str]:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
        yield "[DONE]"

    return sse_response(objects(), space=True)


class _CompletionText:
    """A completion's text and log-probabilities, events at a time; with echo its prompt comes first (and, for
    a scoring call, alone)."""

    def __init__(self, body: CompletionRequest, prompt: str | list[int]) -> None:
        self._body = body
        self._given = prompt if isinstance(prompt, str) else None  # the prompt's text as the client wrote it
        self._offset = 0  # where the next token starts in the choice's text
        self._started = False

    def of(self, events: list[TokenEvent]) -> tuple[str, CompletionLogprobs | None]:
        text, infos = "", []
        for event in events:
            if self._body.echo and not self._started:
                prompt = event.prompt or []
                text += self._given if self._given is not None else "".join(token.text for token in prompt)
                infos += prompt if self._body.logprobs is not None else []
            self._started = True
            if not self._body.scores_only:
                text += event.text
                infos += event.logprobs or []
        if self._body.logprobs is None:
            return text, None
        logprobs = CompletionLogprobs.of(infos, self._offset)
        self._offset += sum(len(token.text) for token in infos)
        return text, logprobs


def _answer_id(prefix: str) -> str:
    """`prefix-<request id>`: the answer's id names the request id that the gateway's and workers' lines carry."""
    return f"{prefix}-{current_request_id() or uuid.uuid4().hex}"


async def completion_chunks(connection: HTTPConnection, body: CompletionRequest) -> AsyncIterator[dict]:
    """A streamed completion's chunks (also what the WebSocket sends)."""
    inflights = await _submit(connection, body)
    completion_id, created = _answer_id("cmpl"), int(time.time())
    pieces = [_CompletionText(body, body.prompts[which // body.n]) for which in range(len(inflights))]

    def chunk(choice: int | None, event: TokenEvent | None) -> dict:
        choices = []
        if event is not None:
            text, logprobs = pieces[choice].of([event])
            finish = _finish_reason(event.finish_reason)
            choices.append(CompletionChoice(index=choice, text=text, logprobs=logprobs, finish_reason=finish))
        return Completion(id=completion_id, created=created, model=body.model, choices=choices).model_dump()

    return await _chunks(connection, inflights, chunk, body)


class _ChatDeltas:
    """A streamed chat answer's deltas, event by event: its content, or the calls a tool_choice forces (a named
    function's arguments as they come; `required` calls once their JSON is whole)."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        self._body = body
        self._text = ""  # of a `required` answer, until it is whole
        self._call_id: str | None = None  # of a named function's call, once announced

    def of(self, event: TokenEvent) -> tuple[Delta, str | None]:
        finish = _finish_reason(event.finish_reason)
        mode = self._body.calls_tools
        if mode == "named":
            announced, self._call_id = self._call_id is not None, self._call_id or call_id()
            name = None if announced else self._body.tool_choice.function.name
            call = ToolCallDelta(
                index=0,
                id=None if announced else self._call_id,
                type=None if announced else "function",
                function=FunctionCallDelta(name=name, arguments=event.text),
            )
            return Delta(tool_calls=[call]), "tool_calls" if finish == "stop" else finish
        if mode != "required":
            return Delta(content=event.text), finish
        self._text += event.text
        if finish is None:
            return Delta(), None
        content, calls = calls_in(self._body, self._text)
        if not calls:
            return Delta(content=content), finish
        deltas = [
            ToolCallDelta(
                index=i,
                id=c.id,
                type="function",
                function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments),
            )
            for i, c in enumerate(calls)
        ]
        return Delta(tool_calls=deltas), "tool_calls"


async def chat_chunks(connection: HTTPConnection, body: ChatCompletionRequest) -> AsyncIterator[dict]:
    """A streamed chat completion's chunks (also what the WebSocket sends): each choice's role first."""
    inflights = await _submit(connection, body)
    completion_id, created = _answer_id("chatcmpl"), int(time.time())
    deltas = [_ChatDeltas(body) for _ in inflights]

    def chunk(choice: int | None, event: TokenEvent | None, delta: Delta | None = None) -> dict:
        choices = []
        if choice is not None:
            finish = None
            if delta is None:
                delta, finish = deltas[choice].of(event)
            logprobs = ChatLogprobs.of(event.logprobs or []) if event and body.logprobs else None
            choices.append(ChatChunkChoice(index=choice, delta=delta, logprobs=logprobs, finish_reason=finish))
        return ChatCompletionChunk(id=completion_id, created=created, model=body.model, choices=choices).model_dump(
            exclude_none=True
        )

    def role(choice: int) -> dict:
        return chunk(choice, None, Delta(role="assistant", content=""))

    return await _chunks(connection, inflights, chunk, body, opening=role)


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={200: event_stream(Completion, _STREAMED, OpenAIError, end="[DONE]"), **OPENAI_ERRORS},
)
async def completions(body: CompletionRequest, request: Request):
    """Complete a prompt (OpenAI's legacy completions), at once or as a stream."""
    if body.stream:
        return _with_done(await completion_chunks(request, body))
    inflights = await _submit(request, body)
    completion_id, created = _answer_id("cmpl"), int(time.time())
    answers = await complete_all(request.app.state.gateway, inflights, request)
    choices = []
    for index, done in enumerate(answers):
        text, logprobs = _CompletionText(body, body.prompts[index // body.n]).of(done.events)
        finish = _finish_reason(done.finish_reason)
        choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish))
    usage = _answers_usage(body, answers)
    return Completion(id=completion_id, created=created, model=body.model, choices=choices, usage=usage)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        200: event_stream(ChatCompletionChunk, _STREAMED, OpenAIError, end="[DONE]"),
        **OPENAI_ERRORS,
    },
)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Answer a conversation, rendered with the model's chat template, at once or as a stream."""
    if body.stream:
        return _with_done(await chat_chunks(request, body))
    inflights = await _submit(request, body)
    completion_id, created = _answer_id("chatcmpl"), int(time.time())
    answers = await complete_all(request.app.state.gateway, inflights, request)
    choices = []
    for index, done in enumerate(answers):
        infos = [info for event in done.events for info in event.logprobs or ()]
        content, calls = calls_in(body, done.text)
        finish = _finish_reason(done.finish_reason)
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(content=content, tool_calls=calls or None),
                logprobs=ChatLogprobs.of(infos) if body.logprobs else None,
                finish_reason="tool_calls" if calls and finish == "stop" else finish,
            )
        )
    return ChatCompletion(
        id=completion_id, created=created, model=body.model, choices=choices, usage=_answers_usage(body, answers)
    )


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    """Every name a live worker serves, aliases and LoRA adapters included (an adapter with its `parent`)."""
    service: GatewayService = request.app.state.gateway
    created = int(time.time())
    cards = []
    for name in service.directory.served_names():
        model = service.directory.announced(name)
        if model.adapter is None:
            cards.append(ModelCard(id=name, created=created, root=model.name))
        else:
            cards.append(ModelCard(id=name, created=created, parent=model.name, root=model.adapters[model.adapter]))
    return ModelList(data=cards)
