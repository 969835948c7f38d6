"""Errors as the contract shapes them: `{"error": ..., "error_type": ...}` with its status.

On the OpenAI-compatible routes (/v1/...) the same errors take OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, and a body that does not
validate is a 400 there, as OpenAI answers it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

VALIDATION_ERROR = "Input Validation Error"
PAYLOAD_TOO_LARGE = "Payload Too Large"
_UNPARSABLE = "There was an error parsing the body"  # FastAPI's 400 for a body json.loads cannot even read


class ErrorBody(BaseModel):
    error: str
    error_type: str


class ApiError(Exception):
    """Raised anywhere in a request's handling; answered with its status and body."""

    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(error=message, error_type=error_type)
        self.headers = headers


def not_found(message: str) -> ApiError:
    return ApiError(404, "NotFoundError", message)


def unavailable(message: str) -> ApiError:
    return ApiError(503, "Service Unavailable", message)


def unprocessable(message: str) -> ApiError:
    return ApiError(422, VALIDATION_ERROR, message)


def describe_validation_error(error: dict) -> str:
    """One pydantic error as a sentence naming the field, the value and what is allowed."""
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    field = ".".join(location) or "body"
    if error.get("type") == "json_invalid":
        return f"the body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}"
    if error.get("type") == "missing":
        return f"{field} is required"
    if error.get("type") == "extra_forbidden":
        return f"{field} is not a known field"
    if error.get("type") == "value_error":  # a model's own check: its message says it all
        reason = str(error.get("ctx", {}).get("error", error.get("msg")))
        return f"{field}: {reason}" if location else reason
    received = error.get("input")
    shown = repr(received) if not isinstance(received, (dict, list)) else type(received).__name__
    if isinstance(received, str) and len(received) > 64:
        shown = f"a string of {len(received)} characters"
    return f"{field}: {error.get('msg', 'invalid')}; received {shown}"


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def openai_error_body(status: int, error_type: str, message: str) -> dict:
    """An error in OpenAI's shape; `code` keeps the contract's error_type."""
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": error_type}}


def error_response(path: str, status: int, error_type: str, message: str, headers=None) -> JSONResponse:
    """The error in the shape of the route at `path`."""
    if path.startswith("/v1/"):
        status = 400 if status == 422 else status
        return JSONResponse(openai_error_body(status, error_type, message), status_code=status, headers=headers)
    body = ErrorBody(error=message, error_type=error_type).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def _answer(request: Request, status: int, error_type: str, message: str, headers=None) -> JSONResponse:
    return error_response(request.url.path, status, error_type, message, headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return _answer(request, error.status, error.body.error_type, error.body.error, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message = "; ".join(describe_validation_error(e) for e in error.errors())
        return _answer(request, 422, VALIDATION_ERROR, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 400 and error.detail == _UNPARSABLE:  # not UTF-8: malformed, as the contract says
            return _answer(request, 422, VALIDATION_ERROR, "the body is not valid JSON: it is not UTF-8 text")
        error_type = "NotFoundError" if error.status_code == 404 else "HTTPError"
        return _answer(request, error.status_code, error_type, str(error.detail))
