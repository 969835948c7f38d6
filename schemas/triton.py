"""Bodies of the Triton-compatible routes: /v2/models/{model}/generate and generate_stream.

Field names, types and ranges are MindIE's (../shared/spec/API.md decides
where its pages disagree). Every optional parameter may be sent as `null`,
which means "not given". Unknown fields are refused, never ignored.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import SamplingParams

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,256}$"
DEFAULT_MAX_NEW_TOKENS = 20

# strict: 5.0 is not an int and "5" is not a number; ints are still accepted as floats.
_STRICT = ConfigDict(extra="forbid", strict=True)


class SamplingParameters(BaseModel):
    """The sampling parameters every Triton route accepts."""

    model_config = _STRICT

    details: bool | None = Field(None, description="Return generation details.")
    do_sample: bool | None = Field(
        None,
        description="Sample rather than take the likeliest token; absent: sample iff a sampling parameter asks.",
    )
    max_new_tokens: int | None = Field(
        None, gt=0, le=INT32_MAX, description="At most this many new tokens (also capped by maxIterTimes); default 20."
    )
    repetition_penalty: float | None = Field(None, gt=0.0, description="1.0 = off.")
    seed: int | None = Field(None, gt=0, le=UINT64_MAX, description="Absent: the server draws one.")
    temperature: float | None = Field(None, gt=1e-6, description="Default 1.0.")
    top_k: int | None = Field(None, ge=0, le=INT32_MAX, description="0 = off.")
    top_p: float | None = Field(None, gt=1e-6, le=1.0, description="Default 1.0.")
    batch_size: int | None = Field(None, gt=0, le=INT32_MAX, description="Informational.")
    typical_p: float | None = Field(None, gt=0.0, le=1.0, description="Absent: off.")
    watermark: bool | None = Field(None, description="Accepted; watermarking is not implemented.")

    def wants_sampling(self) -> bool:
        if self.do_sample is not None:
            return self.do_sample
        return (
            (self.temperature is not None and self.temperature != 1.0)
            or (self.top_k is not None and self.top_k > 0)
            or (self.top_p is not None and self.top_p < 1.0)
            or self.typical_p is not None
        )

    def sampling(self, seed: int) -> SamplingParams:
        """The parameters a worker applies, defaults filled in; `seed` is used when none was given."""
        return SamplingParams(
            do_sample=self.wants_sampling(),
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_k=self.top_k or 0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            typical_p=self.typical_p,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            seed=self.seed if self.seed is not None else seed,
            max_new_tokens=self.max_new_tokens if self.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS,
        )


class GenerateParameters(SamplingParameters):
    perf_stat: bool | None = Field(None, description="Accepted for compatibility.")


class GenerateStreamParameters(SamplingParameters):
    top_k: int | None = Field(None, gt=0, le=INT32_MAX)
    priority: int | None = Field(None, ge=1, le=5, description="1 is the most urgent; default 5.")
    timeout: int | None = Field(None, gt=0, le=3600, description="Seconds from arrival to the last token; default 600.")
    firstTokenCost: int | None = Field(None, ge=0, le=UINT64_MAX, description="Recomputation only.")
    decodeTime: list[Annotated[int, Field(ge=0, le=UINT64_MAX)]] | None = Field(None, description="Recomputation only.")


class GenerateRequest(BaseModel):
    """POST /v2/models/{model}/generate"""

    model_config = _STRICT

    id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    text_input: str = Field(min_length=1, max_length=512 * 1024)
    parameters: GenerateParameters = GenerateParameters()


class GenerateStreamRequest(BaseModel):
    """POST /v2/models/{model}/generate_stream"""

    model_config = _STRICT

    id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    text_input: str = Field(min_length=1, max_length=4 * 1024 * 1024)
    parameters: GenerateStreamParameters = GenerateStreamParameters()


class _TokenCounts(BaseModel):
    generated_tokens: int
    first_token_cost: None = Field(None, description="Not collected, as in MindIE.")
    decode_cost: None = Field(None, description="Not collected, as in MindIE.")


class GenerateDetails(_TokenCounts):
    finish_reason: str


class _Output(BaseModel):
    id: str = Field(description="The request's id, or one the server made up.")
    model_name: str
    model_version: None = None
    text_output: str


class GenerateResponse(_Output):
    details: GenerateDetails | None = Field(None, description="Present when parameters.details is true.")


class StreamDetails(_TokenCounts):
    finish_reason: str | None = Field(None, description="On the last event only.")
    batch_size: int
    queue_wait_time: int = Field(description="Microseconds the sequence waited before the step.")


class StreamEvent(_Output):
    """One `data:` event of generate_stream."""

    details: StreamDetails | None = Field(None, description="Present when parameters.details is true.")
    prefill_time: float | None = Field(None, description="Milliseconds to the first token, on the first event.")
    decode_time: float | None = Field(None, description="Milliseconds since the previous token, on later events.")
