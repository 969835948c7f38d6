"""What crosses the message bus between gateways and workers.

Every message is a pydantic model with a `kind` (what it is) and a `v` (the
wire version). A process that reads a version it does not know drops the
message and logs it rather than guessing. On the wire they are JSON.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from schemas.adapters import LoraSupport

WIRE_VERSION = 1
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


class FinishReason(StrEnum):
    """Why a generation ended, with MindIE's names (see the contract)."""

    EOS_TOKEN = "eos_token"  # the model emitted EOS
    LENGTH = "length"  # max_new_tokens, max_iter_times or max_seq_len reached
    STOP_SEQUENCE = "stop_sequence"  # a stop string or stop token; or cancelled: stopInfer, client gone, timeout
    INVALID_FLAG = "invalid flag"  # anything else


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = WIRE_VERSION


class SamplingParams(BaseModel):
    """How to pick each next token; resolved by the gateway, so workers apply it as is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    typical_p: float | None = None  # None = off
    repetition_penalty: float = 1.0
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # drop tokens less likely than min_p x the likeliest's
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence among the tokens generated so far
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    min_tokens: int = Field(default=0, ge=0)  # EOS and stop tokens cannot be drawn before this many tokens
    # Always set: drawn by the gateway when the client gave none, so that a
    # request retried on another worker draws the same tokens.
    seed: int = Field(ge=0, le=2**64 - 1)
    max_new_tokens: int = Field(default=20, ge=1)
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (benchmarks)
    stop: list[str] = []  # generation ends before the first of these strings (finish stop_sequence)
    stop_token_ids: list[int] = []  # generation ends with the first of these tokens (finish stop_sequence)
    include_stop_str_in_output: bool = False  # the text ends with the stop string rather than before it
    skip_special_tokens: bool = True  # special tokens have no text
    # Structured output: an llguidance grammar (JSON) the text must match; the gateway makes it from a JSON
    # schema or a regex and checks it (gateway/structured/grammars.py); None: free text.
    grammar: str | None = None
    # Each generated token's log-probability, and this many of the likeliest alternatives'; None: none.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The prompt token by token, with log-probabilities and this many alternatives each; None: not listed.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Whether a worker that speculates may propose its tokens (the output is the same either way: only its
    # pace differs); False opts the request out.
    speculative: bool = True


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"] = "text"
    text: str


class ImagePart(BaseModel):
    """The place of the request's next image (GenerationRequest.images), as Hugging Face chat templates take it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["image"] = "image"


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One turn of a chat; the worker renders the conversation with its tokenizer's chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str
    content: str | list[ContentPart]  # parts only where images are: a vision-language model's
    tool_calls: list[dict] | None = None  # an assistant's calls, as Hugging Face chat templates take them
    tool_call_id: str | None = None  # a tool's result: the call it answers


Task = Literal["generate", "tokenize", "detokenize", "embed"]


