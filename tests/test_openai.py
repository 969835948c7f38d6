"""The OpenAI-compatible routes through the official `openai` SDK, unmodified, against `tokenrelay serve`.

Greedy answers are compared with the native generate route's, which is
checked against transformers elsewhere; so a completion must be exactly the
same text. Embeddings are compared with transformers' own hidden states of
the bundled model (float32, after the final norm), pooled as the served
model pools them: the last token's, L2-normalised (it has no
sentence-transformers modules).
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from gateway.structured.tool_calls import calls_in
from schemas.embeddings import MAX_INPUTS
from schemas.openai import ChatCompletionRequest
from tests.reference import bundled, embedding

MODEL = "tokenrelay-tiny"
PROMPT = "The following example"  # greedy: no EOS for hundreds of tokens


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


@pytest.fixture(scope="module")
def client(compat_client) -> openai.OpenAI:
    return compat_client


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


def test_completions_take_each_prompt_form_openai_documents(client):
    ids = bundled().tokenizer(PROMPT)["input_ids"]
    ask = dict(model=MODEL, max_tokens=8, temperature=0)
    alone = client.completions.create(prompt=PROMPT, **ask)
    for form in ([PROMPT], ids, [ids]):
        done = client.completions.create(prompt=form, **ask)
        assert [c.text for c in done.choices] == [alone.choices[0].text], form
        assert done.usage == alone.usage
    other = "Every module"
    two = client.completions.create(prompt=[ids, bundled().tokenizer(other)["input_ids"]], **ask)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [
        alone.choices[0].text,
        client.completions.create(prompt=other, **ask).choices[0].text,
    ]
    assert two.usage.prompt_tokens == len(ids) + len(bundled().tokenizer(other)["input_ids"])
    assert two.usage.completion_tokens == 16


BATCH = ["The following example", "Every module", "A request"]


def test_a_batch_of_prompts_with_n_equals_the_single_requests_prompt_major(client):
    ask = dict(model=MODEL, max_tokens=6, temperature=0.9, seed=7, n=2, extra_body={"ignore_eos": True})
    singles = [client.completions.create(prompt=prompt, **ask) for prompt in BATCH]
    expected = [choice.text for single in singles for choice in single.choices]
    assert len(set(expected)) > 3  # sampled apart: the comparison below tells the choices' places apart

    done = client.completions.create(prompt=BATCH, **ask)
    assert [c.index for c in done.choices] == list(range(6))
    assert [c.text for c in done.choices] == expected
    assert done.usage.prompt_tokens == sum(single.usage.prompt_tokens for single in singles)
    assert done.usage.completion_tokens == 36

    chunks = list(client.completions.create(prompt=BATCH, stream=True, stream_options={"include_usage": True}, **ask))
    texts = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    assert chunks[-1].usage == done.usage


def test_echo_with_max_tokens_0_scores_the_prompts_alone(client):
    """The legacy scoring call of evaluation clients: each prompt's log-probabilities, nothing generated."""
    prompts = [bundled().tokenizer(text)["input_ids"] for text in BATCH[:2]]
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert done.usage.completion_tokens == 0
    assert done.usage.prompt_tokens == sum(map(len, prompts))
    decode = bundled().tokenizer.decode
    for choice, prompt in zip(done.choices, prompts, strict=True):
        _, expected = _reference_logprobs(prompt, 1)
        assert choice.logprobs.tokens == [decode([t]) for t in prompt] and choice.text == "".join(
            choice.logprobs.tokens
        )
        assert choice.logprobs.token_logprobs[0] is None
        for position in range(1, len(prompt)):
            assert choice.logprobs.token_logprobs[position] == pytest.approx(
                expected[position - 1, prompt[position]].item(), abs=1e-4
            )
        assert choice.finish_reason == "length"
    text = client.completions.create(model=MODEL, prompt=BATCH[0], max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in text if c.choices) == BATCH[0]


