"""OpenAI's embeddings body and answer: POST /v1/embeddings.

Each input (a text, or token ids) is embedded apart, by a request of its own
to a worker, and answered at its `index`. `dimensions` is refused (400)
whatever its value: no model is served here with shortened embeddings (a
Matryoshka model's truncation is not read from its directory), so a vector
always has the model's hidden size, and a client that asks for fewer must
not believe it got them. Any other field is ignored and named, as on the
other routes (schemas/body.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from schemas.body import Body
from schemas.parameters import INT32_MAX
from schemas.prompt_forms import Prompt, PromptForms, check_prompts, each_prompt

MAX_INPUTS = 2048  # per request, as OpenAI allows: each is a request of its own to a worker


class EmbeddingRequest(Body):
    """POST /v1/embeddings."""

    model: str = Field(description="A served model name (GET /v1/models).")
    input: PromptForms = Field(
        description=f"A text, texts, token ids, or arrays of token ids: each a separate embedding (at most "
        f"{MAX_INPUTS}), tokenized as a completion's prompt, within the model's prompt length."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding's little-endian float32 bytes, in base64."
    )
    dimensions: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Refused: no model here is served with shortened embeddings."
    )
    user: str | None = Field(None, description="Accepted, for logs.")
    priority: int | None = Field(None, ge=1, le=5, description="vLLM's: 1 is the most urgent; default 5.")

    @field_validator("input")
    @classmethod
    def _inputs(cls, given: str | list) -> str | list:
        return check_prompts(given, MAX_INPUTS)

    @field_validator("dimensions")
    @classmethod
    def _full_size_only(cls, dimensions: int | None) -> int | None:
        if dimensions is not None:
            raise ValueError("no model here is served with shortened embeddings; leave it out for the full size")
        return dimensions

    @property
    def inputs(self) -> list[Prompt]:
        """Each input to embed, in order: a text, or token ids."""
        return each_prompt(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(description="The input's place in `input`.")
    embedding: list[float] | str = Field(
        description="The vector, of the model's hidden size; with encoding_format base64, its float32 bytes."
    )


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of every input.")
    total_tokens: int = Field(description="The same: nothing is generated.")


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
