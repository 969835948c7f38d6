"""TGI-compatible bodies: POST /generate and POST /generate_stream, as MindIE serves them (TGI 0.9.4).

Parameters and ranges are TGI's (see ../shared/spec/API.md), and
`ignore_eos` as on MindIE's routes; other fields are ignored and named
(schemas/body.py). Token log-probabilities are the model's raw ones
(log-softmax of its logits, before temperature and filtering).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from schemas.body import Body
from schemas.parameters import (
    STRICT,
    Details,
    DoSample,
    GrammarParameter,
    IgnoreEos,
    MaxNewTokens,
    RepetitionPenalty,
    RouteParameters,
    Seed,
    SpeculativeParameter,
    Temperature,
    TopK,
    TopPBelowOne,
    TypicalP,
    Watermark,
)

MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
MAX_BEST_OF = 4  # each sequence is a request of its own to a worker (TGI's default --max-best-of is 2)
StopString = Annotated[str, Field(min_length=1, max_length=1024)]


class TgiParameters(RouteParameters):
    adapter_id: str | None = Field(None, description="A LoRA adapter served by name (TGI's); none: the default model.")
    details: Details = None
    decoder_input_details: bool | None = Field(None, description="Also the prompt's tokens (not with a stream).")
    do_sample: DoSample = None
    ignore_eos: IgnoreEos = None
    max_new_tokens: MaxNewTokens = None
    repetition_penalty: RepetitionPenalty = None
    return_full_text: bool | None = Field(None, description="Prepend the prompt to generated_text.")
    seed: Seed = None
    stop: list[StopString] = Field([], max_length=4, description="Generation ends before the first of these.")
    temperature: Temperature = None
    top_k: TopK = None
    top_p: TopPBelowOne = None
    truncate: int | None = Field(None, gt=0, description="Keep only the prompt's last N tokens.")
    typical_p: TypicalP = None
    top_n_tokens: int | None = Field(
        None, ge=0, le=MAX_TOP_N_TOKENS, description="List this many likeliest tokens at each position."
    )
    watermark: Watermark = None
    grammar: GrammarParameter = None
    speculative: SpeculativeParameter = None
    best_of: int | None = Field(
        None, gt=0, le=MAX_BEST_OF, description="Sample this many; answer the likeliest (not with seed or stream)."
    )

    @model_validator(mode="after")
    def _best_of_samples_unseeded(self) -> TgiParameters:
        if (self.best_of or 1) > 1:
            if self.seed is not None:
                raise ValueError("best_of > 1 cannot be used with a seed: each sequence draws its own")
            if not self.wants_sampling():
                raise ValueError("best_of > 1 needs sampling (do_sample, or a sampling parameter)")
        return self

    @field_validator("typical_p")
    @classmethod
    def _typical_below_one(cls, value: float | None) -> float | None:
        if value is not None and value >= 1.0:
            raise ValueError("typical_p must be in (0, 1)")
        return value


class TgiTokenizeRequest(Body):
    """POST /tokenize in TGI's shape: `inputs` tokenized as /generate takes it (truncate applies)."""

    model_config = STRICT

    inputs: str = Field(min_length=1, max_length=512 * 1024)
    parameters: TgiParameters = TgiParameters()


class TgiRequest(TgiTokenizeRequest):
    stream: bool = Field(False, description="On /generate: answer as /generate_stream would.")

    @model_validator(mode="after")
    def _not_when_streaming(self) -> TgiRequest:
        if self.parameters.decoder_input_details and self.stream:
            raise ValueError("decoder_input_details cannot be used with a stream")
        if (self.parameters.best_of or 1) > 1 and self.stream:
            raise ValueError("best_of > 1 cannot be used with a stream")
        return self


class TgiToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None  # null only on a last event without a token of its own
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None


class TgiDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None  # the seed drawn with, when sampling
    prompt_tokens: int | None = None
    prefill: list[PrefillToken] = []
    tokens: list[TgiToken] = []
    top_tokens: list[list[TgiToken]] | None = None  # with top_n_tokens: per generated token
    best_of_sequences: list[BestOfSequence] | None = None  # with best_of > 1


class BestOfSequence(BaseModel):
    """A sequence best_of sampled and did not answer with."""

    generated_text: str
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken] = []
    tokens: list[TgiToken] = []
    top_tokens: list[list[TgiToken]] | None = None


class TgiResponse(BaseModel):
    generated_text: str
    details: TgiDetails | None = None


class TgiStreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None


class TgiStreamEvent(BaseModel):
    token: TgiToken
    top_tokens: list[TgiToken] | None = None  # with top_n_tokens
    generated_text: str | None = None  # on the last event
    details: TgiStreamDetails | None = None  # on the last event, when asked


class TgiSimpleToken(BaseModel):
    """A token of TGI's /tokenize answer: `inputs[start:stop]` is its text (a special token's is empty)."""

    id: int
    text: str
    start: int  # characters into inputs
    stop: int


class TgiError(BaseModel):
    error: str
    error_type: str
