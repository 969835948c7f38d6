"""OpenAI's POST /v1/embeddings: each input a prefill-only request (task "embed") to a worker of the model.

The gateway has no model: a worker tokenizes each input as a completion's
prompt, prefills it beside its other requests, and answers with its pooled
hidden state (workers/engine/pooling.py). The inputs of a request go out as
requests of their own, all at once, as a completion's `n` choices do, so that
they are computed side by side, on one worker or several; the first error
ends the others. Token-id inputs are checked here as a completion's are.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Awaitable

from fastapi import APIRouter, Request

from gateway.dispatch.inflight import InFlight
from gateway.errors import OPENAI_ERRORS, ApiError
from gateway.routes.generation import NOTHING_DRAWN, check_prompt_tokens, complete_all, start_each
from gateway.service import GatewayService
from schemas.embeddings import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from schemas.messages import INCOMPLETE_GENERATION

router = APIRouter(tags=["OpenAI-compatible"])


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as asked: floats, or their little-endian float32 bytes in base64 (as OpenAI's SDK reads them)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@router.post("/v1/embeddings", response_model=EmbeddingList, responses=OPENAI_ERRORS)
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingList:
    """Embed each input (a text, or token ids): its last hidden states pooled as the model's directory says."""
    service: GatewayService = request.app.state.gateway
    model = service.resolve(body.model)
    inputs = body.inputs
    for index, given in enumerate(inputs):
        if not isinstance(given, str):
            check_prompt_tokens(model, given, field=f"input item {index}")

    def embed(which: int) -> Awaitable[InFlight]:
        given = inputs[which]
        prompt = {"prompt_text": given} if isinstance(given, str) else {"prompt_token_ids": given}
        return service.submit(model, NOTHING_DRAWN, task="embed", priority=body.priority, **prompt)

    answers = await complete_all(service, await start_each(service, len(inputs), embed), request)
    vectors = [done.events[-1].embedding for done in answers]
    if None in vectors:  # ended without an error, and without its answer: stopped on its worker
        raise ApiError(500, INCOMPLETE_GENERATION, f"input item {vectors.index(None)} was stopped before its embedding")
    data = [Embedding(index=i, embedding=_encoded(v, body.encoding_format)) for i, v in enumerate(vectors)]
    prompt_tokens = sum(done.prompt_tokens for done in answers)
    return EmbeddingList(
        data=data, model=body.model, usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    )
