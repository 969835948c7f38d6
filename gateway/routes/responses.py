"""POST /v1/responses: OpenAI's Responses API (its stateless subset), served as the chat completion it describes.

The body is made into a chat request (schemas/responses.py), which the chat
route's own code serves: the same prompt, sampling, tool calls and structured
output, so the same tokens. What this module adds is the rendering: chat's
answer as a Responses object, chat's chunks as Responses' typed events.

A stream is `data: {event}` server-sent events: response.created and
response.in_progress; per output item (a message, or a function call) its
output_item.added, then its content (content_part.added, output_text.delta
... output_text.done, content_part.done; or function_call_arguments.delta
... .done), then output_item.done; last, response.completed, or
response.incomplete at the max_output_tokens limit (its
incomplete_details.reason). An error before the first token keeps its HTTP
status; one after is an `error` event, then response.failed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from pydantic import BaseModel

from gateway.access_log import current_request_id
from gateway.errors import OPENAI_ERRORS
from gateway.openapi import event_stream
from gateway.routes.generation import sse_response
from gateway.routes.openai import chat_chunks, chat_completions
from gateway.structured.grammars import json_schema_grammar
from schemas.openai import AssistantMessage, Usage
from schemas.openai_tools import ToolCallDelta
from schemas.responses import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallOutput,
    IncompleteDetails,
    ItemStatus,
    JsonSchemaTextFormat,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseErrorEvent,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
    TextConfig,
)

router = APIRouter(tags=["OpenAI-compatible"])

_STREAMED = "With `stream`: `data: {event}` events, each with its `type` and `sequence_number`."


def _status(finish_reason: str | None) -> ItemStatus:
    return "incomplete" if finish_reason == "length" else "completed"


def _message(text: str, status: ItemStatus) -> OutputMessage:
    return OutputMessage(
        id=f"msg_{uuid.uuid4().hex}", status=status, content=[OutputText(type="output_text", text=text)]
    )


def _call(call_id: str, name: str, arguments: str, status: ItemStatus) -> FunctionCallOutput:
    return FunctionCallOutput(
        id=f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name, arguments=arguments, status=status
    )


def _output(answer: AssistantMessage, status: ItemStatus) -> list[FunctionCallOutput | OutputMessage]:
    """A chat answer's message as output items: its text (if any, or if nothing else), then its calls."""
    output: list[FunctionCallOutput | OutputMessage] = []
    if answer.content is not None or not answer.tool_calls:
        output.append(_message(answer.content or "", status))
    return output + [_call(c.id, c.function.name, c.function.arguments, status) for c in answer.tool_calls or ()]


def _response(
    body: ResponsesRequest,
    response_id: str,
    created_at: int,
    status: str,
    output: list,
    usage: Usage | None = None,
    error: ResponseError | None = None,
) -> ResponseObject:
    """The response object, with the request's settings as applied (their defaults filled in)."""
    chat = body.chat
    return ResponseObject(
        id=response_id,
        created_at=created_at,
        status=status,
        error=error,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=body.model,
        output=output,
        parallel_tool_calls=chat.parallel_tool_calls,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        tool_choice=body.tool_choice or chat.calls_tools,
        tools=body.tools or [],
        text=body.text or TextConfig(),
        usage=None if usage is None else _usage(usage),
    )


def _usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens
    )


def _response_id() -> str:
    """`resp_<request id>`: the id names the request id that the gateway's and workers' lines carry."""
    return f"resp_{current_request_id() or uuid.uuid4().hex}"


