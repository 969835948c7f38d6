"""The engine: a thread that admits requests, steps the model and reports tokens.

The model never runs on the worker's event loop, so that Kafka heartbeats and
control messages keep flowing while it computes. The worker hands requests and
cancellations in through a thread-safe inbox; after each step the engine hands
the step's events out through `on_step`, which must not block.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from schemas.messages import ErrorInfo, FinishReason, GenerationRequest, TokenEvent
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.model_runner import LoadedModel, ModelRunner
from workers.engine.sampler import logits_processors, next_token
from workers.engine.sequence import Sequence

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int = 32  # sequences that run at once (MindIE's maxBatchSize)
    max_seq_len: int = 2560  # prompt + generated tokens (maxSeqLen)
    max_input_len: int = 2048  # prompt tokens (maxInputTokenLen)
    max_iter_times: int = 512  # generated tokens per request (maxIterTimes)


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    received_at: float


@dataclass(frozen=True)
class _Cancel:
    request_id: str


_GENERATION_ERROR = "Generation Error"


class Engine:
    def __init__(self, loaded: LoadedModel, limits: EngineLimits, on_step: Callable[[list[TokenEvent]], None]):
        self._loaded = loaded
        self._limits = limits
        self._on_step = on_step
        self._runner = ModelRunner(loaded)
        self._inbox: queue.SimpleQueue[_Submit | _Cancel | object] = queue.SimpleQueue()
        self._running: dict[str, Sequence] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    @property
    def max_input_len(self) -> int:
        """Prompt tokens a request may have, as the contract computes it."""
        return min(
            self._limits.max_input_len,
            self._limits.max_seq_len - 1,
            self._loaded.max_position_embeddings,
            1024 * 1024,
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout=30)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest, received_at: float) -> None:
        """Queue a request; its events come out of `on_step`. Thread-safe."""
        self._inbox.put(_Submit(request, received_at))

    def cancel(self, request_id: str) -> None:
        """End a request within one step, with finish_reason stop_sequence. Thread-safe."""
        self._inbox.put(_Cancel(request_id))

    # -- the engine thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("engine_crashed")  # the worker sees alive() turn False and exits
            raise

    def _loop(self) -> None:
        while True:
            # Block only when there is nothing to compute.
            commands = [] if self._running else [self._inbox.get()]
            while not self._inbox.empty():
                commands.append(self._inbox.get_nowait())
            events: list[TokenEvent] = []
            for command in commands:
                if command is _STOP:
                    return
                events.extend(self._apply(command))
            events.extend(self._step())
            if events:
                self._on_step(events)

    def _apply(self, command: _Submit | _Cancel) -> list[TokenEvent]:
        if isinstance(command, _Cancel):
            sequence = self._running.pop(command.request_id, None)
            return [sequence.stop(FinishReason.STOP_SEQUENCE)] if sequence else []
        try:
            sequence = self._admit(command.request, command.received_at)
        except _Rejected as rejected:
            return [rejected.event]
        self._running[sequence.request_id] = sequence
        return []

    def _admit(self, request: GenerationRequest, received_at: float) -> Sequence:
        tokenizer = self._loaded.tokenizer
        if request.prompt_token_ids is not None:
            prompt_ids = request.prompt_token_ids
            invalid = [t for t in prompt_ids if not 0 <= t < self._loaded.vocab_size]
            if invalid:
                raise _Rejected(
                    request, f"token id {invalid[0]} is outside the vocabulary [0, {self._loaded.vocab_size})"
                )
        else:
            prompt_ids = tokenizer(request.prompt_text)["input_ids"]
        if not prompt_ids:
            raise _Rejected(request, "the prompt has no tokens")
        if len(prompt_ids) > self.max_input_len:
            raise _Rejected(
                request,
                f"the prompt has {len(prompt_ids)} tokens after tokenization; at most {self.max_input_len} are allowed",
            )
        budget = min(request.sampling.max_new_tokens, self._limits.max_iter_times) - request.tokens_before
        if budget < 1:
            raise _Rejected(request, f"no token is left to generate after the {request.tokens_before} generated before")
        return Sequence(
            request=request,
            prompt_ids=prompt_ids,
            max_new_tokens=budget,
            processors=logits_processors(request.sampling),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids),
            received_at=received_at,
        )

    def _step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        batch_size = len(self._running)
        now = time.time()
        for sequence in list(self._running.values()):
            if now > sequence.request.deadline:
                events.append(self._finish(sequence, FinishReason.STOP_SEQUENCE, _timeout_error(sequence)))
                continue
            started_at = time.monotonic()
            try:
                logits = self._runner.next_logits(sequence)
                token = next_token(
                    logits, sequence.token_ids, sequence.request.sampling, sequence.processors, sequence.next_index
                )
            except Exception as error:  # a broken model must fail its request, not the worker
                log.exception("step_failed", request_id=sequence.request_id)
                failure = ErrorInfo(
                    message=f"generation failed: {error}", error_type="Incomplete Generation", status=500
                )
                events.append(self._finish(sequence, FinishReason.INVALID_FLAG, failure))
                continue
            finish = self._finish_reason(sequence, token)
            events.append(sequence.append(token, started_at, batch_size, finish))
            if finish is not None:
                del self._running[sequence.request_id]
        return events

    def _finish(self, sequence: Sequence, reason: FinishReason, error: ErrorInfo | None) -> TokenEvent:
        del self._running[sequence.request_id]
        return sequence.stop(reason, error)

    def _finish_reason(self, sequence: Sequence, token: int) -> FinishReason | None:
        if token in self._loaded.eos_token_ids:
            return FinishReason.EOS_TOKEN
        generated = len(sequence.generated) + 1
        if generated >= sequence.max_new_tokens or len(sequence.prompt_ids) + generated >= self._limits.max_seq_len:
            return FinishReason.LENGTH
        return None


_STOP = object()  # put in the inbox to end the engine thread


class _Rejected(Exception):
    """A request the engine cannot run; its event says why (a 424, per the contract)."""

    def __init__(self, request: GenerationRequest, message: str) -> None:
        super().__init__(message)
        self.event = TokenEvent(
            request_id=request.request_id,
            attempt=request.attempt,
            index=0,
            finish_reason=FinishReason.INVALID_FLAG,
            error=ErrorInfo(message=message, error_type=_GENERATION_ERROR, status=424),
        )


def _timeout_error(sequence: Sequence) -> ErrorInfo:
    return ErrorInfo(
        message=f"request {sequence.request.request_id} exceeded its timeout",
        error_type="Timeout",
        status=504,
    )
