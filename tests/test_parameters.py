"""Parameters: strict types, each route's own set, and how defaults resolve (bounds: test_api_bounds.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.body import ignored_fields, reading_body
from schemas.mindie import InferTokenRequest
from schemas.tgi import TgiRequest
from schemas.triton import GenerateRequest, GenerateStreamRequest, InferRequest


@pytest.mark.parametrize("body", [GenerateRequest, GenerateStreamRequest])
def test_types_are_strict_and_null_means_not_given(body):
    for wrong in ({"max_new_tokens": 5.0}, {"max_new_tokens": "5"}, {"details": "yes"}, {"temperature": "1"}):
        with pytest.raises(ValidationError):
            body.model_validate({"text_input": "x", "parameters": wrong})
    parsed = body.model_validate({"text_input": "x", "parameters": {"seed": None, "temperature": 1}})
    assert parsed.parameters.seed is None and parsed.parameters.temperature == 1.0


def test_a_route_reads_what_its_siblings_documents_list_and_ignores_what_no_document_lists():
    generate = GenerateRequest.model_validate({"text_input": "x", "parameters": {"priority": 1, "timeout": 30}})
    assert (generate.parameters.given("priority"), generate.parameters.given("timeout")) == (1, 30)
    stream = GenerateStreamRequest.model_validate({"text_input": "x", "parameters": {"perf_stat": True}})
    assert stream.parameters.given("perf_stat") is True
    for body in (GenerateRequest, GenerateStreamRequest):
        given = {"text_input": "x", "parameters": {"frequency_penalty": 0.5}}
        ignoring = body.model_validate(given)
        assert ignored_fields(ignoring) == {("parameters", "frequency_penalty"): 0.5}
        assert ignoring.parameters.given("frequency_penalty") is None
        assert ignoring.parameters.sampling(seed=1) == body.model_validate({"text_input": "x"}).parameters.sampling(1)
        with reading_body(reject=True), pytest.raises(ValidationError) as refused:
            body.model_validate(given)
        [error] = refused.value.errors()
        assert (error["type"], error["loc"], error["input"]) == (
            "extra_forbidden",
            ("parameters", "frequency_penalty"),
            0.5,
        )


@pytest.mark.parametrize(
    ("body", "prompt"),
    [
        (GenerateRequest, {"text_input": "x"}),
        (GenerateStreamRequest, {"text_input": "x"}),
        (InferTokenRequest, {"inputs": "x"}),
        (TgiRequest, {"inputs": "x"}),
    ],
)
def test_ignore_eos_is_read_on_every_generation_route(body, prompt):
    assert body.model_validate(prompt).parameters.sampling(seed=1).ignore_eos is False
    parsed = body.model_validate({**prompt, "parameters": {"ignore_eos": True}})
    assert parsed.parameters.sampling(seed=1).ignore_eos is True and ignored_fields(parsed) == {}
    with pytest.raises(ValidationError, match="parameters.ignore_eos"):
        body.model_validate({**prompt, "parameters": {"ignore_eos": "yes"}})


def test_ignore_eos_is_read_on_the_token_route_in_either_place():
    tensor = {"name": "input0", "shape": [1], "datatype": "UINT32", "data": [1]}
    for where in ({"parameters": {"ignore_eos": True}}, {"inputs": [{**tensor, "parameters": {"ignore_eos": True}}]}):
        infer = InferRequest.model_validate({"inputs": [tensor], **where})
        assert infer.effective_parameters.sampling(seed=1).ignore_eos is True and ignored_fields(infer) == {}


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
