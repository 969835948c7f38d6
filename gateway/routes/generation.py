"""What every generation route does, whatever its format: check, submit, collect or stream.

Routes differ only in their bodies and how they render tokens; this module
turns a validated body into a published request (`start`) and its events into
either one `Completion` or a stream whose first event has been seen, so that
errors known before the first token keep their HTTP status.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi.responses import StreamingResponse
from starlette.requests import HTTPConnection, Request

from gateway.dispatch.inflight import InFlight
from gateway.errors import ApiError
from gateway.service import GatewayService
from gateway.structured.grammars import grammar_parameter
from schemas.messages import GENERATION_ERROR, FinishReason, SamplingParams, ServedModel, TokenEvent
from schemas.parameters import RouteParameters

CLIENT_CLOSED_REQUEST = "Client Closed Request"  # 499, as nginx calls it: nobody reads the answer
# The sampling of a request that draws no token (tokenize, detokenize, embed): a request must say one.
NOTHING_DRAWN = SamplingParams(seed=0)
DISCONNECT_POLL_S = 0.1  # how often a request waiting for its worker checks that its client is still there

T = TypeVar("T")


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    generated_tokens: int  # EOS included, and tokens generated before a recomputation
    prompt_tokens: int  # as the worker counted them (0 if it never said)
    events: list[TokenEvent]  # every event, in order


def _error(event: TokenEvent) -> ApiError:
    assert event.error is not None
    return ApiError(event.error.status, event.error.error_type, event.error.message)


def check_token_ids(model: ServedModel, token_ids: Iterable[int], field: str | None = None) -> None:
    """424 for a token id outside the model's vocabulary, wherever the body carries it (a prompt, stop_token_ids,
    logit_bias's keys); the message names the body's `field` that holds the ids, where one is given. A sampler
    that indexed past the vocabulary would trip a device-side assert on CUDA, which poisons the worker for every
    later request (workers/engine/sampler.py drops such ids too)."""
    named = f"{field}: " if field else ""
    outside = next((t for t in token_ids if not 0 <= t < model.vocab_size), None)
    if outside is not None:
        message = f"{named}token id {outside} is outside the vocabulary [0, {model.vocab_size})"
        raise ApiError(424, GENERATION_ERROR, message)


def check_prompt_tokens(model: ServedModel, token_ids: list[int], field: str | None = None) -> None:
    """424 for a token prompt the model cannot take, as a worker would answer, without asking one; the message
    names the body's `field` that holds the ids, where one is given."""
    check_token_ids(model, token_ids, field)
    named = f"{field}: " if field else ""
    if len(token_ids) > model.max_input_len:
        raise ApiError(
            424,
            GENERATION_ERROR,
            f"{named}the prompt has {len(token_ids)} tokens; at most {model.max_input_len} are allowed",
        )


