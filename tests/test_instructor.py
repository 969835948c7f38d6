"""instructor, the most used structured-output client, unmodified, with plain pydantic models, against serve.

Its models' schemas say nothing of `additionalProperties`; the gateway reads
them strictly, as xgrammar does (gateway/structured/strict_schemas.py), so the bundled
model cannot write a key they do not name, and each extraction is a valid
object in one request (max_retries=0) that ends by itself: in TOOLS mode
(instructor's default: a forced tool call), in JSON_SCHEMA mode
(response_format), and each streamed as partial objects (create_partial).
Greedy, so that each run is the same. Each request asks for JSON in a system
message, as OpenAI's docs tell users of JSON mode to: without one this
4-layer model writes prose into some strings until max_tokens, which no
grammar prevents (3 of the 7 extractions complete in JSON_SCHEMA mode then).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

import instructor
import openai
import pytest
from pydantic import BaseModel

MODEL = "tokenrelay-tiny"


class City(BaseModel):
    name: str
    population: int


class User(BaseModel):
    name: str
    age: int


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    address: Address


class Item(BaseModel):
    name: str
    quantity: int


class Order(BaseModel):
    customer: str
    items: list[Item]


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confident: bool


class Meeting(BaseModel):
    topic: str
    attendees: list[str]
    room: str | None = None


EXTRACTIONS = [
    (City, "Tokyo is a city of 14 million people."),
    (User, "Jason is 25 years old."),
    (Person, "Ada lives at 12 Elm Street in London."),
    (Order, "Bob ordered two apples and one pear."),
    (Sentiment, "I love this product!"),
    (Meeting, "Ann and Raj meet about the budget in room 4."),
    (Address, "Ship it to 5 Main Street, Paris."),
]


def finish_reason(server, request_id: str, timeout_s: float = 10) -> str:
    """How the worker ended the request (its `request_finished` line may follow the answer by a moment)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in server.process.events_named("request_finished"):
            if event["request_id"] == request_id:
                return event["finish_reason"]
        time.sleep(0.05)
    raise AssertionError(f"no request_finished for {request_id}")


def test_the_models_are_instructors_defaults():
    for model, _ in EXTRACTIONS:
        assert "additionalProperties" not in str(model.model_json_schema()), model


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA], ids=lambda mode: mode.name)
def test_each_extraction_is_a_valid_object_in_one_request_that_ends_by_itself(compat_server, mode, partial):
    client = instructor.from_openai(
        openai.OpenAI(base_url=compat_server.url("/v1"), api_key="unused", max_retries=0, timeout=60), mode=mode
    )
    for model, text in EXTRACTIONS:
        request_id = f"instructor-{uuid.uuid4().hex[:12]}"
        ask = dict(
            model=MODEL,
            response_model=model,
            max_retries=0,
            max_tokens=200,
            temperature=0,
            messages=[
                {"role": "system", "content": "Extract the data as JSON."},
                {"role": "user", "content": f"Extract: {text}"},
            ],
            extra_headers={"X-Request-Id": request_id},
        )
        if partial:
            *_, last = client.chat.completions.create_partial(**ask)
            extracted = model.model_validate(last.model_dump())
        else:
            extracted = client.chat.completions.create(**ask)
        assert isinstance(extracted, model)
        assert finish_reason(compat_server, request_id) == "eos_token", (model.__name__, extracted)
