"""The engine: a thread that admits requests, steps the model over a continuous batch, and reports tokens.

The model never runs on the worker's event loop, so that Kafka heartbeats and
control messages keep flowing while it computes. The worker hands requests and
cancellations in through a thread-safe inbox; between steps the engine admits
them, and after each step hands out the step's events through `on_step`,
which must not block. Each step: the scheduler picks chunks, the model runner
computes them in one forward pass, the sampler draws a token for every
sequence whose chunk reached its end (an embed request's prompt is pooled
instead, and that ends it: workers/engine/pooling.py), and finished
sequences free their blocks.
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

from schemas.adapters import AdapterError
from schemas.messages import INCOMPLETE_GENERATION, TIMEOUT, ErrorInfo, FinishReason, TokenEvent
from workers.engine.adapters import Adapters
from workers.engine.admission import Admission, Rejected, Submitted, unstarted_end
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.request import EngineRequest
from workers.engine.scheduler import Chunk, Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence
from workers.engine.speculation import accepted_length, load_draft, speculator_for
from workers.engine.step_output import Scored, StepOutput

log = structlog.get_logger(__name__)


class Runner(Protocol):
    """Computes steps: workers/engine/model_runner.py's ModelRunner, or a simulated one."""

    num_blocks: int  # of the KV cache
    adapters: Adapters | None  # the LoRA adapters it serves (adapters.py); None: none

    def bind_thread(self) -> None:
        """Called first on the engine thread."""

    def execute(self, chunks: list[Chunk], drawing: list[Chunk]) -> StepOutput:
        """Compute the chunks; return the next token of each chunk in `drawing`, and the scores asked for."""

    def yield_between_layers(self, callback: Callable[[], None]) -> None:
        """Have `callback` called within steps, between layers, where the device allows it."""

    def close(self) -> None:
        """The engine is done stepping (its thread has ended)."""


