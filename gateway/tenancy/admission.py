"""A gateway's tenants at admission: whose a request is, what its tenant may ask, whether its limits let it in.

It ties the tenants file (tenants.py) to the limits the gateways hold
together (quotas.py): it shares this gateway's use by each tenant on the
tenant-usage topic and reads the others', reads the file again when it
changes and on SIGHUP, and follows each admitted request until it ends, for
the tenant's requests in flight and tokens. The gateway's service
(gateway/service.py) asks it at each request it is given; without a tenants file
there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import structlog

from bus.base import Bus, Listener
from bus.topics import tenant_usage_topic
from gateway.errors import ApiError
from gateway.tenancy.api_keys import UNAUTHORIZED, current_tenant
from gateway.tenancy.quotas import SHARE_INTERVAL_S, Quotas, Refusal
from gateway.tenancy.tenants import Tenant, Tenants
from schemas.messages import SamplingParams, ServedModel, TenantUsage

log = structlog.get_logger(__name__)

FILE_CHECK_S = 1.0  # how often the tenants file is looked at for a change
FORBIDDEN = "Forbidden"


class Tenancy:
    def __init__(self, bus: Bus, tenants_file: str, topic_prefix: str, gateway_id: str) -> None:
        self._bus = bus
        self._topic = tenant_usage_topic(topic_prefix)
        self._gateway_id = gateway_id
        self.tenants = Tenants(tenants_file)
        self._quotas = Quotas(gateway_id, time.time(), self.tenants)
        self._tenant_of: dict[str, str] = {}  # request id -> its tenant, while it counts in the tenant's use

    async def start(self) -> tuple[Listener, list[asyncio.Task]]:
        """Share and hear the tenants' use, and watch the file: the listener and tasks to stop."""
        await self._bus.create_topics({self._topic: 1}, compacted=True)
        usage = await self._bus.listen(self._topic, from_start=True)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not in the main thread
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.tenants.reload)
        tasks = [
            asyncio.create_task(self._hear(usage), name="hear-tenant-usage"),
            asyncio.create_task(self._share(), name="share-tenant-usage"),
        ]
        return usage, tasks

    def stop(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    async def _hear(self, usage: Listener) -> None:
        async for message in usage:
            if isinstance(message, TenantUsage):
                self._quotas.observe(message)

    async def _share(self) -> None:
        """Publish this gateway's use by its tenants when it changes; read the tenants file again if it changed."""
        checked = time.monotonic()
        while True:
            await asyncio.sleep(SHARE_INTERVAL_S)
            if time.monotonic() - checked >= FILE_CHECK_S:
                self.tenants.reload_if_changed()
                checked = time.monotonic()
            if (report := self._quotas.report(time.time())) is not None:
                await self._bus.publish_or_log(self._topic, report, "tenant_usage_not_published", key=self._gateway_id)

    def current(self) -> tuple[str, Tenant] | tuple[None, None]:
        """The tenant of the request being handled, and its entry; (None, None) for a request of no tenant."""
        name = current_tenant()
        if name is None:
            return None, None
        tenant = self.tenants.get(name)
        if tenant is None:  # the file was read again since the key was checked, without the tenant
            raise ApiError(401, UNAUTHORIZED, f"tenant {name} is no longer served: its key is not valid any more")
        return name, tenant

    @staticmethod
    def within_allowance(
        model: ServedModel, name: str, tenant: Tenant, sampling: SamplingParams, priority: int
    ) -> tuple[SamplingParams, int]:
        """The request as its tenant may send it: 403 for a model it may not use; a priority more urgent than
        its allowance lowered to it, and max_tokens to its ceiling (both logged)."""
        called = model.adapter or model.name
        if tenant.models and called not in tenant.models:
            raise ApiError(
                403, FORBIDDEN, f"tenant {name} may not use model {called}; it may use {', '.join(tenant.models)}"
            )
        if priority < tenant.max_priority:
            log.info("priority_lowered", tenant=name, asked=priority, priority=tenant.max_priority)
            priority = tenant.max_priority
        ceiling = tenant.max_tokens
        if ceiling is not None and sampling.max_new_tokens > ceiling:
            log.info("max_tokens_lowered", tenant=name, asked=sampling.max_new_tokens, max_tokens=ceiling)
            sampling = sampling.model_copy(
                update={"max_new_tokens": ceiling, "min_tokens": min(sampling.min_tokens, ceiling)}
            )
        return sampling, priority

    def admit(self, name: str, tenant: Tenant, request_id: str) -> Refusal | None:
        """Count the request in its tenant's use (until `ended`), or say which limit refuses it."""
        refusal = self._quotas.admit(name, tenant, time.time())
        if refusal is None:
            self._tenant_of[request_id] = name
        return refusal

    def tokens(self, name: str, count: int) -> None:
        """Tokens given to a request of the tenant."""
        self._quotas.tokens(name, count, time.time())

    def ended(self, request_id: str) -> None:
        """The request no longer counts among its tenant's requests in flight (once, however often called)."""
        if (name := self._tenant_of.pop(request_id, None)) is not None:
            self._quotas.ended(name)

    def rate_limit_headers(self, name: str) -> dict[str, str]:
        """The x-ratelimit-* headers of an answer to a request of the tenant (quotas.py)."""
        tenant = self.tenants.get(name)
        return self._quotas.headers(name, tenant, time.time()) if tenant is not None else {}
