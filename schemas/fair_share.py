"""Fair share among the tenants of one priority: virtual token counters (VTC: Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024).

Each tenant's counter grows by the tokens it is served divided by its weight
(its prompt when a request starts, each output token as it is generated).
Among waiting requests of the same priority level, those of the tenant with
the smallest counter go first. A tenant sending ten times another's load
then gets its weight's share of the tokens, not ten times the other's, and
the other's requests wait behind their own only. A tenant that had nothing
here starts again no lower than RETURN_CREDIT below the least served of
those that have something, so that idling banks no more than a request's
worth of credit to spend in a burst.
Requests of no tenant share one counter, of weight 1; with no tenants at
all the order is the aged priority's, as before.

Priority comes first: the level is the aged priority rounded up (a request
gains one level per `aging_s` waited, schemas/messages.py), so that aging
still lifts a request past the fair order of the level it left.

The gateway's held queue (gateway/dispatch/dispatcher.py) and the worker's waiting
queue and choice of a sequence to preempt (workers/engine/scheduler.py) each
keep their own counters, on the tokens they see. A tenant far below another
of its priority (FAIR_PREEMPT_MARGIN), as a gateway sees it (a gateway sees
each request from its start to its end), does not wait for a slot to free:
the gateway sends its request beyond a worker's room, marked so, and the
worker preempts a sequence of its priority of the tenant furthest over its
share there, as a more urgent priority would.
"""

from __future__ import annotations

import math

# How far (in weighted tokens, about a request's worth) a tenant must be below another of the same priority for
# its request to make room for itself: a gateway sends it to a worker beyond the worker's room, and the worker
# preempts a sequence of the tenant furthest over (gateway/dispatch/dispatcher.py, workers/engine/scheduler.py).
# Less, and tenants of near-equal shares would preempt each other back and forth.
FAIR_PREEMPT_MARGIN = 512
# What a tenant that had nothing in a gateway keeps below the least served of the others when it comes back
# there: one request's worth of credit beyond the margin, so that a light tenant's request (whose tenant is
# often idle between its requests) starts at once, by preemption if need be, rather than after a heavy tenant's
# slot frees; never more, so that idling banks no more than that.
RETURN_CREDIT = 2 * FAIR_PREEMPT_MARGIN


def priority_level(urgency: float) -> int:
    """The level of an aged priority (schemas.messages.aged_priority): 5 until it has waited one aging period."""
    return math.ceil(urgency - 1e-9)


class FairShare:
    def __init__(self, return_credit: float = 0.0) -> None:
        """`return_credit`: how far below the least served a tenant that had nothing here comes back (the
        gateway's RETURN_CREDIT; a worker, which sees a tenant with nothing while its requests wait in a
        gateway, gives none)."""
        self._return_credit = return_credit
        self._counters: dict[str | None, float] = {}
        self._active: dict[str | None, int] = {}  # tenant -> its requests here (waiting, or running)
        self._floors: dict[str | None, float] = {}  # an active tenant -> the floor it came back to
        self._idle_floor = 0.0  # where a tenant starts when none is active: the level of the last to leave

    def counter(self, tenant: str | None) -> float:
        return self._counters.get(tenant, 0.0)

    def arrived(self, tenant: str | None) -> None:
        """A request of the tenant came. One that had none here starts no lower than the return credit below the
        floor: the least level of those that have some (or where the last of them left off), a tenant's level
        being its counter, or the floor it came back to while its credit lasts. So two tenants that come back
        together start level, where the second would otherwise start a credit below the first: idling banks
        no more than one credit."""
        if tenant not in self._active:
            floor = min((self._level(t) for t in self._active), default=self._idle_floor)
            self._counters[tenant] = max(self.counter(tenant), floor - self._return_credit)
            self._floors[tenant] = floor
        self._active[tenant] = self._active.get(tenant, 0) + 1

    def left(self, tenant: str | None) -> None:
        """A request of the tenant ended here."""
        self._active[tenant] -= 1
        if not self._active[tenant]:
            del self._active[tenant]
            if not self._active:
                self._idle_floor = self._level(tenant)
            del self._floors[tenant]

    def _level(self, tenant: str | None) -> float:
        return max(self.counter(tenant), self._floors[tenant])

    def charge(self, tenant: str | None, weight: float, tokens: int) -> None:
        """Tokens served to the tenant."""
        self._counters[tenant] = self.counter(tenant) + tokens / weight

    def far_below(self, tenant: str | None) -> bool:
        """Whether another active tenant has been served FAIR_PREEMPT_MARGIN more than this one."""
        return any(self.counter(other) > self.counter(tenant) + FAIR_PREEMPT_MARGIN for other in self._active)

    def order(self, tenant: str | None, urgency: float) -> tuple[int, float, float]:
        """The sort key of a waiting request: its priority level, then its tenant's counter, then its urgency."""
        return priority_level(urgency), self.counter(tenant), urgency
