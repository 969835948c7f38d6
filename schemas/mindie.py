"""Bodies of MindIE's native routes: POST /infer_token and POST /infer (one handler)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from schemas.body import Body
from schemas.parameters import STRICT, InferTokenParameters
from schemas.triton import MAX_PROMPT_TOKENS, TextInput

TokenId = Annotated[int, Field(ge=0, le=1024 * 1024)]


class InferTokenRequest(Body):
    """Token ids in `input_id` (/infer_token), or text or a multimodal list in `inputs` (/infer)."""

    model_config = STRICT

    input_id: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    inputs: TextInput | None = None
    stream: bool | None = Field(None, description="Server-sent events instead of one answer; default false.")
    parameters: InferTokenParameters = InferTokenParameters()

    @model_validator(mode="after")
    def _one_prompt(self) -> InferTokenRequest:
        if self.input_id is not None and self.inputs is not None:
            raise ValueError("input_id and inputs cannot be given together")
        if self.input_id is None and self.inputs is None:
            raise ValueError("one of input_id and inputs is required")
        return self


class InferDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int


class InferTokenResponse(BaseModel):
    generated_text: str
    details: InferDetails | None = Field(None, description="Present when parameters.details is true.")


class StreamToken(BaseModel):
    id: list[int]
    text: str | None = Field(description="null on the last event.")


class InferTokenStreamEvent(BaseModel):
    """One `data: ` event of a streamed /infer_token answer."""

    prefill_time: float | None
    decode_time: float | None
    generated_text: str | None = Field(None, description="On the last event only.")
    details: InferDetails | None = Field(None, description="On the last event, when parameters.details is true.")
    token: StreamToken
