"""KServe v2 as Triton's own HTTP client speaks it: tritonclient.http against the Triton-compatible routes.

The client's defaults (binary tensor data both ways, `binary_data` on every
requested output) and its JSON mode, on `tokenrelay serve` and on Kafka (a
gateway and a worker): the ids it reads back are those the plain JSON infer
answers for the same greedy request. Then what a binary body can get wrong,
on a gateway in this process with no worker (each is refused before any
generation starts).
"""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from gateway.bodies.kserve_binary import _header_length
from gateway.errors import ApiError
from gateway.settings import GatewaySettings
from schemas.triton import InferRequest
from tests.processes import on_kafka
from tests.test_api_errors import in_process_gateway
from tests.test_api_examples import _stream
from tests.test_gateway_state import _heartbeat

MODEL = "tokenrelay-tiny"
PROMPT_IDS = [1, 415, 3497, 4597, 5312, 28713]
NEW_TOKENS = 8
INFER = f"/v2/models/{MODEL}/infer"
TENSOR = {"name": "input0", "shape": [1], "datatype": "UINT32", "data": [5]}


@pytest.fixture(scope="module", params=["serve", pytest.param("kafka", marks=pytest.mark.kafka)])
def base_url(request, tmp_path_factory):
    if request.param == "serve":
        yield request.getfixturevalue("compat_server").base_url
        return
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    with on_kafka(tmp_path_factory.mktemp("kserve"), bootstrap, worker_args=("--served-model-name", MODEL)) as (
        gateway,
        _,
    ):
        yield gateway.base_url


@pytest.fixture
def client(base_url):
    client = triton.InferenceServerClient(base_url.removeprefix("http://"), network_timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="module")
