"""The KV block manager and the scheduler, on sequences alone (no model)."""

from __future__ import annotations

import time

from schemas.messages import SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.request import EngineRequest
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence, Status
from workers.engine.stop_strings import StopStrings


class _NoText:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def _sequence(
    tokens: list[int], priority: int = 5, name: str = "", tenant: str | None = None, weight=1.0, **marks
) -> Sequence:
    request = EngineRequest(
        request_id=name or str(id(tokens)),
        model="m",
        prompt_token_ids=tokens,
        sampling=SamplingParams(seed=1),
        priority=priority,
        deadline=1e12,
        tenant=tenant,
        tenant_weight=weight,
        **marks,
    )
    from workers.engine.detokenizer import IncrementalDetokenizer

    return Sequence(request, tokens, 100, IncrementalDetokenizer(_NoText(), tokens), StopStrings([]), time.monotonic())


def _compute(blocks: BlockManager, sequence: Sequence) -> None:
    """What a step does to the cache: the sequence's tokens all get their KV."""
    blocks.computed(sequence, sequence.num_tokens)


def _start_decoding(scheduler: Scheduler, blocks: BlockManager, sequence: Sequence) -> None:
    """Admit the sequence and compute its whole prompt in one step; it has drawn a token and decodes from now."""
    scheduler.add(sequence)
    [chunk] = scheduler.schedule()
    assert chunk.sequence is sequence and chunk.samples
    _compute(blocks, sequence)
    sequence.generated.append(1)


def test_blocks_cover_the_tokens_without_padding():
    blocks = BlockManager(num_blocks=10, block_size=4)
    sequence = _sequence(list(range(9)))
    assert blocks.can_allocate(sequence)
    blocks.allocate(sequence)
    assert len(sequence.block_table) == 3 and blocks.free_blocks == 7
    blocks.free(sequence)
    assert blocks.free_blocks == 10 and sequence.block_table == []


def test_a_shared_prefix_is_computed_once_and_the_last_token_never_comes_from_the_cache():
    blocks = BlockManager(num_blocks=10, block_size=4)
    first = _sequence(list(range(12)), name="a")
    blocks.allocate(first)
    assert first.num_cached_tokens == 0
    _compute(blocks, first)
    second = _sequence(list(range(8)) + [99, 98, 97], name="b")  # shares two full blocks
    blocks.allocate(second)
    assert second.block_table[:2] == first.block_table[:2] and second.num_cached_tokens == 8
    same = _sequence(list(range(12)), name="c")  # all three blocks match, but the last token must be computed
    blocks.allocate(same)
    assert same.num_cached_tokens == 8 and same.block_table[:2] == first.block_table[:2]
    assert blocks.reused_tokens == 16


def test_blocks_are_reused_only_once_their_kv_exists():
    blocks = BlockManager(num_blocks=10, block_size=4)
    first = _sequence(list(range(12)), name="a")
    blocks.allocate(first)
    early = _sequence(list(range(12)), name="b")
    blocks.allocate(early)  # before first's prefill ran: nothing to reuse yet
    assert early.num_cached_tokens == 0 and set(early.block_table).isdisjoint(first.block_table)


def test_freed_blocks_keep_their_kv_until_handed_out_again():
    blocks = BlockManager(num_blocks=4, block_size=4)
    first = _sequence(list(range(9)), name="a")
    blocks.allocate(first)
    _compute(blocks, first)
    blocks.free(first)
    again = _sequence(list(range(9)), name="b")
    blocks.allocate(again)
    assert again.num_cached_tokens == 8  # its two full blocks were found again
    blocks.free(again)
    other = _sequence(list(range(100, 116)), name="c")
    blocks.allocate(other)  # needs all four blocks: the cached ones are overwritten
    late = _sequence(list(range(9)), name="d")
    blocks.free(other)
    blocks.allocate(late)
    assert late.num_cached_tokens == 0


def test_can_allocate_counts_free_blocks_that_a_cache_hit_would_take():
    blocks = BlockManager(num_blocks=3, block_size=4)
    first = _sequence(list(range(8)), name="a")
    blocks.allocate(first)
    _compute(blocks, first)
    blocks.free(first)  # its two blocks are free but hold a cached prefix
    assert blocks.can_allocate(_sequence(list(range(8)) + [1, 2, 3, 4], name="b"))  # 1 hit + 2 new = 3 blocks
    assert not blocks.can_allocate(_sequence(list(range(50, 66)), name="c"))  # 4 new blocks