class Tokenization(BaseModel):
    """How a tokenize request asks its prompt to be rendered and tokenized (vLLM's /tokenize options)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    add_special_tokens: bool  # the tokenizer's own (BOS) around the prompt, besides what a chat template writes
    add_generation_prompt: bool = True  # a chat ends with the header of the assistant's turn to come
    continue_final_message: bool = False  # a chat ends open, inside its last message


class GenerationRequest(_Message):
    """A request for a worker: published to the topic of its model and priority."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64")

    kind: Literal["generate"] = "generate"
    # What the worker does with the prompt: generate from it (sampling), or only tokenize it, decode its token
    # ids back to text, or compute its embedding (a prefill whose pooled hidden state is the answer).
    task: Task = "generate"
    request_id: str  # unique per generation, assigned by the gateway (logged as generation_id)
    # The request id (X-Request-Id) of the HTTP request or WebSocket stream it came from, which several
    # generations (OpenAI's n) share: logged as request_id, so that one grep finds a request's every line.
    trace_id: str = ""
    attempt: int = 0  # raised when the request is re-published after a failure
    model: str  # the canonical served name (the one its topics are named after)
    # The LoRA adapter (schemas/adapters.py) it is generated under, by the name clients call it, and its
    # directory; None: the base model.
    adapter: str | None = None
    adapter_path: str | None = None
    # Set by the router on what it sends a worker: adapters in the worker's device slots that other workers of
    # the model hold too. Should the worker have to load `adapter`, it takes one of their slots before any
    # other's, so that no adapter loses its last copy while another has two (gateway/dispatch/router.py).
    evict_adapters_first: list[str] = []
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    chat_messages: list[ChatMessage] | None = None
    prompt_parts: list[ContentPart] | None = None  # a raw prompt with images in it (TGI's ![](url))
    # The images that ImageParts stand for, in order: their bytes as the gateway checked them (gateway/media/images.py).
    images: list[bytes] = []
    tools: list[dict] | None = None  # functions the chat template presents (OpenAI's tools)
    truncate: int | None = Field(default=None, gt=0)  # keep only the prompt's last N tokens (TGI)
    # None: tokenized as for generation (a text with the tokenizer's special tokens, a chat with its template's).
    tokenization: Tokenization | None = None
    sampling: SamplingParams
    priority: int = Field(default=5, ge=1, le=5)
    # The tenant of the key it came with (gateway/tenancy/tenants.py) and its fair-share weight: within a priority,
    # tenants are served in proportion to their weights (schemas/fair_share.py); None: no tenant's.
    tenant: str | None = None
    tenant_weight: float = Field(default=1.0, gt=0)
    # Set by a gateway that sent it past the worker's room, its tenant far below another's share: the worker
    # preempts a sequence of its priority of the tenant furthest over for it (schemas/fair_share.py).
    preempt_for_share: bool = False
    # A recomputation continues a generation that broke off: this many tokens
    # were generated (and delivered) before, and count towards max_new_tokens.
    tokens_before: int = Field(default=0, ge=0)
    # A failover continues a generation whose worker died: these tokens were
    # generated by earlier attempts and delivered; the new worker prefills them
    # after the prompt and draws the next ones exactly as the first worker would have.
    generated_token_ids: list[int] = []
    arrival: float  # unix time the gateway received it
    deadline: float  # unix time after which nobody waits for it any more
    reply_to: str  # the topic of the gateway that waits for the tokens

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationRequest:
        prompts = (self.prompt_text, self.prompt_token_ids, self.chat_messages, self.prompt_parts)
        if sum(p is not None for p in prompts) != 1:
            raise ValueError("exactly one of prompt_text, prompt_token_ids, chat_messages and prompt_parts must be set")
        if len(self.image_places()) != len(self.images):
            raise ValueError(f"{len(self.image_places())} image parts for {len(self.images)} images")
        return self

    def log_ids(self) -> dict[str, str]:
        """The ids its log lines carry: its request's (which one grep finds everywhere) and its own; and its
        LoRA adapter and its tenant, where it has them."""
        ids = {"request_id": self.trace_id, "generation_id": self.request_id}
        ids |= {"adapter": self.adapter} if self.adapter is not None else {}
        return ids | ({"tenant": self.tenant} if self.tenant is not None else {})

    def image_places(self) -> list[ImagePart]:
        parts = list(self.prompt_parts or ())
        for message in self.chat_messages or ():
            parts += message.content if isinstance(message.content, list) else ()
        return [p for p in parts if isinstance(p, ImagePart)]

    def urgency(self, now: float, aging_s: float) -> float:
        """Lower is more urgent: its priority, less one level per `aging_s` waited since arrival."""
        return aged_priority(self.priority, now - self.arrival, aging_s)


def aged_priority(priority: int, waited_s: float, aging_s: float) -> float:
    """Priority aging, wherever requests wait (topics, engine): priority 5 is never starved."""
    return priority - waited_s / aging_s


# The error_types that end a request's stream (ErrorInfo.error_type): the engine could not generate for it, or
# could not finish; its deadline passed.
GENERATION_ERROR = "Generation Error"
INCOMPLETE_GENERATION = "Incomplete Generation"
TIMEOUT = "Timeout"
STREAM_ERRORS = (GENERATION_ERROR, INCOMPLETE_GENERATION)  # the failures among them; a timeout is counted apart


