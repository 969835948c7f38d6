"""Errors as the contract shapes them: `{"error": ..., "error_type": ...}` with its status.

On the OpenAI-compatible routes (/v1/...) the same errors take OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, and a body that does not
validate is a 400 there, as OpenAI answers it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from schemas.openai import OpenAIError
from schemas.placement import as_named, discriminator_values, dotted, where_it_belongs

VALIDATION_ERROR = "Input Validation Error"
PAYLOAD_TOO_LARGE = "Payload Too Large"
METHOD_NOT_ALLOWED = "Method Not Allowed"
_UNPARSABLE = "There was an error parsing the body"  # FastAPI's 400 for a body json.loads cannot even read


class ErrorBody(BaseModel):
    error: str
    error_type: str


# What a generation route (MindIE, Triton, TGI) may answer besides its 200, for the OpenAPI document.
GENERATION_ERRORS = {status: {"model": ErrorBody} for status in (404, 413, 422, 424, 429, 500, 503, 504)}
# And an OpenAI-compatible one (/v1/...), in OpenAI's shape.
OPENAI_ERRORS = {status: {"model": OpenAIError} for status in (400, 404, 413, 424, 429, 500, 503, 504)}


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


def _location(error: dict) -> tuple[str | int, ...]:
    """Where in the body the error is: its pydantic location less FastAPI's leading "body"."""
    location = tuple(error.get("loc", ()))
    return location[1:] if location[:1] == ("body",) else location


def offending_field(error: dict, body_type: Any = None) -> str | None:
    """The dotted name of the field a pydantic error is about ("messages.0.role"); None for the body as a whole.

    `body_type`, the type the body was validated as, leaves out the union members' tags pydantic adds."""
    if error.get("type") == "json_invalid":  # its location is a position in the text, not a field
        return None
    location = _location(error)
    return dotted(as_named(body_type, location) if body_type is not None else location) or None


def describe_validation_error(error: dict, body_type: Any = None) -> str:
    """One pydantic error as a sentence naming the field, the value and what is allowed.

    `body_type`, the type the body was validated as, lets a misplaced field's error say where it belongs.
    """
    location = _location(error)
    field = dotted(as_named(body_type, location) if body_type is not None else location) or "body"
    context = error.get("ctx", {})
    if error.get("type") == "json_invalid":
        return f"the body is not valid JSON: {context.get('error', error.get('msg'))}"
    if error.get("type") == "missing":
        return f"{field} is required"
    if error.get("type") == "extra_forbidden":
        place = where_it_belongs(body_type, location, error.get("input")) if body_type is not None else None
        return f"{field} is not a known field here; it belongs {place}" if place else f"{field} is not a known field"
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # a discriminated union: say its values
        discriminator = context["discriminator"].strip("'")
        name = f"{field}.{discriminator}" if location else discriminator
        if error["type"] == "union_tag_invalid":
            return f"{name} {context['tag']!r} is not one of {context['expected_tags']}"
        values = discriminator_values(body_type, location, discriminator) if body_type is not None else []
        return f"{name} is required" + (f": one of {', '.join(map(repr, values))}" if values else "")
    if error.get("type") == "value_error":  # a model's own check: its message says it all
        reason = str(context.get("error", error.get("msg")))
        return f"{field}: {reason}" if location else reason
    received = error.get("input")
    shown = repr(received) if not isinstance(received, (dict, list)) else type(received).__name__
    if isinstance(received, str) and len(received) > 64:
        shown = f"a string of {len(received)} characters"
    return f"{field}: {error.get('msg', 'invalid')}; received {shown}"


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def openai_error_body(status: int, error_type: str, message: str, param: str | None = None) -> dict:
    """An error in OpenAI's shape; `code` keeps the contract's error_type, `param` names the offending field."""
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": error_type}}


def error_response(
    path: str, status: int, error_type: str, message: str, headers=None, param: str | None = None
) -> JSONResponse:
    """The error in the shape of the route at `path` (`param` is for OpenAI's shape only: the contract's has none)."""
    if path.startswith("/v1/"):
        status = 400 if status == 422 else status
        body = openai_error_body(status, error_type, message, param)
        return JSONResponse(body, status_code=status, headers=headers)
    body = ErrorBody(error=message, error_type=error_type).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def _answer(request: Request, status: int, error_type: str, message: str, headers=None, param=None) -> JSONResponse:
    return error_response(request.url.path, status, error_type, message, headers, param)


def _body_type(request: Request) -> Any:
    """The type the matched route validates its body as; None without one."""
    body_field = getattr(request.scope.get("route"), "body_field", None)
    return body_field.field_info.annotation if body_field is not None else None


def _no_route(request: Request) -> str:
    """A 404 for a path no route serves; one that ends in a slash says whether the path without it is served."""
    path = request.url.path
    message = f"nothing is served at {path}"
    if path.endswith("/") and path != "/":
        trimmed = {**request.scope, "path": path.rstrip("/")}
        if any(route.matches(trimmed)[0] is not Match.NONE for route in request.app.router.routes):
            message += f"; the path is {path.rstrip('/')}, without the trailing slash"
    return message


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return _answer(request, error.status, error.body.error_type, error.body.error, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        errors, body_type = error.errors(), _body_type(request)
        message = "; ".join(describe_validation_error(e, body_type) for e in errors)
        param = offending_field(errors[0], body_type) if errors else None
        return _answer(request, 422, VALIDATION_ERROR, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 400 and error.detail == _UNPARSABLE:  # not UTF-8: malformed, as the contract says
            return _answer(request, 422, VALIDATION_ERROR, "the body is not valid JSON: it is not UTF-8 text")
        if error.status_code == 405:  # from routing, with the route's methods in Allow
            methods = set(error.headers["Allow"].split(", "))
            if "GET" in methods:
                methods.add("HEAD")  # answered wherever GET is (gateway/app.py: HeadAsGet)
            allowed = ", ".join(sorted(methods))
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {allowed}"
            return _answer(request, 405, METHOD_NOT_ALLOWED, message, {**error.headers, "Allow": allowed})
        if error.status_code == 404 and request.scope.get("route") is None:  # no route matched the path
            return _answer(request, 404, "NotFoundError", _no_route(request))
        error_type = "NotFoundError" if error.status_code == 404 else "HTTPError"
        return _answer(request, error.status_code, error_type, str(error.detail), error.headers)
