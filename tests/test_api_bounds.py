"""Both sides of every bound of every parameter on every route, over HTTP.

Just inside a bound: 200. Just outside: 422 naming the field and the value.
The ranges below are written from ../shared/spec/API.md and the source
documents, not read from our own schemas, so that a schema that drifts from
the contract fails here.
"""

from __future__ import annotations

import httpx
import pytest

from tests.processes import serving

MODEL = "tokenrelay-tiny"
I32, U64 = 2**31 - 1, 2**64 - 1

ROUTES = {  # route -> (path, body around parameters)
    "generate": (f"/v2/models/{MODEL}/generate", {"text_input": "x"}),
    "generate_stream": (f"/v2/models/{MODEL}/generate_stream", {"text_input": "x"}),
    "infer_token": ("/infer_token", {"input_id": [5]}),
    "infer": ("/infer", {"inputs": "x"}),
    "triton_infer": (
        f"/v2/models/{MODEL}/infer",
        {
            "inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [5]}],
            "outputs": [{"name": "output0"}],
        },
    ),
}

COMMON = [  # (parameter, just inside, just outside)
    ("temperature", 1.1e-6, 1e-6),
    ("max_new_tokens", 1, 0),
    ("max_new_tokens", I32, I32 + 1),
    ("repetition_penalty", 0.01, 0.0),
    ("seed", 1, 0),
    ("seed", U64, U64 + 1),
    ("top_p", 1.1e-6, 1e-6),
    ("top_k", I32, I32 + 1),
]
TYPICAL_P = [("typical_p", 0.001, 0.0), ("typical_p", 1.0, 1.01)]
TOP_P_UP_TO_ONE = [("top_p", 1.0, 1.0000001)]
TOP_K_FROM_ONE = [("top_k", 1, 0)]
BATCH_SIZE = [("batch_size", 1, 0), ("batch_size", I32, I32 + 1)]
PRIORITY_TIMEOUT = [("priority", 1, 0), ("priority", 5, 6), ("timeout", 1, 0), ("timeout", 3600, 3601)]
PER_ROUTE = {
    "generate": COMMON + TYPICAL_P + TOP_P_UP_TO_ONE + BATCH_SIZE + PRIORITY_TIMEOUT + [("top_k", 0, -1)],
    "generate_stream": COMMON
    + TYPICAL_P
    + TOP_P_UP_TO_ONE
    + TOP_K_FROM_ONE
    + BATCH_SIZE
    + PRIORITY_TIMEOUT
    + [("firstTokenCost", 0, -1), ("decodeTime", [0], [-1])],
    "infer_token": COMMON + TYPICAL_P + TOP_K_FROM_ONE + PRIORITY_TIMEOUT + [("top_p", 0.999, 1.0)],
    "infer": COMMON + TYPICAL_P + TOP_K_FROM_ONE + PRIORITY_TIMEOUT + [("top_p", 0.999, 1.0)],
    "triton_infer": COMMON + TOP_P_UP_TO_ONE + TOP_K_FROM_ONE + BATCH_SIZE + PRIORITY_TIMEOUT,
}
CASES = [(route, *case) for route, cases in PER_ROUTE.items() for case in cases]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Two tokens per request at most: hundreds of requests stay fast.
    with serving(tmp_path_factory.mktemp("bounds"), "--max-iter-times", "2", "--max-request-length", "8") as served:
        yield served


def _post(server, route: str, body: dict) -> httpx.Response:
    path, _ = ROUTES[route]
    with httpx.stream("POST", server.url(path), json=body, timeout=60) as response:
        response.read()  # a stream is read to its end
        return response


def _with_parameter(route: str, name: str, value) -> dict:
    _, base = ROUTES[route]
    return {**base, "parameters": {name: value}}


