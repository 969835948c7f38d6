"""LoRA adapters loaded and unloaded at run time: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Loading makes a gateway read a directory a client names, so both routes are
closed unless configured, and each refusal says why:
- who: `Authorization: Bearer` must be one of --admin-api-keys, compared in
  constant time (none sent: 401; another: 403; none configured: 403);
- what: the directory, resolved (`..` and symbolic links followed; a relative
  one is taken under --lora-root), must lie under --lora-root, checked before
  anything is read (outside: 403; no --lora-root: 403);
- then the adapter is read (its config and its tensors' shapes, no weights)
  and checked against what its base model's workers announce they take
  (schemas/adapters.py): 400 naming the reason.
A load or an unload is published on the adapters topic, which every gateway
and worker reads from its beginning (GatewayService.change_adapter): the
workers serve it, and this gateway resolves it at once. Answers are vLLM's
plain-text ones; errors take OpenAI's shape, as on every /v1 route.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from gateway.errors import OPENAI_ERRORS, VALIDATION_ERROR, ApiError, not_found
from gateway.service import GatewayService
from schemas.adapters import AdapterError, check_fits, read_adapter
from schemas.body import Body
from schemas.messages import AdapterState

router = APIRouter(tags=["LoRA adapters"])

UNAUTHORIZED = "Unauthorized"
FORBIDDEN = "Forbidden"
# The answers are plain text (vLLM's) and the errors JSON: each status says its own media type.
# (OpenAIError's schema is among the document's: the OpenAI routes answer with it.)
_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
_ADMIN_ERRORS = {status: _ERROR for status in (*OPENAI_ERRORS, 401, 403)}
_NAME = r"^[^\x00-\x1f/]+$"  # a model name of its own, and half of the topic's key model/name


class LoadLoraAdapterRequest(Body):
    """vLLM's LoadLoRAAdapterRequest."""

    lora_name: str = Field(pattern=_NAME, max_length=256, description="The model name clients will call it by.")
    lora_path: str = Field(
        min_length=1, description="Its directory (PEFT's format), under --lora-root; a relative one is taken there."
    )
    base_model_name: str | None = Field(default=None, description="The model it adapts; absent: the only one served.")


class UnloadLoraAdapterRequest(Body):
    """vLLM's UnloadLoRAAdapterRequest."""

    lora_name: str = Field(min_length=1, description="The adapter's name, as it was loaded.")


def check_admin(service: GatewayService, authorization: str | None) -> None:
    """401 without a Bearer key, 403 with one that is not an admin key (or with no admin keys configured)."""
    keys = service.settings.admin_api_keys
    if not keys:
        raise ApiError(
            403, FORBIDDEN, "loading LoRA adapters at run time is off: start the gateway with --admin-api-keys"
        )
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            UNAUTHORIZED,
            "an admin key (--admin-api-keys) is required: Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # Compared with every key, in constant time, so that timing tells nothing about them.
    if not any([hmac.compare_digest(key.strip().encode(), k.encode()) for k in keys]):
        raise ApiError(403, FORBIDDEN, "this key may not load or unload adapters: it is not one of --admin-api-keys")


def under_root(path: str, root: str) -> str | None:
    """`path` resolved (symbolic links, `..`; a relative one taken under `root`), if it lies under the resolved
    directory `root`; None if it does not."""
    resolved = os.path.realpath(os.path.join(root, path))
    return resolved if os.path.commonpath([resolved, root]) == root else None


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses={200: {"description": "`Success: LoRA adapter 'NAME' added successfully.`"}, **_ADMIN_ERRORS},
)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """Serve a LoRA adapter under a model name of its own, on every worker of its base model (admin keys only)."""
    service: GatewayService = request.app.state.gateway
    check_admin(service, request.headers.get("authorization"))
    root = service.settings.lora_root
    if not root:
        raise ApiError(403, FORBIDDEN, "loading LoRA adapters at run time is off: start the gateway with --lora-root")
    path = under_root(body.lora_path, root)
    if path is None:
        raise ApiError(403, FORBIDDEN, f"lora_path {body.lora_path} does not lie under --lora-root {root}")
    model = service.directory.announced(body.base_model_name or service.default_model_name())
    if model.adapter is not None:
        raise ApiError(
            400, VALIDATION_ERROR, f"base_model_name {model.adapter} is an adapter of {model.name}, not a model"
        )
    if model.lora is None:
        raise ApiError(
            400, VALIDATION_ERROR, f"model {model.name} serves no adapters (start its workers with --max-loras)"
        )
    if body.lora_name in service.directory.known_names():
        taken = service.directory.announced(body.lora_name)
        what = f"adapter of {taken.name}" if taken.adapter is not None else "model"
        raise ApiError(400, VALIDATION_ERROR, f"lora_name {body.lora_name} is already the name of a served {what}")
    try:
        spec = await asyncio.to_thread(read_adapter, path, model.lora.max_rank)
        check_fits(spec, model.lora)
    except AdapterError as error:
        raise ApiError(400, VALIDATION_ERROR, f"lora_path: {error}") from None
    await service.change_adapter(
        AdapterState(model=model.name, name=body.lora_name, path=path, loaded=True, changed_at=time.time())
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses={200: {"description": "`Success: LoRA adapter 'NAME' removed successfully.`"}, **_ADMIN_ERRORS},
)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """Stop serving a LoRA adapter (admin keys only); requests already running under it finish with it."""
    service: GatewayService = request.app.state.gateway
    check_admin(service, request.headers.get("authorization"))
    known = service.directory.known_names()
    adapters = [name for name in known if service.directory.announced(name).adapter is not None]
    if body.lora_name not in adapters:
        raise not_found(f"lora_name {body.lora_name} is not a served adapter; served: {', '.join(adapters) or 'none'}")
    model = service.directory.announced(body.lora_name)
    await service.change_adapter(
        AdapterState(
            model=model.name,
            name=body.lora_name,
            path=model.adapters[body.lora_name],
            loaded=False,
            changed_at=time.time(),
        )
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
