"""OpenAI's tool calling, in chat bodies and answers: the tools a request declares, and the calls made.

A call's `arguments` is JSON text, as OpenAI sends it. Calls in a
conversation's earlier assistant turns go to the chat template with their
arguments parsed, as Hugging Face templates expect them.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field

from schemas.body import Body

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object"}, description="A JSON schema.")
    strict: bool | None = Field(None, description="Arguments always match `parameters` here, strict or not.")


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Body):
    name: str
    arguments: str = Field(description="JSON text.")


class ToolCall(Body):
    """A call the model made: in an answer, or in an earlier assistant turn of a conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As Hugging Face chat templates take it: the arguments parsed, when they are JSON."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: the first carries its id and name, later ones more of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