async def start(
    service: GatewayService,
    model_name: str,
    parameters: RouteParameters,
    *,
    prompt: dict | None = None,
    token_ids: list[int] | None = None,
    tokens_before: int = 0,
    client_id: str | None = None,
    truncate: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> InFlight:
    """Resolve the model, check the prompt, publish the request (asking for these log-probabilities, if any).

    `prompt`: the prompt fields gateway/media/prompts.py makes, or `token_ids`."""
    grammar = grammar_parameter(parameters.given("grammar"))
    model = service.resolve(model_name)
    if token_ids is not None:
        check_prompt_tokens(model, token_ids)
    sampling = parameters.sampling(seed=service.draw_seed())
    return await service.submit(
        model,
        sampling.model_copy(update={"logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "grammar": grammar}),
        **(prompt or {}),
        prompt_token_ids=token_ids,
        priority=parameters.given("priority"),
        timeout_s=parameters.given("timeout"),
        tokens_before=tokens_before,
        client_id=client_id,
        truncate=truncate,
    )


async def complete(service: GatewayService, inflight: InFlight, connection: HTTPConnection) -> Completion:
    """Every event of the request, as one answer; an error event raises ApiError."""
    token_ids: list[int] = []
    pieces: list[str] = []
    events: list[TokenEvent] = []
    last: TokenEvent | None = None
    prompt_tokens = 0

    async def collect() -> None:
        nonlocal last, prompt_tokens
        async for event in inflight.events():
            if event.error is not None:
                raise _error(event)
            prompt_tokens = event.prompt_tokens or prompt_tokens
            events.append(event)
            token_ids.extend(event.token_ids)
            pieces.append(event.text)
            last = event

    try:
        await _unless_gone(collect(), connection)
    finally:
        service.finish(inflight)
    assert last is not None and last.finish_reason is not None
    generated = last.index + len(last.token_ids)
    return Completion(token_ids, "".join(pieces), last.finish_reason, generated, prompt_tokens, events)


async def _unless_gone(awaitable: Awaitable[T], connection: HTTPConnection) -> T:
    """Await `awaitable`, unless the HTTP client disconnects first (then raise ApiError 499).

    A WebSocket's streams are cancelled by the socket's own handler instead.
    """
    if not isinstance(connection, Request):
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await connection.is_disconnected():
                raise ApiError(499, CLIENT_CLOSED_REQUEST, "the client closed the connection")
        return task.result()
    finally:
        task.cancel()


def sse(obj: dict, space: bool) -> str:
    """One server-sent event: `data: {...}` on the native routes, `data:{...}` on the Triton ones."""
    return ("data: " if space else "data:") + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def sse_response(objects: AsyncIterator[dict | str], space: bool) -> StreamingResponse:
    """Stream objects as server-sent events; closing them (the client left) tells the worker to stop."""

    async def frames() -> AsyncIterator[str]:
        async with aclosing(objects):
            async for obj in objects:
                yield f"data: {obj}\n\n" if isinstance(obj, str) else sse(obj, space)

    return StreamingResponse(frames(), media_type="text/event-stream")


def error_object(event: TokenEvent) -> dict:
    """The last object of a stream that failed after it started."""
    assert event.error is not None
    return {"error": event.error.message, "error_type": event.error.error_type}


async def start_each(
    service: GatewayService, count: int, start_one: Callable[[int], Awaitable[InFlight]]
) -> list[InFlight]:
    """`count` requests (OpenAI's `n` choices, TGI's best_of), started in turn by `start_one(which)`; if one
    cannot start, those started already end."""
    inflights: list[InFlight] = []
    try:
        for which in range(count):
            inflights.append(await start_one(which))
    except BaseException:
        for inflight in inflights:
            service.finish(inflight)
        raise
    return inflights


async def streams(
    service: GatewayService, inflights: list[InFlight], connection: HTTPConnection
) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of several requests (OpenAI's `n` choices) as (which, event), as they come.

    An error as any one's first event raises here, and ends the others. The
    iterator ends when every request has; closing it ends those still running.
    """
    opened: list[AsyncIterator[TokenEvent]] = []
    try:
        for inflight in inflights:
            opened.append(await stream(service, inflight, connection))
    except BaseException:
        for inflight in inflights:
            service.finish(inflight)
        raise

    async def merged() -> AsyncIterator[tuple[int, TokenEvent]]:
        arrived: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()

        async def pump(which: int, events: AsyncIterator[TokenEvent]) -> None:
            try:
                async with aclosing(events):
                    async for event in events:
                        arrived.put_nowait((which, event))
            finally:
                arrived.put_nowait((which, None))

        pumps = [asyncio.create_task(pump(which, events)) for which, events in enumerate(opened)]
        try:
            running = len(pumps)
            while running:
                which, event = await arrived.get()
                if event is None:
                    running -= 1
                else:
                    yield which, event
        finally:
            for task in pumps:
                task.cancel()

    return merged()


async def complete_all(
    service: GatewayService, inflights: list[InFlight], connection: HTTPConnection
) -> list[Completion]:
    """Every request's answer (OpenAI's `n` choices); an error in any ends the others and raises."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(complete(service, inflight, connection)) for inflight in inflights]
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


async def stream(service: GatewayService, inflight: InFlight, connection: HTTPConnection) -> AsyncIterator[TokenEvent]:
    """The request's events, once the first has arrived.

    An error as the first event raises ApiError here; a later one is yielded
    as the stream's last event, for the route to render. A client that leaves
    before the first event, or closes the iterator early, cancels the request
    on its worker.
    """
    events = inflight.events()
    try:
        first = await _unless_gone(anext(events), connection)
    except BaseException:
        service.finish(inflight)
        raise
    if first.error is not None:
        service.finish(inflight)
        raise _error(first)

    async def rest() -> AsyncIterator[TokenEvent]:
        try:
            yield first
            async with aclosing(events):
                async for event in events:
                    yield event
        finally:
            service.finish(inflight)

    return rest()
