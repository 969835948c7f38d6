"""Fair share among the tenants of one priority: virtual token counters (VTC: Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024).

Each tenant's counter grows by the tokens it is served divided by its weight
(its prompt when a request starts, each output token as it is generated).
Among waiting requests of the same priority level, those of the tenant with
the smallest counter go first. A tenant sending ten times another's load
then gets its weight's share of the tokens, not ten times the other's, and
the other's requests wait behind their own only. A tenant that had nothing
here starts again no lower than the least served of those that have
something, so that idling banks no credit to spend in a burst.
Requests of no tenant share one counter, of weight 1; with no tenants at
all the order is the aged priority's, as before.

Priority comes first: the level is the aged priority rounded up (a request
gains one level per `aging_s` waited, schemas/messages.py), so that aging
still lifts a request past the fair order of the level it left.

The gateway's held queue (gateway/dispatch.py) and the worker's waiting
queue and choice of a sequence to preempt (workers/engine/scheduler.py) each
keep their own counters, on the tokens they see.
"""

from __future__ import annotations

import math


def priority_level(urgency: float) -> int:
    """The level of an aged priority (schemas.messages.aged_priority): 5 until it has waited one aging period."""
    return math.ceil(urgency - 1e-9)


class FairShare:
    def __init__(self) -> None:
        self._counters: dict[str | None, float] = {}
        self._active: dict[str | None, int] = {}  # tenant -> its requests here (waiting, or running)
        self._idle_floor = 0.0  # where a tenant starts when none is active: the counter of the last to leave

    def counter(self, tenant: str | None) -> float:
        return self._counters.get(tenant, 0.0)

    def arrived(self, tenant: str | None) -> None:
        """A request of the tenant came. One that had none here starts no lower than the least served of those
        that have some (or where the last of them left off): credit is not banked while idle."""
        if tenant not in self._active:
            floor = min((self.counter(t) for t in self._active), default=self._idle_floor)
            self._counters[tenant] = max(self.counter(tenant), floor)
        self._active[tenant] = self._active.get(tenant, 0) + 1

    def left(self, tenant: str | None) -> None:
        """A request of the tenant ended here."""
        self._active[tenant] -= 1
        if not self._active[tenant]:
            del self._active[tenant]
            if not self._active:
                self._idle_floor = self.counter(tenant)

    def charge(self, tenant: str | None, weight: float, tokens: int) -> None:
        """Tokens served to the tenant."""
        self._counters[tenant] = self.counter(tenant) + tokens / weight

    def order(self, tenant: str | None, urgency: float) -> tuple[int, float, float]:
        """The sort key of a waiting request: its priority level, then its tenant's counter, then its urgency."""
        return priority_level(urgency), self.counter(tenant), urgency
