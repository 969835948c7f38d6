"""Per-tenant limits held across every gateway: requests and tokens per minute, and requests at once.

Each gateway counts its tenants' use: per second of the rate window, the
requests it admitted and the tokens their workers gave them (prompt and
output); and the requests it has in flight. It publishes that use on the
tenant-usage topic every SHARE_INTERVAL_S while it changes (every
REPORT_EVERY_S anyway, so that the others know it is there), and reads
every other gateway's. A request is admitted when the cluster's use (this
gateway's now, the others' as last reported) is under each limit of its
tenant. A refusal is a 429 with Retry-After and OpenAI's x-ratelimit-*
headers, which every answer to a tenant's request carries as well.

How far past a limit the cluster can go:
- requests per minute, and requests at once: the others' use is up to one
  sharing interval (plus the bus's latency) old, so gateways that see the
  same room could each fill it. A gateway therefore spends, between two of its
  reports, at most its share of the room it sees: ⌈room / gateways⌉, the
  gateways being those heard within STALE_S, itself included. The cluster
  then passes such a limit by at most one request per other gateway. The
  price: near a limit, with several gateways, a request may be refused while a
  little room is left, for at most one interval (Retry-After: 1).
- tokens per minute: tokens are counted as the workers produce them, so the
  requests in flight when the limit is reached may take the cluster past it
  by what they still generate, and the other gateways by what theirs were
  given in the last interval. The limit bounds a tenant's throughput; the
  tenant's max_tokens bounds one request.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from prometheus_client import Counter as CounterMetric
from prometheus_client import Gauge

from gateway.tenancy.tenants import Tenant, Tenants
from schemas.messages import TenantUsage, TenantUse

SHARE_INTERVAL_S = 0.25
REPORT_EVERY_S = 1.0
STALE_S = 3.0  # a gateway not heard for this long has stopped: its requests in flight ended with it

REQUESTS, TOKENS, CONCURRENT = "requests_per_minute", "tokens_per_minute", "max_concurrent"
ADMITTED = "admitted"

TENANT_REQUESTS = CounterMetric(
    "tokenrelay_gateway_tenant_requests",
    "Requests of each tenant at this gateway: admitted, or refused by the limit named.",
    ["tenant", "outcome"],
)
TENANT_TOKENS = CounterMetric(
    "tokenrelay_gateway_tenant_tokens",
    "Prompt and output tokens of each tenant's requests at this gateway.",
    ["tenant"],
)
TENANT_IN_FLIGHT = Gauge("tokenrelay_gateway_tenant_in_flight", "Each tenant's requests in flight here.", ["tenant"])


@dataclass
class _Use:
    """A tenant's use at this gateway."""

    seconds: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # [requests, tokens]
    in_flight: int = 0


@dataclass(frozen=True)
class Refusal:
    limit: str  # which: REQUESTS, TOKENS or CONCURRENT
    message: str
    retry_after_s: int


@dataclass(frozen=True)
class _ClusterUse:
    """A tenant's use by every gateway, as this one sees it now."""

    seconds: dict[int, list[int]]  # the window's seconds, oldest first
    in_flight: int
    gateways: int

    def total(self, which: int) -> int:
        return sum(counts[which] for counts in self.seconds.values())

    def room_again_in(self, which: int, allowed: float, now: float, window_s: int) -> float:
        """Seconds until the use counted in `which` (0 requests, 1 tokens) falls under `allowed`."""
        used = self.total(which)
        for second, counts in self.seconds.items():
            used -= counts[which]
            if used < allowed:
                return second + window_s - now
        return window_s