def test_completion_prompt_forms_out_of_bounds_are_400s_naming_prompt(server):
    def refused(prompt, **more) -> dict:
        answer = httpx.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": prompt, **more}, timeout=10)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    many = refused(["x"] * 257)
    assert many["param"] == "prompt" and "prompt: at most 256 per request are served; received 257" in many["message"]
    negative = refused([[1, 2], [3, -1]])
    assert negative["param"] == "prompt.1.1"
    assert negative["message"] == "prompt.1.1: Input should be greater than or equal to 0; received -1"
    assert "prompt: item 1 is empty" in refused([[1], []])["message"]
    assert refused("x", max_tokens=0)["param"] == "max_tokens"
    outside = httpx.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": [[1], [1, 32000]]}, timeout=10)
    assert outside.status_code == 424
    assert outside.json()["error"]["message"] == "prompt item 1: token id 32000 is outside the vocabulary [0, 32000)"


_OUTSIDE = "token id {} is outside the vocabulary [0, 32000)"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        ({"min_tokens": 5, "stop_token_ids": [99999999]}, 424, "stop_token_ids: " + _OUTSIDE.format(99999999)),
        ({"min_tokens": 5, "stop_token_ids": [2, 32000]}, 424, "stop_token_ids: " + _OUTSIDE.format(32000)),
        (
            {"min_tokens": 5, "stop_token_ids": [-1]},
            400,
            "stop_token_ids.0: Input should be greater than or equal to 0",
        ),
        ({"logit_bias": {"32000": 1}}, 424, "logit_bias: " + _OUTSIDE.format(32000)),
        ({"logit_bias": {"-1": 1}}, 400, "logit_bias.-1.[key]: String should match pattern"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(server, route, fields, status, message):
    """Every field of token ids is checked as a prompt's are: a stop token past the vocabulary, which min_tokens
    bans, would have the sampler index past its scores (on CUDA, an assert that poisons the worker)."""
    prompt = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    body = {"model": MODEL, "max_tokens": 8, **prompt, **fields}
    answer = httpx.post(server.url(route), json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]["message"]


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
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=17)
    assert "n: Input should be less than or equal to 16" in many.value.body["message"]
    ignored = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2, suffix="!")
    assert ignored.http_response.status_code == 200 and ignored.headers["x-ignored-fields"] == "suffix"
    with pytest.raises(openai.BadRequestError) as alone:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert "top_logprobs requires logprobs" in alone.value.body["message"]
    raw = httpx.post(server.url("/v1/chat/completions"), json={"model": MODEL, "messages": []}, timeout=10)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def _reference_logprobs(prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `prompt`, and log-softmax of its own forward pass at every position."""
    loaded = bundled()
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)[0]
        logits = loaded.model(out[None]).logits[0]
    return out[len(prompt) :].tolist(), logits.float().log_softmax(dim=-1)


def test_completion_logprobs_with_echo_are_transformers_own_in_and_out_of_a_stream(client):
    prompt = bundled().tokenizer(PROMPT)["input_ids"]
    generated, expected = _reference_logprobs(prompt, 6)
    ask = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True)
    done = client.completions.create(**ask).choices[0]
    logprobs = done.logprobs
    assert len(logprobs.tokens) == len(prompt) + 6 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert done.text == "".join(logprobs.tokens)  # the prompt's pieces, then the completion
    decode = bundled().tokenizer.decode
    assert logprobs.tokens == [decode([t]) for t in prompt + generated]
    for position, token in enumerate(prompt + generated):
        if position == 0:
            continue
        value = logprobs.token_logprobs[position]
        assert value == pytest.approx(expected[position - 1, token].item(), abs=1e-4), position
        top = logprobs.top_logprobs[position]
        assert len(top) == 3 and max(top.values()) == pytest.approx(expected[position - 1].max().item(), abs=1e-4)
    for i in range(len(prompt), len(prompt) + 6):  # greedy: the chosen token is the likeliest
        assert logprobs.token_logprobs[i] == max(logprobs.top_logprobs[i].values())
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]

    chunks = [c for c in client.completions.create(**ask, stream=True) if c.choices]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    values = [v for lp in streamed for v in lp.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-6)
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks) == done.text


def test_chat_logprobs_and_top_logprobs_in_and_out_of_a_stream(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a module."}], max_tokens=8, temperature=0)
    done = client.chat.completions.create(**ask, logprobs=True, top_logprobs=5)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert entry.top_logprobs[0].token == entry.token and entry.bytes == list(entry.token.encode())
        assert entry.logprob <= 0 and [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    plain = client.chat.completions.create(**ask, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * len(content)
    assert client.chat.completions.create(**ask).choices[0].logprobs is None

    chunks = list(client.chat.completions.create(**ask, logprobs=True, top_logprobs=5, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_vllm_extensions_as_the_sdk_sends_them_in_extra_body(client):
    """A benchmark's chat stream: exactly max_tokens tokens, usage in every chunk."""
    extra = {"ignore_eos": True, "min_tokens": 20, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=20,
            stop=None,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=extra | {"skip_special_tokens": False, "include_stop_str_in_output": False},
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 20 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_logit_bias_of_100_makes_every_greedy_token_that_token(client):
    token = bundled().tokenizer("hello")["input_ids"][-1]
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, logit_bias={str(token): 100}
    )
    assert done.choices[0].logprobs.tokens == [bundled().tokenizer.decode([token])] * 5


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["module", "class", "function"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "size": {
            "type": "object",
            "properties": {"lines": {"type": "integer", "minimum": 0, "maximum": 9999}, "ok": {"type": "boolean"}},
            "required": ["lines", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "size"],
    "additionalProperties": False,
}


async def test_sampled_answers_to_a_json_schema_all_parse_and_validate(server):
    """The bundled model never writes JSON unprompted; at temperature 1 every answer still matches the schema."""
    client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    answer_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    asks = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a module."}],
            max_tokens=150,
            temperature=1,
            seed=seed,
            response_format=answer_format,
        )
        for seed in range(50)
    ]
    answers = await asyncio.gather(*asks)
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    assert len({a.choices[0].message.content for a in answers}) > 40  # sampled, not one forced answer
    anything = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},  # as vLLM takes it on completions
    )
    # Any object: its strings are unbounded, and this model's run on; the text is one all the same.
    assert anything.choices[0].text.startswith('{"') and not _native(server, PROMPT, 8).startswith("{")
    with pytest.raises(openai.BadRequestError) as unsupported:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {"type": "null"}}}},
        )
    message = unsupported.value.body["message"]
    assert "response_format.json_schema.schema" in message and "not" in message and "cannot constrain" in message


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -99, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


