"""Errors as the contract shapes them: `{"error": ..., "error_type": ...}` with its status."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

VALIDATION_ERROR = "Input Validation Error"


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


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body.model_dump(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message = "; ".join(describe_validation_error(e) for e in error.errors())
        return JSONResponse(ErrorBody(error=message, error_type=VALIDATION_ERROR).model_dump(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = "NotFoundError" if error.status_code == 404 else "HTTPError"
        return JSONResponse(
            ErrorBody(error=str(error.detail), error_type=error_type).model_dump(), status_code=error.status_code
        )