class _StreamedResponse:
    """A chat stream's chunks (of one choice, usage last) as Responses' events, numbered in order."""

    def __init__(self, body: ResponsesRequest) -> None:
        self._body = body
        self._id, self._created_at = _response_id(), int(time.time())
        self._sequence = 0
        self._output: list[OutputMessage | FunctionCallOutput] = []
        self._message: OutputMessage | None = None  # the text being streamed, once it has started
        self._calls: dict[int, FunctionCallOutput] = {}  # by chat's call index
        self._finish_reason: str | None = None
        self._usage: Usage | None = None

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        yield self._event(ResponseCreated, response=self._snapshot("in_progress"))
        yield self._event(ResponseInProgress, response=self._snapshot("in_progress"))
        async with aclosing(chunks):  # closed early (the client left): the worker stops
            async for chunk in chunks:
                if "error" in chunk:  # the last chunk of a stream that failed
                    error = chunk["error"]
                    yield self._event(
                        ResponseErrorEvent, code=error["code"], message=error["message"], param=error["param"]
                    )
                    failed = ResponseError(code="server_error", message=error["message"])
                    yield self._event(ResponseFailed, response=self._snapshot("failed", error=failed))
                    return
                for event in self._of(chunk):
                    yield event
        for event in self._ended():
            yield event

    def _event(self, kind: type[BaseModel], **fields) -> dict:
        event = kind(sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event.model_dump(by_alias=True)

    def _snapshot(self, status: str, error: ResponseError | None = None) -> ResponseObject:
        return _response(self._body, self._id, self._created_at, status, self._output, self._usage, error)

    def _of(self, chunk: dict) -> list[dict]:
        """One chunk's events (chat's chunks leave out what is None)."""
        if "usage" in chunk:
            self._usage = Usage(**chunk["usage"])
        events = []
        for choice in chunk["choices"]:
            if choice["delta"].get("content"):
                events += self._text(choice["delta"]["content"])
            for call in choice["delta"].get("tool_calls", ()):
                events += self._call_delta(ToolCallDelta(**call))
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        return events

    def _added(self, item: OutputMessage | FunctionCallOutput) -> dict:
        self._output.append(item)
        return self._event(OutputItemAdded, output_index=len(self._output) - 1, item=item)

    def _text(self, delta: str) -> list[dict]:
        events = []
        if self._message is None:  # announced empty, then its one part
            self._message = _message("", "in_progress")
            part = self._message.content.pop()
            events.append(self._added(self._message))
            self._message.content.append(part)
            events.append(self._event(ContentPartAdded, **self._where(self._message), part=part))
        if delta:
            self._message.content[0].text += delta
            events.append(self._event(OutputTextDelta, **self._where(self._message), delta=delta))
        return events

    def _call_delta(self, delta: ToolCallDelta) -> list[dict]:
        events = []
        call = self._calls.get(delta.index)
        if call is None:  # its first delta names it
            call = self._calls[delta.index] = _call(delta.id, delta.function.name, "", "in_progress")
            events.append(self._added(call))
        if delta.function.arguments:
            call.arguments += delta.function.arguments
            index = self._output.index(call)
            events.append(
                self._event(
                    FunctionCallArgumentsDelta, item_id=call.id, output_index=index, delta=delta.function.arguments
                )
            )
        return events

    def _where(self, message: OutputMessage) -> dict:
        return {"item_id": message.id, "output_index": self._output.index(message), "content_index": 0}

    def _ended(self) -> list[dict]:
        """Each item's last events, then the response's."""
        status = _status(self._finish_reason)
        events = [] if self._output else self._text("")  # an answer with no text is an empty message
        for index, item in enumerate(self._output):
            item.status = status
            if isinstance(item, OutputMessage):
                part = item.content[0]
                events.append(self._event(OutputTextDone, **self._where(item), text=part.text))
                events.append(self._event(ContentPartDone, **self._where(item), part=part))
            else:
                done = {"name": item.name, "arguments": item.arguments}
                events.append(self._event(FunctionCallArgumentsDone, item_id=item.id, output_index=index, **done))
            events.append(self._event(OutputItemDone, output_index=index, item=item))
        last = ResponseIncomplete if status == "incomplete" else ResponseCompleted
        events.append(self._event(last, response=self._snapshot(status)))
        return events


def _check_format(body: ResponsesRequest) -> None:
    """A schema the server cannot constrain output to is refused naming this body's field (chat's would be named
    otherwise)."""
    answer = body.answer_format
    if isinstance(answer, JsonSchemaTextFormat):
        json_schema_grammar(answer.schema_, "text.format.schema")


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={200: event_stream(ResponseStreamEvent, _STREAMED, ResponseErrorEvent), **OPENAI_ERRORS},
)
async def responses(body: ResponsesRequest, request: Request):
    """Answer a conversation (OpenAI's Responses API, stateless: nothing is stored), at once or as typed events."""
    _check_format(body)
    if body.stream:
        return sse_response(_StreamedResponse(body).events(await chat_chunks(request, body.chat)), space=True)
    created_at = int(time.time())
    answer = await chat_completions(body.chat, request)
    [choice] = answer.choices
    status = _status(choice.finish_reason)
    output = _output(choice.message, status)
    return _response(body, _response_id(), created_at, status, output, answer.usage)
