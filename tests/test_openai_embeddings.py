"""POST /v1/embeddings through the official `openai` SDK, unmodified, against `tokenrelay serve`.

Each vector is compared with transformers' own hidden states of the bundled
model (float32, after the final norm), pooled as the served model is: the
last token's, L2-normalised (it has no sentence-transformers modules).
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from schemas.embeddings import MAX_INPUTS
from tests.reference import bundled, embedding

MODEL = "tokenrelay-tiny"
TEXTS = ["The os module provides", "A context manager is", "def main():\n"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def _ids(text: str) -> list[int]:
    return bundled().tokenizer(text)["input_ids"]


def _assert_embeds(vector, token_ids: list[int]) -> None:
    difference = (torch.tensor(vector, dtype=torch.float32) - embedding(token_ids)).abs().max().item()
    assert difference <= TOLERANCE, difference


def test_texts_and_token_arrays_embed_as_transformers_hidden_states_in_order_with_usage(client):
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert [d.index for d in one.data] == [0] and one.model == MODEL and one.object == "list"
    _assert_embeds(one.data[0].embedding, _ids(TEXTS[0]))
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(_ids(TEXTS[0]))

    many = client.embeddings.create(model="gpt-tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for done, text in zip(many.data, TEXTS, strict=True):
        _assert_embeds(done.embedding, _ids(text))
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(len(_ids(t)) for t in TEXTS)

    tokens = client.embeddings.create(model=MODEL, input=_ids(TEXTS[1]), encoding_format="float")
    _assert_embeds(tokens.data[0].embedding, _ids(TEXTS[1]))
    arrays = client.embeddings.create(model=MODEL, input=[_ids(t) for t in TEXTS], encoding_format="float")
    for done, text in zip(arrays.data, TEXTS, strict=True):
        _assert_embeds(done.embedding, _ids(text))
    assert arrays.usage.prompt_tokens == many.usage.prompt_tokens


def test_base64_is_the_float_answers_little_endian_float32_bytes(client):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() for d in raw.data]
    assert decoded == [d.embedding for d in floats.data]
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    assert [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS).data] == decoded


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"input": "x", "dimensions": 64}, "dimensions: no model here is served with shortened embeddings"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate": 4}, "truncate is not a known field"),
        ({"input": []}, "input: there is nothing to embed"),
        ({"input": ["x", ""]}, "input: item 1 is empty"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, f"at most {MAX_INPUTS} inputs per request are allowed; received 2049"),
        ({"input": [[1, -1]]}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, named):
    answer = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]["message"]


def test_inputs_the_model_cannot_take_are_refused_naming_which(server, client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    outside = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, "input": [[1], [1, 32000]]}, timeout=30)
    assert outside.status_code == 424
    assert outside.json()["error"]["message"] == "input 1: token id 32000 is outside the vocabulary [0, 32000)"
    long = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, "input": ["x", "y " * 5000]}, timeout=30)
    assert long.status_code == 424 and "tokens after tokenization; at most" in long.json()["error"]["message"]
