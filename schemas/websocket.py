"""Messages of the WebSocket endpoint `/ws`.

Client to server, one JSON object per text message:
- `{"op": "generate_stream", "model": NAME, "id": ..., "text_input": ..., "parameters": {...}}`:
  start a stream; the fields after `model` are generate_stream's body.
- `{"op": "cancel", "id": ...}`: stop that stream.

Server to client:
- `{"id": ..., "data": {...}}`: one event, the same object generate_stream
  sends as SSE `data:` (or `{"error", "error_type"}` when the stream failed);
- `{"id": ..., "done": true}`: the stream with that id has ended.
Several streams may run at once over one socket; `id` tells them apart.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.triton import REQUEST_ID_PATTERN, GenerateStreamRequest


class WsGenerateStream(GenerateStreamRequest):
    op: Literal["generate_stream"]
    model: str


class WsCancel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    op: Literal["cancel"]
    id: str = Field(pattern=REQUEST_ID_PATTERN)


WsClientMessage = TypeAdapter(Annotated[WsGenerateStream | WsCancel, Field(discriminator="op")])