@pytest.mark.parametrize(("route", "name", "inside", "outside"), CASES)
def test_both_sides_of_a_parameter_bound(server, route, name, inside, outside):
    accepted = _post(server, route, _with_parameter(route, name, inside))
    assert accepted.status_code == 200, accepted.text
    refused = _post(server, route, _with_parameter(route, name, outside))
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["error_type"] == "Input Validation Error"
    assert (
        f"parameters.{name}" in body["error"]
        and repr(outside if not isinstance(outside, list) else outside[0]) in body["error"]
    )


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("generate", {"id": "a" * 257, "text_input": "x"}, "id"),
        ("generate", {"id": "not ok", "text_input": "x"}, "id"),
        ("generate_stream", {"id": "a" * 257, "text_input": "x"}, "id"),
        ("generate", {"text_input": ""}, "text_input"),
        ("generate", {"text_input": "x" * (512 * 1024 + 1)}, "text_input"),
        ("generate_stream", {"text_input": "x" * (4 * 1024 * 1024 + 1)}, "text_input"),
        ("generate_stream", {"text_input": [{"type": "text", "text": "x"}] * 21}, "text_input"),
        ("generate_stream", {"text_input": []}, "text_input"),
        ("infer_token", {"input_id": []}, "input_id"),
        ("infer_token", {"input_id": [-1]}, "input_id.0"),
        ("infer_token", {"input_id": [1024 * 1024 + 1]}, "input_id.0"),
        ("infer_token", {"input_id": [5], "inputs": "x"}, "input_id and inputs cannot be given together"),
        ("infer_token", {}, "one of input_id and inputs is required"),
        ("infer_token", {"input_id": [5], "stream": "yes"}, "stream"),
        ("infer", {"inputs": ""}, "inputs"),
        ("generate", {"text_input": "x", "parameters": {"max_new_tokens": 5.0}}, "parameters.max_new_tokens"),
        ("generate", {"text_input": "x", "parameters": {"do_sample": "true"}}, "parameters.do_sample"),
    ],
)
def test_other_fields_are_checked_too(server, route, body, field):
    refused = _post(server, route, body)
    assert refused.status_code == 422 and field in refused.json()["error"], refused.text


@pytest.mark.parametrize(
    ("route", "body", "error"),
    [
        ("generate", {"text_input": ""}, "text_input: String should have at least 1 character; received ''"),
        ("generate_stream", {"text_input": ""}, "text_input: String should have at least 1 character; received ''"),
        ("infer", {"inputs": ""}, "inputs: String should have at least 1 character; received ''"),
        (
            "generate",
            {"text_input": "x" * (512 * 1024 + 1)},
            "text_input: String should have at most 524288 characters; received a string of 524289 characters",
        ),
        (
            "generate_stream",
            {"text_input": 5},
            "text_input: Input should be a text or a list of text and media items; received 5",
        ),
        (
            "generate_stream",
            {"text_input": [{"text": ""}]},
            "text_input.0.text: String should have at least 1 character",
        ),
    ],
)
def test_a_bad_prompt_is_one_message_naming_the_field_and_the_rule(server, route, body, error):
    refused = _post(server, route, body)
    assert refused.status_code == 422 and refused.json()["error"].startswith(error), refused.text
    assert "constrained-str" not in refused.text and "tagged-union" not in refused.text


@pytest.mark.parametrize(
    ("route", "unknown", "named"),
    [
        ("generate", {"parameters": {"frequency_penalty": 0.5}}, "parameters.frequency_penalty"),
        ("generate", {"temperature": 0.5}, "temperature"),
        ("infer", {"parameters": {"ignore_eos": False, "n": 2}, "model": "x"}, "model, parameters.n"),
        (
            "triton_infer",
            {"outputs": [{"name": "output0", "parameters": {"classification": 3}}]},
            "outputs.0.parameters.classification",
        ),
    ],
)
def test_a_field_no_document_lists_is_ignored_and_named(server, route, unknown, named):
    """The answer is the one without the field (greedy: the same tokens), with the field named in a header."""
    _, base = ROUTES[route]
    plain = _post(server, route, base)
    answer = _post(server, route, {**base, **unknown})
    assert answer.status_code == 200 and answer.headers["x-ignored-fields"] == named, answer.text
    assert answer.json() == {**plain.json(), **({"id": answer.json()["id"]} if "id" in plain.json() else {})}
    assert "x-ignored-fields" not in plain.headers


