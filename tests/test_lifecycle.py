"""A process's life (tokenrelay/lifecycle.py): signals drain, a second one hurries, one after the stop is harmless."""

from __future__ import annotations

import asyncio

from bus.inprocess import InProcessBus
from tokenrelay import lifecycle


class _Part:
    """A worker that runs until cancelled and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def start(self) -> None:
        self.asked.append("start")

    async def run(self) -> None:
        await asyncio.Future()

    async def drain(self, timeout_s: float) -> None:
        self.asked.append("drain")

    async def stop(self) -> None:
        self.asked.append("stop")


async def test_a_signal_drains_then_stops_and_one_after_the_stop_is_harmless():
    part, asks = _Part(), []
    running = asyncio.create_task(lifecycle.run(InProcessBus(), None, [part], 1.0, asks_to_stop=asks.append))
    while part.asked != ["start"]:
        await asyncio.sleep(0.01)
    [stop_asked] = asks
    stop_asked()
    assert await running is True
    assert part.asked == ["start", "drain", "stop"]
    stop_asked()  # a second signal after the drain ended (it raised AttributeError once)
    stop_asked()


async def test_a_signal_while_starting_stops_without_a_drain():
    class _Slow(_Part):
        async def start(self) -> None:
            self.asked.append("start")
            await asyncio.Future()  # a group join, a model load: never ends here

    part, asks = _Slow(), []
    running = asyncio.create_task(lifecycle.run(InProcessBus(), None, [part], 1.0, asks_to_stop=asks.append))
    while part.asked != ["start"]:
        await asyncio.sleep(0.01)
    asks[0]()
    assert await running is True
    assert part.asked == ["start", "stop"]