def json_ids(base_url) -> list[int]:
    """What the plain JSON infer answers (no binary data, no KServe parameters) for the greedy request: the ids
    /infer_token streams for it."""
    body = {
        "inputs": [{"name": "input0", "shape": [1, len(PROMPT_IDS)], "datatype": "UINT32", "data": PROMPT_IDS}],
        "outputs": [{"name": "output0"}],
        "parameters": {"max_new_tokens": NEW_TOKENS},
    }
    answer = httpx.post(base_url + INFER, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    ids = answer.json()["outputs"][0]["data"]
    assert len(ids) == NEW_TOKENS and len(set(ids)) > 1, ids  # a real generation, not a constant
    streamed = _stream(
        base_url + "/infer_token",
        {"input_id": PROMPT_IDS, "stream": True, "parameters": {"max_new_tokens": NEW_TOKENS}},
        prefix="data: ",
    )
    assert [token_id for event in streamed for token_id in event["token"]["id"]] == ids
    return ids


def _prompt(binary_data: bool) -> triton.InferInput:
    tensor = triton.InferInput("input0", [1, len(PROMPT_IDS)], "UINT32")
    tensor.set_data_from_numpy(np.array([PROMPT_IDS], dtype=np.uint32), binary_data=binary_data)
    return tensor


def test_the_clients_defaults_binary_tensors_both_ways_give_the_json_answers_ids(client, json_ids):
    result = client.infer(MODEL, [_prompt(binary_data=True)], parameters={"max_new_tokens": NEW_TOKENS})
    output = result.get_output("output0")
    assert output["parameters"] == {"binary_data_size": 4 * NEW_TOKENS} and "data" not in output
    assert result.as_numpy("output0").tolist() == [json_ids]
    asked = client.infer(
        MODEL,
        [_prompt(binary_data=True)],
        outputs=[triton.InferRequestedOutput("output0")],  # binary_data=True, the default
        priority=1,
        parameters={"max_new_tokens": NEW_TOKENS},
    )
    assert asked.as_numpy("output0").tolist() == [json_ids]


def test_json_tensors_with_output_parameters(client, json_ids):
    result = client.infer(
        MODEL,
        [_prompt(binary_data=False)],
        outputs=[triton.InferRequestedOutput("output0", binary_data=False)],
        request_id="kserve-json",
        parameters={"max_new_tokens": NEW_TOKENS},
    )
    assert result.get_response() == {
        "id": "kserve-json",
        "outputs": [{"name": "output0", "shape": [1, NEW_TOKENS], "datatype": "UINT32", "data": json_ids}],
    }
    assert result.as_numpy("output0").dtype == np.uint32


def test_metadata_and_configuration(client):
    server = client.get_server_metadata()
    assert server["name"] == "tokenrelay" and server["extensions"] == ["binary_tensor_data", "model_configuration"]
    tensors = {"inputs": [{"name": "input0", "datatype": "UINT32", "shape": [-1]}]}
    assert client.get_model_metadata(MODEL) == {
        "name": MODEL,
        "versions": [],
        "platform": "transformers",
        **tensors,
        "outputs": [{"name": "output0", "datatype": "UINT32", "shape": [-1]}],
    }
    assert client.get_model_config(MODEL) == {
        "name": MODEL,
        "platform": "transformers",
        "max_batch_size": 0,
        "input": [{"name": "input0", "data_type": "TYPE_UINT32", "dims": [-1]}],
        "output": [{"name": "output0", "data_type": "TYPE_UINT32", "dims": [-1]}],
    }
    assert client.is_server_live() and client.is_model_ready(MODEL)


def test_a_binary_answer_is_framed_as_triton_frames_it(base_url, json_ids):
    """The bytes themselves, without the client: header length, content type, little-endian ids."""
    tensor = _binary_input(len(PROMPT_IDS))
    tensor["parameters"]["max_new_tokens"] = NEW_TOKENS  # MindIE's sampling parameters may sit beside it
    header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    body = header + struct.pack(f"<{len(PROMPT_IDS)}I", *PROMPT_IDS)
    answer = httpx.post(base_url + INFER, content=body, headers={"Inference-Header-Content-Length": str(len(header))})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/octet-stream"
    length = int(answer.headers["inference-header-content-length"])
    assert struct.unpack(f"<{NEW_TOKENS}I", answer.content[length:]) == tuple(json_ids)
    assert json.loads(answer.content[:length])["outputs"][0]["parameters"] == {"binary_data_size": 4 * NEW_TOKENS}


def _binary_input(ids: int, size: int | None = None) -> dict:
    size = 4 * ids if size is None else size
    return {"name": "input0", "shape": [1, ids], "datatype": "UINT32", "parameters": {"binary_data_size": size}}


@pytest.mark.parametrize(
    ("output_parameters", "request_parameters", "binary"),
    [
        (None, None, False),
        (None, {"binary_data_output": True}, True),
        ({"binary_data": False}, {"binary_data_output": True}, False),
        ({"binary_data": True}, {"binary_data_output": False}, True),
        ({}, {"seed": 3}, False),
    ],
)
def test_an_outputs_own_binary_data_wins_over_binary_data_output(output_parameters, request_parameters, binary):
    output = {"name": "output0"} if output_parameters is None else {"name": "o", "parameters": output_parameters}
    body = {"inputs": [TENSOR], "outputs": [output]}
    if request_parameters is not None:
        body["parameters"] = request_parameters
    assert InferRequest.model_validate(body).binary_output is binary


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway in this process that a worker announced `tiny` to, and no worker: only refusals come back.

    With --reject-unknown-fields, so that a KServe parameter not served is refused by name (by default it is
    ignored and named: test_ignored_fields.py)."""
    settings = GatewaySettings(reject_unknown_fields=True)
    client, service = in_process_gateway(tmp_path_factory.mktemp("kserve-gateway"), settings)
    with client:
        service.directory.observe(_heartbeat("w1", ["tiny"]))
        yield client


def _framed(header: dict, data: bytes, declared: int | str | None = None) -> tuple[bytes, dict]:
    """The body, and its header length as declared (the JSON's own by default; latin-1, as HTTP carries it)."""
    text = json.dumps(header).encode()
    length = str(len(text) if declared is None else declared).encode("latin-1")
    return text + data, {"Inference-Header-Content-Length": length}


TWO_IDS = struct.pack("<2I", 5, 6)


@pytest.mark.parametrize(
    ("header", "data", "declared", "status", "error"),
    [
        (
            {"inputs": [_binary_input(2)]},
            TWO_IDS,
            10_000,
            400,
            "the Inference-Header-Content-Length header says the JSON header has 10000 bytes; the body has only",
        ),
        ({"inputs": [_binary_input(2)]}, TWO_IDS, "-1", 400, "header must be a number of bytes; received '-1'"),
        (
            {"inputs": [_binary_input(2, size=12)]},
            TWO_IDS,
            None,
            400,
            "inputs.0.parameters.binary_data_size is 12, but 8 bytes of binary data follow the JSON header",
        ),
        (
            {"inputs": [_binary_input(2, size=6)]},
            TWO_IDS[:6],
            None,
            400,
            "inputs.0.parameters.binary_data_size 6 is not a multiple of 4",
        ),
        (
            {"inputs": [_binary_input(3, size=8)]},
            TWO_IDS,
            None,
            400,
            "inputs.0: shape [1, 3] does not fit binary data of length 2: use [n] or [1, n]",
        ),
        (
            {"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [5]}]},
            TWO_IDS,
            None,
            400,
            "8 bytes of binary data follow the JSON header, but no input declares them",
        ),
        ({"inputs": [_binary_input(2, size=0)]}, b"", None, 422, "inputs.0.parameters.binary_data_size"),
        (
            {"inputs": [{**_binary_input(1), "data": [5]}]},
            b"",
            None,
            422,
            "give data or parameters.binary_data_size (the ids as binary data), not both",
        ),
    ],
)
def test_a_binary_body_that_does_not_add_up_is_refused_saying_why(gateway, header, data, declared, status, error):
    body, headers = _framed(header, data, declared)
    answer = gateway.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert answer.status_code == status and error in answer.json()["error"], answer.text
    assert answer.json()["error_type"] == "Input Validation Error"


def test_a_header_length_that_only_str_isdigit_calls_a_number_is_a_400_too():
    """A "²" (a latin-1 header byte) is a digit to str.isdigit(), not to int(). The test client re-encodes header
    values as UTF-8, so this one is checked below HTTP."""
    with pytest.raises(ApiError) as refused:
        _header_length("\xb2", 100)
    assert refused.value.status == 400 and "must be a number of bytes; received '²'" in refused.value.body.error


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (
            {"inputs": [TENSOR], "outputs": [{"name": "output0", "parameters": {"classification": 3}}]},
            422,
            "outputs.0.parameters.classification is not a known field",
        ),
        (
            {"inputs": [TENSOR], "outputs": [{"name": "output0", "parameters": {"binary_data": "yes"}}]},
            422,
            "outputs.0.parameters.binary_data: Input should be a valid boolean; received 'yes'",
        ),
        ({"inputs": [TENSOR], "parameters": {"binary_data_output": 1}}, 422, "parameters.binary_data_output"),
        (
            {"inputs": [{**_binary_input(1, size=4 * 1024 * 1024 + 1)}]},
            422,
            "inputs.0.parameters.binary_data_size: Input should be less than or equal to 4194304",
        ),
        (
            {"inputs": [_binary_input(1)]},
            400,
            "inputs.0.parameters.binary_data_size is set, but the request has no Inference-Header-Content-Length",
        ),
        ({"inputs": [TENSOR], "outputs": []}, 422, "outputs"),
    ],
)
def test_kserve_parameters_out_of_bounds_are_refused_by_name(gateway, body, status, error):
    answer = gateway.post("/v2/models/tiny/infer", json=body)
    assert answer.status_code == status and error in answer.json()["error"], answer.text
    assert "belongs" not in answer.json()["error"]
