"""OpenAI-compatible bodies: /v1/completions, /v1/chat/completions, /v1/models.

The fields OpenAI documents that this server honours, and vLLM's extensions
that its users' benchmark and evaluation clients send (`ignore_eos`,
`min_tokens`, `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`,
`stream_options.continuous_usage_stats`, `priority`: this server's 1–5, 1
most urgent), and this server's `speculative` (false: a speculating worker
proposes no tokens for the request; the output is the same). Any other field
is ignored, and named in the answer's X-Ignored-Fields header (schemas/body.py),
so that a client can tell that a parameter was not applied.

Log-probabilities are the model's raw ones: log-softmax of its logits, before
temperature, penalties and filtering (vLLM's default).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from schemas.body import Body
from schemas.messages import ChatMessage, ImagePart, SamplingParams, TokenInfo
from schemas.messages import TextPart as WireTextPart
from schemas.multimodal import MAX_ITEMS
from schemas.openai_tools import NamedToolChoice, Tool, ToolCall, ToolCallDelta
from schemas.parameters import INT32_MAX
from schemas.prompt_forms import Prompt, PromptForms, TokenId, check_prompts, each_prompt

SEED_MAX = 2**63 - 1
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$")]  # JSON object keys are strings
MAX_CHOICES = 16  # each choice is a request of its own to a worker
MAX_PROMPTS = 256  # prompts in one completions request, as many of vLLM's evaluation clients batch them


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: usage so far in every chunk.")


class JsonSchemaFormat(Body):
    name: str = Field(max_length=64, description="The schema's name.")
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema", description="The JSON schema answers match.")
    strict: bool | None = Field(None, description="Answers always match the schema here, strict or not.")


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema.")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class _Sampling(Body):
    model: str = Field(description="A served model name (GET /v1/models).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Default 1.")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices, sampled apart (seeds derived from `seed`).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Up to 4 strings; the text ends before the first.")
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=64, description="Generation ends with these tokens (ids in [0, vocabulary size), else 424)."
    )
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Sampling noise; the same seed, the same tokens.")
    user: str | None = Field(None, description="Accepted, for logs.")
    priority: int | None = Field(None, ge=1, le=5, description="1 is the most urgent; default 5.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Per token generated so far.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Per occurrence so far.")
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None,
        max_length=300,
        description="Token id (as a string; in [0, vocabulary size), else 424) -> added to its logit, -100 to 100.",
    )
    # vLLM's extensions
    ignore_eos: bool = Field(False, description="Generate max_tokens whatever the model says.")
    min_tokens: int = Field(0, ge=0, le=INT32_MAX, description="EOS and stop tokens wait for this many tokens.")
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Drop tokens under min_p x the likeliest's.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description="transformers'; 1: off.")
    skip_special_tokens: bool = Field(True, description="Special tokens have no text.")
    include_stop_str_in_output: bool = Field(False, description="The text ends with the stop string.")
    response_format: ResponseFormat | None = Field(None, description="JSON answers: any object, or a schema's.")
    # tokenrelay's
    speculative: bool = Field(True, description="false: a speculating worker proposes no tokens for it.")

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

    def sampling(self, seed: int, max_iter_times: int, grammar: str | None = None) -> SamplingParams:
        """As OpenAI means them: temperature 1 (sampling) unless 0 (greedy) is asked for."""
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            seed=seed if self.seed is None else self.seed,
            max_new_tokens=self.max_new_tokens(max_iter_times),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            stop_token_ids=list(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.top_logprobs_wanted,
            prompt_logprobs=self.prompt_logprobs_wanted,
            grammar=grammar,
            speculative=self.speculative,
        )

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives listed per generated token; None: no log-probabilities."""
        return None

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives listed per prompt token; None: the prompt is not listed."""
        return None

    @property
    def scores_only(self) -> bool:
        """Nothing generated is answered: only the prompt, scored."""
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: PromptForms = Field(
        description=f"A text, texts, token ids, or arrays of token ids: up to {MAX_PROMPTS} prompts, each with its "
        "own n choices."
    )
    logprobs: int | None = Field(None, ge=0, le=5, description="Log-probabilities, with this many alternatives.")
    echo: bool = Field(False, description="The prompt comes first in the text (and in logprobs).")
    max_tokens: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="Default: the server's maxIterTimes. 0 only with echo: the prompt alone, scored (logprobs).",
    )

    @property
    def prompts(self) -> list[Prompt]:
        """Each prompt, as text or as token ids: its choices are requests of their own."""
        return each_prompt(self.prompt)

    @property
    def prompts_are_text(self) -> bool:
        return isinstance(self.prompts[0], str)

    @property
    def scores_only(self) -> bool:
        """The legacy scoring call (echo, max_tokens 0): the prompt's log-probabilities, nothing generated."""
        return self.max_tokens == 0

    def max_new_tokens(self, max_iter_times: int) -> int:
        """One token for a scoring call, which a prompt's scores come with and the answer leaves out."""
        return 1 if self.scores_only else super().max_new_tokens(max_iter_times)

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """With echo: the prompt's tokens when log-probabilities are asked for, or when only they give its text."""
        if not self.echo:
            return None
        return self.logprobs if self.logprobs is not None else (None if self.prompts_are_text else 0)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list) -> str | list:
        return check_prompts(prompt, MAX_PROMPTS)

    @field_validator("max_tokens")
    @classmethod
    def _scoring_echoes(cls, max_tokens: int | None, info: ValidationInfo) -> int | None:
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("0 is served with echo only (the prompt's log-probabilities alone); otherwise at least 1")
        return max_tokens


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageUrl(Body):
    url: str = Field(min_length=1, description="A data: URI, a file under the media directory, or an allowed URL.")
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ImageUrlPart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPartIn = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class ChatMessageIn(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPartIn] | None = Field(None, description="None only for an assistant's tool calls.")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls.")
    tool_call_id: str | None = Field(None, description="A tool's result: the call it answers.")

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessageIn:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @property
    def image_urls(self) -> list[str]:
        return [p.image_url.url for p in self.content or () if isinstance(p, ImageUrlPart)]

    def as_message(self) -> ChatMessage:
        """The turn as a worker renders it: text, or parts where it has images (the request carries them)."""
        content = self.content or ""
        if not isinstance(content, str):
            parts = [WireTextPart(text=p.text) if isinstance(p, TextPart) else ImagePart() for p in content]
            content = parts if self.image_urls else "".join(p.text for p in content if isinstance(p, TextPart))
        return ChatMessage(
            role="system" if self.role == "developer" else self.role,
            content=content,
            tool_calls=[call.for_template() for call in self.tool_calls] if self.tool_calls else None,
            tool_call_id=self.tool_call_id,
        )


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Default: the server's maxIterTimes.")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Wins over max_tokens.")
    logprobs: bool = Field(False, description="Each token's log-probability.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: this many alternatives.")
    tools: list[Tool] | None = Field(None, max_length=128, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without."
    )
    parallel_tool_calls: bool = Field(True, description="With tool_choice required: more than one call allowed.")

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which tools do not declare")
        if self.tool_choice not in (None, "none", "auto") and self.response_format is not None:
            raise ValueError("response_format cannot be combined with a tool_choice that forces a call")
        images = sum(len(m.image_urls) for m in self.messages)
        if images > MAX_ITEMS:
            raise ValueError(f"messages: {images} image_url parts; at most {MAX_ITEMS} per request")
        return self

    @property
    def calls_tools(self) -> Literal["none", "auto", "required", "named"]:
        """How the answer may call tools: not at all, as the model likes, at least once, or the named one."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self, max_iter_times: int) -> int:
        return self.max_completion_tokens or self.max_tokens or max_iter_times


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions' log-probabilities: one entry per token, offsets into the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token, with echo
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def of(cls, infos: list[TokenInfo], offset: int = 0) -> CompletionLogprobs:
        """For these tokens, the first of which starts at `offset` of the choice's text."""
        offsets = []
        for info in infos:
            offsets.append(offset)
            offset += len(info.text)
        return cls(
            tokens=[info.text for info in infos],
            token_logprobs=[info.logprob for info in infos],
            top_logprobs=[
                None if info.logprob is None else {top.text: top.logprob for top in info.top} for info in infos
            ],
            text_offset=offsets,
        )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's text as UTF-8

    @classmethod
    def of(cls, info: TokenInfo) -> TopLogprob:
        return cls(token=info.text, logprob=info.logprob, bytes=list(info.text.encode()))


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None

    @classmethod
    def of(cls, infos: list[TokenInfo]) -> ChatLogprobs:
        return cls(
            content=[
                ChatTokenLogprob(**TopLogprob.of(info).model_dump(), top_logprobs=[TopLogprob.of(t) for t in info.top])
                for info in infos
            ]
        )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


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
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


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
    parent: str | None = None  # a LoRA adapter's: the model it adapts (vLLM's field)
    root: str | None = None  # the model's own name, or an adapter's directory (vLLM's field)


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
