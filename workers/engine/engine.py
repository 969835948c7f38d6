"""The engine: a thread that admits requests, steps the model over a continuous batch, and reports tokens.

The model never runs on the worker's event loop, so that Kafka heartbeats and
control messages keep flowing while it computes. The worker hands requests and
cancellations in through a thread-safe inbox; between steps the engine admits
them, and after each step hands out the step's events through `on_step`,
which must not block. Each step: the scheduler picks chunks, the model runner
computes them in one forward pass, the sampler draws a token for every
sequence whose chunk reached its end, and finished sequences free their blocks.
A request more urgent than every running one does not wait for the step
in flight where the runner pauses between layers (on the CPU): its own
step runs there, and its first token goes out at once.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from bus.prefixes import CHUNK_BYTES, prefix_hashes, prompt_bytes
from schemas.messages import ErrorInfo, FinishReason, GenerationRequest, TextPart, TokenEvent
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.scheduler import Chunk, Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence
from workers.engine.step_output import StepOutput
from workers.engine.stop_strings import StopStrings

log = structlog.get_logger(__name__)


class Runner(Protocol):
    """Computes steps: workers/engine/model_runner.py's ModelRunner, or a simulated one."""

    num_blocks: int  # of the KV cache

    def bind_thread(self) -> None:
        """Called first on the engine thread."""

    def execute(self, chunks: list[Chunk], drawing: list[Chunk]) -> StepOutput:
        """Compute the chunks; return the next token of each chunk in `drawing`, and the scores asked for."""

    def yield_between_layers(self, callback: Callable[[], None]) -> None:
        """Have `callback` called within steps, between layers, where the device allows it."""


class Model(Protocol):
    """What the engine needs of a model: model_loader.py's LoadedModel, or workers/simulated/'s."""

    tokenizer: Any  # a Hugging Face tokenizer's calls: __call__, apply_chat_template, decode, chat_template
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]

    @property
    def device_type(self) -> str: ...

    def runner(self, config: EngineConfig, capture: Any = None) -> Runner: ...

    def grammars(self) -> Any:
        """A workers/engine/grammar.py Grammars for its tokenizer; None: structured output is not served."""

    def vision(self) -> Any:
        """A workers/engine/vision.py Vision for a vision-language model; None: text only."""


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    received_at: float
    matcher: Any = None  # its grammar compiled: an llguidance LLMatcher
    refusal: str | None = None  # why its grammar could not be compiled


@dataclass(frozen=True)
class _Cancel:
    request_id: str


_STOP = object()  # put in the inbox to end the engine thread
_GENERATION_ERROR = "Generation Error"