class ErrorInfo(BaseModel):
    """An error a worker reports for a request, in the contract's terms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    message: str
    error_type: str  # the contract's error_type: one of those above
    status: int  # the HTTP status a non-stream answer carries


class TokenInfo(BaseModel):
    """A token, its own text, and what the model thought of it (see workers/engine/step_output.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int
    text: str  # decoded alone, special tokens included
    logprob: float | None = None  # None: the prompt's first token, which nothing predicts
    top: list[TokenInfo] = []  # the likeliest tokens at its position, likeliest first


class PromptToken(BaseModel):
    """A token of a tokenized prompt: its id, its spelling in the vocabulary, its place in the prompt's text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int
    token: str  # as the vocabulary spells it (convert_ids_to_tokens): "Ġworld", "<s>"
    # Characters into the prompt text, stop excluded; None where the tokens are of a rendering (a chat's).
    start: int | None = None
    stop: int | None = None


class TokenEvent(BaseModel):
    """Tokens of one request produced by one engine step (usually one token)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    attempt: int = 0
    index: int  # position of token_ids[0] among the request's generated tokens
    token_ids: list[int] = []
    text: str = ""  # the new text these tokens complete; never half a character
    prompt_tokens: int | None = None  # on the first event
    cached_prompt_tokens: int | None = None  # on the first event: of the prompt, found in the prefix cache
    # On the first event when sampling.prompt_logprobs is set: the prompt's tokens.
    prompt: list[TokenInfo] | None = None
    logprobs: list[TokenInfo] | None = None  # when sampling.logprobs is set: one per token of token_ids
    tokens: list[PromptToken] | None = None  # a tokenize request's answer; a detokenize request's is its text
    embedding: list[float] | None = None  # task embed: the prompt's pooled hidden state, on its one event
    prefill_time_ms: float | None = None  # first token: arrival at the worker to token
    decode_time_ms: float | None = None  # later tokens: since the previous token
    queue_wait_us: int = 0  # how long the sequence waited before this step ran
    batch_size: int = 1  # sequences in the step that produced this event
    finish_reason: FinishReason | None = None  # on the last event
    error: ErrorInfo | None = None  # the request failed; this is its last event


class TokenEvents(_Message):
    """All of one step's events for one gateway, in one message."""

    kind: Literal["events"] = "events"
    worker_id: str
    events: list[TokenEvent]


class CancelRequest(_Message):
    """Stop a request wherever it is: queued, or running on some worker."""

    kind: Literal["cancel"] = "cancel"
    request_id: str
    reason: str
    deadline: float  # the request's: after it nobody runs the request anyway, so workers may forget the cancel
    # Only the attempts below this one (a failover fences the old attempt); None: every attempt.
    attempts_before: int | None = None

    def covers(self, attempt: int) -> bool:
        return attempt < self.reach

    @property
    def reach(self) -> float:
        """It covers every attempt below this."""
        return math.inf if self.attempts_before is None else self.attempts_before


class ServedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # canonical: request topics are named after it
    aliases: list[str]  # every name clients may use, the canonical one included
    max_seq_len: int
    max_input_len: int
    max_iter_times: int
    vocab_size: int
    # A vision-language model's: the most pixels of an image worth sending it (its processor scales larger
    # ones down: the gateway does it first, to a little more, so requests stay small); None: no images.
    image_pixels: int | None = None
    lora: LoraSupport | None = None  # what its workers take of LoRA adapters; None: they serve none
    adapters: dict[str, str] = {}  # the LoRA adapters its workers serve: name clients use -> directory
    # Set by a gateway, never announced: the adapter of the name a client called it by (a key of `adapters`).
    adapter: str | None = None

    def under(self, adapter: str) -> ServedModel:
        """This model as clients call it by the name of one of its adapters."""
        return self.model_copy(update={"adapter": adapter})


class WorkerHeartbeat(_Message):
    """A worker's periodic announcement on the control topic."""

    kind: Literal["worker_heartbeat"] = "worker_heartbeat"
    worker_id: str
    model: ServedModel
    running: int
    capacity: int
    # Request id -> attempt of every request it has taken and not finished:
    # a gateway fails over those of its requests that a live worker stops listing.
    requests: dict[str, int] = {}
    interval_s: float  # how often to expect the next one
    leaving: bool = False  # the worker is shutting down: forget it now
    # Request id -> attempt of requests it had taken and will not run (it is draining): fail them over now.
    handed_back: dict[str, int] = {}


class WorkerLoad(_Message):
    """What a router needs of a worker, on the routing topic: where it reads, how busy it is, what it has cached.

    Sent with every heartbeat and, at most every few tens of milliseconds, when
    its load changes. Prefix hashes (bus/prefixes.py) come as changes since the
    worker's previous message, and whole (`snapshot`) every few seconds.
    """

    kind: Literal["worker_load"] = "worker_load"
    worker_id: str
    model: str  # canonical name
    inbox: str  # the topic where it reads the requests routed to it
    capacity: int  # sequences it runs at once
    running: int
    waiting: int  # read from its inbox or the shared queue, not started yet
    running_by_priority: list[int] = Field(min_length=5, max_length=5)  # running requests of priority 1..5
    kv_blocks: int
    free_kv_blocks: int  # free or only holding cached prefixes
    block_size: int  # tokens per block
    seconds_per_prompt_token: float = 0.0  # what a prompt token costs it to compute, lately; 0: not known yet
    prompt_tokens: int = 0  # of the requests it started, since it started
    cached_prompt_tokens: int = 0  # of those, found in its prefix cache
    prefixes_added: list[int] = []
    prefixes_removed: list[int] = []
    snapshot: bool = False  # prefixes_added is every prefix it holds
    # Reply topic (a gateway's) -> the requests of that gateway it has read from its inbox since it started:
    # a gateway counts against the worker's room what it routed there that this does not show read yet.
    inbox_reads: dict[str, int] = {}
    interval_s: float  # the longest wait for its next report
    draining: bool = False  # it finishes what it runs and takes nothing more: route nothing to it
    tensor_parallel_size: int = Field(default=1, ge=1)  # devices its model is split across
    adapters: list[str] = []  # the LoRA adapters in its device slots, most recently used first
    adapter_loads: int = 0  # adapters it has put into a device slot, since it started
    adapter_slots: int = 0  # its device slots for adapters
    idle_adapters: list[str] = []  # those of `adapters` that no running sequence computes under


class StopClientRequest(_Message):
    """stopInfer on one gateway for a request another gateway took: the gateway that has it stops it."""

    kind: Literal["stop_client_request"] = "stop_client_request"
    model: str
    client_id: str
    question_id: str
    reply_to: str  # where the gateway that stops it says so


class StopAnswer(_Message):
    """A gateway stopped requests for a StopClientRequest."""

    kind: Literal["stop_answer"] = "stop_answer"
    question_id: str
    stopped: int


class GatewayHeartbeat(_Message):
    """A gateway's periodic announcement on the control topic: workers drop the requests of a silent one."""

    kind: Literal["gateway_heartbeat"] = "gateway_heartbeat"
    gateway_id: str
    reply_to: str  # its reply topic, as its requests name it
    interval_s: float  # how often to expect the next one
    leaving: bool = False  # the gateway is shutting down: nobody waits for its requests any more


class AdapterState(_Message):
    """A LoRA adapter loaded or unloaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).

    On the adapters topic, which Kafka compacts: keyed by `model/name`, the
    latest message of a key is the adapter's state, so that a gateway or a
    worker that starts reads the fleet's adapters from the topic's beginning.
    """

    kind: Literal["adapter_state"] = "adapter_state"
    model: str  # the canonical name of the base model
    name: str  # the model name clients call it by
    path: str  # its directory, as resolved under the gateway's --lora-root
    loaded: bool  # False: unloaded
    # When a gateway published it (time.time()): the gateway that did applies it at once, and its echo on the
    # topic must not undo a later change it applied meanwhile.
    changed_at: float

    @property
    def key(self) -> str:
        return f"{self.model}/{self.name}"


class TenantUse(BaseModel):
    """One gateway's use by one tenant: its requests in flight, and per second of the rate window the requests
    it admitted and the tokens its requests were given (prompt and output)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    in_flight: int = 0
    seconds: list[tuple[int, int, int]] = []  # (second since the epoch, requests, tokens), seconds with any


class TenantUsage(_Message):
    """A gateway's use by each tenant over the rate window, on the tenant-usage topic (gateway/tenancy/quotas.py).

    Compacted on Kafka and keyed by gateway id: the latest report of each
    gateway is its use, and a gateway that starts reads every gateway's from
    the topic's beginning, so a restart forgets no use still in the window.
    """

    kind: Literal["tenant_usage"] = "tenant_usage"
    gateway_id: str
    started_at: float  # the gateway process's start (time.time()): a restart under the same id is another
    sent_at: float
    tenants: dict[str, TenantUse] = {}


UsageOutcome = Literal["finished", "cancelled", "timed_out", "failed"]


class UsageRecord(_Message):
    """One request's use, for billing: on the usage topic, keyed by its request id (gateway/tenancy/usage.py).

    The gateway that answered it publishes it once, before the client sees
    the request's last event (or when the client leaves). The topic is
    compacted and `tokenrelay usage` keeps one record per key, so a record
    published twice (a producer's retry) counts once.
    """

    kind: Literal["usage"] = "usage"
    request_id: str  # the generation's id (GenerationRequest.request_id)
    trace_id: str = ""  # the HTTP request's (X-Request-Id), which OpenAI's n choices share
    tenant: str | None = None
    key_id: str | None = None  # the first 12 hex digits of the API key's SHA-256; None without keys
    model: str
    adapter: str | None = None
    task: Task = "generate"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0  # generated and delivered to the gateway
    arrival: float  # unix times: the gateway received it, its first token came, it ended
    first_token_at: float | None = None
    ended_at: float
    outcome: UsageOutcome
    attempts: int = 1  # workers it ran on (a failover adds one)
    gateway_id: str


BusMessage = Annotated[
    GenerationRequest
    | TokenEvents
    | CancelRequest
    | WorkerHeartbeat
    | GatewayHeartbeat
    | WorkerLoad
    | StopClientRequest
    | StopAnswer
    | AdapterState
    | TenantUsage
    | UsageRecord,
    Field(discriminator="kind"),
]
_bus_message = TypeAdapter(BusMessage)


def encode(message: BusMessage) -> bytes:
    return message.model_dump_json(exclude_none=True).encode()


def decode(payload: bytes) -> BusMessage:
    """Parse a bus message; raises pydantic.ValidationError for anything else."""
    return _bus_message.validate_json(payload)
