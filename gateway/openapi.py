"""The OpenAPI document: FastAPI's, plus the event models of the server-sent-event routes.

FastAPI documents JSON responses from their models; an event stream is
documented here as `text/event-stream` content whose schema describes one
event (OpenAPI 3.2's way, which schemathesis checks): its `data` is JSON
(`contentMediaType`) of the event's model, registered under components like
every other model, or of the error object that ends a failed stream. Two
corrections keep the document truthful: the OpenAI routes answer an invalid
body with 400 (documented), never with FastAPI's 422; and with API keys
configured, every route but the open ones requires a bearer token and may
answer 401.

The pages that show the document, /docs (Swagger UI) and /redoc, load their
scripts, styles and icon from this server (/docs-assets/, files of the
fastapi-offline package) instead of FastAPI's default CDN, so that they work
with no network: a gateway often runs where there is none. Nor do the scripts
fetch anything elsewhere once loaded: Swagger UI's validator badge (an image
from validator.swagger.io, given this server's address) is off, and ReDoc's
bundle is served without the address of Redocly's logo.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.staticfiles import NotModifiedResponse
from starlette.types import Scope

from gateway.access_log import LabelledMount

_EVENT_MODELS: list[type[BaseModel]] = []
_REF = "#/components/schemas/{model}"
DOCS_ASSETS = "/docs-assets"
FAVICON = f"{DOCS_ASSETS}/favicon.png"
_ASSETS = files("fastapi_offline") / "static"
_REDOC_BUNDLE = "redoc.standalone.js"
# ReDoc's side menu shows Redocly's logo from their CDN, and leaves it out when it fails to load (as it does with
# no network). The bundle served here has it fail at once, fetching nothing: an empty data: URL in its place.
_REDOC_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


def event_stream(event: type[BaseModel], description: str, error: type[BaseModel], end: str | None = None) -> dict:
    """A `responses` entry for a route that streams `event` objects as server-sent events.

    A stream that fails after its first event ends with one `error` object
    instead; `end` is a last `data` that is not JSON (OpenAI's `[DONE]`).
    """
    _EVENT_MODELS.extend((event, error))
    refs = [{"$ref": _REF.format(model=model.__name__)} for model in (event, error)]
    data: dict = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": refs}}
    if end is not None:
        data = {"anyOf": [{"const": end}, data]}
    schema = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"description": description, "content": {"text/event-stream": {"schema": schema}}}


def install(app: FastAPI, keys_required: Callable[[str], bool]) -> None:
    """`keys_required(path)`: whether that path needs an API key (never, without keys)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, definitions = models_json_schema(
                [(model, "serialization") for model in _EVENT_MODELS], ref_template=_REF
            )
            document.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
            _correct(document, keys_required)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
    _install_pages(app)


def _install_pages(app: FastAPI) -> None:
    """/docs and /redoc, with their assets served from the installed fastapi-offline package (the app is created
    with docs_url=None and redoc_url=None, which would otherwise serve FastAPI's CDN-loading pages)."""
    app.router.routes.append(LabelledMount(DOCS_ASSETS, app=_DocsAssets(directory=str(_ASSETS)), name="docs-assets"))

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{FAVICON}",
            swagger_ui_parameters={"validatorUrl": None},  # else a badge from validator.swagger.io, sent our address
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_ASSETS}/{_REDOC_BUNDLE}",
            redoc_favicon_url=f"{root}{FAVICON}",
            with_google_fonts=False,
        )


class _DocsAssets(StaticFiles):
    """fastapi-offline's files, ReDoc's bundle without the address of Redocly's logo."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if path != _REDOC_BUNDLE:
            return await super().get_response(path, scope)
        content, etag = _redoc_bundle()
        response = Response(content, media_type="text/javascript", headers={"etag": etag})
        if self.is_not_modified(response.headers, Headers(scope=scope)):  # as StaticFiles answers a file it has
            return NotModifiedResponse(response.headers)
        return response


@functools.cache
def _redoc_bundle() -> tuple[bytes, str]:
    """ReDoc's bundle as served, and its ETag."""
    content = (_ASSETS / _REDOC_BUNDLE).read_bytes().replace(_REDOC_LOGO, b"data:,")
    return content, f'"{hashlib.sha256(content).hexdigest()[:32]}"'


def _root(request: Request) -> str:
    """The prefix the app is served under, behind a proxy that serves it under one ("" otherwise)."""
    return request.scope.get("root_path", "").rstrip("/")


def _correct(document: dict, keys_required: Callable[[str], bool]) -> None:
    secured = False
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if path.startswith("/v1/"):
                responses.pop("422", None)
            if keys_required(path):
                secured = True
                operation["security"] = [{"bearer": []}]
                error = "OpenAIError" if path.startswith("/v1/") else "ErrorBody"
                responses["401"] = {
                    "description": "No valid API key",
                    "content": {"application/json": {"schema": {"$ref": _REF.format(model=error)}}},
                }
    if secured:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
