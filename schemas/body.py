"""Request bodies: the model every HTTP and WebSocket body is made of, and the fields a body ignores.

A field no document lists is accepted and ignored, but never silently
(../shared/spec/API.md, "Parameters and their ranges", revised 2026-12-05):
MindIE's own server, vLLM and TGI pass over keys they do not read, and the
clients MindIE users run send such keys as a matter of course (AISBench's
stock configurations put `generation_kwargs` in `parameters`). So every
body's models derive from `Body`: pydantic ignores a field the model does
not name, and the model keeps it, by name, for `ignored_fields` to find
with its place in the body (`parameters.foo`, `messages.1.bar`). The fields
a body does read are validated as strictly as ever.

Which body is a request's: the first `Body` validated outside another one
while `reading_body` is in effect, which the gateway sets around each HTTP
request and each WebSocket message (gateway/bodies/ignored_fields.py). FastAPI
validates a route's body before its handler runs, so models the handler
builds later are not taken for it. With `reject` (the server's
--reject-unknown-fields) an ignored field is refused instead, as every body
did before the revision: the error is pydantic's own `extra_forbidden` at
the field's place, so a misplaced field's 422 still says where it belongs
(schemas/placement.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from schemas.placement import Location, models_of


@dataclass
class BodyReading:
    """What validating one request's body found."""

    reject: bool  # refuse an unknown field (422) rather than ignore it
    ignored: dict[Location, Any] | None = None  # the unknown fields by place, with their values; None: no body yet


_reading: ContextVar[BodyReading | None] = ContextVar("body_reading", default=None)
_depth: ContextVar[int] = ContextVar("body_depth", default=0)  # bodies being validated around the current one


@contextmanager
def reading_body(reject: bool) -> Iterator[BodyReading]:
    """While in effect, the first body validated outside another is read into the reading yielded."""
    reading = BodyReading(reject)
    token = _reading.set(reading)
    try:
        yield reading
    finally:
        _reading.reset(token)


class Body(BaseModel):
    """A request body or a part of one: a field it does not name is ignored and kept by name."""

    # NaN and ±Infinity (which Python's json reads) are no numbers.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    _unknown: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_unknown_fields(cls, data: Any, handler) -> Body:
        depth = _depth.get()
        token = _depth.set(depth + 1)
        try:
            model = handler(data)
        finally:
            _depth.reset(token)
        if isinstance(data, dict):  # not an instance given as it is
            model._unknown = {name: value for name, value in data.items() if name not in _field_names(cls)}
        if depth == 0:
            _read(model)
        return model


@cache
def _field_names(model: type[Body]) -> frozenset[str]:
    """The names a body uses for the model's fields (an alias where one is set)."""
    return frozenset(info.alias or name for name, info in model.model_fields.items())


@cache
def _nesting_fields(model: type[Body]) -> tuple[tuple[str, str], ...]:
    """(attribute, name in the body) of the model's fields that can hold bodies' parts: the ones to walk."""
    return tuple(
        (name, info.alias or name)
        for name, info in model.model_fields.items()
        if any(issubclass(inner, Body) for inner in models_of(info.annotation))
    )


def ignored_fields(value: Any, location: Location = ()) -> dict[Location, Any]:
    """The fields a validated body (or any value holding bodies) ignored, by place, with the values given."""
    found: dict[Location, Any] = {}
    if isinstance(value, Body):
        found |= {(*location, name): given for name, given in value._unknown.items()}
        for attribute, name in _nesting_fields(type(value)):
            found |= ignored_fields(getattr(value, attribute), (*location, name))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found |= ignored_fields(item, (*location, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            found |= ignored_fields(item, (*location, key))
    return found


def _read(body: Body) -> None:
    """The request's body is `body`, if it is the first read under `reading_body`: note or refuse what it ignored."""
    reading = _reading.get()
    if reading is None or reading.ignored is not None:
        return
    ignored = ignored_fields(body)
    if reading.reject and ignored:
        errors = [InitErrorDetails(type="extra_forbidden", loc=place, input=given) for place, given in ignored.items()]
        raise ValidationError.from_exception_data(type(body).__name__, errors)
    reading.ignored = ignored