def _scheduler(max_batch: int = 4, budget: int = 64, num_blocks: int = 100, aging_s: float = 10.0):
    blocks = BlockManager(num_blocks=num_blocks, block_size=4)
    return Scheduler(SchedulerConfig(max_batch, budget, aging_s), blocks), blocks


def test_the_most_urgent_are_admitted_first():
    scheduler, _ = _scheduler(max_batch=2)
    low = [_sequence([1, 2], priority=5, name=f"low{i}") for i in range(2)]
    high = _sequence([1, 2], priority=1, name="high")
    for sequence in (*low, high):
        scheduler.add(sequence)
    names = {c.sequence.request_id for c in scheduler.schedule()}
    assert names == {"high", "low0"}


def test_waiting_long_enough_makes_a_request_more_urgent():
    scheduler, _ = _scheduler(max_batch=1, aging_s=0.05)
    old = _sequence([1, 2], priority=5, name="old")
    scheduler.add(old)
    old.waiting_since -= 0.25  # five aging intervals: now as urgent as a 0
    scheduler.add(_sequence([1, 2], priority=1, name="new"))
    assert [c.sequence.request_id for c in scheduler.schedule()] == ["old"]


def test_decoding_comes_first_and_prompts_share_the_rest_of_the_budget():
    scheduler, blocks = _scheduler(max_batch=4, budget=10)
    _start_decoding(scheduler, blocks, _sequence(list(range(5)), name="decoding"))
    long_prompt = _sequence(list(range(100, 130)), name="long")
    scheduler.add(long_prompt)
    chunks = {c.sequence.request_id: c for c in scheduler.schedule()}
    assert chunks["decoding"].num_tokens == 1
    assert chunks["long"].num_tokens == 9 and not chunks["long"].samples  # a chunk of the prompt
    _compute_partially(blocks, long_prompt, 9)
    chunks = {c.sequence.request_id: c for c in scheduler.schedule()}
    assert chunks["long"].num_tokens == 9 and long_prompt.num_cached_tokens == 9


def _compute_partially(blocks: BlockManager, sequence: Sequence, tokens: int) -> None:
    blocks.computed(sequence, sequence.num_cached_tokens + tokens)


def test_a_prompt_more_urgent_than_every_decoding_sequence_gets_a_step_of_its_own():
    scheduler, blocks = _scheduler(max_batch=4, budget=100)
    _start_decoding(scheduler, blocks, _sequence(list(range(5)), priority=3, name="decoding"))
    for name, priority, first in (("background", 5, 100), ("urgent", 2, 200)):
        scheduler.add(_sequence(list(range(first, first + 20)), priority=priority, name=name))
    [alone] = scheduler.schedule()
    assert alone.sequence.request_id == "urgent" and alone.num_tokens == 20 and alone.samples
    _compute(blocks, alone.sequence)
    alone.sequence.generated.append(7)  # decoding now: the steps mix again
    chunks = {c.sequence.request_id: c.num_tokens for c in scheduler.schedule()}
    assert chunks == {"decoding": 1, "urgent": 1, "background": 20}


def test_an_urgent_request_preempts_the_least_urgent_when_memory_is_short():
    scheduler, blocks = _scheduler(max_batch=4, num_blocks=4)
    background = _sequence(list(range(11)), priority=5, name="background")  # 3 of the 4 blocks
    _start_decoding(scheduler, blocks, background)
    urgent = _sequence(list(range(100, 108)), priority=1, name="urgent")  # needs 2 blocks
    scheduler.add(urgent)
    chunks = scheduler.schedule()
    assert [c.sequence.request_id for c in chunks] == ["urgent"]
    assert background.status is Status.WAITING and background.block_table == [] and scheduler.preemptions == 1
    # It comes back by recomputing, and finds its own first blocks in the prefix cache.
    scheduler.remove(urgent)
    [resumed] = scheduler.schedule()
    assert resumed.sequence is background and background.num_cached_tokens == 8


def test_an_equally_urgent_request_waits_instead_of_preempting():
    scheduler, blocks = _scheduler(max_batch=4, num_blocks=4)
    _start_decoding(scheduler, blocks, _sequence(list(range(11)), priority=3, name="first"))
    second = _sequence(list(range(100, 108)), priority=3, name="second")
    scheduler.add(second)
    second.waiting_since -= 100  # long enough to be first in the queue, not to preempt
    assert [c.sequence.request_id for c in scheduler.schedule()] == ["first"]
    assert scheduler.preemptions == 0 and len(scheduler.waiting) == 1


