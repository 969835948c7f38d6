"""POST /tokenize and /detokenize (vLLM's bodies, and TGI's on the same path) against `tokenrelay serve`.

Every answer is compared with the bundled model's own tokenizer, as
transformers loads it: ids, token strings, chat templates, offsets.
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from workers.bundled import BUNDLED_MODEL
from workers.engine.config import EngineConfig

TEXT = "Hello wörld, 日本 ok"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "Adds.", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def _ok(server, path: str, body: dict):
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_text_tokenizes_as_the_tokenizer_does_and_detokenizes_back(server, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    answer = _ok(server, "/tokenize", {"model": "gpt-tiny", "prompt": TEXT, "return_token_strs": True})
    assert answer == {
        "count": len(ids),
        "max_model_len": EngineConfig().max_seq_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    assert _ok(server, "/tokenize", {"prompt": TEXT})["tokens"] == ids  # no model: the default one
    bare = _ok(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer(TEXT, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None
    assert _ok(server, "/detokenize", {"tokens": bare["tokens"]}) == {"prompt": TEXT}
    assert _ok(server, "/detokenize", {"model": "tokenrelay-tiny", "tokens": ids}) == {"prompt": "<s>" + TEXT}
    assert _ok(server, "/tokenize", {"prompt": ""})["tokens"] == tokenizer("")["input_ids"]


def test_a_chat_tokenizes_as_its_chat_template_renders_it(server, tokenizer):
    answer = _ok(server, "/tokenize", {"messages": CHAT, "tools": [TOOL], "return_token_strs": True})
    expected = tokenizer.apply_chat_template(CHAT, tools=[TOOL], add_generation_prompt=True, tokenize=True)
    assert answer["tokens"] == expected["input_ids"] and answer["count"] == len(expected["input_ids"])
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(expected["input_ids"])
    replying = [*CHAT, {"role": "assistant", "content": "It is"}]
    body = {"messages": replying, "add_generation_prompt": False, "continue_final_message": True}
    expected = tokenizer.apply_chat_template(replying, continue_final_message=True, tokenize=True)
    assert _ok(server, "/tokenize", body)["tokens"] == expected["input_ids"]
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    with_bos = _ok(server, "/tokenize", {"messages": CHAT, "add_special_tokens": True})["tokens"]
    assert with_bos == tokenizer(rendered)["input_ids"] and with_bos[:2] == [
        1,
        1,
    ]  # the tokenizer's BOS and the template's


def test_tgi_tokenize_answers_each_token_with_its_offsets_into_inputs(server, tokenizer):
    encoded = tokenizer(TEXT, return_offsets_mapping=True)
    tokens = _ok(server, "/tokenize", {"inputs": TEXT})
    assert [t["id"] for t in tokens] == encoded["input_ids"]
    assert [(t["start"], t["stop"]) for t in tokens] == [tuple(o) for o in encoded["offset_mapping"]]
    assert all(t["text"] == TEXT[t["start"] : t["stop"]] for t in tokens) and tokens[1]["text"] == "Hello"
    assert tokens[0] == {"id": 1, "text": "", "start": 0, "stop": 0}  # BOS, which has no characters
    truncated = _ok(server, "/tokenize", {"inputs": TEXT, "parameters": {"truncate": 3}})
    assert truncated == tokens[-3:]


@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        ("/tokenize", {"inputs": TEXT, "prompt": TEXT}, 422, "exactly one of inputs (TGI's), prompt or messages"),
        ("/tokenize", {}, 422, "exactly one of inputs"),
        ("/tokenize", {"prompt": "x" * (512 * 1024 + 1)}, 422, "prompt:"),
        ("/tokenize", {"prompt": TEXT, "add_special_tokens": "maybe"}, 422, "add_special_tokens:"),
        ("/tokenize", {"messages": []}, 422, "messages:"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 422, "continue_final_message and add_gen"),
        ("/tokenize", {"messages": CHAT, "tools": [TOOL] * 129}, 422, "tools:"),
        ("/tokenize", {"inputs": ""}, 422, "inputs:"),
        ("/tokenize", {"inputs": TEXT, "parameters": {"truncate": 0}}, 422, "parameters.truncate:"),
        ("/tokenize", {"prompt": TEXT, "model": "nope"}, 404, "model nope is not served"),
        ("/detokenize", {"tokens": [1, 32000]}, 424, "tokens: token id 32000 is outside the vocabulary [0, 32000)"),
        ("/detokenize", {"tokens": [-1]}, 422, "tokens.0:"),
        ("/detokenize", {"tokens": list(range(2049))}, 424, "tokens: the prompt has 2049 tokens; at most 2048"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, status, named):
    response = _post(server, path, body)
    assert response.status_code == status and named in response.json()["error"], response.text


def test_a_prompt_over_the_input_limit_is_refused_by_the_worker(server):
    response = _post(server, "/tokenize", {"prompt": "ab " * 3000})
    assert response.status_code == 424 and "at most 2048 are allowed" in response.json()["error"], response.text


def test_the_openapi_document_shows_each_body_of_tokenize(server):
    document = httpx.get(server.url("/openapi.json"), timeout=30).json()
    schema = document["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    members = schema.get("oneOf") or schema.get("anyOf")
    assert {m["$ref"].rsplit("/", 1)[1] for m in members} == {
        "TgiTokenizeRequest",
        "TokenizePromptRequest",
        "TokenizeChatRequest",
    }
    answers = document["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert len(answers.get("anyOf") or answers.get("oneOf")) == 2  # vLLM's answer and TGI's list
