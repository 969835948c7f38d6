"""Admission: a request turned into a sequence the scheduler can run, or refused with the reason why.

Between steps, on the engine thread: the prompt is tokenized (text, token ids,
a chat rendered by the model's template, a prompt with images prepared for a
vision-language model), truncated where asked, checked against the limits,
and its named prefixes placed among its KV blocks. A refusal is the request's
last event, a 424 per the contract, after whatever its client already has.
A tokenize or detokenize request goes through the same tokenization and
limits, and is answered here at once, in one event: it needs no KV and no step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas.messages import (
    GENERATION_ERROR,
    ErrorInfo,
    FinishReason,
    GenerationRequest,
    PromptToken,
    TextPart,
    TokenEvent,
    Tokenization,
)
from workers.engine.config import EngineConfig
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.request import EngineRequest
from workers.engine.sequence import Sequence
from workers.engine.stop_strings import StopStrings


@dataclass(frozen=True)
class Submitted:
    """A request handed to the engine, with its grammar compiled (or why it could not be)."""

    request: EngineRequest
    received_at: float  # time.monotonic() when the worker took it
    matcher: Any = None  # its grammar compiled: an llguidance LLMatcher
    refusal: str | None = None  # why its grammar could not be compiled


class Rejected(Exception):
    """A request the engine cannot run; its event says why (a 424, per the contract)."""

    def __init__(self, request: EngineRequest, message: str) -> None:
        super().__init__(message)
        error = ErrorInfo(message=message, error_type=GENERATION_ERROR, status=424)
        self.event = unstarted_end(request, FinishReason.INVALID_FLAG, error)


def unstarted_end(
    request: EngineRequest | GenerationRequest, reason: FinishReason, error: ErrorInfo | None = None
) -> TokenEvent:
    """The last event of a request that ends before the engine (or its worker) starts it: after the tokens
    delivered before."""
    return TokenEvent(
        request_id=request.request_id,
        attempt=request.attempt,
        index=request.tokens_before + len(request.generated_token_ids),
        finish_reason=reason,
        error=error,
    )


# How generation tokenizes a chat: the template writes the special tokens, and ends with the assistant's header.
_CHAT_AS_GENERATED = Tokenization(add_special_tokens=False)


class Admission:
    def __init__(self, model: Any, vision: Any, config: EngineConfig, max_input_len: int) -> None:
        """`model`: the engine's (its tokenizer and vocabulary); `vision`: its images' preparation
        (vision.py), None for a text-only model; `config` with the device's defaults."""
        self._tokenizer = model.tokenizer
        self._vocab_size = model.vocab_size
        self._vision = vision
        self._config = config
        self._max_input_len = max_input_len

    def admit(self, submitted: Submitted) -> Sequence:
        """The request's sequence, its generated tokens replayed; Rejected when it cannot run."""
        request = submitted.request
        if submitted.refusal is not None:
            raise Rejected(request, f"the grammar cannot be applied: {submitted.refusal}")
        prompt_ids, images = self._prompt(request)
        prompt_ids = prompt_ids[self._kept_from(request, len(prompt_ids), images is not None) :]
        if not prompt_ids:
            raise Rejected(request, "the prompt has no tokens")
        budget = min(request.sampling.max_new_tokens, self._config.max_iter_times) - request.tokens_before
        if budget < 1:
            raise Rejected(request, f"no token is left to generate after the {request.tokens_before} generated before")
        sequence = Sequence(
            request=request,
            prompt_ids=prompt_ids,
            max_new_tokens=budget,
            detokenizer=IncrementalDetokenizer(self._tokenizer, prompt_ids, request.sampling.skip_special_tokens),
            stop_strings=StopStrings(request.sampling.stop, request.sampling.include_stop_str_in_output),
            received_at=submitted.received_at,
            matcher=submitted.matcher,
            images=images,
        )
        sequence.replay(request.generated_token_ids)  # the text goes on exactly where the client's stopped
        if request.prefixes is not None:
            sequence.prefix_marks = self._prefix_marks(request, len(prompt_ids))
        return sequence

    def answer(self, request: EngineRequest) -> TokenEvent:
        """A tokenize request's tokens, or a detokenize request's text: its one event; Rejected as admit."""
        try:
            return self._tokenized(request)
        except Rejected:
            raise
        except Exception as error:  # a tokenizer that cannot (a slow one's offsets): the request fails, not the engine
            raise Rejected(request, f"the tokenizer cannot answer: {error}") from None

    def _tokenized(self, request: EngineRequest) -> TokenEvent:
        if request.task == "detokenize":
            token_ids, _ = self._prompt(request)  # the vocabulary checked
            text = self._tokenizer.decode(token_ids)  # special tokens included, as vLLM's /detokenize
            return self._answer(request, len(token_ids), text=text)
        if request.prompt_text is not None:  # with each token's place in the text
            add_special_tokens = request.tokenization is None or request.tokenization.add_special_tokens
            encoded = self._tokenizer(
                request.prompt_text, add_special_tokens=add_special_tokens, return_offsets_mapping=True
            )
            token_ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
            images = None
        else:
            (token_ids, images), offsets = self._prompt(request), None
        kept = self._kept_from(request, len(token_ids), images is not None)
        token_ids, places = token_ids[kept:], (offsets or [(None, None)] * len(token_ids))[kept:]
        spellings = self._tokenizer.convert_ids_to_tokens(token_ids)
        tokens = [
            PromptToken(id=token, token=spelling, start=start, stop=stop)
            for token, spelling, (start, stop) in zip(token_ids, spellings, places, strict=True)
        ]
        return self._answer(request, len(tokens), tokens=tokens)

    @staticmethod
    def _answer(request: EngineRequest, prompt_tokens: int, **answer: Any) -> TokenEvent:
        # Its finish_reason says the prompt was read to its end.
        return TokenEvent(
            request_id=request.request_id,
            attempt=request.attempt,
            index=0,
            prompt_tokens=prompt_tokens,
            finish_reason=FinishReason.LENGTH,
            **answer,
        )

    def _kept_from(self, request: EngineRequest, prompt_tokens: int, has_images: bool) -> int:
        """Where the tokens kept of a prompt of `prompt_tokens` start (truncate); Rejected if too many are left."""
        kept_from = 0
        if request.truncate is not None:
            if has_images and request.truncate < prompt_tokens:
                raise Rejected(request, "a prompt with images cannot be truncated (truncate)")
            kept_from = max(0, prompt_tokens - request.truncate)
        if prompt_tokens - kept_from > self._max_input_len:
            limit = self._max_input_len
            raise Rejected(
                request,
                f"the prompt has {prompt_tokens - kept_from} tokens after tokenization; at most {limit} are allowed",
            )
        return kept_from

    def _prompt(self, request: EngineRequest) -> tuple[list[int], Any]:
        """The prompt's token ids, and what its images need (vision.py), if it has any."""
        if request.prompt_token_ids is not None:
            invalid = [t for t in request.prompt_token_ids if not 0 <= t < self._vocab_size]
            if invalid:
                raise Rejected(request, f"token id {invalid[0]} is outside the vocabulary [0, {self._vocab_size})")
            return request.prompt_token_ids, None
        if request.chat_messages is not None or request.prompt_parts is not None:
            return self._with_images(request)
        return self._tokenizer(request.prompt_text)["input_ids"], None

    def _prefix_marks(self, request: EngineRequest, prompt_tokens: int) -> dict[int, list[int]]:
        """Where each named prefix of the prompt ends among its KV blocks, in proportion to its bytes (a
        router's estimate: the names are of bytes, the blocks of tokens)."""
        prefixes = request.prefixes
        tokens_per_byte = prompt_tokens / max(1, prefixes.prompt_bytes)
        marks: dict[int, list[int]] = {}
        for number, prefix in enumerate(prefixes.hashes, start=1):
            block = int(number * prefixes.chunk_bytes * tokens_per_byte) // self._config.block_size - 1
            if block >= 0:
                marks.setdefault(block, []).append(prefix)
        return marks

    def _with_images(self, request: EngineRequest) -> tuple[list[int], Any]:
        """The token ids of a chat or of a raw prompt in parts, and what its images need (vision.py), if any."""
        if request.images and self._vision is None:
            raise Rejected(request, f"model {request.model} does not accept image input")
        if request.chat_messages is None:
            text = "".join(
                p.text if isinstance(p, TextPart) else self._vision.placeholder for p in request.prompt_parts
            )
        elif self._vision is None:
            return self._render_chat(request), None
        elif request.tokenization not in (None, _CHAT_AS_GENERATED):
            raise Rejected(
                request,
                f"model {request.model} renders a chat with its processor's template as for generation: "
                "add_special_tokens false, add_generation_prompt true, continue_final_message false",
            )
        else:
            text = self._rendered(request, self._vision.render_chat)
        if self._vision is None:
            return self._tokenizer(text)["input_ids"], None
        from workers.engine.vision import ImageRefused

        try:
            return self._vision.prepare(text, list(request.images), rendered=request.chat_messages is not None)
        except ImageRefused as refused:
            raise Rejected(request, str(refused)) from None

    def _render_chat(self, request: EngineRequest) -> list[int]:
        tokenizer = self._tokenizer
        if not tokenizer.chat_template:
            raise Rejected(request, "this model has no chat template; use a completion route")
        options = request.tokenization or _CHAT_AS_GENERATED
        rendered = self._rendered(
            request,
            lambda m, t: tokenizer.apply_chat_template(
                m,
                tools=t,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=False,
            ),
        )
        return tokenizer(rendered, add_special_tokens=options.add_special_tokens)["input_ids"]

    @staticmethod
    def _rendered(request: EngineRequest, render: Callable[[list[dict], list[dict] | None], Any]) -> Any:
        messages = [m.model_dump(exclude_none=True) for m in request.chat_messages or ()]
        try:
            return render(messages, request.tools)
        except Exception as error:  # the template refuses the conversation (roles out of order, ...)
            raise Rejected(request, f"the chat template cannot render these messages: {error}") from None
