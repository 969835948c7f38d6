"""Who on the control topic is still there, judged only while the topic demonstrably works.

Gateways and workers heartbeat on the control topic and read it, their own
heartbeats included. A broker outage silences every peer at once, and so does
a consumer that stopped fetching; neither means the peers died. So silence
counts only while this process hears its own heartbeats: a peer is gone once
the topic has carried `silence_s` of its own heartbeats without a word from
it, or once it said goodbye. Publishing its own heartbeats successfully for
`stuck_after_s` (every one of them, so the broker is there) while none of
them comes back means this process's consumer is stuck.
"""

from __future__ import annotations

import time

import structlog

from bus.base import Bus, BusUnavailable, Listener
from schemas.messages import BusMessage

log = structlog.get_logger(__name__)


class PeerClock:
    def __init__(self, interval_s: float, silence_s: float, stuck_after_s: float, forget_after_s: float) -> None:
        self._interval_s = interval_s  # of this process's own heartbeats
        self._silence_s = silence_s
        self._stuck_after_s = stuck_after_s
        self._forget_after_s = forget_after_s
        self._heard: dict[str, float] = {}  # peer -> when last heard
        self._left: dict[str, float] = {}  # peer -> when it said goodbye
        self._own_heard_at: float | None = None
        self._working_since = 0.0  # since when own heartbeats come back without a gap
        self._unheard_published = 0  # own heartbeats published since the last one heard

    def own_published(self, now: float) -> None:
        self._unheard_published += 1

    def own_not_published(self) -> None:
        """The broker did not take a heartbeat: silence says nothing about the consumer now."""
        self._unheard_published = 0

    def own_heard(self, now: float) -> None:
        if not self.working(now):
            self._working_since = now
        self._own_heard_at = now
        self._unheard_published = 0

    def consumer_rebuilt(self) -> None:
        """Start counting towards `stuck` again, from the next own heartbeat published."""
        self._unheard_published = 0

    def heard(self, peer: str, now: float) -> None:
        self._heard[peer] = now
        self._left.pop(peer, None)

    def expect(self, peer: str, now: float) -> None:
        """A peer first known from a message other than its heartbeat: give it `silence_s` to be heard."""
        if peer not in self._heard and peer not in self._left:
            self._heard[peer] = now

    def left(self, peer: str, now: float) -> None:
        self._heard.pop(peer, None)
        self._left[peer] = now

    def working(self, now: float) -> bool:
        """Whether own heartbeats come back (none missed but the one on its way)."""
        return self._own_heard_at is not None and now - self._own_heard_at <= 2.5 * self._interval_s

    def silent_for(self, now: float) -> float | None:
        """How long own heartbeats have not come back, once they did and stopped; None while they come."""
        if self._own_heard_at is None or self.working(now):
            return None
        return now - self._own_heard_at

    def counted_to(self, now: float) -> float:
        """Up to when a peer's silence counts: the last own heartbeat heard while they come back (what this process
        has not read yet may hold the peer's next heartbeat, as it holds its own), else now."""
        return self._own_heard_at if self.working(now) else now

    def gone(self, peer: str, now: float) -> bool:
        """Said goodbye, or silent for `silence_s` of a working topic. An unknown peer is not gone.

        Its silence is counted up to the last own heartbeat heard, not up to `now`: what this process has not
        read yet (its event loop or its consumer paused for a couple of seconds, on a loaded machine) may hold
        the peer's next heartbeat, and the own heartbeats after it."""
        if peer in self._left:
            return True
        heard_at = self._heard.get(peer)
        if heard_at is None or not self.working(now):
            return False
        return self.counted_to(now) - max(heard_at, self._working_since) > self._silence_s

    def stuck(self) -> bool:
        """Own heartbeats were published, each of them, for `stuck_after_s` and none came back."""
        return self._unheard_published * self._interval_s > self._stuck_after_s

    def forget_old(self, now: float) -> None:
        """Drop peers not heard of for `forget_after_s` (as long as their requests may still be waiting)."""
        horizon = now - self._forget_after_s
        self._heard = {p: t for p, t in self._heard.items() if t > horizon}
        self._left = {p: t for p, t in self._left.items() if t > horizon}


async def send_own_heartbeat(bus: Bus, topic: str, heartbeat: BusMessage, listener: Listener, echo: PeerClock) -> None:
    """Publish this process's heartbeat where `listener` reads; rebuild the listener once `echo` says it is stuck
    (if the broker refuses the rebuild now, the next heartbeat tries again)."""
    if await bus.publish_or_log(topic, heartbeat, "heartbeat_not_published"):
        echo.own_published(time.monotonic())
    else:
        echo.own_not_published()
    if not echo.stuck():
        return
    log.warning("listener_stuck", topic=topic)
    try:
        await listener.rebuild()
    except BusUnavailable as error:
        log.warning("listener_not_rebuilt", topic=topic, error=str(error))
        return
    echo.consumer_rebuilt()
