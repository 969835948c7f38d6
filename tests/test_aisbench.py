"""AISBench 3.1's stock service configurations, run against `tokenrelay serve` as its `--mode perf` runs them.

AISBench (PyPI `ais-bench-benchmark`, which MindIE's pages name as MindIE Benchmark's successor) is no
dependency here: it pins numpy < 2. What it sends and reads is written below as data instead, each with the
file of AISBench 3.1 it is taken from: the request body its client class's `get_request_body` builds from a
stock config (`generation_kwargs` as the config has them, `ignore_eos` set as a perf run sets it, and the
run's output length), and the keys its `parse_text_response` / `parse_stream_response` read from each
answer or event. Its SSE reading (`BaseAPIModel.iter_lines`, `stream_infer`) is followed too: events split on
blank lines, `:` comments skipped, `data:` cut off, `[DONE]` the end.

A run is 16 requests, 4 at once, at most 32 tokens each. With `ignore_eos` every answer has exactly 32 tokens:
counted in the events of a stream (one token each), in `usage` where AISBench reads it, and in the gateway's
generated-token counter (16 x 32, and none may have more); without, they complete as well.
VITA's config (configs/models/vita/vita_generate_chat.py) is left out: it speaks the `/generate` of
VITA's own server (`prompt`, `text` lists), not TGI's, which is ours.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from tests.processes import metric

API_MODELS = "ais_bench/benchmark/models/api_models"
REQUESTS, CONCURRENCY, MAX_OUT_LEN = 16, 4, 32
GENERATION_KWARGS = {"temperature": 0.01}  # every stock config's, with ignore_eos (set per run below)
PROMPTS = [f"{i} The following example shows" for i in range(REQUESTS)]
TOOL = {  # a BFCL-style function, as vllm_api_function_call_chat.py's runs pass `tools` in
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass(frozen=True)
class Service:
    config: str  # under ais_bench/benchmark/configs/models/
    path: str  # {model}: what AISBench asks GET /v1/models for (`_get_service_model_path`)
    stream: bool
    body: Callable[[str, dict, str], dict]  # (prompt, generation kwargs, model) -> the request body
    parse: Callable[[dict, str], str]  # (one answer or event, content so far) -> content, as AISBench's parser
    events_are_tokens: bool = False  # one event per token: a stream's length is its events'


def _mindie(prompt, kwargs, model):  # mindie_stream_api.py: MindieStreamApi.get_request_body
    return {"inputs": prompt, "stream": True, "parameters": {**kwargs, "max_new_tokens": MAX_OUT_LEN}}


def _triton(prompt, kwargs, model):  # triton_api.py: TritonCustomAPI.get_request_body
    return {"id": str(uuid.uuid4()), "text_input": prompt, "parameters": {**kwargs, "max_new_tokens": MAX_OUT_LEN}}


def _tgi(prompt, kwargs, model):  # tgi_api.py: TGICustomAPI.get_request_body
    return {"inputs": prompt, "parameters": {**kwargs, "max_new_tokens": MAX_OUT_LEN}}


def _completions(stream: bool):  # vllm_custom_api.py: VLLMCustomAPI.get_request_body
    def body(prompt, kwargs, model):
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        return {"prompt": prompt, "stream": stream, **extra, **kwargs, "max_tokens": MAX_OUT_LEN, "model": model}

    return body


def _chat(stream: bool, turns: int = 1, tools: bool = False):  # vllm_custom_api_chat.py: VLLMCustomAPIChat
    def body(prompt, kwargs, model):
        # A PromptList's items ({role, prompt}) become messages, roles mapped by ROLE_MAP; multiturn: the history.
        history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}] * (turns - 1)
        messages = [*history, {"role": "user", "content": prompt}]
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        generation = {**kwargs, "max_tokens": MAX_OUT_LEN, "model": model, **({"tools": [TOOL]} if tools else {})}
        return {"stream": stream, "messages": messages, **extra, **generation}

    return body


def _last(key: str):  # keeps each answer's `key`: the last one's stays
    return lambda answer, content: answer.get(key, "")


def _appended(read: Callable[[dict], str]):  # appends each event's
    return lambda event, content: content + read(event)


def _message(answer, content):  # VLLMCustomAPIChat.parse_text_response
    return answer["choices"][0]["message"]["content"] or ""


def _delta(event) -> str:  # VLLMCustomAPIChat.parse_stream_response
    return "".join(choice["delta"].get("content") or "" for choice in event.get("choices", []))


def _text(event) -> str:  # VLLMCustomAPI.parse_stream_response
    return event["choices"][0]["text"] if event.get("choices") else ""


CHAT = "/v1/chat/completions"
SERVICES = [
    # mindie_stream_api.py: MindieStreamApi.parse_stream_response keeps each event's generated_text.
    Service("mindie_api/mindie_stream_api_general.py", "/infer", True, _mindie, _last("generated_text"), True),
    # triton_api.py: TritonCustomAPI reads text_output; appends each event's when streamed.
    Service("triton_api/triton_api_general.py", "/v2/models/{model}/generate", False, _triton, _last("text_output")),
    Service(
        "triton_api/triton_stream_api_general.py",
        "/v2/models/{model}/generate_stream",
        True,
        _triton,
        _appended(lambda event: event.get("text_output", "")),
        True,
    ),
    # tgi_api.py: TGICustomAPI reads generated_text, streamed too ("TGI will return the generated text in last
    # chunk").
    Service("tgi_api/tgi_api_general.py", "/generate", False, _tgi, _last("generated_text")),
    Service("tgi_api/tgi_stream_api_general.py", "/generate_stream", True, _tgi, _last("generated_text"), True),
    # vllm_custom_api.py: VLLMCustomAPI reads choices[0].text, appended when streamed.
    Service("vllm_api/vllm_api_general.py", "/v1/completions", False, _completions(False), lambda a, c: _text(a)),
    Service("vllm_api/vllm_api_general_stream.py", "/v1/completions", True, _completions(True), _appended(_text)),
    # vllm_custom_api_chat.py: VLLMCustomAPIChat reads message.content, or each delta's content.
    Service("vllm_api/vllm_api_general_chat.py", CHAT, False, _chat(False), _message),
    Service("vllm_api/vllm_api_stream_chat.py", CHAT, True, _chat(True), _appended(_delta)),
    Service("vllm_api/vllm_api_stream_chat_multiturn.py", CHAT, True, _chat(True, turns=2), _appended(_delta)),
    Service("vllm_api/vllm_api_function_call_chat.py", CHAT, False, _chat(False, tools=True), _message),
]


def _events(raw: bytes) -> list[dict]:
    """A stream's events as BaseAPIModel.iter_lines and stream_infer read them."""
    events = []
    for chunk in raw.replace(b"\r\n\r\n", b"\n\n").replace(b"\r\r", b"\n\n").split(b"\n\n"):
        text = chunk.strip().decode()
        if not text or text.startswith(":"):
            continue
        text = text.removeprefix("data:").strip()
        if text == "[DONE]":
            break
        events.append(json.loads(text))
    return events