class Model(Protocol):
    """What the engine needs of a model: model_loader.py's LoadedModel, or workers/simulated/'s."""

    tokenizer: Any  # a Hugging Face tokenizer's calls: __call__, apply_chat_template, decode, chat_template
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]

    @property
    def device_type(self) -> str: ...

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks (devices) it is split across."""

    def runner(self, config: EngineConfig, capture: Any = None, draft: Any = None) -> Runner:
        """`draft`: a draft model (workers/engine/draft.py) that will share the device, whose memory the runner's
        KV cache leaves."""

    def grammars(self) -> Any:
        """A workers/engine/grammar.py Grammars for its tokenizer; None: structured output is not served."""

    def vision(self) -> Any:
        """A workers/engine/vision.py Vision for a vision-language model; None: text only."""

    @property
    def pooling(self) -> Any:
        """How its embeddings are pooled (workers/engine/pooling.py's Pooling); None: embeddings are not served."""


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _ForgetAdapter:
    name: str


_STOP = object()  # put in the inbox to end the engine thread
# Tasks the admission answers from the tokenizer alone, between steps, in the inbox's order: no KV, no step.
_ANSWERED_AT_ONCE = frozenset(("tokenize", "detokenize"))


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
        hashes (the requests' PromptPrefixes, request.py) that became cached and that were evicted, after the
        steps that change them."""
        self._loaded = loaded
        self._eos_token_ids = loaded.eos_token_ids  # read at every token
        self.config = config = config.for_device(loaded.device_type)  # the device's defaults filled in
        self._on_step = on_step
        self._on_cache = on_cache
        draft = load_draft(config, loaded)  # first: the target's KV cache is sized around the draft's memory
        self._runner = loaded.runner(config, graph_capture, draft)
        self._grammars = loaded.grammars()
        self._vision = loaded.vision()
        self.image_pixels = self._vision.image_pixels if self._vision is not None else None
        capacity = self._runner.num_blocks * config.block_size
        if capacity < config.max_seq_len:
            raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_seq_len {config.max_seq_len}")
        self._blocks = BlockManager(self._runner.num_blocks, config.block_size)
        self.adapters = self._runner.adapters
        self._scheduler = Scheduler(
            SchedulerConfig(config.max_batch_size, config.max_tokens_per_step, config.aging_s),
            self._blocks,
            self.adapters,
        )
        self._speculator = speculator_for(config, loaded, capacity, draft)
        self._sequences: dict[str, Sequence] = {}
        self.seconds_per_prompt_token = 0.0  # of the steps with prompt chunks, lately (a router weighs waits by it)
        self._inbox: queue.SimpleQueue[Submitted | _Cancel | object] = queue.SimpleQueue()
        self._deferred: list[Submitted | _Cancel | object] = []  # read within a step, applied after it
        self._yielded_s = 0.0  # spent within the current step on urgent requests' steps
        # Requests whose grammar is compiling (added by submit's thread), and those of them already cancelled.
        self._compiling: set[str] = set()
        self._cancelled_compiling: set[str] = set()
        self._admission = Admission(loaded, self._vision, config, self.max_input_len)
        self._runner.yield_between_layers(self._start_urgent)
        self._thread: threading.Thread | None = None  # start()'s
        self._busy_since: float | None = None  # when the engine thread took up its current round of work

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
        """Counters since start: preemptions, prompt tokens served from the prefix cache, and speculation's
        tokens proposed and accepted and its verifications (speculation.py)."""
        counts = self._speculator.counts if self._speculator is not None else None
        return {
            "preemptions": self._scheduler.preemptions,
            "reused_tokens": self._blocks.reused_tokens,
            "speculative_proposed": counts.proposed if counts else 0,
            "speculative_accepted": counts.accepted if counts else 0,
            "speculative_verifications": counts.verifications if counts else 0,
        }

    def start(self) -> None:
        """Start stepping, in a thread whose log lines carry what the caller's context binds (its worker's id)."""
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name="engine", daemon=True
        )
        self._thread.start()

    def stop(self, wait_s: float = 30.0) -> None:
        """End the engine thread after its step, waiting for it at most `wait_s` (a stuck one: not at all)."""
        if self.alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout=wait_s)
        if not self.alive():  # a stuck step holds the runner: it ends with the process
            self._runner.close()
        if self._grammars is not None:
            self._grammars.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def busy_s(self) -> float:
        """How long the engine thread has been on its current step (admissions included); 0 while it waits for
        work. Read from any thread: a step that never ends shows here as a number that only grows."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def submit(self, request: EngineRequest, received_at: float) -> None:
        """Queue a request; its events come out of `on_step`. Thread-safe. A request with a grammar
        is queued once the grammar is compiled, which neither the caller nor the engine thread waits for."""
        grammar = request.sampling.grammar
        if grammar is None:
            self._inbox.put(Submitted(request, received_at))
        elif self._grammars is None:
            self._inbox.put(Submitted(request, received_at, refusal="this worker's model cannot constrain its output"))
        else:
            self._compiling.add(request.request_id)

            def compiled(matcher) -> None:
                refused = isinstance(matcher, Exception)
                self._inbox.put(
                    Submitted(request, received_at, None if refused else matcher, str(matcher) if refused else None)
                )

            self._grammars.compile(grammar, compiled)

    def cancel(self, request_id: str) -> None:
        """End a request within one step, with finish_reason stop_sequence. Thread-safe."""
        self._inbox.put(_Cancel(request_id))

    def forget_adapter(self, name: str) -> None:
        """LoRA adapter `name` was unloaded: out of the host cache between two steps (the sequences that hold it
        finish with it). Thread-safe: the adapters are the engine thread's."""
        self._inbox.put(_ForgetAdapter(name))

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
                self._busy_since = None  # waiting for work is not being stuck
                commands.append(self._inbox.get())
            self._busy_since = time.monotonic()
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

    def _apply(self, command: Submitted | _Cancel | _ForgetAdapter) -> list[TokenEvent]:
        if isinstance(command, _ForgetAdapter):
            if self.adapters is not None:
                self.adapters.forget(command.name)
            return []
        if isinstance(command, _Cancel):
            sequence = self._sequences.get(command.request_id)
            if sequence is None and command.request_id in self._compiling:
                self._cancelled_compiling.add(command.request_id)
            return [self._end(sequence, FinishReason.STOP_SEQUENCE)] if sequence else []
        request = command.request
        self._compiling.discard(request.request_id)
        if request.request_id in self._cancelled_compiling:  # cancelled while its grammar compiled
            self._cancelled_compiling.discard(request.request_id)
            return [unstarted_end(request, FinishReason.STOP_SEQUENCE)]
        try:
            if request.task in _ANSWERED_AT_ONCE:
                return [self._admission.answer(request)]
            sequence = self._admission.admit(command)
            if request.task == "embed":
                if self._loaded.pooling is None:
                    raise Rejected(request, f"model {request.model} does not compute embeddings")
                sequence.pooling = self._loaded.pooling
        except Rejected as rejected:
            return [rejected.event]
        if sequence.generated and self._out_of_room(sequence, len(sequence.generated)):
            # A failover of a request whose last event was lost: nothing is left to generate.
            return [sequence.stop(FinishReason.LENGTH)]
        if request.adapter is not None:
            try:
                sequence.adapter = self._pin_adapter(request)
            except Rejected as rejected:
                return [rejected.event]
        self._sequences[sequence.request_id] = sequence
        self._scheduler.add(sequence)
        return []

    def _pin_adapter(self, request: EngineRequest):
        if self.adapters is None:
            raise Rejected(request, f"model {request.model} serves no LoRA adapters (--max-loras 0)")
        if request.adapter_path is None:
            raise Rejected(request, f"adapter {request.adapter} has no directory to read it from")
        try:
            return self.adapters.pin(request.adapter, request.adapter_path)
        except AdapterError as error:
            raise Rejected(request, str(error)) from error

    def _end(self, sequence: Sequence, reason: FinishReason, error: ErrorInfo | None = None) -> TokenEvent:
        self._remove(sequence)
        return sequence.stop(reason, error)

    def _remove(self, sequence: Sequence) -> None:
        self._scheduler.remove(sequence)
        del self._sequences[sequence.request_id]
        if self._speculator is not None:
            self._speculator.forget(sequence)

    def _expire(self) -> list[TokenEvent]:
        now = time.time()
        return [
            self._end(s, FinishReason.STOP_SEQUENCE, _timeout_error(s))
            for s in list(self._sequences.values())
            if now > s.request.deadline
        ]

    def _step(self) -> list[TokenEvent]:
        chunks = self._scheduler.schedule()
        if self._speculator is not None:
            chunks = self._speculator.plan(chunks, self._blocks, self._scheduler.step_budget)
        self._yielded_s = 0.0
        started_at = time.monotonic()
        events = self._compute(chunks)
        seconds = time.monotonic() - started_at - self._yielded_s  # less urgent requests' steps run within it
        prompt_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        if self._speculator is not None and chunks:
            self._speculator.rule.measured(None if prompt_tokens else sum(c.rows for c in chunks), seconds)
        if prompt_tokens:
            cost = seconds / prompt_tokens  # decoding rows ride along: an upper bound
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
            if not isinstance(command, Submitted) or not self._scheduler.outranks_running(command.request.priority):
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
            failure = ErrorInfo(message=f"generation failed: {error}", error_type=INCOMPLETE_GENERATION, status=500)
            return [self._end(c.sequence, FinishReason.INVALID_FLAG, failure) for c in chunks]
        for chunk in chunks:
            scores = output.prompt_logprobs.get(chunk.sequence.request_id)
            if scores is not None:
                chunk.sequence.score_prompt(chunk.sequence.num_cached_tokens, scores)
            if not chunk.proposed:  # a speculating one's computed tokens are known once verified
                self._blocks.computed(chunk.sequence, chunk.sequence.num_cached_tokens + chunk.num_tokens)
        events = []
        row = 0  # of the output's draws: a chunk has one, and one more per token proposed
        for chunk in drawing:
            end = row + 1 + len(chunk.proposed)
            events += self._take(chunk, output.tokens[row:end], output.logprobs[row:end], started_at, len(chunks))
            row = end
        for request_id, vector in output.embeddings.items():
            events.append(self._sequences[request_id].embedded(vector, len(chunks)))
        for event in events:
            if event.finish_reason is not None:
                self._remove(self._sequences[event.request_id])
        return events

    def _take(
        self, chunk: Chunk, drawn: list[int | None], scores: list[Scored | None], started_at: float, batch_size: int
    ) -> list[TokenEvent]:
        """The chunk's new tokens: its proposals accepted (speculation.py), then the draw after them; each
        an event, up to the first that ends the sequence. A draw of None (NaN logits) ends it with an error."""
        sequence = chunk.sequence
        accepted = accepted_length(chunk.proposed, drawn)
        events = []
        for token, scored in zip(drawn[: accepted + 1], scores, strict=False):
            if token is None:
                events.append(_nan_output(sequence))
                break
            events.append(sequence.append(token, scored, started_at, batch_size, self._finish_reason(sequence, token)))
            if sequence.finish_reason is not None:
                break
        if chunk.proposed:
            # The KV of its last token and of the proposals taken is its own; the rest's slots are rewritten.
            self._blocks.computed(sequence, sequence.num_cached_tokens + len(events))
            self._blocks.shrink(sequence, sequence.num_tokens)
            self._speculator.settled(len(chunk.proposed), accepted)
        return events

    def _finish_reason(self, sequence: Sequence, token: int) -> FinishReason | None:
        if token in self._eos_token_ids and (not sequence.request.sampling.ignore_eos or sequence.grammar_done):
            return FinishReason.EOS_TOKEN
        if token in sequence.request.sampling.stop_token_ids:
            return FinishReason.STOP_SEQUENCE
        return FinishReason.LENGTH if self._out_of_room(sequence, len(sequence.generated) + 1) else None

    def _out_of_room(self, sequence: Sequence, generated: int) -> bool:
        """Whether a sequence with `generated` tokens has reached max_new_tokens or max_seq_len."""
        return generated >= sequence.max_new_tokens or len(sequence.prompt_ids) + generated >= self.config.max_seq_len


def _nan_output(sequence: Sequence) -> TokenEvent:
    """The last event of a sequence whose logits were NaN: an error, as it has no next token to give or to feed
    its next step; the rest of the batch goes on."""
    log.error("output_nan", request_id=sequence.request_id, index=sequence.next_index)
    message = f"generation failed: the model's output was NaN at generated token {sequence.next_index}"
    return sequence.stop(
        FinishReason.INVALID_FLAG, ErrorInfo(message=message, error_type=INCOMPLETE_GENERATION, status=500)
    )


def _timeout_error(sequence: Sequence) -> ErrorInfo:
    return ErrorInfo(
        message=f"request {sequence.request.request_id} exceeded its timeout",
        error_type=TIMEOUT,
        status=504,
    )
