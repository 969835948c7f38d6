"""The TGI-compatible routes through huggingface_hub's InferenceClient, unmodified, against `tokenrelay serve`.

Greedy answers are compared with the native generate route's, so a TGI
answer must be exactly that text.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import torch
from huggingface_hub import InferenceClient

from tests.reference import bundled

MODEL = "tokenrelay-tiny"
PROMPT = "The following example"  # greedy: no EOS for hundreds of tokens


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


@pytest.fixture(scope="module")
def client(server) -> InferenceClient:
    return InferenceClient(base_url=server.base_url, timeout=60)


@pytest.fixture(scope="module")
def expected(server) -> str:
    body = {"text_input": PROMPT, "parameters": {"max_new_tokens": 12}}
    return httpx.post(server.url(f"/v2/models/{MODEL}/generate"), json=body, timeout=60).json()["text_output"]


def test_non_stream_text_and_details_equal_the_native_greedy_answer(client, expected):
    assert client.text_generation(PROMPT, max_new_tokens=12) == expected
    out = client.text_generation(PROMPT, max_new_tokens=12, details=True, decoder_input_details=True)
    assert out.generated_text == expected
    assert (out.details.finish_reason, out.details.generated_tokens, out.details.seed) == ("length", 12, None)
    assert "".join(t.text for t in out.details.tokens) == expected and len(out.details.tokens) == 12
    assert len(out.details.prefill) == out.details.prompt_tokens > 0
    assert client.text_generation(PROMPT, max_new_tokens=12, return_full_text=True) == PROMPT + expected
    kept = client.text_generation(PROMPT, max_new_tokens=2, truncate=2, details=True, decoder_input_details=True)
    assert kept.details.prompt_tokens == 2 and [t.id for t in kept.details.prefill] == [
        t.id for t in out.details.prefill[-2:]
    ]  # only the prompt's last two tokens


def test_a_stream_carries_one_token_per_event_and_the_text_and_details_last(client, expected):
    events = list(client.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True))
    assert len(events) == 12 and "".join(e.token.text for e in events) == expected
    assert all(e.generated_text is None for e in events[:-1]) and events[-1].generated_text == expected
    assert (events[-1].details.finish_reason, events[-1].details.generated_tokens) == ("length", 12)
    assert "".join(client.text_generation(PROMPT, max_new_tokens=12, stream=True)) == expected


def test_token_details_carry_transformers_own_log_probabilities_and_the_likeliest_tokens(client, expected):
    prompt = bundled().tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        generated = bundled().model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0]
        logprobs = bundled().model(generated[None]).logits[0].float().log_softmax(dim=-1)
    out = client.text_generation(PROMPT, max_new_tokens=6, details=True, decoder_input_details=True, top_n_tokens=3)
    tokens = generated.tolist()
    assert [t.id for t in out.details.prefill] == prompt and out.details.prefill[0].logprob is None
    for position, token in enumerate(out.details.prefill[1:] + out.details.tokens, start=1):
        assert token.id == tokens[position]
        assert token.logprob == pytest.approx(logprobs[position - 1, token.id].item(), abs=1e-4), position
    tops = [[_fields(t) for t in top] for top in out.details.top_tokens]  # the client leaves these as dicts
    for token, top in zip(out.details.tokens, tops, strict=True):
        assert len(top) == 3 and top[0]["id"] == token.id and top[0]["logprob"] == token.logprob  # greedy
    events = list(client.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True, top_n_tokens=2))
    assert [e.token.logprob for e in events] == pytest.approx([t.logprob for t in out.details.tokens], abs=1e-6)
    streamed = [[_fields(t)["id"] for t in e.top_tokens] for e in events]
    assert streamed == [[t["id"] for t in top[:2]] for top in tops]


def _fields(token) -> dict:
    return token if isinstance(token, dict) else vars(token)


def test_a_grammar_of_json_or_regex_shapes_the_text(client):
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "kind": {"enum": ["a", "b"]}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    }
    for seed in (1, 2, 3):
        text = client.text_generation(
            PROMPT, max_new_tokens=30, do_sample=True, seed=seed, grammar={"type": "json", "value": schema}
        )
        jsonschema.validate(json.loads(text), schema)
        dated = client.text_generation(
            PROMPT,
            max_new_tokens=30,
            do_sample=True,
            seed=seed,
            grammar={"type": "regex", "value": r"20[0-9]{2}-(0[1-9]|1[0-2])"},
        )
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", dated), dated
    with pytest.raises(Exception) as broken:  # the client raises its own error type for a 422
        client.text_generation(PROMPT, max_new_tokens=3, grammar={"type": "regex", "value": "[0-9"})
    assert "parameters.grammar.value" in str(broken.value) and "unclosed character class" in str(broken.value)


def test_best_of_answers_the_likeliest_of_its_samples(client):
    out = client.text_generation(PROMPT, max_new_tokens=8, do_sample=True, best_of=3, details=True)
    [*others] = out.details.best_of_sequences
    assert len(others) == 2 and len({out.details.seed, *(o.seed for o in others)}) == 3

    def total(tokens) -> float:
        return sum(t.logprob for t in tokens)

    assert all(total(out.details.tokens) >= total(o.tokens) for o in others)
    assert all(o.generated_tokens == len(o.tokens) for o in others)
    with pytest.raises(Exception) as seeded:
        client.text_generation(PROMPT, max_new_tokens=2, do_sample=True, best_of=2, seed=1)
    assert "best_of > 1 cannot be used with a seed" in str(seeded.value)


def test_a_stop_string_ends_the_text_before_it(client, expected):
    stop = expected[5:9]
    out = client.text_generation(PROMPT, max_new_tokens=12, stop=[stop], details=True)
    assert out.generated_text == expected[: expected.index(stop)]
    assert out.details.finish_reason == "stop_sequence"


def test_a_seeded_sampled_generation_reports_its_seed_and_repeats(client):
    first = client.text_generation(PROMPT, max_new_tokens=8, do_sample=True, temperature=0.8, seed=7, details=True)
    again = client.text_generation(PROMPT, max_new_tokens=8, do_sample=True, temperature=0.8, seed=7)
    assert first.details.seed == 7 and first.generated_text == again


def test_generate_stream_sends_data_events_and_bad_input_is_a_422_naming_the_field(server, expected):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12}}
    with httpx.stream("POST", server.url("/generate_stream"), json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(line[len("data:") :]) for line in response.iter_lines() if line]
    assert "".join(e["token"]["text"] for e in events) == expected and events[-1]["generated_text"] == expected
    for parameters, field in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_p": 1.0}, "top_p"),
        ({"best_of": 2}, "best_of"),
    ]:
        refused = httpx.post(server.url("/generate"), json={"inputs": PROMPT, "parameters": parameters}, timeout=10)
        assert refused.status_code == 422 and field in refused.json()["error"], refused.text
    both = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
    assert httpx.post(server.url("/generate_stream"), json=both, timeout=10).status_code == 422