async def _run(server, service: Service, ignore_eos: bool) -> list[tuple[str, int | None, int]]:
    """The perf run: (content as AISBench parses it, usage's completion_tokens, events) per request."""
    model = httpx.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"]  # _get_service_model_path
    url = server.url(service.path.format(model=model))
    kwargs = {**GENERATION_KWARGS, "ignore_eos": ignore_eos}
    at_once = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, int | None, int]:
        async with at_once:
            answer = await client.post(url, json=service.body(prompt, kwargs, model))
        assert answer.status_code == 200, answer.text  # anything else is a failed request to AISBench
        assert "x-ignored-fields" not in answer.headers  # every field AISBench sends is read
        answers = _events(answer.content) if service.stream else [answer.json()]
        content, usage = "", None
        for each in answers:
            content = service.parse(each, content)
            usage = (each.get("usage") or {}).get("completion_tokens", usage)  # _parse_usage
        return content, usage, len(answers)

    headers = {"Content-Type": "application/json"}  # BaseAPIModel.headers
    async with httpx.AsyncClient(headers=headers, timeout=120) as client:
        return await asyncio.gather(*(one(client, prompt) for prompt in PROMPTS))


def _generated(server) -> float:
    metrics = httpx.get(server.url("/metrics"), timeout=10).text
    return metric(metrics, "tokenrelay_gateway_generated_tokens_total", model="tokenrelay-tiny")


@pytest.mark.parametrize("ignore_eos", [True, False], ids=["ignore_eos", "eos"])
@pytest.mark.parametrize("service", SERVICES, ids=[s.config.split("/")[1].removesuffix(".py") for s in SERVICES])
def test_a_stock_aisbench_config_runs_unmodified(compat_server, service, ignore_eos):
    before = _generated(compat_server)
    results = asyncio.run(_run(compat_server, service, ignore_eos))
    generated = _generated(compat_server) - before
    assert len(results) == REQUESTS and all(isinstance(content, str) for content, _, _ in results)
    usages = [usage for _, usage, _ in results]
    if service.path.startswith("/v1/"):
        assert all(usage is not None and 1 <= usage <= MAX_OUT_LEN for usage in usages), usages
        assert sum(usages) == generated
    if service.events_are_tokens:
        assert all(1 <= events <= MAX_OUT_LEN for _, _, events in results)
        assert sum(events for _, _, events in results) == generated
    if ignore_eos:
        assert generated == REQUESTS * MAX_OUT_LEN  # none has more: each has exactly MAX_OUT_LEN
        assert all(usage == MAX_OUT_LEN for usage in usages if usage is not None)
        assert all(content for content, _, _ in results)
