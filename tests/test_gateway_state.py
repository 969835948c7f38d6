"""The gateway's bookkeeping: in-flight requests and the directory of workers."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from bus.inprocess import InProcessBus
from bus.peers import PeerClock
from bus.topics import control_topic, reply_topic
from gateway.dispatch.directory import WorkerDirectory
from gateway.dispatch.inflight import DEADLINE_GRACE_S, InFlightRegistry
from gateway.errors import ApiError
from gateway.service import GatewayService
from gateway.settings import GatewaySettings
from schemas.messages import (
    CancelRequest,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    ServedModel,
    TokenEvent,
    TokenEvents,
    WorkerHeartbeat,
)


def _request(request_id: str, timeout_s: float = 60, attempt: int = 0) -> GenerationRequest:
    now = time.time()
    return GenerationRequest(
        request_id=request_id,
        attempt=attempt,
        model="m",
        prompt_text="x",
        sampling=SamplingParams(seed=1),
        arrival=now,
        deadline=now + timeout_s,
        reply_to="r",
    )


def _event(request_id: str, index: int, attempt: int = 0, last: bool = False, **fields) -> TokenEvent:
    return TokenEvent(
        request_id=request_id,
        attempt=attempt,
        index=index,
        token_ids=[index],
        text=f"<{index}>",
        finish_reason=FinishReason.LENGTH if last else None,
        **fields,
    )


async def test_replies_reach_their_own_request_and_end_with_the_last_event():
    registry = InFlightRegistry()
    a, b = registry.open(_request("a"), "a"), registry.open(_request("b"), "b")
    registry.deliver(TokenEvents(worker_id="w", events=[_event("a", 0), _event("b", 0), _event("zzz", 0)]))
    registry.deliver(TokenEvents(worker_id="w", events=[_event("a", 1, last=True), _event("b", 1, last=True)]))
    assert [e.text async for e in a.events()] == ["<0>", "<1>"]
    assert [e.text async for e in b.events()] == ["<0>", "<1>"]
    assert a.finished and a.worker_ended


async def test_a_first_event_says_its_worker_holds_the_prompt_and_no_other_event_does():
    registry = InFlightRegistry()
    a, b = registry.open(_request("a"), "a"), registry.open(_request("b", attempt=1), "b")
    first = [_event("a", 0, prompt_tokens=9), _event("b", 0, prompt_tokens=9)]  # b's from a stale attempt
    assert registry.deliver(TokenEvents(worker_id="w", events=first)).prefilled == [a]
    later = [_event("a", 1), _event("b", 0, attempt=1, prompt_tokens=11)]  # b's first of its own attempt
    assert registry.deliver(TokenEvents(worker_id="w", events=later)).prefilled == [b]


async def test_requests_are_found_by_model_and_client_id():
    registry = InFlightRegistry()
    mine = registry.open(_request("a"), "client-1")
    registry.open(_request("b"), "client-2")
    assert registry.find("m", "client-1") == [mine]
    assert registry.find("other-model", "client-1") == [] and registry.find("m", "nobody") == []
    registry.close("a")
    assert registry.find("m", "client-1") == []


async def test_events_of_another_attempt_are_dropped():
    registry = InFlightRegistry()
    inflight = registry.open(_request("a", attempt=2), "a")
    registry.deliver(TokenEvents(worker_id="old", events=[_event("a", 0, attempt=1), _event("a", 1, attempt=1)]))
    registry.deliver(TokenEvents(worker_id="new", events=[_event("a", 0, attempt=2, last=True)]))
    assert [(e.attempt, e.index) async for e in inflight.events()] == [(2, 0)]


async def test_duplicates_are_dropped_gaps_break_the_request_and_a_failover_goes_on_after_the_delivered_tokens():
    registry = InFlightRegistry()
    inflight = registry.open(_request("a"), "a")
    routed = registry.deliver(TokenEvents(worker_id="w1", events=[_event("a", 0), _event("a", 1), _event("a", 1)]))
    assert (routed.unwanted, routed.broken) == ([], [])
    assert inflight.received == [0, 1] and inflight.worker_id == "w1"
    routed = registry.deliver(TokenEvents(worker_id="w1", events=[_event("a", 3), _event("zzz", 0)]))
    assert routed.broken == [inflight] and [e.request_id for e in routed.unwanted] == ["zzz"]

    retry = inflight.attempt_again()
    assert (retry.attempt, retry.generated_token_ids, inflight.worker_id) == (1, [0, 1], None)
    routed = registry.deliver(TokenEvents(worker_id="w1", events=[_event("a", 2)]))  # the old attempt
    assert [(e.request_id, e.attempt) for e in routed.unwanted] == [("a", 0)]
    registry.deliver(TokenEvents(worker_id="w2", events=[_event("a", 2, attempt=1), _event("a", 3, 1, last=True)]))
    assert [e.index async for e in inflight.events()] == [0, 1, 2, 3]


def test_a_request_its_live_worker_stops_listing_is_lost_after_two_heartbeats():
    registry = InFlightRegistry()
    inflight = registry.open(_request("a"), "a")
    assert registry.observe(_heartbeat("w1", ["m"], requests={"a": 0})) == []
    assert inflight.worker_id == "w1"
    assert registry.observe(_heartbeat("w2", ["m"])) == []  # another worker's silence says nothing
    assert registry.observe(_heartbeat("w1", ["m"])) == []  # its last event may still be on its way
    assert registry.observe(_heartbeat("w1", ["m"])) == [inflight]


def test_what_a_draining_worker_hands_back_is_lost_at_once_and_only_its_current_attempt():
    registry = InFlightRegistry()
    waiting, running = registry.open(_request("waiting"), "w"), registry.open(_request("running", attempt=1), "r")
    registry.observe(_heartbeat("w1", ["m"], requests={"waiting": 0, "running": 1}))
    heartbeat = _heartbeat("w1", ["m"], requests={"running": 1}).model_copy(
        update={"handed_back": {"waiting": 0, "running": 0, "unknown": 0}}  # an older attempt of "running"
    )
    assert registry.handed_back(heartbeat) == [waiting]  # no second heartbeat to wait for
    assert running.worker_id == "w1" and not running.finished


async def test_a_request_nobody_answers_ends_with_a_timeout_after_its_deadline():
    registry = InFlightRegistry()
    inflight = registry.open(_request("a", timeout_s=0.2), "a")
    started = time.monotonic()
    [event] = [e async for e in inflight.events()]
    assert 0.2 + DEADLINE_GRACE_S - 0.1 <= time.monotonic() - started < 0.2 + DEADLINE_GRACE_S + 1.0
    assert event.finish_reason == FinishReason.STOP_SEQUENCE
    assert (event.error.status, event.error.error_type) == (504, "Timeout")
    assert inflight.finished and not inflight.worker_ended  # so the gateway tells the worker to stop


def _heartbeat(
    worker: str, names: list[str], interval_s: float = 1.0, leaving: bool = False, requests: dict | None = None
) -> WorkerHeartbeat:
    model = ServedModel(
        name=names[0], aliases=names, max_seq_len=2560, max_input_len=2048, max_iter_times=512, vocab_size=32000
    )
    return WorkerHeartbeat(
        worker_id=worker,
        model=model,
        running=len(requests or {}),
        requests=requests or {},
        capacity=8,
        interval_s=interval_s,
        leaving=leaving,
    )


def test_the_directory_knows_aliases_and_which_models_are_live():
    directory = WorkerDirectory()
    assert not directory.any_live()
    directory.observe(_heartbeat("w1", ["tiny", "llama_65b"]))
    directory.observe(_heartbeat("w2", ["tiny", "llama_65b"]))
    assert directory.announced("llama_65b").name == "tiny"
    assert directory.live_workers("tiny") == 2
    directory.observe(_heartbeat("w1", ["tiny"], leaving=True))
    assert directory.live_workers("tiny") == 1


def test_a_silent_worker_is_dead_after_three_intervals_but_its_model_stays_known():
    directory = WorkerDirectory()
    directory.observe(_heartbeat("w1", ["tiny"], interval_s=0.1))
    assert directory.live_workers("tiny") == 1
    time.sleep(0.35)
    assert directory.live_workers("tiny") == 0 and not directory.any_live()
    assert directory.announced("tiny").name == "tiny"  # 503 rather than 404


def test_a_workers_silence_counts_up_to_the_gateways_own_last_heartbeat_while_they_come_back():
    """A broker that stops right after a worker's late heartbeat: while the gateway's own heartbeats are not yet
    missed, the worker is not dead for it (the 503 blames the broker once they are); then it is."""
    clock = PeerClock(interval_s=0.2, silence_s=0.3, stuck_after_s=60, forget_after_s=60)
    directory = WorkerDirectory(counted_to=clock.counted_to)
    directory.observe(_heartbeat("w1", ["tiny"], interval_s=0.1))
    clock.own_heard(time.monotonic())
    time.sleep(0.4)  # the worker silent for 4 of its intervals, the gateway's own for 2 of its 2.5
    assert directory.live_workers("tiny") == 1 and directory.any_live()
    time.sleep(0.2)  # the gateway's own heartbeats missed too: silence counts up to now
    assert directory.live_workers("tiny") == 0 and not directory.any_live()


def test_routes_without_a_model_use_the_only_one_or_the_configured_default():
    service = GatewayService(InProcessBus(), GatewaySettings())
    with pytest.raises(ApiError) as none_yet:
        service.default_model_name()
    assert none_yet.value.status == 503
    service.directory.observe(_heartbeat("w1", ["tiny", "alias"]))
    assert service.default_model_name() == "tiny"
    service.directory.observe(_heartbeat("w2", ["other"]))
    with pytest.raises(ApiError) as ambiguous:
        service.default_model_name()
    assert ambiguous.value.status == 404 and "--default-model" in ambiguous.value.body.error
    configured = GatewayService(InProcessBus(), GatewaySettings(default_model="other"))
    assert configured.default_model_name() == "other"


def test_a_models_failure_and_failover_counts_are_exported_at_zero_once_it_is_announced():
    """Before their first event too: Grafana shows 0 rather than "No data", and rate() counts that first event."""
    model = f"zero-{uuid.uuid4().hex[:8]}"  # the registry is the process's: a model no other test counts for

    def counts() -> dict[tuple[str, str], float]:
        return {
            (sample.name, sample.labels.get("reason", "")): sample.value
            for family in REGISTRY.collect()
            for sample in family.samples
            if sample.labels.get("model") in (model, "its-alias") and sample.name.endswith("_total")
        }

    service = GatewayService(InProcessBus(), GatewaySettings())
    assert counts() == {}
    service.directory.observe(_heartbeat("w1", [model, "its-alias"]))
    assert counts() == {
        ("tokenrelay_gateway_failovers_total", "tokens_lost"): 0.0,
        ("tokenrelay_gateway_failovers_total", "handed_back_by_a_draining_worker"): 0.0,
        ("tokenrelay_gateway_failovers_total", "lost_by_its_worker"): 0.0,
        ("tokenrelay_gateway_failovers_total", "worker_gone"): 0.0,
        ("tokenrelay_gateway_failures_total", "generation_error"): 0.0,
        ("tokenrelay_gateway_failures_total", "incomplete_generation"): 0.0,
        ("tokenrelay_gateway_failures_total", "service_unavailable"): 0.0,
        ("tokenrelay_gateway_failures_total", "too_many_requests"): 0.0,
        ("tokenrelay_gateway_timeouts_total", ""): 0.0,
    }


async def test_events_nobody_waits_for_are_answered_with_one_cancel_for_every_attempt():
    bus = InProcessBus()
    service = GatewayService(bus, GatewaySettings(gateway_id="gw"))
    await service.start()
    control = await bus.listen(control_topic("tokenrelay"))
    try:
        ghost = TokenEvents(worker_id="w", events=[_event("ghost", 0)])
        for _ in range(2):  # the second is within the 5 s after the first cancel: not answered again
            await bus.publish(reply_topic("tokenrelay", "gw"), ghost)
        cancels = []

        async def collect() -> None:
            async for message in control:
                if isinstance(message, CancelRequest):
                    cancels.append(message)

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(collect(), 1.0)
        assert [(c.request_id, c.attempts_before) for c in cancels] == [("ghost", None)]
    finally:
        await control.close()
        await service.stop()
