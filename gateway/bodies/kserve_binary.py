"""KServe v2's binary tensor data extension on /v2/models/{model}/infer, as Triton serves it.

Triton's clients (tritonclient.http among them) send and ask for tensors as
raw bytes by default: a body whose first `Inference-Header-Content-Length`
bytes are the JSON request, followed by the data of each input that declares
`parameters.binary_data_size`, in input order (the ids as little-endian
UINT32, 4 bytes each). An answer's output asked for with `binary_data` is
sent the same way: the JSON answer (`parameters.binary_data_size` in place of
`data`), then its bytes, with that header and `Content-Type:
application/octet-stream`.

The route's body stays the JSON request (so that FastAPI validates and
documents it as any other): `BinaryTensorRoute` cuts the binary data off
before FastAPI reads the body, and the route reads it back from the
request's state. What does not add up (a header length past the body, sizes
that do not match the bytes sent, bytes no input declares) is a 400 that
says so, as Triton answers it.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from gateway.bodies.request_body import replay
from gateway.errors import VALIDATION_ERROR, ApiError
from schemas.triton import UINT32_BYTES, InferRequest, shape_problem

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"


def _bad_request(message: str) -> ApiError:
    return ApiError(400, VALIDATION_ERROR, message)


def _header_length(declared: str, body_length: int) -> int:
    """The JSON header's length in bytes, as the header declares it; a 400 when it cannot be that."""
    if re.fullmatch("[0-9]+", declared) is None:  # str.isdigit() takes "²", which int() does not
        raise _bad_request(f"the {HEADER_LENGTH} header must be a number of bytes; received {declared!r}")
    length = int(declared)
    if length > body_length:
        raise _bad_request(
            f"the {HEADER_LENGTH} header says the JSON header has {length} bytes; the body has only {body_length}"
        )
    return length


class BinaryTensorRoute(APIRoute):
    """A route whose body may be a JSON header followed by binary tensor data (request.state.binary_tensor_data)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle_json = super().get_route_handler()

        async def handle(request: Request) -> Response:
            declared = request.headers.get(HEADER_LENGTH)
            if declared is None:
                return await handle_json(request)
            body = await request.body()
            length = _header_length(declared, len(body))
            request.state.binary_tensor_data = body[length:]
            return await handle_json(Request(request.scope, replay(body[:length], request.receive)))

        return handle


def binary_tensor_data(request: Request) -> bytes | None:
    """The bytes after the JSON header; None when the request had no such header."""
    return getattr(request.state, "binary_tensor_data", None)


def input_ids(body: InferRequest, binary: bytes | None) -> list[int]:
    """The prompt's ids: the input's data, or its binary data; a 400 when the binary data does not fit."""
    tensor = body.inputs[0]
    size = tensor.binary_data_size
    sent = len(binary or b"")
    if size is None:
        if sent:
            raise _bad_request(f"{sent} bytes of binary data follow the JSON header, but no input declares them")
        return tensor.data
    field = "inputs.0.parameters.binary_data_size"
    if binary is None:
        raise _bad_request(f"{field} is set, but the request has no {HEADER_LENGTH} header (and no binary data)")
    if size % UINT32_BYTES:
        raise _bad_request(f"{field} {size} is not a multiple of {UINT32_BYTES}, the bytes of one UINT32 id")
    if size != sent:
        raise _bad_request(f"{field} is {size}, but {sent} bytes of binary data follow the JSON header")
    ids = struct.unpack(f"<{size // UINT32_BYTES}I", binary)
    problem = shape_problem(tensor.shape, len(ids), data="binary data")
    if problem is not None:
        raise _bad_request(f"inputs.0: {problem}")
    return list(ids)


def uint32_bytes(ids: list[int]) -> bytes:
    """Ids as little-endian UINT32 bytes, as binary tensor data carries them."""
    return struct.pack(f"<{len(ids)}I", *ids)


def binary_response(answer: dict, data: bytes) -> Response:
    """The JSON answer (which says each output's binary_data_size) followed by the outputs' bytes."""
    header = json.dumps(answer, separators=(",", ":")).encode()
    return Response(header + data, media_type=BINARY_CONTENT_TYPE, headers={HEADER_LENGTH: str(len(header))})
