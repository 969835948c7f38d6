"""POST /v1/responses through the official `openai` SDK, unmodified, against the session's `tokenrelay serve`.

A Responses body is served as the chat completion it describes, so greedy
answers are compared with chat completions' for the same conversation: the
same text exactly. Every answer and event is also validated as the SDK's own
pydantic types (which parse leniently by default), so their shapes are
OpenAI's, field for field.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from PIL import Image
from pydantic import TypeAdapter

from gateway.routes.responses import _StreamedResponse
from schemas.responses import ResponsesRequest
from tests.test_openai import MODEL, SCHEMA, TOOLS

EVENT = TypeAdapter(ResponseStreamEvent)
ADD = {"type": "function", **TOOLS[1]["function"]}  # Responses' tools are flat
WEATHER = {"type": "function", **TOOLS[0]["function"]}
CONVERSATION = [
    {"role": "developer", "content": "You are terse."},
    {"role": "user", "content": [{"type": "input_text", "text": "Name a module."}]},
    {"role": "assistant", "content": [{"type": "output_text", "text": "os", "annotations": []}]},
    {"role": "user", "content": "Another one."},
]
CHAT_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": "You are terse."},
    {"role": "user", "content": "Name a module."},
    {"role": "assistant", "content": "os"},
    {"role": "user", "content": "Another one."},
]


def _exact(response: Response) -> Response:
    """The response, validated as the SDK's type (the SDK itself builds it without validation)."""
    return Response.model_validate(response.to_dict())