def test_a_sequence_that_outgrows_memory_preempts_the_least_urgent():
    scheduler, blocks = _scheduler(max_batch=4, num_blocks=4)
    keep = _sequence(list(range(8)), priority=1, name="keep")
    drop = _sequence(list(range(100, 108)), priority=5, name="drop")
    for sequence in (keep, drop):
        scheduler.add(sequence)
    scheduler.schedule()
    for sequence in (keep, drop):
        _compute(blocks, sequence)
        sequence.generated.append(1)  # each now needs a third block; only one pair fits
    chunks = scheduler.schedule()
    assert [c.sequence.request_id for c in chunks] == ["keep"] and drop.status is Status.WAITING


def test_an_urgent_request_preempts_the_least_urgent_when_the_batch_is_full():
    scheduler, blocks = _scheduler(max_batch=2)
    older, newer = (_sequence([1, 2, 3], priority=5, name=n) for n in ("older", "newer"))
    for sequence in (older, newer):
        scheduler.add(sequence)
    scheduler.schedule()
    urgent = _sequence([4, 5, 6], priority=1, name="urgent")
    scheduler.add(urgent)
    names = {c.sequence.request_id for c in scheduler.schedule()}
    # The most recently received of the least urgent makes room; an equal priority would not.
    assert names == {"older", "urgent"} and newer.status is Status.WAITING and scheduler.preemptions == 1
    scheduler.add(_sequence([7, 8], priority=5, name="equal"))
    assert {c.sequence.request_id for c in scheduler.schedule()} == {"older", "urgent"}
    assert scheduler.preemptions == 1 and len(scheduler.waiting) == 2


def test_a_named_prefix_is_reported_once_its_block_is_computed_and_gone_once_the_block_is_reused():
    blocks = BlockManager(num_blocks=4, block_size=4)
    first = _sequence(list(range(10)), name="a")
    first.prefix_marks = {0: [101], 1: [102]}  # prefixes ending in blocks 0 and 1
    blocks.allocate(first)
    assert blocks.drain_prefix_changes() == ([], [])  # nothing computed yet
    blocks.computed(first, 6)  # block 0 full, block 1 not
    assert blocks.drain_prefix_changes() == ([101], [])
    _compute(blocks, first)
    assert blocks.drain_prefix_changes() == ([102], [])
    again = _sequence(list(range(10)), name="b")
    again.prefix_marks = {0: [101]}
    blocks.allocate(again)  # a cache hit: already held, not reported twice
    assert blocks.drain_prefix_changes() == ([], [])
    blocks.free(again)
    blocks.free(first)
    blocks.allocate(_sequence([50 + i for i in range(16)], name="c"))  # takes every block, the held ones last
    assert blocks.drain_prefix_changes() == ([], [102, 101])


def test_a_twin_prompt_waits_for_its_twins_prefill_and_then_takes_its_kv_from_the_cache():
    blocks = BlockManager(num_blocks=20, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=8, max_tokens_per_step=64, aging_s=60), blocks)
    prompt = list(range(10))
    first, twin, other = _sequence(prompt, name="a"), _sequence(list(prompt), name="b"), _sequence([7] * 9, name="c")
    for sequence in (first, twin, other):
        scheduler.add(sequence)
    chunks = scheduler.schedule()
    assert [c.sequence.request_id for c in chunks] == ["a", "c"] and twin.status is Status.WAITING
    for chunk in chunks:
        _compute(blocks, chunk.sequence)
        chunk.sequence.generated.append(1)
    [*_, started] = scheduler.schedule()
    assert started.sequence is twin and twin.num_cached_tokens == 8 and started.num_tokens == 2


def _run_until_done(scheduler: Scheduler, blocks: BlockManager, output_tokens: int) -> list[str]:
    """Steps until every sequence has `output_tokens`: the tenants of the sequences in the order they finish."""
    finished = []
    while len(scheduler):
        for chunk in scheduler.schedule():
            sequence = chunk.sequence
            _compute(blocks, sequence)  # every chunk here reaches its sequence's end
            sequence.generated.append(1)
            if len(sequence.generated) == output_tokens:
                scheduler.remove(sequence)
                finished.append(sequence.request.tenant)
    return finished


