"""Bodies of the Triton-compatible routes: /v2/models/{model}/generate, generate_stream, infer.

Field names, types and ranges are MindIE's (../shared/spec/API.md decides
where its pages disagree); other fields are ignored and named
(schemas/body.py). On infer, KServe v2's own parameters come besides
MindIE's, so that Triton's clients work with their defaults:
`binary_data_size` on an input, whose ids then follow the JSON header as raw
bytes (gateway/bodies/kserve_binary.py),
`binary_data` on a requested output and `binary_data_output` at the top
level, which ask for the answer's ids that way.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from schemas.body import Body
from schemas.multimodal import text_or_items
from schemas.parameters import (
    STRICT,
    GenerateParameters,
    GenerateStreamParameters,
    TritonInferParameters,
)

REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,256}$"
MAX_PROMPT_TOKENS = 1024 * 1024  # the contract's cap, whatever the model allows
UINT32_MAX = 2**32 - 1

TextInput = text_or_items(4 * 1024 * 1024)
GenerateTextInput = text_or_items(512 * 1024)  # the generate page's limit
RequestId = Annotated[str | None, Field(pattern=REQUEST_ID_PATTERN, description="Absent: the server makes one up.")]


class GenerateRequest(Body):
    """POST /v2/models/{model}/generate"""

    model_config = STRICT

    id: RequestId = None
    # A multimodal list as generate_stream takes it (beyond MindIE's page for this route: images need it).
    text_input: GenerateTextInput
    parameters: GenerateParameters = GenerateParameters()


class GenerateStreamRequest(Body):
    """POST /v2/models/{model}/generate_stream"""

    model_config = STRICT

    id: RequestId = None
    text_input: TextInput
    parameters: GenerateStreamParameters = GenerateStreamParameters()


UINT32_BYTES = 4
DEFAULT_OUTPUT = "output0"


def shape_problem(shape: list[int], length: int, data: str = "data") -> str | None:
    """Why an input's shape does not fit its `length` ids (`data` says where they are); None when it does."""
    if shape in ([length], [1, length]):
        return None
    return f"shape {shape} does not fit {data} of length {length}: use [n] or [1, n]"


class InferInputParameters(TritonInferParameters):
    """inputs[0].parameters: MindIE's sampling parameters (or at the top level), and KServe's binary_data_size."""

    binary_data_size: int | None = Field(
        None,
        gt=0,
        le=MAX_PROMPT_TOKENS * UINT32_BYTES,
        description="Bytes of this input's ids after the JSON header (4 per id, little-endian); data is then absent.",
    )


class InferRequestParameters(TritonInferParameters):
    """The top-level parameters: MindIE's sampling parameters (or in inputs[0]), and KServe's binary_data_output."""

    binary_data_output: bool | None = Field(
        None, description="Answer every output whose own binary_data is not set as binary data; default false."
    )


def sampling_given(parameters: TritonInferParameters | None) -> bool:
    """Whether any of MindIE's sampling parameters is set, KServe's binary_data ones aside."""
    return parameters is not None and any(
        parameters.given(name) is not None for name in TritonInferParameters.model_fields
    )


class InferInput(Body):
    model_config = STRICT

    name: Literal["input0"]
    shape: list[int] = Field(min_length=1, max_length=2, description="[n] or [1, n], n the number of ids.")
    datatype: Literal["UINT32"]
    data: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = Field(
        None,
        min_length=1,
        max_length=MAX_PROMPT_TOKENS,
        description="Prompt token ids; absent when parameters.binary_data_size says they follow as binary data.",
    )
    parameters: InferInputParameters | None = None

    @property
    def binary_data_size(self) -> int | None:
        return self.parameters.binary_data_size if self.parameters is not None else None

    @model_validator(mode="after")
    def _data_once(self) -> InferInput:
        if self.data is not None and self.binary_data_size is not None:
            raise ValueError("give data or parameters.binary_data_size (the ids as binary data), not both")
        if self.data is None and self.binary_data_size is None:
            raise ValueError("data is required, or parameters.binary_data_size with the ids as binary data")
        problem = shape_problem(self.shape, len(self.data)) if self.data is not None else None
        if problem is not None:
            raise ValueError(problem)
        return self


