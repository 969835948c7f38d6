"""The one place a bus is built: from its settings (bus/settings.py), for a gateway, a worker, a bench.

aiokafka is imported only for a Kafka bus, so that `tokenrelay serve` never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bus.settings import InProcessSettings, KafkaSettings

if TYPE_CHECKING:
    from bus.base import Bus


def open_bus(settings: InProcessSettings | KafkaSettings, client_id: str) -> Bus:
    """A bus, not yet started. `client_id` names this process to the Kafka broker."""
    if isinstance(settings, KafkaSettings):
        from bus.kafka import KafkaBus

        return KafkaBus(settings, client_id)
    from bus.inprocess import InProcessBus

    return InProcessBus(settings.max_message_bytes)
