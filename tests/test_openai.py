"""The OpenAI-compatible routes through the official `openai` SDK, unmodified, against `tokenrelay serve`.

Greedy answers are compared with the native generate route's, which is
checked against transformers elsewhere; so a completion must be exactly the
same text.
"""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tokenrelay-tiny"
PROMPT = "The following example"  # greedy: no EOS for hundreds of tokens


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def _native(server, prompt: str, max_new_tokens: int) -> str:
    body = {"text_input": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    return httpx.post(server.url(f"/v2/models/{MODEL}/generate"), json=body, timeout=60).json()["text_output"]


def test_completions_non_stream_and_stream_equal_the_native_greedy_text(server, client):
    expected = _native(server, PROMPT, 12)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12

    chunks = list(
        client.completions.create(
            model="gpt-tiny",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(server, client):
    expected = _native(server, PROMPT, 30)
    stop = expected[10:14]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert done.choices[0].text == expected[: expected.index(stop)]
    assert done.choices[0].finish_reason == "stop"


def test_a_seeded_sampled_completion_is_reproducible(client):
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=123)
    assert client.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text


def test_chat_non_stream_and_stream_say_the_same_with_the_chat_template(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a module."}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    answer = done.choices[0].message
    assert answer.role == "assistant" and answer.content and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.prompt_tokens > 10  # the template's role markers count

    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.content
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_models_lists_every_served_name(client):
    assert sorted(m.id for m in client.models.list()) == ["gpt-tiny", MODEL]


def test_errors_come_in_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert "nope" in unknown.value.body["message"]
    with pytest.raises(openai.BadRequestError) as two:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2)
    assert "n" in two.value.body["message"]
    with pytest.raises(openai.BadRequestError) as penalty:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, presence_penalty=0.5)
    assert "presence_penalty is not a known field" in penalty.value.body["message"]
    raw = httpx.post(server.url("/v1/chat/completions"), json={"model": MODEL, "messages": []}, timeout=10)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
