"""Tool calls in chat answers: the grammar that forces them, and the calls read back out of the text.

How the answer may call tools (ChatCompletionRequest.calls_tools):
- `required`: the answer is a JSON array of calls, `[{"name", "arguments"}]`
  (exactly one without parallel_tool_calls), each call's arguments matching
  its function's parameters;
- a named function: the answer is that function's arguments, matching its
  parameters (streamed as they come, as the arguments of one call);
- `auto`: the model writes what it likes; calls written in the Hermes format
  that the bundled chat template renders (and Qwen and Hermes models write),
  `<tool_call>{"name", "arguments"}</tool_call>`, are read back out of an
  answer that is not streamed;
- `none`: the model is not shown the tools.
"""

from __future__ import annotations

import json
import re
import uuid

from gateway.structured.grammars import json_schema_grammar
from schemas.openai import ChatCompletionRequest
from schemas.openai_tools import FunctionCall, ToolCall

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tools_grammar(body: ChatCompletionRequest) -> str | None:
    """The grammar a forced call's answer matches; None when calls are not forced."""
    mode = body.calls_tools
    if mode == "named":
        function = _function(body, body.tool_choice.function.name)
        return json_schema_grammar(function.parameters, f"tools[{function.name}].function.parameters")
    if mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in body.tools or ()
    ]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not body.parallel_tool_calls:
        array["maxItems"] = 1
    return json_schema_grammar(array, "tools")


def calls_in(body: ChatCompletionRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    """The answer's content and its calls. A forced answer cut short (max_tokens) stays content, with no call."""
    mode = body.calls_tools
    if mode == "named":
        return None, [_call(body.tool_choice.function.name, text)]
    if mode == "required":
        try:
            made = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [_call(call["name"], json.dumps(call["arguments"])) for call in made]
    if mode == "auto":
        calls = []
        for written in _HERMES_CALL.findall(text):
            try:
                call = json.loads(written)
                calls.append(_call(call["name"], json.dumps(call["arguments"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # not a call after all: the text stays as it was written
        content = _HERMES_CALL.sub("", text).strip() if calls else text
        return content or None, calls
    return text, []


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))


def _function(body: ChatCompletionRequest, name: str):
    return next(tool.function for tool in body.tools or () if tool.function.name == name)
