"""Bodies of POST /tokenize and POST /detokenize: vLLM's, and TGI's /tokenize, on one path.

Gateways have no tokenizer: these requests go to a worker of the model like
any other, whose engine tokenizes the prompt exactly as it would for
generation (the same chat template, the same limits). vLLM's and TGI's
/tokenize share a path; the body's shape says which is meant: `inputs` is
TGI's, `prompt` or `messages` vLLM's. Field names and defaults are vLLM's
(TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest) and TGI's
(GenerateRequest); other fields are ignored and named (schemas/body.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from schemas.body import Body
from schemas.mindie import TokenId
from schemas.openai import ChatMessageIn
from schemas.openai_tools import Tool
from schemas.tgi import TgiTokenizeRequest
from schemas.triton import MAX_PROMPT_TOKENS

_MODEL = "The served model; absent: the default one, as /infer's."
_TOKEN_STRS = "Also each token as the vocabulary spells it (`token_strs`)."


class TokenizePromptRequest(Body):
    """vLLM's /tokenize of a text."""

    model: str | None = Field(None, description=_MODEL)
    prompt: str = Field(max_length=512 * 1024)
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS).")
    return_token_strs: bool = Field(False, description=_TOKEN_STRS)


class TokenizeChatRequest(Body):
    """vLLM's /tokenize of a chat, rendered by the model's chat template as /v1/chat/completions renders it."""

    model: str | None = Field(None, description=_MODEL)
    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="End with the header of the assistant's turn to come.")
    continue_final_message: bool = Field(
        False, description="End open, inside the last message (not with add_generation_prompt)."
    )
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens besides the template's.")
    tools: list[Tool] | None = Field(None, max_length=128, description="Functions the chat template presents.")
    return_token_strs: bool = Field(False, description=_TOKEN_STRS)

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


def _shape(body: Any) -> str | None:
    """Which body a /tokenize body is, by the one prompt field it has: TGI's `inputs`, vLLM's `prompt` or `messages`."""
    if not isinstance(body, dict):
        return {TgiTokenizeRequest: "tgi", TokenizePromptRequest: "prompt-text", TokenizeChatRequest: "chat"}.get(
            type(body)
        )
    present = [tag for key, tag in (("inputs", "tgi"), ("prompt", "prompt-text"), ("messages", "chat")) if key in body]
    return present[0] if len(present) == 1 else None


TokenizeRequest = Annotated[
    Annotated[TgiTokenizeRequest, Tag("tgi")]
    | Annotated[TokenizePromptRequest, Tag("prompt-text")]
    | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(
        _shape,
        custom_error_type="tokenize_body",
        custom_error_message="the body needs exactly one of inputs (TGI's), prompt or messages (vLLM's)",
    ),
]


class TokenizeResponse(BaseModel):
    """vLLM's answer."""

    count: int
    max_model_len: int  # the model's context: prompt and generated tokens together
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(Body):
    model: str | None = Field(None, description=_MODEL)
    tokens: list[TokenId] = Field(
        max_length=MAX_PROMPT_TOKENS, description="Token ids, decoded special tokens and all."
    )


class DetokenizeResponse(BaseModel):
    prompt: str
