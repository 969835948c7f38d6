"""Bodies of the Triton-compatible routes: /v2/models/{model}/generate, generate_stream, infer.

Field names, types and ranges are MindIE's (../shared/spec/API.md decides
where its pages disagree). Unknown fields are refused, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from schemas.multimodal import MultimodalInput
from schemas.parameters import (
    STRICT,
    GenerateParameters,
    GenerateStreamParameters,
    TritonInferParameters,
)

REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,256}$"
MAX_PROMPT_TOKENS = 1024 * 1024  # the contract's cap, whatever the model allows
UINT32_MAX = 2**32 - 1

RequestId = Annotated[str | None, Field(pattern=REQUEST_ID_PATTERN, description="Absent: the server makes one up.")]


class GenerateRequest(BaseModel):
    """POST /v2/models/{model}/generate"""

    model_config = STRICT

    id: RequestId = None
    # A multimodal list as generate_stream takes it (beyond MindIE's page for this route: images need it).
    text_input: Annotated[str, Field(min_length=1, max_length=512 * 1024)] | MultimodalInput
    parameters: GenerateParameters = GenerateParameters()


class GenerateStreamRequest(BaseModel):
    """POST /v2/models/{model}/generate_stream"""

    model_config = STRICT

    id: RequestId = None
    text_input: Annotated[str, Field(min_length=1, max_length=4 * 1024 * 1024)] | MultimodalInput
    parameters: GenerateStreamParameters = GenerateStreamParameters()


class InferInput(BaseModel):
    model_config = STRICT

    name: Literal["input0"]
    shape: list[int] = Field(min_length=1, max_length=2, description="[n] or [1, n], n the length of data.")
    datatype: Literal["UINT32"]
    data: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] = Field(
        min_length=1, max_length=MAX_PROMPT_TOKENS, description="Prompt token ids."
    )
    parameters: TritonInferParameters | None = None

    @model_validator(mode="after")
    def _shape_fits_data(self) -> InferInput:
        if self.shape not in ([len(self.data)], [1, len(self.data)]):
            raise ValueError(f"shape {self.shape} does not fit data of length {len(self.data)}: use [n] or [1, n]")
        return self


class InferOutputRequest(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=256)


class InferRequest(BaseModel):
    """POST /v2/models/{model}/infer: token ids in, token ids out."""

    model_config = STRICT

    id: RequestId = None
    inputs: list[InferInput] = Field(min_length=1, max_length=1)
    outputs: list[InferOutputRequest] = Field(min_length=1, max_length=1)
    parameters: TritonInferParameters | None = Field(None, description="Also accepted as inputs[0].parameters.")

    @model_validator(mode="after")
    def _parameters_once(self) -> InferRequest:
        if self.parameters is not None and self.inputs[0].parameters is not None:
            raise ValueError("give parameters either at the top level or in inputs[0], not both")
        return self

    @property
    def effective_parameters(self) -> TritonInferParameters:
        return self.parameters or self.inputs[0].parameters or TritonInferParameters()


class StopInferRequest(BaseModel):
    """POST /v2/models/{model}/stopInfer"""

    model_config = STRICT

    id: str = Field(pattern=REQUEST_ID_PATTERN, description="The id the request was sent with.")


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


class InferOutput(BaseModel):
    name: str
    shape: list[int] = Field(description="[1, n]")
    datatype: Literal["UINT32"] = "UINT32"
    data: list[int] = Field(description="The generated token ids.")


class InferResponse(BaseModel):
    id: str
    outputs: list[InferOutput]


class TensorMetadata(BaseModel):
    name: str
    datatype: Literal["UINT32"] = "UINT32"
    shape: list[int] = [-1]


class ModelMetadata(BaseModel):
    """GET /v2/models/{model}, as KServe v2 describes a model."""

    name: str
    versions: list[str] = []
    platform: str = "transformers"
    inputs: list[TensorMetadata] = [TensorMetadata(name="input0")]
    outputs: list[TensorMetadata] = [TensorMetadata(name="output0")]


class ServerMetadata(BaseModel):
    """GET /v2, as KServe v2 describes a server."""

    name: str = "tokenrelay"
    version: str
    extensions: list[str] = []