class Engine:
    def __init__(
        self,
        loaded: Model,
        config: EngineConfig,
        on_step: Callable[[list[TokenEvent]], None],
        graph_capture=None,
        on_cache: Callable[[list[int], list[int]], None] | None = None,
    ):
        """`loaded`: a LoadedModel (model_loader.py) or a SimulatedModel (workers/simulated/), whose
        runner computes the steps; `graph_capture`: how a ModelRunner captures decode graphs
        (cuda_graphs.py); tests replace it on the CPU. `on_cache(added, removed)`: the prompt prefix
        hashes (bus/prefixes.py) that became cached and that were evicted, after the steps that change them."""
        self._loaded = loaded
        self.config = config = config.for_device(loaded.device_type)  # the device's defaults filled in
        self._on_step = on_step
        self._on_cache = on_cache
        self._runner = loaded.runner(config, graph_capture)
        self._grammars = loaded.grammars()
        self._vision = loaded.vision()
        self.image_pixels = self._vision.image_pixels if self._vision is not None else None
        capacity = self._runner.num_blocks * config.block_size
        if capacity < config.max_seq_len:
            raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_seq_len {config.max_seq_len}")
        self._blocks = BlockManager(self._runner.num_blocks, config.block_size)
        self._scheduler = Scheduler(
            SchedulerConfig(config.max_batch_size, config.max_tokens_per_step, config.aging_s), self._blocks
        )
        self._sequences: dict[str, Sequence] = {}
        self.seconds_per_prompt_token = 0.0  # of the steps with prompt chunks, lately (a router weighs waits by it)
        self._inbox: queue.SimpleQueue[_Submit | _Cancel | object] = queue.SimpleQueue()
        self._deferred: list[_Submit | _Cancel | object] = []  # read within a step, applied after it
        self._yielded_s = 0.0  # spent within the current step on urgent requests' steps
        # Requests whose grammar is compiling (added by submit's thread), and those of them already cancelled.
        self._compiling: set[str] = set()
        self._cancelled_compiling: set[str] = set()
        self._runner.yield_between_layers(self._start_urgent)
        self._thread: threading.Thread | None = None  # start()'s

    @property
    def max_input_len(self) -> int:
        """Prompt tokens a request may have, as the contract computes it."""
        return min(
            self.config.max_input_len,
            self.config.max_seq_len - 1,
            self._loaded.max_position_embeddings,
            1024 * 1024,
        )

    @property
    def kv_blocks(self) -> int:
        return self._runner.num_blocks

    @property
    def free_kv_blocks(self) -> int:
        """Blocks free, or only holding cached prefixes (read from any thread: a length, never torn)."""
        return self._blocks.free_blocks

    def prompt_stats(self) -> dict[str, int]:
        """Prompt tokens of the requests started, and of those the tokens found in the prefix cache."""
        return {
            "prompt_tokens": self._scheduler.prompt_tokens,
            "cached_prompt_tokens": self._scheduler.cached_prompt_tokens,
        }

    def stats(self) -> dict[str, int]:
        """Counters since start: preemptions, and prompt tokens served from the prefix cache."""
        return {"preemptions": self._scheduler.preemptions, "reused_tokens": self._blocks.reused_tokens}

    def start(self) -> None:
        """Start stepping, in a thread whose log lines carry what the caller's context binds (its worker's id)."""
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name="engine", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self.alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout=30)
        if self._grammars is not None:
            self._grammars.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: GenerationRequest, received_at: float) -> None:
        """Queue a request; its events come out of `on_step`. Thread-safe. A request with a grammar
        is queued once the grammar is compiled, which neither the caller nor the engine thread waits for."""
        grammar = request.sampling.grammar
        if grammar is None:
            self._inbox.put(_Submit(request, received_at))
        elif self._grammars is None:
            self._inbox.put(_Submit(request, received_at, refusal="this worker's model cannot constrain its output"))
        else:
            self._compiling.add(request.request_id)

            def compiled(matcher) -> None:
                refused = isinstance(matcher, Exception)
                self._inbox.put(
                    _Submit(request, received_at, None if refused else matcher, str(matcher) if refused else None)
                )

            self._grammars.compile(grammar, compiled)

    def cancel(self, request_id: str) -> None:
        """End a request within one step, with finish_reason stop_sequence. Thread-safe."""
        self._inbox.put(_Cancel(request_id))

    # -- the engine thread

    def _run(self) -> None:
        self._runner.bind_thread()
        try:
            self._loop()
        except BaseException:
            log.exception("engine_crashed")  # the worker sees alive() turn False and exits
            raise

    def _loop(self) -> None:
        while True:
            commands, self._deferred = self._deferred, []
            if not commands and not self._sequences:  # block only when there is nothing to compute
                commands.append(self._inbox.get())
            while not self._inbox.empty():
                commands.append(self._inbox.get_nowait())
            events: list[TokenEvent] = []
            for command in commands:
                if command is _STOP:
                    return
                events.extend(self._apply(command))
            events.extend(self._expire())
            events.extend(self._step())
            if events:
                self._on_step(events)
            if self._on_cache is not None:
                added, removed = self._blocks.drain_prefix_changes()
                if added or removed:
                    self._on_cache(added, removed)

    def _apply(self, command: _Submit | _Cancel) -> list[TokenEvent]:
        if isinstance(command, _Cancel):
            sequence = self._sequences.get(command.request_id)
            if sequence is None and command.request_id in self._compiling:
                self._cancelled_compiling.add(command.request_id)
            return [self._end(sequence, FinishReason.STOP_SEQUENCE)] if sequence else []
        request = command.request
        self._compiling.discard(request.request_id)
        if request.request_id in self._cancelled_compiling:  # cancelled while its grammar compiled
            self._cancelled_compiling.discard(request.request_id)
            return [_unstarted_end(request, FinishReason.STOP_SEQUENCE)]
        try:
            sequence = self._admit(command)
        except _Rejected as rejected:
            return [rejected.event]
        if sequence.generated and self._out_of_room(sequence, len(sequence.generated)):
            # A failover of a request whose last event was lost: nothing is left to generate.
            return [sequence.stop(FinishReason.LENGTH)]
        self._sequences[sequence.request_id] = sequence
        self._scheduler.add(sequence)
        return []

    def _admit(self, submitted: _Submit) -> Sequence:
        request, received_at = submitted.request, submitted.received_at
        tokenizer = self._loaded.tokenizer
        if submitted.refusal is not None:
            raise _Rejected(request, f"the grammar cannot be applied: {submitted.refusal}")
        images = None
        if request.prompt_token_ids is not None:
            prompt_ids = request.prompt_token_ids
            invalid = [t for t in prompt_ids if not 0 <= t < self._loaded.vocab_size]
            if invalid:
                vocab = self._loaded.vocab_size
                raise _Rejected(request, f"token id {invalid[0]} is outside the vocabulary [0, {vocab})")
        elif request.chat_messages is not None or request.prompt_parts is not None:
            prompt_ids, images = self._with_images(request)
        else:
            prompt_ids = tokenizer(request.prompt_text)["input_ids"]
        if request.truncate is not None:
            if images is not None and request.truncate < len(prompt_ids):
                raise _Rejected(request, "a prompt with images cannot be truncated (truncate)")
            prompt_ids = prompt_ids[-request.truncate :]
        if not prompt_ids:
            raise _Rejected(request, "the prompt has no tokens")
        if len(prompt_ids) > self.max_input_len:
            raise _Rejected(
                request,
                f"the prompt has {len(prompt_ids)} tokens after tokenization; at most {self.max_input_len} are allowed",
            )
        budget = min(request.sampling.max_new_tokens, self.config.max_iter_times) - request.tokens_before
        if budget < 1:
            raise _Rejected(request, f"no token is left to generate after the {request.tokens_before} generated before")
        sequence = Sequence(
            request=request,
            prompt_ids=prompt_ids,
            max_new_tokens=budget,
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids, request.sampling.skip_special_tokens),
            stop_strings=StopStrings(request.sampling.stop, request.sampling.include_stop_str_in_output),
            received_at=received_at,
            matcher=submitted.matcher,
            images=images,
        )
        sequence.replay(request.generated_token_ids)  # the text goes on exactly where the client's stopped
        if self._on_cache is not None:
            sequence.prefix_marks = self._prefix_marks(request, len(prompt_ids))
        return sequence

    def _prefix_marks(self, request: GenerationRequest, prompt_tokens: int) -> dict[int, list[int]]:
        """Where each named prefix of the prompt ends among its KV blocks, in proportion to its bytes (a
        router's estimate: the names are of bytes, the blocks of tokens)."""
        tokens_per_byte = prompt_tokens / max(1, len(prompt_bytes(request)))
        marks: dict[int, list[int]] = {}
        for number, prefix in enumerate(prefix_hashes(request), start=1):
            block = int(number * CHUNK_BYTES * tokens_per_byte) // self.config.block_size - 1
            if block >= 0:
                marks.setdefault(block, []).append(prefix)
        return marks

    def _with_images(self, request: GenerationRequest) -> tuple[list[int], Any]:
        """The token ids of a chat or of a raw prompt in parts, and what its images need (vision.py), if any."""
        if request.images and self._vision is None:
            raise _Rejected(request, f"model {request.model} does not accept image input")
        if request.chat_messages is None:
            text = "".join(
                p.text if isinstance(p, TextPart) else self._vision.placeholder for p in request.prompt_parts
            )
        elif self._vision is None:
            return self._render_chat(request), None
        else:
            text = self._rendered(request, self._vision.render_chat)
        if self._vision is None:
            return self._loaded.tokenizer(text)["input_ids"], None
        from workers.engine.vision import ImageRefused

        try:
            return self._vision.prepare(text, request.images, rendered=request.chat_messages is not None)
        except ImageRefused as refused:
            raise _Rejected(request, str(refused)) from None

    def _render_chat(self, request: GenerationRequest) -> list[int]:
        tokenizer = self._loaded.tokenizer
        if not tokenizer.chat_template:
            raise _Rejected(request, "this model has no chat template; use a completion route")
        rendered = self._rendered(
            request, lambda m, t: tokenizer.apply_chat_template(m, tools=t, add_generation_prompt=True, tokenize=True)
        )
        return rendered["input_ids"]

    @staticmethod
    def _rendered(request: GenerationRequest, render: Callable[[list[dict], list[dict] | None], Any]) -> Any:
        messages = [m.model_dump(exclude_none=True) for m in request.chat_messages or ()]
        try:
            return render(messages, request.tools)
        except Exception as error:  # the template refuses the conversation (roles out of order, ...)
            raise _Rejected(request, f"the chat template cannot render these messages: {error}") from None

    def _end(self, sequence: Sequence, reason: FinishReason, error: ErrorInfo | None = None) -> TokenEvent:
        self._scheduler.remove(sequence)
        del self._sequences[sequence.request_id]
        return sequence.stop(reason, error)

    def _expire(self) -> list[TokenEvent]:
        now = time.time()
        return [
            self._end(s, FinishReason.STOP_SEQUENCE, _timeout_error(s))
            for s in list(self._sequences.values())
            if now > s.request.deadline
        ]

    def _step(self) -> list[TokenEvent]:
        chunks = self._scheduler.schedule()
        self._yielded_s = 0.0
        started_at = time.monotonic()
        events = self._compute(chunks)
        prompt_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        if prompt_tokens:
            # Decoding rows ride along: an upper bound. The urgent requests' steps run within it are not its cost.
            cost = (time.monotonic() - started_at - self._yielded_s) / prompt_tokens
            self.seconds_per_prompt_token = (
                0.8 * self.seconds_per_prompt_token + 0.2 * cost if self.seconds_per_prompt_token else cost
            )
        return events

    def _start_urgent(self) -> None:
        """Within a step, between two layers: start a request more urgent than every running one.

        Its first token then waits for its own prompt's step, run here, rather
        than for the rest of the step too. Whatever else came in waits for the
        step's end.
        """
        while not self._inbox.empty():
            command = self._inbox.get_nowait()
            if not isinstance(command, _Submit) or not self._scheduler.outranks_running(command.request.priority):
                self._deferred.append(command)
                continue
            started_at = time.monotonic()
            events = self._apply(command)
            sequence = self._sequences.get(command.request.request_id)
            chunk = self._scheduler.start_beside(sequence) if sequence is not None and not events else None
            if chunk is not None:
                events = self._compute([chunk])
            if events:
                self._on_step(events)
            self._yielded_s += time.monotonic() - started_at

    def _compute(self, chunks: list[Chunk]) -> list[TokenEvent]:
        """Run one step of these chunks; their events."""
        if not chunks:
            return []
        started_at = time.monotonic()
        drawing = [c for c in chunks if c.samples]
        try:
            output = self._runner.execute(chunks, drawing)
        except Exception as error:  # a broken step must fail its requests, not the worker
            log.exception("step_failed", requests=[c.sequence.request_id for c in chunks])
            failure = ErrorInfo(message=f"generation failed: {error}", error_type="Incomplete Generation", status=500)
            return [self._end(c.sequence, FinishReason.INVALID_FLAG, failure) for c in chunks]
        for chunk in chunks:
            scores = output.prompt_logprobs.get(chunk.sequence.request_id)
            if scores is not None:
                chunk.sequence.score_prompt(chunk.sequence.num_cached_tokens, scores)
            self._blocks.computed(chunk.sequence, chunk.sequence.num_cached_tokens + chunk.num_tokens)
        events = []
        for chunk, token, scored in zip(drawing, output.tokens, output.logprobs, strict=True):
            sequence = chunk.sequence
            finish = self._finish_reason(sequence, token)
            event = sequence.append(token, scored, started_at, len(chunks), finish)
            events.append(event)
            if event.finish_reason is not None:
                self._scheduler.remove(sequence)
                del self._sequences[sequence.request_id]
        return events

    def _finish_reason(self, sequence: Sequence, token: int) -> FinishReason | None:
        if token in self._loaded.eos_token_ids and (not sequence.request.sampling.ignore_eos or sequence.grammar_done):
            return FinishReason.EOS_TOKEN
        if token in sequence.request.sampling.stop_token_ids:
            return FinishReason.STOP_SEQUENCE
        return FinishReason.LENGTH if self._out_of_room(sequence, len(sequence.generated) + 1) else None

    def _out_of_room(self, sequence: Sequence, generated: int) -> bool:
        """Whether a sequence with `generated` tokens has reached max_new_tokens or max_seq_len."""
        return generated >= sequence.max_new_tokens or len(sequence.prompt_ids) + generated >= self.config.max_seq_len


class _Rejected(Exception):
    """A request the engine cannot run; its event says why (a 424, per the contract)."""

    def __init__(self, request: GenerationRequest, message: str) -> None:
        super().__init__(message)
        error = ErrorInfo(message=message, error_type=_GENERATION_ERROR, status=424)
        self.event = _unstarted_end(request, FinishReason.INVALID_FLAG, error)


def _unstarted_end(request: GenerationRequest, reason: FinishReason, error: ErrorInfo | None = None) -> TokenEvent:
    """The last event of a request that ends before the engine starts it: after the tokens delivered before."""
    return TokenEvent(
        request_id=request.request_id,
        attempt=request.attempt,
        index=request.tokens_before + len(request.generated_token_ids),
        finish_reason=reason,
        error=error,
    )


def _timeout_error(sequence: Sequence) -> ErrorInfo:
    return ErrorInfo(
        message=f"request {sequence.request.request_id} exceeded its timeout",
        error_type="Timeout",
        status=504,
    )