async def test_tool_choice_required_makes_every_sampled_answer_a_valid_call(server):
    client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    asks = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=1,
            seed=seed,
        )
        for seed in range(20)
    ]
    for answer in await asyncio.gather(*asks):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_function_streams_as_deltas_the_sdk_reassembles_and_its_result_goes_back(client):
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Add two numbers."}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=40,
        temperature=0,
    )
    done = client.chat.completions.create(**ask)
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "add" and done.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    with client.chat.completions.stream(**ask) as stream:  # the SDK's own reassembly of tool-call deltas
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == ("add", call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    # The call and its result go back through the chat template: both count as prompt tokens.
    messages = [
        *ask["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    after = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=5, temperature=0)
    assert after.usage.prompt_tokens > done.usage.prompt_tokens + len(call.function.arguments) // 4
    assert after.choices[0].message.content is not None and after.choices[0].message.tool_calls is None
    unknown = dict(ask, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**unknown)
    assert "'nope', which tools do not declare" in refused.value.body["message"]


def test_auto_reads_back_calls_written_in_the_hermes_format_and_leaves_other_text_alone():
    body = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    written = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'
    content, [call] = calls_in(body, written)
    assert content == "Let me check." and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "C"}
    assert calls_in(body, "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert calls_in(body, "plain") == ("plain", [])


def test_n_choices_are_sampled_apart_reproducible_with_a_seed_and_choice_0_is_the_single_answer(client):
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1, seed=42, extra_body={"ignore_eos": True})
    four = client.completions.create(**ask, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and len({c.text for c in four.choices}) == 4
    assert [c.text for c in client.completions.create(**ask, n=4).choices] == [c.text for c in four.choices]
    assert client.completions.create(**ask).choices[0].text == four.choices[0].text
    assert four.usage.completion_tokens == 48
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=1, seed=5, n=3)
    done = client.chat.completions.create(**chat)
    streamed = [""] * 3
    for chunk in client.chat.completions.create(**chat, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in done.choices]


def test_the_openapi_document_describes_the_new_fields(server):
    schemas = httpx.get(server.url("/openapi.json"), timeout=10).json()["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    for field in ("logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format", "n"):
        assert field in chat, field
    for field in (
        "logprobs",
        "echo",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "ignore_eos",
        "min_tokens",
    ):
        assert field in completion, field
    assert {"top_n_tokens", "best_of", "grammar"} <= set(schemas["TgiParameters"]["properties"])
    assert "grammar" in schemas["GenerateParameters"]["properties"]
    assert "best_of_sequences" in schemas["TgiDetails"]["properties"]
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]


# -- /v1/embeddings

EMBEDDED = ["The os module provides", "A context manager is", "def main():\n"]
EMBEDDING_TOLERANCE = 1e-5


def _embed_ids(text: str) -> list[int]:
    return bundled().tokenizer(text)["input_ids"]


def _assert_embeds(vector, token_ids: list[int]) -> None:
    difference = (torch.tensor(vector, dtype=torch.float32) - embedding(token_ids)).abs().max().item()
    assert difference <= EMBEDDING_TOLERANCE, difference


def test_embeddings_of_texts_and_token_arrays_are_transformers_pooled_hidden_states_in_order_with_usage(client):
    one = client.embeddings.create(model=MODEL, input=EMBEDDED[0], encoding_format="float")
    assert [d.index for d in one.data] == [0] and one.model == MODEL and one.object == "list"
    _assert_embeds(one.data[0].embedding, _embed_ids(EMBEDDED[0]))
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(_embed_ids(EMBEDDED[0]))

    many = client.embeddings.create(model="gpt-tiny", input=EMBEDDED, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for done, text in zip(many.data, EMBEDDED, strict=True):
        _assert_embeds(done.embedding, _embed_ids(text))
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(len(_embed_ids(t)) for t in EMBEDDED)

    tokens = client.embeddings.create(model=MODEL, input=_embed_ids(EMBEDDED[1]), encoding_format="float")
    _assert_embeds(tokens.data[0].embedding, _embed_ids(EMBEDDED[1]))
    arrays = client.embeddings.create(model=MODEL, input=[_embed_ids(t) for t in EMBEDDED], encoding_format="float")
    for done, text in zip(arrays.data, EMBEDDED, strict=True):
        _assert_embeds(done.embedding, _embed_ids(text))
    assert arrays.usage.prompt_tokens == many.usage.prompt_tokens


def test_base64_embeddings_are_the_float_answers_little_endian_float32_bytes(client):
    # One input, alone in its steps each time: the same vector to the bit (inputs batched otherwise need not be).
    floats = client.embeddings.create(model=MODEL, input=EMBEDDED[0], encoding_format="float").data[0].embedding
    raw = client.embeddings.create(model=MODEL, input=EMBEDDED[0], encoding_format="base64").data[0].embedding
    assert np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist() == floats
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    assert client.embeddings.create(model=MODEL, input=EMBEDDED[0]).data[0].embedding == floats


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"input": "x", "dimensions": 64}, "dimensions: no model here is served with shortened embeddings"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": []}, "input: it is empty"),
        ({"input": ["x", ""]}, "input: item 1 is empty"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, f"input: at most {MAX_INPUTS} per request are served; received 2049"),
        ({"input": [[1, -1]]}, "input.0.1: Input should be greater than or equal to 0; received -1"),
        ({"input": "x", "priority": 6}, "priority: Input should be less than or equal to 5"),
    ],
)
def test_bad_embeddings_input_is_a_400_naming_the_field(server, body, named):
    answer = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]["message"]


def test_embeddings_inputs_the_model_cannot_take_are_refused_naming_which(server, client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    outside = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, "input": [[1], [1, 32000]]}, timeout=30)
    assert outside.status_code == 424
    assert outside.json()["error"]["message"] == "input item 1: token id 32000 is outside the vocabulary [0, 32000)"
    long = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, "input": ["x", "y " * 5000]}, timeout=30)
    assert long.status_code == 424 and "tokens after tokenization; at most" in long.json()["error"]["message"]