def test_within_a_priority_a_tenant_s_backlog_does_not_hold_back_a_lighter_tenant():
    """One slot. The heavy tenant has 6 requests waiting when the light one sends 2: the light ones go each after
    one heavy one, not after the heavy backlog (first come, first served would put them last)."""
    scheduler, blocks = _scheduler(max_batch=1, num_blocks=64)
    for i in range(6):
        scheduler.add(_sequence([1, 2, 3, 4], name=f"h{i}", tenant="heavy"))
    scheduler.schedule()  # h0 runs
    for i in range(2):
        scheduler.add(_sequence([5, 6, 7, 8], name=f"l{i}", tenant="light"))
    order = _run_until_done(scheduler, blocks, output_tokens=4)
    assert order == ["heavy", "light", "heavy", "light", "heavy", "heavy", "heavy", "heavy"]


def test_tenants_share_a_saturated_slot_by_their_weights():
    """Both tenants always have requests waiting; weights 2 and 1: of 30 requests served, 20 and 10."""
    scheduler, blocks = _scheduler(max_batch=1, num_blocks=64)
    for i in range(30):
        scheduler.add(_sequence([1, 2, 3, 4], name=f"a{i}", tenant="a", weight=2.0))
        scheduler.add(_sequence([5, 6, 7, 8], name=f"b{i}", tenant="b", weight=1.0))
    served = []
    while len(served) < 30:
        [chunk] = scheduler.schedule()
        sequence = chunk.sequence
        blocks.computed(sequence, sequence.num_tokens)
        sequence.generated.append(1)
        if len(sequence.generated) == 4:
            scheduler.remove(sequence)
            served.append(sequence.request.tenant)
    assert (served.count("a"), served.count("b")) == (20, 10)


def test_priority_comes_before_fair_share_and_preemption_takes_the_tenant_furthest_over_its_share():
    """The greedy tenant runs two sequences to the modest one's one, so its counter runs ahead. An urgent request
    (of the greedy tenant, even) preempts a priority-5 sequence: the greedy tenant's newest, though the modest
    one came last (without tenants, the newest goes)."""
    scheduler, blocks = _scheduler(max_batch=3, num_blocks=64)
    greedy = [_sequence([1, 2, 3, 4], name=f"g{i}", tenant="greedy") for i in range(2)]
    for sequence in greedy:
        scheduler.add(sequence)
    _run_steps(scheduler, blocks, 1)
    modest = _sequence([5], name="m", tenant="modest")
    scheduler.add(modest)
    _run_steps(scheduler, blocks, 5)
    assert scheduler.fair_share.counter("greedy") > scheduler.fair_share.counter("modest")
    scheduler.add(_sequence([3, 4], priority=1, name="urgent", tenant="greedy"))
    assert [c.sequence.request_id for c in scheduler.schedule()] == ["urgent"]  # its prompt: a step of its own
    assert greedy[1].status is Status.WAITING
    assert greedy[0].status is Status.RUNNING and modest.status is Status.RUNNING


def _run_steps(scheduler: Scheduler, blocks: BlockManager, steps: int) -> None:
    for _ in range(steps):
        for chunk in scheduler.schedule():
            _compute(blocks, chunk.sequence)  # every chunk here reaches its sequence's end
            chunk.sequence.generated.append(1)


def test_a_sequence_a_gateway_sent_past_the_room_preempts_the_tenant_furthest_over_and_no_other_does():
    """The heavy tenant's two sequences fill the batch. A sequence a gateway sent past this worker's room (its
    tenant far below the heavy one's share, as the gateway saw it) takes the newest heavy one's place at once;
    one it did not mark waits for a slot, as does a marked one when every running sequence is its tenant's."""
    scheduler, blocks = _scheduler(max_batch=2, budget=2048, num_blocks=512)
    heavy = [_sequence(list(range(i, i + 700)), name=f"h{i}", tenant="heavy") for i in range(2)]
    for sequence in heavy:
        scheduler.add(sequence)
    _run_steps(scheduler, blocks, 1)
    for waits in (
        _sequence([1, 2, 3], name="own", tenant="heavy", preempt_for_share=True),
        _sequence([1, 2, 3], name="unmarked", tenant="light"),
    ):
        scheduler.add(waits)
        _run_steps(scheduler, blocks, 1)
        assert waits.status is Status.WAITING and scheduler.preemptions == 0, waits.request_id
        scheduler.remove(waits)  # (the first in the queue that does not fit stops admission: nothing overtakes it)
    marked = _sequence([4, 5, 6], name="marked", tenant="light", preempt_for_share=True)
    scheduler.add(marked)
    _run_steps(scheduler, blocks, 1)
    assert marked.status is Status.RUNNING and heavy[1].status is Status.WAITING and heavy[0].status is Status.RUNNING
    assert scheduler.preemptions == 1