def _streamed(client: openai.OpenAI, **ask) -> list:
    """The raw events of a streamed response, each validated as the SDK's event type, numbered from 0."""
    events = [EVENT.validate_python(event.to_dict()) for event in client.responses.create(**ask, stream=True)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def test_text_at_once_and_streamed_is_chat_completions_greedy_text_with_usage_and_the_length_limit(compat_client):
    chat = compat_client.chat.completions.create(model=MODEL, messages=CHAT_CONVERSATION, max_tokens=12, temperature=0)
    ask = dict(model=MODEL, instructions="Be brief.", input=CONVERSATION, max_output_tokens=12, temperature=0)
    done = _exact(compat_client.responses.create(**ask, store=False, extra_headers={"X-Request-Id": "responses-1"}))
    assert done.output_text == chat.choices[0].message.content and done.id == "resp_responses-1"
    assert chat.choices[0].finish_reason == "length"  # so the response is incomplete, for that reason
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    [message] = done.output
    assert message.id.startswith("msg_") and message.role == "assistant" and message.status == "incomplete"
    usage = done.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + 12 and usage.input_tokens_details.cached_tokens == 0
    assert (done.instructions, done.max_output_tokens, done.temperature) == ("Be brief.", 12, 0)
    assert done.tool_choice == "none" and done.tools == []
    # The answer's message goes back as it came, as the next turn's assistant item.
    turn = [*CONVERSATION, message.to_dict(), {"role": "user", "content": "And?"}]
    again = compat_client.responses.create(**{**ask, "input": turn})
    assert again.usage.input_tokens > usage.input_tokens + 2 and again.output_text

    events = _streamed(compat_client, **ask)
    assert [event.type for event in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == done.output_text and len(deltas) > 1
    assert [event.type for event in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[-4].text == done.output_text and events[-2].item.status == "incomplete"
    final = events[-1].response
    assert final.output_text == done.output_text and final.usage == done.usage and final.id == events[0].response.id
    assert {event.item_id for event in deltas} == {final.output[0].id}


def test_a_forced_function_call_at_once_through_the_sdks_stream_helper_and_its_result_sent_back(compat_client):
    ask = dict(
        model=MODEL,
        input="Add two numbers.",
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=40,
        temperature=0,
    )
    done = _exact(compat_client.responses.create(**ask))
    [call] = done.output
    assert call.type == "function_call" and call.name == "add" and done.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])

    with compat_client.responses.stream(**ask) as stream:  # the SDK's own accumulation of the events
        kinds = [EVENT.validate_python(event.model_dump(exclude={"snapshot"})).type for event in stream]
        final = stream.get_final_response()
    assert kinds[2] == "response.output_item.added" and "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [streamed] = final.output
    assert (streamed.name, streamed.arguments) == ("add", call.arguments)

    required = compat_client.responses.create(**{**ask, "tool_choice": "required", "parallel_tool_calls": False})
    [any_call] = required.output
    jsonschema.validate(
        json.loads(any_call.arguments), {"get_weather": WEATHER, "add": ADD}[any_call.name]["parameters"]
    )

    # The call and its result go back as items (the call as the answer gave it): both are prompt tokens.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    turn = [{"role": "user", "content": "Add two numbers."}, call.to_dict(), result]
    after = _exact(
        compat_client.responses.create(
            model=MODEL, input=turn, tools=[WEATHER, ADD], max_output_tokens=5, temperature=0
        )
    )
    assert after.output[0].type == "message" and after.output_text
    assert after.usage.input_tokens > done.usage.input_tokens + len(call.arguments) // 4


def test_a_json_schema_text_format_at_once_and_through_the_stream_helper(compat_client):
    answer_format = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    ask = dict(
        model=MODEL,
        input="Describe a module.",
        text={"format": answer_format},
        max_output_tokens=150,
        temperature=0,
    )
    done = _exact(compat_client.responses.create(**ask))
    assert done.status == "completed" and done.text.format.type == "json_schema"
    jsonschema.validate(json.loads(done.output_text), SCHEMA)
    with compat_client.responses.stream(**ask) as stream:
        final = stream.get_final_response()
    assert final.output_text == done.output_text
    anything = compat_client.responses.create(
        model=MODEL, input="x", text={"format": {"type": "json_object"}}, max_output_tokens=8, temperature=0
    )
    assert anything.output_text.startswith('{"')


def _png() -> str:
    image = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(image, format="PNG")
    return "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()


def test_bad_bodies_are_400s_naming_the_field(compat_server, compat_client):
    def refused(**ask) -> str:
        with pytest.raises(openai.BadRequestError) as error:
            compat_client.responses.create(**{"model": MODEL, "input": "x", **ask})
        assert set(error.value.body) == {"message", "type", "param", "code"}
        return error.value.body["message"]

    assert "store: this server keeps no responses" in refused(store=True)
    assert "previous_response_id: this server keeps no responses" in refused(previous_response_id="resp_1")
    assert "max_output_tokens: Input should be greater than or equal to 1" in refused(max_output_tokens=0)
    assert "temperature: Input should be less than or equal to 2" in refused(temperature=2.5)
    assert "top_p: Input should be greater than 0" in refused(top_p=0)
    assert "tool_choice needs tools" in refused(tool_choice="required")
    assert "'nope', which tools do not declare" in refused(
        tools=[ADD], tool_choice={"type": "function", "name": "nope"}
    )
    forced = refused(tools=[ADD], tool_choice="required", text={"format": {"type": "json_object"}})
    assert "text.format cannot be combined with a tool_choice that forces a call" in forced
    unsupported = {"type": "json_schema", "name": "n", "schema": {"not": {"type": "null"}}}
    assert "text.format.schema" in refused(text={"format": unsupported})
    assert "an item's type is message" in refused(input=[{"type": "reasoning", "summary": []}])
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": _png(), "detail": "auto"}]}]
    assert "does not accept image input" in refused(input=image)  # the bundled model reads text only
    raw = httpx.post(compat_server.url("/v1/responses"), json={"model": MODEL, "input": []}, timeout=10)
    assert raw.status_code == 400 and "List should have at least 1 item" in raw.json()["error"]["message"]


async def test_an_error_after_the_first_token_is_an_error_event_then_response_failed():
    body = ResponsesRequest(model=MODEL, input="x", stream=True)

    def chunk(delta: dict) -> dict:
        return {
            "id": "c",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }

    async def chunks():
        yield chunk({"role": "assistant", "content": ""})
        yield chunk({"content": "Hi"})
        yield {"error": {"message": "the worker failed", "type": "server_error", "param": None, "code": "Failed"}}

    events = [EVENT.validate_python(event) async for event in _StreamedResponse(body).events(chunks())]
    assert [event.type for event in events[-3:]] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2].message == "the worker failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error" and events[-1].response.output[0].content[0].text == "Hi"
