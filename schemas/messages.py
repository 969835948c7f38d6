"""What crosses the message bus between gateways and workers.

Every message is a pydantic model with a `kind` (what it is) and a `v` (the
wire version). A process that reads a version it does not know drops the
message and logs it rather than guessing. On the wire they are JSON.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

WIRE_VERSION = 1


class FinishReason(StrEnum):
    """Why a generation ended, with MindIE's names (see the contract)."""

    EOS_TOKEN = "eos_token"  # the model emitted EOS
    LENGTH = "length"  # max_new_tokens, max_iter_times or max_seq_len reached
    STOP_SEQUENCE = "stop_sequence"  # cancelled: stopInfer, client gone, timeout
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
    # Always set: drawn by the gateway when the client gave none, so that a
    # request retried on another worker draws the same tokens.
    seed: int = Field(ge=0, le=2**64 - 1)
    max_new_tokens: int = Field(default=20, ge=1)
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (benchmarks)


class GenerationRequest(_Message):
    """A request for a worker: published to the topic of its model and priority."""

    kind: Literal["generate"] = "generate"
    request_id: str  # unique per request, assigned by the gateway
    attempt: int = 0  # raised when the request is re-published after a failure
    model: str  # the canonical served name (the one its topics are named after)
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams
    priority: int = Field(default=5, ge=1, le=5)
    # A recomputation continues a generation that broke off: this many tokens
    # were generated (and delivered) before, and count towards max_new_tokens.
    tokens_before: int = Field(default=0, ge=0)
    arrival: float  # unix time the gateway received it
    deadline: float  # unix time after which nobody waits for it any more
    reply_to: str  # the topic of the gateway that waits for the tokens

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationRequest:
        if (self.prompt_text is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of prompt_text and prompt_token_ids must be set")
        return self

    def urgency(self, now: float, aging_s: float) -> float:
        """Lower is more urgent: its priority, less one level per `aging_s` waited since arrival."""
        return aged_priority(self.priority, now - self.arrival, aging_s)


def aged_priority(priority: int, waited_s: float, aging_s: float) -> float:
    """Priority aging, wherever requests wait (topics, engine): priority 5 is never starved."""
    return priority - waited_s / aging_s


class ErrorInfo(BaseModel):
    """An error a worker reports for a request, in the contract's terms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    message: str
    error_type: str  # the contract's error_type, e.g. "Generation Error"
    status: int  # the HTTP status a non-stream answer carries


class TokenEvent(BaseModel):
    """Tokens of one request produced by one engine step (usually one token)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    attempt: int = 0
    index: int  # position of token_ids[0] among the request's generated tokens
    token_ids: list[int] = []
    text: str = ""  # the new text these tokens complete; never half a character
    prompt_tokens: int | None = None  # on the first event
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


class ServedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # canonical: request topics are named after it
    aliases: list[str]  # every name clients may use, the canonical one included
    max_seq_len: int
    max_input_len: int
    max_iter_times: int
    vocab_size: int


class WorkerHeartbeat(_Message):
    """A worker's periodic announcement on the control topic."""

    kind: Literal["worker_heartbeat"] = "worker_heartbeat"
    worker_id: str
    model: ServedModel
    running: int
    capacity: int
    interval_s: float  # how often to expect the next one
    leaving: bool = False  # the worker is shutting down: forget it now


class GatewayHeartbeat(_Message):
    """A gateway's periodic announcement on the control topic: workers drop the requests of a silent one."""

    kind: Literal["gateway_heartbeat"] = "gateway_heartbeat"
    gateway_id: str
    reply_to: str  # its reply topic, as its requests name it
    interval_s: float  # how often to expect the next one
    leaving: bool = False  # the gateway is shutting down: nobody waits for its requests any more


BusMessage = Annotated[
    GenerationRequest | TokenEvents | CancelRequest | WorkerHeartbeat | GatewayHeartbeat,
    Field(discriminator="kind"),
]
_bus_message = TypeAdapter(BusMessage)


def encode(message: BusMessage) -> bytes:
    return message.model_dump_json(exclude_none=True).encode()


def decode(payload: bytes) -> BusMessage:
    """Parse a bus message; raises pydantic.ValidationError for anything else."""
    return _bus_message.validate_json(payload)
