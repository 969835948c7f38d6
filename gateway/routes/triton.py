"""Triton-compatible routes: generate, generate_stream, infer (token ids), stopInfer, metadata, model config.

infer speaks KServe v2 as Triton does, binary tensor data included
(gateway/bodies/kserve_binary.py), so that Triton's HTTP clients work with their
defaults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from importlib.metadata import version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import HTTPConnection

from gateway.bodies.kserve_binary import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    BinaryTensorRoute,
    binary_response,
    binary_tensor_data,
    input_ids,
    uint32_bytes,
)
from gateway.errors import GENERATION_ERRORS, ErrorBody, not_found
from gateway.media.prompts import multimodal_prompt
from gateway.openapi import event_stream
from gateway.routes.generation import complete, error_object, sse_response, start, stream
from gateway.service import GatewayService
from schemas.messages import TokenEvent
from schemas.triton import (
    GenerateRequest,
    GenerateResponse,
    GenerateStreamRequest,
    InferRequest,
    InferResponse,
    ModelConfig,
    ModelMetadata,
    ServerMetadata,
    StopInferRequest,
    StreamEvent,
)

router = APIRouter(tags=["Triton-compatible"])


def stream_event(client_id: str, model_name: str, event: TokenEvent, text: str, details: bool) -> dict:
    """One generate_stream event, keys in the order of MindIE's examples."""
    body: dict = {"id": client_id, "model_name": model_name, "model_version": None, "text_output": text}
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


async def stream_objects(
    connection: HTTPConnection, model_name: str, body: GenerateStreamRequest
) -> AsyncIterator[dict]:
    """Submit a generate_stream body and render its events (an ApiError raises before the first).

    `connection` is the HTTP request or the WebSocket it came over.
    """
    service: GatewayService = connection.app.state.gateway
    parameters = body.parameters
    inflight = await start(
        service,
        model_name,
        parameters,
        prompt=await multimodal_prompt(body.text_input, service.resolve(model_name), connection.app.state.media),
        tokens_before=parameters.tokens_before,
        client_id=body.id,
    )
    events = await stream(service, inflight, connection)

    async def render() -> AsyncIterator[dict]:
        so_far = ""
        async with aclosing(events):
            async for event in events:
                if event.error is not None:
                    yield error_object(event)
                    continue
                so_far += event.text
                text = so_far if service.settings.full_text else event.text
                yield stream_event(inflight.client_id, model_name, event, text, parameters.wants_details)

    return render()


@router.post("/v2/models/{model}/generate", response_model=GenerateResponse, responses=GENERATION_ERRORS)
async def generate(model: str, body: GenerateRequest, request: Request) -> JSONResponse:
    """Generate text for a prompt and answer with all of it at once."""
    service: GatewayService = request.app.state.gateway
    prompt = await multimodal_prompt(body.text_input, service.resolve(model), request.app.state.media)
    inflight = await start(service, model, body.parameters, prompt=prompt, client_id=body.id)
    done = await complete(service, inflight, request)
    answer: dict = {"id": inflight.client_id, "model_name": model, "model_version": None, "text_output": done.text}
    if body.parameters.wants_details:
        answer["details"] = {
            "finish_reason": done.finish_reason.value,
            "generated_tokens": done.generated_tokens,
            "first_token_cost": None,
            "decode_cost": None,
        }
    return JSONResponse(answer)


@router.post(
    "/v2/models/{model}/generate_stream",
    responses={200: event_stream(StreamEvent, "One `data:{...}` event per token.", ErrorBody), **GENERATION_ERRORS},
)
async def generate_stream(model: str, body: GenerateStreamRequest, request: Request) -> StreamingResponse:
    """Generate text for a prompt and stream it as server-sent events, `data:{...}` per token."""
    return sse_response(await stream_objects(request, model, body), space=False)


async def infer(model: str, body: InferRequest, request: Request) -> Response:
    """Generate from prompt token ids; answer with the generated token ids.

    With an `Inference-Header-Content-Length` header, the body is that many bytes of JSON followed by the
    binary data its input declares; an output asked for as binary data comes back the same way."""
    service: GatewayService = request.app.state.gateway
    prompt = input_ids(body, binary_tensor_data(request))
    inflight = await start(service, model, body.effective_parameters, token_ids=prompt, client_id=body.id)
    done = await complete(service, inflight, request)
    output = {"name": body.output.name, "shape": [1, len(done.token_ids)], "datatype": "UINT32"}
    if body.binary_output:
        data = uint32_bytes(done.token_ids)
        answer = {"id": inflight.client_id, "outputs": [{**output, "parameters": {"binary_data_size": len(data)}}]}
        return binary_response(answer, data)
    return JSONResponse({"id": inflight.client_id, "outputs": [{**output, "data": done.token_ids}]})


_BINARY_ANSWER = {
    "description": f"JSON; or, for outputs asked for as binary data, `{BINARY_CONTENT_TYPE}`: the JSON answer "
    f"(its length in the `{HEADER_LENGTH}` header) followed by the ids as little-endian UINT32.",
    "content": {BINARY_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
}
router.add_api_route(
    "/v2/models/{model}/infer",
    infer,
    methods=["POST"],
    response_model=InferResponse,
    responses={200: _BINARY_ANSWER, 400: {"model": ErrorBody}, **GENERATION_ERRORS},
    route_class_override=BinaryTensorRoute,
)


@router.post("/v2/models/{model}/stopInfer", response_model=StopInferRequest, responses=GENERATION_ERRORS)
async def stop_infer(model: str, body: StopInferRequest, request: Request) -> StopInferRequest:
    """Stop the running request with this id; its stream ends with finish_reason stop_sequence."""
    service: GatewayService = request.app.state.gateway
    if not await service.stop_requests(model, body.id):
        raise not_found(f"no request with id {body.id} is running for model {model}")
    return body


@router.get("/v2", response_model=ServerMetadata)
async def server_metadata() -> ServerMetadata:
    """The server's name, version and the extensions it serves (KServe v2)."""
    return ServerMetadata(version=version("tokenrelay"))


_MODEL_ERRORS = {404: {"model": ErrorBody}, 503: {"model": ErrorBody}}  # a model no worker announced


@router.get("/v2/models/{model}", response_model=ModelMetadata, responses=_MODEL_ERRORS)
async def model_metadata(model: str, request: Request) -> ModelMetadata:
    """The model's inputs and outputs (KServe v2): token ids in `input0`, token ids out of `output0`."""
    service: GatewayService = request.app.state.gateway
    service.directory.announced(model)
    return ModelMetadata(name=model)


@router.get("/v2/models/{model}/config", response_model=ModelConfig, responses=_MODEL_ERRORS)
async def model_config(model: str, request: Request) -> ModelConfig:
    """The model's configuration in Triton's shape (the model_configuration extension): input0 and output0."""
    service: GatewayService = request.app.state.gateway
    service.directory.announced(model)
    return ModelConfig(name=model)
