"""OpenAI-compatible bodies: /v1/completions, /v1/chat/completions, /v1/models.

The fields OpenAI documents that this server honours; any other field is
refused by name (400), so that a client never believes a parameter was
applied when it was not. `n` must be 1. `stop_token_ids` and `priority` are
vLLM's extensions; `priority` is this server's 1–5 (1 most urgent).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from schemas.messages import ChatMessage, SamplingParams
from schemas.parameters import BODY, INT32_MAX

SEED_MAX = 2**63 - 1


class StreamOptions(BaseModel):
    model_config = BODY

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = BODY

    model: str = Field(description="A served model name (GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Default: the server's maxIterTimes.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Default 1.")
    n: Literal[1] = Field(1, description="Only 1 choice per request is served.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Up to 4 strings; the text ends before the first.")
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="Generation ends with these tokens.")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Sampling noise; the same seed, the same tokens.")
    user: str | None = Field(None, description="Accepted, for logs.")
    priority: int | None = Field(None, ge=1, le=5, description="1 is the most urgent; default 5.")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > 4:
            raise ValueError(f"at most 4 stop strings are allowed; received {len(strings)}")
        if any(not 1 <= len(s) <= 1024 for s in strings):
            raise ValueError("each stop string must have 1 to 1024 characters")
        return stop

    def max_new_tokens(self, max_iter_times: int) -> int:
        return self.max_tokens or max_iter_times

    def sampling(self, seed: int, max_iter_times: int) -> SamplingParams:
        """As OpenAI means them: temperature 1 (sampling) unless 0 (greedy) is asked for."""
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=seed if self.seed is None else self.seed,
            max_new_tokens=self.max_new_tokens(max_iter_times),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            stop_token_ids=list(self.stop_token_ids or ()),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] = Field(description="Text, token ids, or a list of one text.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError(f"one prompt per request is served; received {len(prompt)}")
        return prompt


class TextPart(BaseModel):
    model_config = BODY

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = BODY

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def as_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Wins over max_tokens.")

    def max_new_tokens(self, max_iter_times: int) -> int:
        return self.max_completion_tokens or self.max_tokens or max_iter_times


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenrelay"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """Every error on the /v1 routes, in OpenAI's shape."""

    error: OpenAIErrorDetail
