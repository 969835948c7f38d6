"""Messages of the WebSocket endpoint `/ws`: every streaming API, several streams per socket.

Client to server, one JSON object per text message:
- `{"op": "generate_stream", "model": NAME, "id": ..., "text_input": ..., "parameters": {...}}`:
  start a Triton generate_stream; the fields after `model` are its body.
- `{"op": OP, "id": ..., "body": {...}}` with OP one of `infer` (MindIE's
  /infer and /infer_token body), `tgi` (TGI's /generate_stream body),
  `completions` and `chat.completions` (OpenAI's bodies; `stream` need not be
  set): start that API's stream.
- `{"op": "cancel", "id": ...}`: stop that stream as stopInfer does (its worker stops
  within a step): it ends with its API's last event, finish reason and all
  (stop_sequence; OpenAI's stop), then `done`.

Server to client:
- `{"id": ..., "data": {...}}`: one event, the object that API's SSE stream
  sends as `data:` (OpenAI's chunks, without `[DONE]`), or an error object
  in that API's shape;
- `{"id": ..., "done": true}`: the stream with that id has ended;
- `{"id": ..., "ignored_fields": [...]}`: before anything else under that
  id, the fields of the message that no document lists, which were ignored
  (dotted paths, as HTTP's X-Ignored-Fields header names them); with the
  server's --reject-unknown-fields such a message is refused instead.
A message that is refused (422: not valid, an unknown `op`, whose error
names the ops there are) is answered with an error object under the
message's own `id` (`null` if it has none), then `done` for that id unless a
stream is running under it.
`id` (1-256 of A-Z a-z 0-9 _ -) tells streams apart; absent, the server makes
one up. The server pings every 20 s; it closes with 1000 when the client
does, 1008 without a valid API key (when keys are configured), 1011 on an
internal error.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from schemas.body import Body
from schemas.mindie import InferTokenRequest
from schemas.openai import ChatCompletionRequest, CompletionRequest
from schemas.parameters import STRICT
from schemas.tgi import TgiRequest
from schemas.triton import REQUEST_ID_PATTERN, GenerateStreamRequest

StreamId = Annotated[str | None, Field(pattern=REQUEST_ID_PATTERN)]


class WsGenerateStream(GenerateStreamRequest):
    op: Literal["generate_stream"]
    model: str


class _WsOp(Body):
    id: StreamId = None


class WsInfer(_WsOp):
    op: Literal["infer"]
    body: InferTokenRequest


class WsTgi(_WsOp):
    op: Literal["tgi"]
    body: TgiRequest


class WsCompletions(_WsOp):
    op: Literal["completions"]
    body: CompletionRequest


class WsChatCompletions(_WsOp):
    op: Literal["chat.completions"]
    body: ChatCompletionRequest


class WsCancel(Body):
    model_config = STRICT

    op: Literal["cancel"]
    id: str = Field(pattern=REQUEST_ID_PATTERN)


WsStart = WsGenerateStream | WsInfer | WsTgi | WsCompletions | WsChatCompletions
WsMessage = Annotated[WsStart | WsCancel, Field(discriminator="op")]
WsClientMessage = TypeAdapter(WsMessage)