@pytest.mark.parametrize("route", ["generate", "infer", "generate_stream"])
def test_the_grammar_extension_shapes_the_text_on_mindies_routes_too(server, route):
    grammar = {"type": "regex", "value": "(yes|no)"}
    answer = _post(server, route, _with_parameter(route, "grammar", grammar))
    assert answer.status_code == 200, answer.text
    if route == "generate":
        assert answer.json()["text_output"] in ("yes", "no")
    elif route == "infer":
        assert answer.json()["generated_text"] in ("yes", "no")
    broken = _post(server, route, _with_parameter(route, "grammar", {"type": "json", "value": {"not": {}}}))
    assert broken.status_code == 422 and "parameters.grammar.value" in broken.json()["error"], broken.text
    assert 'Unimplemented keys: ["not"]' in broken.json()["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "said"),
    [
        (ROUTES["generate"][0], b"[" * 100_000 + b"]" * 100_000, 422, "nested more than"),
        (
            ROUTES["infer"][0],
            b'{"inputs": "x", "parameters": {"seed": ' + b"7" * 5000 + b"}}",
            422,
            "more than 4300 digits",
        ),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested more than"),
        (ROUTES["generate"][0], b'{"text_input": "x", "parameters": {"temperature": Infinity}}', 422, "temperature"),
        (ROUTES["generate_stream"][0], b'{"text_input": "x", "parameters": {"top_p": NaN}}', 422, "top_p"),
        ("/generate", b'{"inputs": "x", "parameters": {"repetition_penalty": Infinity}}', 422, "repetition_penalty"),
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [], "temperature": NaN}' % MODEL.encode(),
            400,
            "temperature",
        ),
        ("/v1/completions", b'{"model": "%s", "prompt": "x", "top_p": -Infinity}' % MODEL.encode(), 400, "top_p"),
    ],
)
def test_json_python_reads_but_no_number_is_named(server, path, body, status, said):
    """Nesting and digits past the parser's limits, and NaN/Infinity where a number is expected."""
    refused = httpx.post(server.url(path), content=body, timeout=60)
    assert refused.status_code == status, refused.text
    error = refused.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert said in message, message
    if said in ("temperature", "top_p", "repetition_penalty"):
        assert "finite number" in message, message


def _triton(**overrides) -> dict:
    tensor = {"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [5, 6], **overrides}
    return {"inputs": [tensor], "outputs": [{"name": "output0"}]}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_triton(shape=[2]), None),
        (_triton(shape=[1, 3]), "shape [1, 3] does not fit data of length 2"),
        (_triton(shape=[2, 1]), "shape [2, 1] does not fit"),
        (_triton(name="input1"), "inputs.0.name"),
        (_triton(datatype="INT32"), "inputs.0.datatype"),
        (_triton(data=[]), "inputs.0.data"),
        ({**_triton(), "inputs": _triton()["inputs"] * 2}, "inputs"),
        ({**_triton(), "outputs": []}, "outputs"),
        (
            {**_triton(), "parameters": {"seed": 1}, "inputs": [{**_triton()["inputs"][0], "parameters": {"seed": 2}}]},
            "either at the top level or in inputs[0]",
        ),
    ],
)
def test_triton_infer_tensors(server, body, message):
    answer = _post(server, "triton_infer", body)
    if message is None:
        assert answer.status_code == 200, answer.text
    else:
        assert answer.status_code == 422 and message in answer.json()["error"], answer.text


def test_parameters_may_also_sit_in_the_input_tensor(server):
    tensor = {**_triton()["inputs"][0], "parameters": {"max_new_tokens": 1}}
    answer = _post(server, "triton_infer", {**_triton(), "inputs": [tensor]})
    assert answer.status_code == 200 and answer.json()["outputs"][0]["shape"] == [1, 1]


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("infer_token", {"input_id": [31999]}, None),
        ("infer_token", {"input_id": [32000]}, "token id 32000 is outside the vocabulary [0, 32000)"),
        ("infer_token", {"input_id": [1024 * 1024]}, "outside the vocabulary"),
        ("triton_infer", _triton(data=[5, 32000]), "token id 32000 is outside the vocabulary"),
        ("infer_token", {"input_id": [7] * 2048}, None),
        ("infer_token", {"input_id": [7] * 2049}, "the prompt has 2049 tokens; at most 2048 are allowed"),
        ("generate", {"text_input": "x" * 512 * 1024}, "tokens after tokenization; at most 2048 are allowed"),
    ],
)
def test_what_the_model_cannot_take_is_424(server, route, body, message):
    answer = _post(server, route, body)
    if message is None:
        assert answer.status_code == 200, answer.text
    else:
        assert answer.status_code == 424, answer.text
        assert answer.json()["error_type"] == "Generation Error" and message in answer.json()["error"]
