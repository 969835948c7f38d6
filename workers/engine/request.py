"""A request as the engine runs it: its prompt in one of its forms, how to sample, where its client stands.

The engine does not read the bus's messages. The worker turns each
GenerationRequest it takes into an EngineRequest (workers/worker.py), and
names the prompt's prefixes there as gateways name them (bus/prefixes.py), so
that the engine can say which of them its KV cache holds without knowing how
they are named. Benches and tests build EngineRequests directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.messages import ChatMessage, ContentPart, SamplingParams, Task, Tokenization


@dataclass(frozen=True)
class PromptPrefixes:
    """The names of a prompt's prefixes: one per whole `chunk_bytes` of the prompt read as bytes."""

    hashes: tuple[int, ...]
    prompt_bytes: int  # the prompt's length as bytes, against which its tokens are apportioned to the names
    chunk_bytes: int


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    sampling: SamplingParams
    deadline: float  # unix time after which nobody waits for it: it ends with a timeout
    model: str = ""  # the name it was asked by, for its error messages
    task: Task = "generate"  # or only tokenize, detokenize, or embed the prompt (schemas/messages.py)
    attempt: int = 0  # echoed on its events: the gateway drops those of an attempt it gave up
    priority: int = 5  # 1 most urgent
    tenant: str | None = None  # whose it is, for the fair share within a priority (schemas/fair_share.py)
    tenant_weight: float = 1.0
    preempt_for_share: bool = False  # the gateway sent it past the worker's room (schemas/fair_share.py)
    # The prompt: exactly one of these four.
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    chat_messages: list[ChatMessage] | None = None
    prompt_parts: list[ContentPart] | None = None  # a raw prompt with images in it
    images: tuple[bytes, ...] = ()  # the prompt's images, in order
    tools: list[dict] | None = None  # functions the chat template presents
    truncate: int | None = None  # keep only the prompt's last N tokens
    tokenization: Tokenization | None = None  # a tokenize request's options; None: as for generation
    # Where its client stands after a failover: tokens it has been sent, and those of them to replay.
    tokens_before: int = 0
    generated_token_ids: tuple[int, ...] = ()
    prefixes: PromptPrefixes | None = None  # None: nobody asks which of its prefixes are cached
    adapter: str | None = None  # the LoRA adapter it is generated under (its name), or the base model (None)
    adapter_path: str | None = None  # that adapter's directory
    evict_adapters_first: tuple[str, ...] = ()  # should it load its adapter: slots of these go first
