"""Usage records (gateway/tenancy/usage.py) and their sums (`tokenrelay usage`, tokenrelay/usage.py), without a broker:
the broker's part is in test_failover.py, test_rolling_restart.py and test_tenant_limits.py."""

from __future__ import annotations

from datetime import UTC, datetime

from bus.inprocess import InProcessBus
from gateway.dispatch.inflight import InFlight
from gateway.tenancy.usage import UsageMeter, outcome_of
from schemas.messages import (
    TIMEOUT,
    ErrorInfo,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    UsageRecord,
)
from tokenrelay.usage import summarize


def _at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def _record(request_id: str, ended: str, tenant: str | None = "a", outcome: str = "finished", **tokens) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        tenant=tenant,
        model="m",
        arrival=_at(ended) - 1,
        ended_at=_at(ended),
        outcome=outcome,
        gateway_id="g",
        **{"prompt_tokens": 10, "output_tokens": 5, **tokens},
    )


def test_the_sums_count_each_request_once_per_tenant_and_period():
    records = [
        _record("r1", "2026-12-01T10:15", output_tokens=7),
        _record("r1", "2026-12-01T10:15", output_tokens=7),  # sent twice: counts once
        _record("r2", "2026-12-01T11:05", outcome="cancelled", cached_prompt_tokens=8),
        _record("r3", "2026-12-02T09:00", tenant=None, outcome="timed_out"),
    ]
    days = summarize(records, "day")
    assert [(r["tenant"], r["period"], r["requests"]) for r in days] == [("-", "2026-12-02", 1), ("a", "2026-12-01", 2)]
    a = days[1]
    assert (a["finished"], a["cancelled"], a["timed_out"], a["failed"]) == (1, 1, 0, 0)
    assert (a["prompt_tokens"], a["cached_prompt_tokens"], a["output_tokens"]) == (20, 8, 12)
    assert [r["period"] for r in summarize(records, "hour")] == ["2026-12-02T09", "2026-12-01T10", "2026-12-01T11"]
    assert [r["period"] for r in summarize(records, "month")] == ["2026-12", "2026-12"]
    assert [r["requests"] for r in summarize(records, "all")] == [1, 2]
    within = summarize(records, "all", since=_at("2026-12-01T11:00"), until=_at("2026-12-02T09:00"))
    assert [(r["tenant"], r["requests"], r["output_tokens"]) for r in within] == [("a", 1, 5)]


def _inflight() -> InFlight:
    request = GenerationRequest(
        request_id="gen-1",
        trace_id="req-1",
        model="m",
        adapter=None,
        prompt_text="hello",
        sampling=SamplingParams(seed=1),
        tenant="a",
        arrival=100.0,
        deadline=1e12,
        reply_to="replies",
    )
    return InFlight(request, "client")


def _event(index: int, **fields) -> TokenEvent:
    return TokenEvent(request_id="gen-1", index=index, token_ids=[index + 7], **fields)


async def test_a_request_s_record_has_its_first_worker_s_prompt_count_every_token_delivered_and_is_made_once():
    inflight = _inflight()
    for event in (_event(0, prompt_tokens=12, cached_prompt_tokens=8), _event(1)):
        inflight.deliver(event, "w1")
    retried = inflight.attempt_again()  # a failover: the next worker counts the generated tokens as prompt too
    inflight.deliver(_event(2, attempt=1, prompt_tokens=14, cached_prompt_tokens=0), "w2")
    last = _event(3, attempt=1, finish_reason=FinishReason.LENGTH)
    inflight.deliver(last, "w2")
    async for _ in inflight.events():
        pass
    meter = UsageMeter(InProcessBus(), "t.usage", "g1")
    record = meter.record(inflight, last, "abc123")
    assert record.model_dump(exclude={"ended_at", "first_token_at", "v", "kind"}) == {
        "request_id": "gen-1",
        "trace_id": "req-1",
        "tenant": "a",
        "key_id": "abc123",
        "model": "m",
        "adapter": None,
        "task": "generate",
        "prompt_tokens": 12,
        "cached_prompt_tokens": 8,
        "output_tokens": 4,
        "arrival": 100.0,
        "outcome": "finished",
        "attempts": retried.attempt + 1,
        "gateway_id": "g1",
    }
    assert record.first_token_at <= record.ended_at
    assert meter.record(inflight, last, "abc123") is None  # once: the end and the client's leaving both ask


def test_an_outcome_is_the_last_event_s_or_cancelled_for_a_request_dropped_or_stopped():
    inflight = _inflight()
    timeout = ErrorInfo(message="late", error_type=TIMEOUT, status=504)
    failed = ErrorInfo(message="broken", error_type="Generation Error", status=500)
    assert outcome_of(inflight, _event(0, finish_reason=FinishReason.EOS_TOKEN)) == "finished"
    assert outcome_of(inflight, _event(0, error=timeout)) == "timed_out"
    assert outcome_of(inflight, _event(0, error=failed)) == "failed"
    assert outcome_of(inflight, None) == "cancelled"  # the client left first
    inflight.stopped = True
    assert outcome_of(inflight, _event(0, finish_reason=FinishReason.STOP_SEQUENCE)) == "cancelled"
