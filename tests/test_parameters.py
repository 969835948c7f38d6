"""Bodies of generate and generate_stream: every bound, and how defaults resolve."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.errors import describe_validation_error
from schemas.triton import GenerateRequest, GenerateStreamRequest

SHARED = [  # (parameter, just inside, just outside)
    ("temperature", 1.1e-6, 1e-6),
    ("top_p", 1.0, 1.0000001),
    ("top_p", 1.1e-6, 1e-6),
    ("typical_p", 1.0, 1.01),
    ("typical_p", 0.001, 0.0),
    ("seed", 1, 0),
    ("seed", 2**64 - 1, 2**64),
    ("repetition_penalty", 0.01, 0.0),
    ("max_new_tokens", 1, 0),
    ("max_new_tokens", 2**31 - 1, 2**31),
    ("batch_size", 1, 0),
    ("batch_size", 2**31 - 1, 2**31),
    ("top_k", 2**31 - 1, 2**31),
]
GENERATE_ONLY = [("top_k", 0, -1)]
STREAM_ONLY = [
    ("top_k", 1, 0),
    ("priority", 1, 0),
    ("priority", 5, 6),
    ("timeout", 1, 0),
    ("timeout", 3600, 3601),
    ("firstTokenCost", 0, -1),
]
CASES = [(GenerateRequest, *case) for case in SHARED + GENERATE_ONLY] + [
    (GenerateStreamRequest, *case) for case in SHARED + STREAM_ONLY
]


@pytest.mark.parametrize(("body", "name", "inside", "outside"), CASES)
def test_both_sides_of_every_bound(body, name, inside, outside):
    body.model_validate({"text_input": "x", "parameters": {name: inside}})
    with pytest.raises(ValidationError) as raised:
        body.model_validate({"text_input": "x", "parameters": {name: outside}})
    [error] = raised.value.errors()
    message = describe_validation_error(error)
    assert message.startswith(f"parameters.{name}: ") and f"received {outside!r}" in message


@pytest.mark.parametrize("body", [GenerateRequest, GenerateStreamRequest])
def test_types_are_strict_and_null_means_not_given(body):
    for wrong in ({"max_new_tokens": 5.0}, {"max_new_tokens": "5"}, {"details": "yes"}, {"temperature": "1"}):
        with pytest.raises(ValidationError):
            body.model_validate({"text_input": "x", "parameters": wrong})
    parsed = body.model_validate({"text_input": "x", "parameters": {"seed": None, "temperature": 1}})
    assert parsed.parameters.seed is None and parsed.parameters.temperature == 1.0


def test_each_route_accepts_only_its_own_parameters():
    with pytest.raises(ValidationError, match="priority"):
        GenerateRequest.model_validate({"text_input": "x", "parameters": {"priority": 1}})
    with pytest.raises(ValidationError, match="perf_stat"):
        GenerateStreamRequest.model_validate({"text_input": "x", "parameters": {"perf_stat": False}})


def test_id_and_text_input_limits():
    GenerateRequest.model_validate({"id": "a" * 256, "text_input": "x" * 512 * 1024})
    for bad in (
        {"id": "a" * 257, "text_input": "x"},
        {"id": "a b", "text_input": "x"},
        {"text_input": ""},
        {"text_input": "x" * (512 * 1024 + 1)},
        {},
    ):
        with pytest.raises(ValidationError):
            GenerateRequest.model_validate(bad)
    GenerateStreamRequest.model_validate({"text_input": "x" * 4 * 1024 * 1024})


def test_defaults_resolve_to_greedy_with_the_drawn_seed():
    sampling = GenerateStreamRequest.model_validate({"text_input": "x"}).parameters.sampling(seed=77)
    assert (sampling.do_sample, sampling.seed, sampling.max_new_tokens) == (False, 77, 20)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.typical_p) == (1.0, 0, 1.0, None)


@pytest.mark.parametrize(
    ("parameters", "samples"),
    [
        ({}, False),
        ({"temperature": 1.0}, False),
        ({"temperature": 0.7}, True),
        ({"top_k": 5}, True),
        ({"top_p": 0.9}, True),
        ({"typical_p": 0.5}, True),
        ({"top_k": 5, "do_sample": False}, False),
        ({"do_sample": True}, True),
    ],
)
def test_sampling_is_on_when_asked_for(parameters, samples):
    params = GenerateStreamRequest.model_validate({"text_input": "x", "parameters": parameters}).parameters
    assert params.sampling(seed=1).do_sample is samples


def test_a_given_seed_wins_over_the_drawn_one():
    params = GenerateRequest.model_validate({"text_input": "x", "parameters": {"seed": 123}}).parameters
    assert params.sampling(seed=77).seed == 123
