"""TGI-compatible routes: POST /generate, POST /generate_stream, and POST / (TGI's: either, by `stream`).

They serve the default model (`--default-model`, or the only one served), as
TGI serves its one model. `huggingface_hub.InferenceClient(base_url)` posts
to `/`. A stream's events each carry one token; the last also carries
`generated_text` and, when asked, `details`. A last event without a token of
its own (the request was stopped) carries an empty special token with id -1.
TGI's POST /tokenize shares its path with vLLM's: gateway/routes/tokenize.py
serves both, told apart by the body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import HTTPConnection

from gateway.dispatch.inflight import InFlight
from gateway.errors import GENERATION_ERRORS, ErrorBody, unprocessable
from gateway.media.prompts import tgi_prompt
from gateway.openapi import event_stream
from gateway.routes.generation import Completion, complete_all, error_object, sse_response, start, start_each, stream
from gateway.service import GatewayService
from schemas.messages import FinishReason, TokenEvent
from schemas.tgi import TgiRequest, TgiResponse, TgiStreamEvent

router = APIRouter(tags=["TGI-compatible"])

_NO_TOKEN = {"id": -1, "text": "", "logprob": None, "special": True}


def _finish(reason: FinishReason) -> str:
    return {FinishReason.EOS_TOKEN: "eos_token", FinishReason.STOP_SEQUENCE: "stop_sequence"}.get(reason, "length")


def _tokens(event: TokenEvent) -> list[dict]:
    """One TGI token per generated token; a multi-token event's text goes with its last token."""
    special = event.finish_reason == FinishReason.EOS_TOKEN
    last = len(event.token_ids) - 1
    logprobs = event.logprobs or [None] * len(event.token_ids)
    return [
        {
            "id": t,
            "text": event.text if i == last else "",
            "logprob": info and info.logprob,
            "special": special and i == last,
        }
        for i, (t, info) in enumerate(zip(event.token_ids, logprobs, strict=True))
    ]


def _top_tokens(event: TokenEvent) -> list[list[dict]]:
    """Per generated token, the likeliest tokens at its position (TGI's top_tokens)."""
    return [
        [{"id": top.id, "text": top.text, "logprob": top.logprob, "special": False} for top in info.top]
        for info in event.logprobs or ()
    ]


async def _submit(connection: HTTPConnection, body: TgiRequest, streaming: bool) -> InFlight:
    service: GatewayService = connection.app.state.gateway
    parameters = body.parameters
    model = parameters.adapter_id or service.default_model_name()
    return await start(
        service,
        model,
        parameters,
        prompt=await tgi_prompt(body.inputs, service.resolve(model), connection.app.state.media),
        truncate=parameters.truncate,
        # Token details carry log-probabilities: a stream's every token, the details' tokens, and best_of ranks by them.
        logprobs=(parameters.top_n_tokens or 0) if streaming or parameters.details or parameters.best_of else None,
        prompt_logprobs=0 if parameters.decoder_input_details else None,
    )


def _seed(inflight: InFlight) -> int | None:
    sampling = inflight.request.sampling
    return sampling.seed if sampling.do_sample else None


async def stream_objects(connection: HTTPConnection, body: TgiRequest) -> AsyncIterator[dict]:
    """Submit the body and render its events as stream objects (an ApiError raises before the first)."""
    if body.parameters.decoder_input_details:
        raise unprocessable("parameters.decoder_input_details cannot be used with a stream")
    if (body.parameters.best_of or 1) > 1:
        raise unprocessable("parameters.best_of > 1 cannot be used with a stream")
    service: GatewayService = connection.app.state.gateway
    inflight = await _submit(connection, body, streaming=True)
    events = await stream(service, inflight, connection)
    prefix = body.inputs if body.parameters.return_full_text else ""

    async def render() -> AsyncIterator[dict]:
        text = prefix
        async for event in events:
            if event.error is not None:
                yield error_object(event)
                break
            text += event.text
            tokens = _tokens(event) or [_NO_TOKEN]
            tops = _top_tokens(event) if body.parameters.top_n_tokens else []
            for i, token in enumerate(tokens):
                out: dict = {"token": token, "generated_text": None, "details": None}
                if i < len(tops):
                    out["top_tokens"] = tops[i]
                if event.finish_reason is not None and i == len(tokens) - 1:
                    out["generated_text"] = text
                    if body.parameters.details:
                        generated = event.index + len(event.token_ids)
                        out["details"] = {
                            "finish_reason": _finish(event.finish_reason),
                            "generated_tokens": generated,
                            "seed": _seed(inflight),
                        }
                yield out

    return render()


@router.post(
    "/generate",
    response_model=TgiResponse,
    responses={
        200: event_stream(TgiStreamEvent, "With `stream`: as /generate_stream.", ErrorBody),
        **GENERATION_ERRORS,
    },
)
async def generate(body: TgiRequest, request: Request):
    """Generate text for `inputs` and answer with all of it (or stream it, with `stream`)."""
    if body.stream:
        return sse_response(await stream_objects(request, body), space=False)
    service: GatewayService = request.app.state.gateway
    # Each of best_of's sequences draws its own seed.
    inflights = await start_each(
        service, body.parameters.best_of or 1, lambda _: _submit(request, body, streaming=False)
    )
    answers = await complete_all(service, inflights, request)
    # best_of: the likeliest sequence wins (highest sum of its tokens' log-probabilities), as in TGI.
    ranked = sorted(zip(answers, inflights, strict=True), key=lambda pair: -_total_logprob(pair[0]))
    (done, inflight), others = ranked[0], ranked[1:]
    answer: dict = {"generated_text": _full_text(body, done)}
    if body.parameters.details:
        answer["details"] = _details(body, done, inflight) | {"prompt_tokens": done.prompt_tokens}
        if others:
            answer["details"]["best_of_sequences"] = [
                {"generated_text": _full_text(body, other)} | _details(body, other, other_inflight)
                for other, other_inflight in others
            ]
    return JSONResponse(answer)


def _full_text(body: TgiRequest, done: Completion) -> str:
    return (body.inputs if body.parameters.return_full_text else "") + done.text


def _total_logprob(done: Completion) -> float:
    return sum(info.logprob for event in done.events for info in event.logprobs or ())


def _details(body: TgiRequest, done: Completion, inflight: InFlight) -> dict:
    first = done.events[0] if done.events else None
    details = {
        "finish_reason": _finish(done.finish_reason),
        "generated_tokens": done.generated_tokens,
        "seed": _seed(inflight),
        "prefill": [{"id": t.id, "text": t.text, "logprob": t.logprob} for t in (first.prompt or [])] if first else [],
        "tokens": [token for event in done.events for token in _tokens(event)],
    }
    if body.parameters.top_n_tokens:
        details["top_tokens"] = [top for event in done.events for top in _top_tokens(event)]
    return details


router.post(
    "/",
    response_model=TgiResponse,
    responses={
        200: event_stream(TgiStreamEvent, "With `stream`: as /generate_stream.", ErrorBody),
        **GENERATION_ERRORS,
    },
    summary="Generate (TGI's root route)",
)(generate)


@router.post(
    "/generate_stream",
    responses={200: event_stream(TgiStreamEvent, "One `data:{...}` event per token.", ErrorBody), **GENERATION_ERRORS},
)
async def generate_stream(body: TgiRequest, request: Request) -> StreamingResponse:
    """Generate text for `inputs` and stream it as server-sent events, one token per event."""
    return sse_response(await stream_objects(request, body), space=False)
