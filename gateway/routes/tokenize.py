"""POST /tokenize and POST /detokenize, as vLLM serves them, and TGI's POST /tokenize on the same path.

Gateways have no tokenizer: the request goes to a worker of the model like
any other, on every topology, and its engine answers it between two steps
with the tokenization generation would use (the chat template, truncate, the
prompt limits), without computing anything. vLLM's and TGI's /tokenize share
the path; the body's shape picks the format (schemas/tokenize.py): `inputs`
is TGI's and is answered with TGI's list of tokens and their character
offsets, `prompt` or `messages` vLLM's. TGI's `inputs` is tokenized as text:
a `![](url)` there is its characters, not an image. Errors take the
contract's shape, as on the other routes outside /v1.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.errors import GENERATION_ERRORS
from gateway.media.prompts import PromptFields, chat_prompt
from gateway.routes.generation import NOTHING_DRAWN, check_prompt_tokens, complete
from gateway.service import GatewayService
from schemas.messages import ServedModel, Task, TokenEvent, Tokenization
from schemas.tgi import TgiSimpleToken, TgiTokenizeRequest
from schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(tags=["Tokenizer"])


async def _ask(request: Request, model: ServedModel, task: Task, prompt: PromptFields, **options: object) -> TokenEvent:
    """The worker's answer to a tokenize or detokenize request: its one event (an error raises ApiError)."""
    service: GatewayService = request.app.state.gateway
    inflight = await service.submit(model, NOTHING_DRAWN, **prompt, task=task, **options)
    return (await complete(service, inflight, request)).events[-1]


def _model(request: Request, name: str | None) -> ServedModel:
    service: GatewayService = request.app.state.gateway
    return service.resolve(name or service.default_model_name())


@router.post(
    "/tokenize",
    response_model=TokenizeResponse | list[TgiSimpleToken],
    responses={
        200: {"description": "vLLM's answer to a `prompt` or `messages` body; TGI's list of tokens to `inputs`."},
        **GENERATION_ERRORS,
    },
)
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """Tokenize a text or a chat as the model's worker would for generation: vLLM's body, or TGI's (`inputs`)."""
    if isinstance(body, TgiTokenizeRequest):
        answer = await _ask(
            request, _model(request, None), "tokenize", {"prompt_text": body.inputs}, truncate=body.parameters.truncate
        )
        tokens = [
            {"id": t.id, "text": body.inputs[t.start : t.stop], "start": t.start, "stop": t.stop} for t in answer.tokens
        ]
        return JSONResponse(tokens)
    model = _model(request, body.model)
    if isinstance(body, TokenizePromptRequest):
        prompt: PromptFields = {"prompt_text": body.prompt}
        tokenization = Tokenization(add_special_tokens=body.add_special_tokens)
    else:
        prompt = await chat_prompt(body.messages, model, request.app.state.media)
        if body.tools is not None:
            prompt["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
        tokenization = _chat_tokenization(body)
    answer = await _ask(request, model, "tokenize", prompt, tokenization=tokenization)
    return JSONResponse(
        {
            "count": len(answer.tokens),
            "max_model_len": model.max_seq_len,
            "tokens": [t.id for t in answer.tokens],
            "token_strs": [t.token for t in answer.tokens] if body.return_token_strs else None,
        }
    )


def _chat_tokenization(body: TokenizeChatRequest) -> Tokenization:
    return Tokenization(
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=GENERATION_ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """Decode token ids to text, special tokens included, as vLLM's /detokenize does."""
    model = _model(request, body.model)
    check_prompt_tokens(model, body.tokens, field="tokens")
    answer = await _ask(request, model, "detokenize", {"prompt_token_ids": body.tokens})
    return JSONResponse({"prompt": answer.text})
