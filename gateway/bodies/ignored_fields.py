"""Fields a request's body ignored, named: the `X-Ignored-Fields` header, the log line, a WebSocket's notice.

A field no document lists is accepted and ignored, never silently
(schemas/body.py says why and how a body finds them). A pure ASGI
middleware reads each HTTP request's body under `reading_body`, and puts
the fields its body ignored in the answer's `X-Ignored-Fields` header and
in `scope["state"]["ignored_fields"]`, which the access log's line of the
request carries (gateway/access_log.py). The WebSocket route does the same
per message (gateway/routes/websocket.py). With --reject-unknown-fields such
a field is a 422 naming it instead.

Each field is named by its dotted path (`parameters.foo`, `messages.0.bar`);
a name is percent-encoded where it is not letters, digits, `_`, `-` or `~`
(a dot in a name is `%2E`, so that the dots are the path's), and cut at 64
characters. At most 32 fields are listed, then `+N` says how many more.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.body import reading_body
from schemas.placement import Location

HEADER = b"x-ignored-fields"
MAX_LISTED = 32
MAX_NAME = 64


def _name(part: str | int) -> str:
    text = str(part)
    cut = text[:MAX_NAME] + ("…" if len(text) > MAX_NAME else "")
    return quote(cut, safe="").replace(".", "%2E")


def listed(ignored: dict[Location, Any]) -> list[str]:
    """The ignored fields as the header and the log name them: dotted paths, at most MAX_LISTED, then `+N`."""
    paths = [".".join(_name(part) for part in place) for place in ignored]
    more = len(paths) - MAX_LISTED
    return paths[:MAX_LISTED] + ([f"+{more}"] if more > 0 else [])


class IgnoredFields:
    def __init__(self, app: ASGIApp, reject: bool) -> None:
        self._app = app
        self._reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        with reading_body(self._reject) as reading:

            async def naming(message: Message) -> None:
                if message["type"] == "http.response.start" and reading.ignored:
                    names = listed(reading.ignored)
                    scope.setdefault("state", {})["ignored_fields"] = names
                    message = {**message, "headers": [*message.get("headers", ()), (HEADER, ", ".join(names).encode())]}
                await send(message)

            await self._app(scope, receive, naming)
