"""Request bodies before anything parses them: a size limit, and JSON whatever the label.

A pure ASGI middleware:
- a declared Content-Length over the limit is refused with 413 at once,
  unread; a chunked body is read up to the limit and refused as soon as it
  passes it;
- every route here takes JSON, and MindIE's clients (curl -d among them)
  often label it application/x-www-form-urlencoded or not at all, so a POST
  body is handed on labelled application/json;
- a body Python's json cannot read for its own limits (nesting deeper than
  the interpreter's recursion limit, an integer of more digits than it
  converts) is refused with a 422 that says so; FastAPI would call it
  unparsable (400) without saying why. Other malformed JSON goes on, for
  FastAPI to name where it breaks.
"""

from __future__ import annotations

import json
import re
import sys

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import PAYLOAD_TOO_LARGE, VALIDATION_ERROR, error_response


class RequestBodies:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self._app = app
        self._max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_bytes:
            await self._refuse(send, int(declared))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self._max_bytes:
                await self._refuse(send, len(body))
                return
            if not message.get("more_body", False):
                break
        problem = _beyond_parser_limits(bytes(body))
        if problem is not None:
            await error_response(scope["path"], 422, VALIDATION_ERROR, problem)(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        # Changed in place, not in a copy: the access log (gateway/access_log.py) reads the route that routing
        # records in this scope.
        scope["headers"] = [*headers, (b"content-type", b"application/json")]
        await self._app(scope, replay(bytes(body), receive), send)

    async def _refuse(self, send: Send, size: int) -> None:
        error = f"the request body has {size} bytes or more; at most {self._max_bytes} are allowed"
        payload = json.dumps({"error": error, "error_type": PAYLOAD_TOO_LARGE}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (sys.get_int_max_str_digits() + 1))


def _beyond_parser_limits(body: bytes) -> str | None:
    """Why Python's json cannot read this body although it may be valid JSON; None when that is not the case.

    Parsed here only when it might be so (FastAPI parses every body anyway): more brackets than the
    recursion limit, or a run of digits longer than the longest integer converted."""
    deep_enough = body.count(b"[") + body.count(b"{") > sys.getrecursionlimit()
    if not deep_enough and _LONG_DIGITS.search(body) is None:
        return None
    try:
        json.loads(body)
    except RecursionError:
        return f"the body is not valid JSON here: it is nested more than {sys.getrecursionlimit()} levels deep"
    except ValueError as error:
        if "integer string conversion" in str(error):
            limit = sys.get_int_max_str_digits()
            return f"the body is not valid JSON here: an integer has more than {limit} digits"
    return None


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then waits for the client as usual."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