class InferOutputParameters(Body):
    model_config = STRICT

    binary_data: bool | None = Field(
        None, description="Answer this output's ids as binary data after the JSON header; absent: binary_data_output."
    )


class InferOutputRequest(Body):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=256)
    parameters: InferOutputParameters | None = None


class InferRequest(Body):
    """POST /v2/models/{model}/infer: token ids in, token ids out."""

    model_config = STRICT

    id: RequestId = None
    inputs: list[InferInput] = Field(min_length=1, max_length=1)
    outputs: list[InferOutputRequest] | None = Field(
        None, min_length=1, max_length=1, description=f"Absent: the one output, named {DEFAULT_OUTPUT}."
    )
    parameters: InferRequestParameters | None = Field(None, description="Also accepted as inputs[0].parameters.")

    @model_validator(mode="after")
    def _parameters_once(self) -> InferRequest:
        if sampling_given(self.parameters) and sampling_given(self.inputs[0].parameters):
            raise ValueError("give parameters either at the top level or in inputs[0], not both")
        return self

    @property
    def effective_parameters(self) -> TritonInferParameters:
        given = [p for p in (self.parameters, self.inputs[0].parameters) if sampling_given(p)]
        return given[0] if given else TritonInferParameters()

    @property
    def output(self) -> InferOutputRequest:
        """The requested output, or the one there is when none was requested."""
        return self.outputs[0] if self.outputs is not None else InferOutputRequest(name=DEFAULT_OUTPUT)

    @property
    def binary_output(self) -> bool:
        """Whether the answer's ids go as binary data: the output's binary_data, else binary_data_output."""
        own = self.output.parameters.binary_data if self.output.parameters is not None else None
        if own is not None:
            return own
        return bool(self.parameters is not None and self.parameters.binary_data_output)


class StopInferRequest(Body):
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


class BinaryDataSize(BaseModel):
    binary_data_size: int = Field(description="Bytes of this output's ids after the JSON header.")


class InferOutput(BaseModel):
    name: str
    shape: list[int] = Field(description="[1, n]")
    datatype: Literal["UINT32"] = "UINT32"
    data: list[int] | None = Field(None, description="The generated token ids; absent when they go as binary data.")
    parameters: BinaryDataSize | None = Field(None, description="Present when the ids go as binary data.")


class InferResponse(BaseModel):
    id: str
    outputs: list[InferOutput]


PLATFORM = "transformers"


class TensorMetadata(BaseModel):
    name: str
    datatype: Literal["UINT32"] = "UINT32"
    shape: list[int] = [-1]


class ModelMetadata(BaseModel):
    """GET /v2/models/{model}, as KServe v2 describes a model."""

    name: str
    versions: list[str] = Field([], description="Empty: /versions/{version} paths are not served.")
    platform: str = PLATFORM
    inputs: list[TensorMetadata] = [TensorMetadata(name="input0")]
    outputs: list[TensorMetadata] = [TensorMetadata(name=DEFAULT_OUTPUT)]


class TensorConfig(BaseModel):
    name: str
    data_type: Literal["TYPE_UINT32"] = "TYPE_UINT32"
    dims: list[int] = Field([-1], description="Any number of ids (max_batch_size 0: no batch dimension).")


class ModelConfig(BaseModel):
    """GET /v2/models/{model}/config, in the shape of Triton's model configuration (its JSON form)."""

    name: str
    platform: str = PLATFORM
    max_batch_size: int = Field(0, description="0: requests are not batched by the client; the engine batches.")
    input: list[TensorConfig] = [TensorConfig(name="input0")]
    output: list[TensorConfig] = [TensorConfig(name=DEFAULT_OUTPUT)]


class ServerMetadata(BaseModel):
    """GET /v2, as KServe v2 describes a server."""

    name: str = "tokenrelay"
    version: str
    extensions: list[str] = Field(
        ["binary_tensor_data", "model_configuration"], description="The KServe v2 / Triton extensions served."
    )
