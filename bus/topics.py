"""Topic names: one request topic per served model and priority (the queue
shared by its workers), one inbox per worker (the requests routed to it),
one reply topic per gateway, one control topic for everyone, one routing
topic where workers tell gateways their load and cache, one adapters topic,
compacted on Kafka, that holds the LoRA adapters loaded at run time, and one
tenant-usage topic, compacted too, where gateways share their tenants' use,
and one usage topic, compacted, that holds each request's use for billing."""

from __future__ import annotations

import re

PRIORITIES = (1, 2, 3, 4, 5)  # 1 is the most urgent
_NOT_IN_TOPIC_NAMES = re.compile(r"[^A-Za-z0-9._-]")


def _slug(name: str) -> str:
    # Model names may be hub ids ("Qwen/Qwen2-0.5B"); Kafka allows [A-Za-z0-9._-].
    return _NOT_IN_TOPIC_NAMES.sub("_", name)


def request_topic(prefix: str, model: str, priority: int) -> str:
    return f"{prefix}.{_slug(model)}.p{priority}"


def request_topics(prefix: str, model: str) -> list[str]:
    """The model's request topics, most urgent first."""
    return [request_topic(prefix, model, p) for p in PRIORITIES]


def worker_group(prefix: str, model: str) -> str:
    """The Kafka consumer group of the workers of a model: each request goes to one of them."""
    return f"{prefix}.workers.{_slug(model)}"


def reply_topic(prefix: str, gateway_id: str) -> str:
    return f"{prefix}.replies.{_slug(gateway_id)}"


def control_topic(prefix: str) -> str:
    return f"{prefix}.control"


def inbox_topic(prefix: str, worker_id: str) -> str:
    return f"{prefix}.inbox.{_slug(worker_id)}"


def routing_topic(prefix: str) -> str:
    return f"{prefix}.routing"


def adapters_topic(prefix: str) -> str:
    """The LoRA adapters loaded and unloaded at run time (schemas.messages.AdapterState), keyed by model/name:
    compacted on Kafka and read from its beginning, so that the latest state of each adapter is never lost."""
    return f"{prefix}.adapters"


def tenant_usage_topic(prefix: str) -> str:
    """Each gateway's use by each tenant (schemas.messages.TenantUsage), keyed by gateway id: compacted on Kafka
    and read from its beginning, so that the limits hold across gateways and across their restarts."""
    return f"{prefix}.tenant-usage"


def usage_topic(prefix: str) -> str:
    """One record per request (schemas.messages.UsageRecord), keyed by its request id: compacted on Kafka, so
    that a record published twice is kept once; `tokenrelay usage` sums it."""
    return f"{prefix}.usage"