class Quotas:
    def __init__(self, gateway_id: str, started_at: float, tenants: Tenants) -> None:
        self._gateway_id = gateway_id
        self._started_at = started_at
        self._tenants = tenants
        self._own: dict[str, _Use] = defaultdict(_Use)
        self._unreported: Counter[str] = Counter()  # requests admitted since the last report
        self._others: dict[tuple[str, float], TenantUsage] = {}  # (gateway id, its start) -> its last report
        self._changed = False
        self._reported_at = 0.0

    @property
    def window_s(self) -> int:
        """The rate window, as the tenants file says now."""
        return self._tenants.window_s

    def _allowed(self, per_minute: int) -> float:
        return per_minute * self.window_s / 60

    def _cluster(self, name: str, now: float) -> _ClusterUse:
        oldest = int(now) - self.window_s + 1
        seconds: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        own = self._own.get(name) or _Use()
        in_flight, gateways = own.in_flight, 1
        rows = [(second, *counts) for second, counts in own.seconds.items()]
        for report in self._others.values():
            fresh = now - report.sent_at < STALE_S
            gateways += fresh
            if (use := report.tenants.get(name)) is not None:
                in_flight += use.in_flight if fresh else 0
                rows += use.seconds
        for second, requests, tokens in rows:
            if second >= oldest:
                seconds[second][0] += requests
                seconds[second][1] += tokens
        return _ClusterUse(dict(sorted(seconds.items())), in_flight, gateways)

    def admit(self, name: str, tenant: Tenant, now: float) -> Refusal | None:
        """Count a request of the tenant in, or say which limit refuses it."""
        use = self._cluster(name, now)
        rooms: list[tuple[float, str]] = []  # each counted limit's room before this gateway's unreported requests
        if (per_minute := tenant.requests_per_minute) is not None:
            if refusal := self._past_rate(name, use, now, REQUESTS, per_minute):
                return refusal
            rooms.append((self._allowed(per_minute) - (use.total(0) - self._unreported[name]), REQUESTS))
        if tenant.max_concurrent is not None:
            if use.in_flight >= tenant.max_concurrent:
                return self._refused(
                    name,
                    CONCURRENT,
                    f"tenant {name} has {use.in_flight} requests in flight, its limit (max_concurrent)",
                    1,
                )
            rooms.append((tenant.max_concurrent - (use.in_flight - self._unreported[name]), CONCURRENT))
        if tenant.tokens_per_minute is not None and (
            refusal := self._past_rate(name, use, now, TOKENS, tenant.tokens_per_minute)
        ):
            return refusal
        if rooms and use.gateways > 1:
            room, limit = min(rooms)
            if self._unreported[name] >= max(1, math.ceil(room / use.gateways)):
                self._changed = True  # report at once: the others then see this gateway's use
                return self._refused(
                    name,
                    limit,
                    f"tenant {name} is near its limit ({limit}) and this gateway has taken its share of the "
                    f"{use.gateways} gateways' room until they hear of it",
                    SHARE_INTERVAL_S,
                )
        own = self._own[name]
        own.seconds[int(now)][0] += 1
        own.in_flight += 1
        self._unreported[name] += 1
        self._changed = True
        TENANT_REQUESTS.labels(name, ADMITTED).inc()
        TENANT_IN_FLIGHT.labels(name).set(own.in_flight)
        return None

    def _past_rate(self, name: str, use: _ClusterUse, now: float, limit: str, per_minute: int) -> Refusal | None:
        """The refusal of a request once the window's requests (limit REQUESTS) or tokens (TOKENS) reach the
        tenant's per-minute limit; None while under it."""
        which, noun = (0, "requests") if limit == REQUESTS else (1, "tokens")
        allowed, used = self._allowed(per_minute), use.total(which)
        if used < allowed:
            return None
        message = (
            f"tenant {name} has used {used} {noun} in the last {self.window_s} s, its limit of {per_minute} per minute"
        )
        return self._refused(name, limit, message, use.room_again_in(which, allowed, now, self.window_s))

    @staticmethod
    def _refused(name: str, limit: str, message: str, wait_s: float) -> Refusal:
        TENANT_REQUESTS.labels(name, limit).inc()
        return Refusal(limit, message, max(1, math.ceil(wait_s)))

    def tokens(self, name: str, count: int, now: float) -> None:
        """Tokens given to a request of the tenant: its prompt's, once, and each generated."""
        self._own[name].seconds[int(now)][1] += count
        self._changed = True
        TENANT_TOKENS.labels(name).inc(count)

    def ended(self, name: str) -> None:
        own = self._own[name]
        own.in_flight -= 1
        self._changed = True
        TENANT_IN_FLIGHT.labels(name).set(own.in_flight)

    def headers(self, name: str, tenant: Tenant, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's per-minute limits: each limit, what may still be used
        in the window now, and how long until its use has left the window."""
        use = self._cluster(name, now)
        headers = {}
        for kind, which, per_minute in (
            ("requests", 0, tenant.requests_per_minute),
            ("tokens", 1, tenant.tokens_per_minute),
        ):
            if per_minute is None:
                continue
            used = use.total(which)
            newest = max((s for s, counts in use.seconds.items() if counts[which]), default=None)
            headers[f"x-ratelimit-limit-{kind}"] = str(per_minute)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(self._allowed(per_minute) - used)))
            headers[f"x-ratelimit-reset-{kind}"] = duration(newest + self.window_s - now if newest is not None else 0)
        return headers

    def observe(self, report: TenantUsage) -> None:
        """Another gateway's use (this gateway's own reports come back too: skipped)."""
        if (report.gateway_id, report.started_at) != (self._gateway_id, self._started_at):
            self._others[report.gateway_id, report.started_at] = report

    def report(self, now: float) -> TenantUsage | None:
        """This gateway's use, when it is time to share it (asked every SHARE_INTERVAL_S): when it changed since
        the last report, or REPORT_EVERY_S after it."""
        if not (self._changed or now - self._reported_at >= REPORT_EVERY_S):
            return None
        oldest = int(now) - self.window_s + 1
        tenants = {}
        for name, use in self._own.items():
            for second in [s for s in use.seconds if s < oldest]:
                del use.seconds[second]
            rows = [(second, *counts) for second, counts in sorted(use.seconds.items())]
            if rows or use.in_flight:
                tenants[name] = TenantUse(in_flight=use.in_flight, seconds=rows)
        gone = [key for key, other in self._others.items() if now - other.sent_at > self.window_s + STALE_S]
        for key in gone:
            del self._others[key]
        self._unreported.clear()
        self._changed, self._reported_at = False, now
        return TenantUsage(gateway_id=self._gateway_id, started_at=self._started_at, sent_at=now, tenants=tenants)


def duration(seconds: float) -> str:
    """A time as OpenAI's reset headers write it: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 1), 60)
    text = f"{rest:.1f}".removesuffix(".0") + "s"
    return f"{int(minutes)}m{text}" if minutes else text
