"""Speculative decoding (workers/engine/speculation.py): prompt lookup's proposals, what a step may propose, the
measured rule that switches proposals off, and exactness: a speculating engine's tokens are the ones it gives
without speculation, greedy and seeded sampling alike, with penalties, grammars, stop strings and
log-probabilities; and the rule is rejection sampling, whose output has the target's distribution."""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import replace

import httpx
import pytest
import structlog
import torch
from llguidance import LLMatcher

from schemas.messages import SamplingParams
from tests.processes import metric, serving
from tests.test_cuda_graphs import replay_eagerly
from tests.test_engine import PROMPTS, Harness, _poison_embedding, _tokens, loaded  # noqa: F401 (a fixture)
from tests.test_scheduler import _sequence
from workers.bundled import BUNDLED_DRAFT_MODEL
from workers.engine import model_runner
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.draft import DraftProposer
from workers.engine.model_loader import load_model
from workers.engine.model_runner import DeviceMemory, KVGeometry, ModelRunner, gpu_kv_cache_tokens
from workers.engine.output_head import OutputHead
from workers.engine.prompt_lookup import NgramProposer
from workers.engine.sampler import Draw, DrawBatch, choose
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.speculation import Speculator, accepted_length
from workers.engine.speculation_rule import CostLine, SpeculationRule, proposals_pay


def _lookup(proposer: NgramProposer, sequence_or_tokens, k: int) -> list[int]:
    sequence = sequence_or_tokens if not isinstance(sequence_or_tokens, tuple) else _sequence(list(sequence_or_tokens))
    [proposal] = proposer.propose([sequence], [k])
    return proposal


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_match():
    # The last three tokens (7 8 9) occurred once, followed by 4 5 6; the last one (9) since, followed by 1.
    assert _lookup(NgramProposer(1, 3), (7, 8, 9, 4, 5, 6, 9, 1, 2, 7, 8, 9), 3) == [4, 5, 6]
    # (1 2) occurred twice: the later occurrence's continuation.
    assert _lookup(NgramProposer(2, 2), (1, 2, 3, 1, 2, 4, 1, 2), 2) == [4, 1]
    # Where the continuation reaches the present, it repeats itself: a loop is proposed whole.
    assert _lookup(NgramProposer(2, 2), (5, 6, 5, 6), 5) == [5, 6, 5, 6, 5]
    # Nothing matched, or only an n-gram shorter than ngram_min: nothing proposed.
    assert _lookup(NgramProposer(2, 4), (1, 2, 3, 4), 3) == []
    assert _lookup(NgramProposer(2, 4), (1, 2, 3, 1), 3) == []
    assert _lookup(NgramProposer(1, 4), (1, 2, 3, 1), 3) == [2, 3, 1]


def test_the_index_kept_as_a_sequence_grows_proposes_as_one_built_at_once():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(60)]
    growing, proposer = _sequence(tokens[:4]), NgramProposer(1, 3)
    for token in tokens[4:]:
        growing.generated.append(token)
        fresh = tuple(growing.token_ids)
        assert _lookup(proposer, growing, 4) == _lookup(NgramProposer(1, 3), fresh, 4), len(growing.token_ids)


def test_proposals_are_accepted_up_to_the_first_the_models_draw_differs_from():
    assert accepted_length((5, 6, 7), [5, 6, 9, 1]) == 2
    assert accepted_length((5, 6), [5, 6, 3]) == 2
    assert accepted_length((5,), [4, 5]) == 0
    assert accepted_length((), [3]) == 0


def test_the_cost_line_recovers_a_steps_fixed_and_per_row_seconds():
    line = CostLine()
    for step in range(7):
        line.add(1 + step % 20, 0.010 + 0.001 * (1 + step % 20))
    assert line.fit() is None  # too few steps
    for step in range(7, 60):
        line.add(1 + step % 20, 0.010 + 0.001 * (1 + step % 20))
    a, b = line.fit()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.001, rel=1e-6)
    steady = CostLine()
    for _ in range(60):
        steady.add(8, 0.02)
    assert steady.fit() is None  # rows that never vary say nothing of a row's cost
    assert steady.at(16) == pytest.approx(0.04)  # without a line: in proportion to the rows
    assert CostLine().at(16) == 0.0  # nothing measured


def test_proposals_pay_while_accepted_tokens_are_worth_more_than_their_rows_and_their_making():
    line = (0.010, 0.0002)  # 10 ms a step, 0.2 ms a row
    assert proposals_pay(0.5, line, drawing=1, proposals=4, proposing_s=0.0)
    # At 64 decoding rows a row is 56 % of the step: half the proposals accepted no longer pays, 90 % does.
    assert not proposals_pay(0.5, line, drawing=64, proposals=256, proposing_s=0.0)
    assert proposals_pay(0.9, line, drawing=64, proposals=256, proposing_s=0.0)
    assert proposals_pay(0.0, None, drawing=64, proposals=256, proposing_s=1.0)  # unmeasured: tried
    # A CPU's step at batch 1 (2 ms, 0.5 ms a row), 60 % of 4 proposals accepted: a draft whose 4 steps take
    # 1.5 ms each costs more than it saves; one at 0.5 ms each saves more. No proposal never pays.
    cpu = (0.002, 0.0005)
    assert not proposals_pay(0.6, cpu, drawing=1, proposals=4, proposing_s=0.006)
    assert proposals_pay(0.6, cpu, drawing=1, proposals=4, proposing_s=0.002)
    assert not proposals_pay(1.0, cpu, drawing=1, proposals=0, proposing_s=0.0)


def test_the_rule_counts_what_proposing_costs_and_learns_the_cost_line_from_decode_only_steps():
    rule = SpeculationRule(num_tokens=4)
    for step in range(100):  # a step: 2 ms and 0.5 ms a row; 60 % of the proposals accepted
        rule.settled(4, 2 + step % 2)
        rule.measured(1 + step % 5, 0.002 + 0.0005 * (1 + step % 5))
    assert rule.cost.fit() == pytest.approx((0.002, 0.0005))
    assert rule.acceptance == pytest.approx(0.6, abs=0.05)
    rule.measured(None, 5.0)  # a step with prompt rows: not on the line
    assert rule.cost.fit() == pytest.approx((0.002, 0.0005))
    assert rule.asking(drawing=1, speculating=1) == 1  # prompt lookup's proposals cost next to nothing
    for _ in range(40):  # a draft whose 4 steps take 1.5 ms each: more than its 2.4 tokens save
        rule.proposed(asked=1, made=4, seconds=0.006)
    assert rule.asking(drawing=1, speculating=1) == 0
    always = SpeculationRule(num_tokens=4, always=True)  # --speculative-always: proposals whatever they cost
    for _ in range(40):
        always.measured(1, 0.002)
        always.proposed(asked=1, made=4, seconds=0.006)
    assert always.asking(drawing=3, speculating=2) == 2


def _decoding(scheduler: Scheduler, blocks: BlockManager, **sampling):
    """A sequence of LOOP's prompt (its first token its own), its prompt computed and 1 drawn: it decodes."""
    sequence = _sequence([len(scheduler), *LOOP], name=str(len(scheduler)))
    sequence.request = replace(sequence.request, sampling=SamplingParams(seed=1, **sampling))
    scheduler.add(sequence)
    assert [c.sequence for c in scheduler.schedule() if c.num_tokens > 1] == [sequence]
    blocks.computed(sequence, sequence.num_tokens)
    sequence.generated.append(1)
    return sequence


LOOP = [1, 2, 3, 1, 2, 3]  # then 1: prompt lookup proposes 2 3 1 2


def test_a_step_proposes_within_its_budget_the_tokens_left_and_the_cache_not_for_requests_that_opt_out():
    blocks = BlockManager(num_blocks=7, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=8, max_tokens_per_step=8), blocks)
    speculator = Speculator(NgramProposer(2, 3), 4, max_seq_len=64)
    first = _decoding(scheduler, blocks)
    opted_out = _decoding(scheduler, blocks, speculative=False)
    short = _decoding(scheduler, blocks)
    short.max_new_tokens = 3  # 1 generated: the step may add 2, its own and one proposal
    chunks = speculator.plan(scheduler.schedule(), blocks, scheduler.step_budget)
    # 8 tokens each, 2 blocks; the first's 4 proposals take the 7th and last block: the short one's 1 finds none.
    assert [c.proposed for c in chunks] == [(2, 3, 1, 2), (), ()]
    assert len(first.block_table) == 3 and blocks.free_blocks == 0
    blocks.shrink(first, first.num_tokens)  # rejected: the block they took is free again
    assert len(first.block_table) == 2 and blocks.free_blocks == 1
    chunks = speculator.plan(scheduler.schedule(), blocks, budget=4)  # 3 decode rows: room for 1 proposal
    assert [c.proposed for c in chunks] == [(2,), (), ()]
    assert opted_out.request.sampling.speculative is False


def test_the_rule_probes_one_sequence_after_16_32_64_steps_when_off_skips_one_in_16_when_on_and_logs_switches():
    blocks = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=8, max_tokens_per_step=8), blocks)
    speculator = Speculator(NgramProposer(2, 3), 2, max_seq_len=64)
    sequences = [_decoding(scheduler, blocks), _decoding(scheduler, blocks)]

    def steps(speculator: Speculator, count: int) -> list[tuple[bool, ...]]:
        proposing = []
        for _ in range(count):
            chunks = speculator.plan(scheduler.schedule(), blocks, scheduler.step_budget)
            proposing.append(tuple(bool(chunk.proposed) for chunk in chunks))
            for sequence in sequences:
                blocks.shrink(sequence, sequence.num_tokens)
        return proposing

    for step in range(40):  # a row costs 10 ms, a step 1 ms more; no proposal is ever accepted
        speculator.rule.settled(2, 0)
        speculator.rule.measured(1 + step % 5, 0.001 + 0.010 * (1 + step % 5))
    with structlog.testing.capture_logs() as logs:
        proposing = steps(speculator, 120)
    probes = {step: proposed for step, proposed in enumerate(proposing, 1) if any(proposed)}
    # After 16 steps, then 32, then 64 (then 128, 256, 256, ...), the first sequence alone.
    assert probes == {16: (True, False), 48: (True, False), 112: (True, False)}
    [switched] = [entry for entry in logs if entry["event"] == "speculation_switched"]
    assert switched["on"] is False and switched["acceptance"] < 0.2 and switched["row_s"] == pytest.approx(0.01)
    fresh = Speculator(NgramProposer(2, 3), 2, max_seq_len=64)  # unmeasured: proposals are taken to pay
    assert steps(fresh, 32) == ([(True, True)] * 15 + [(False, False)]) * 2


# -- exactness on the bundled model, in float64 (tests/test_engine.py says why)

KINDS = [
    {},
    {"do_sample": True, "temperature": 0.7},
    {"do_sample": True, "top_p": 0.9, "top_k": 50},
    {"repetition_penalty": 1.2},
    {"do_sample": True, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"logprobs": 2},
    {"min_tokens": 30, "do_sample": True},
    {"stop": ["object"]},
]


def _run(harness: Harness, workload) -> list[tuple]:
    ids = [harness.submit(prompt, max_new, **dict(kind)) for prompt, max_new, kind in workload]
    results = harness.collect(ids)
    return [
        (
            _tokens(results[i]),
            "".join(e.text for e in results[i]),
            results[i][-1].finish_reason,
            [[(t.id, t.logprob, [(a.id, a.logprob) for a in t.top]) for t in e.logprobs or ()] for e in results[i]],
        )
        for i in ids
    ]


def _same(expected: list[tuple], got: list[tuple]) -> None:
    for index, ((tokens, text, finish, scores), (tokens2, text2, finish2, scores2)) in enumerate(
        zip(expected, got, strict=True)
    ):
        assert (tokens2, text2, finish2) == (tokens, text, finish), index
        flat = [(t, v) for event in scores for t, v, _ in event]
        flat2 = [(t, v) for event in scores2 for t, v, _ in event]
        assert [t for t, _ in flat2] == [t for t, _ in flat], index
        assert [v for _, v in flat2] == pytest.approx([v for _, v in flat], abs=1e-9), index


# Proposing in every step (--speculative-always): how much the measured rule would propose depends on the
# machine's timings (prompt lookup pays on a CPU, the bundled draft does not), and these tests are of exactness.
NGRAM = {"speculative": "ngram", "speculative_always": True}
DRAFT = {"speculative": "draft", "speculative_model": str(BUNDLED_DRAFT_MODEL), "speculative_always": True}


@pytest.mark.parametrize("proposing", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_seeded_sampling_penalties_stops_and_logprobs_give_the_same_tokens_with_proposals_alone_or_batched(
    loaded,  # noqa: F811
    proposing,
):
    rng = random.Random(3)
    workload = []
    for i in range(32):
        prompt = [rng.randrange(4, 32000) for _ in range(rng.randint(2, 60))]
        workload.append((prompt, rng.randint(10, 80), {**KINDS[i % len(KINDS)], "seed": i}))
    runs = {}
    for name, config in [
        ("plain", {}),
        ("speculating", proposing),
        ("speculating alone", {**proposing, "max_batch_size": 1}),
    ]:
        harness = Harness(loaded, EngineConfig(max_seq_len=512, kv_cache_bytes=256 << 20, **config))
        try:
            runs[name] = _run(harness, workload if name != "speculating alone" else workload[:8])
            stats = harness.engine.stats()
        finally:
            harness.close()
        if name != "plain":  # the bundled model repeats itself: prompt lookup finds much to propose
            assert stats["speculative_accepted"] >= 10 and stats["speculative_verifications"] >= 10, stats
    _same(runs["plain"], runs["speculating"])
    _same(runs["plain"][:8], runs["speculating alone"])


@pytest.mark.parametrize("proposing", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_a_grammar_takes_only_proposals_it_allows_and_gives_the_same_tokens(loaded, proposing):  # noqa: F811
    # A grammar that repeats: prompt lookup proposes from its own output, some of which the grammar allows.
    grammar = LLMatcher.grammar_from_regex(r"(red|green|blue)( (red|green|blue)){11}")
    workload = [(PROMPTS[i % 4], 60, {"do_sample": i % 2 == 1, "seed": i, "grammar": grammar}) for i in range(6)]
    runs = {}
    for name, config in (("plain", {}), ("speculating", proposing)):
        harness = Harness(loaded, EngineConfig(max_seq_len=512, kv_cache_bytes=256 << 20, **config))
        try:
            runs[name] = _run(harness, workload)
            stats = harness.engine.stats()
        finally:
            harness.close()
    _same(runs["plain"], runs["speculating"])
    assert all(len(text.split()) == 12 for _, text, _, _ in runs["speculating"]), runs["speculating"]
    assert stats["speculative_accepted"] > 0, stats


def test_a_draft_that_kept_its_cache_proposes_what_a_fresh_one_does_and_frees_it(loaded):  # noqa: F811
    """The draft keeps the proposals the target took, rolls back the others, and takes the target's own token."""
    draft = load_model(str(BUNDLED_DRAFT_MODEL), "cpu", "float64")
    config = EngineConfig(max_seq_len=512, kv_cache_bytes=1 << 20).for_device("cpu")
    kept = DraftProposer(draft, loaded, config, target_tokens=512)
    sequence = _sequence(loaded.tokenizer(PROMPTS[0])["input_ids"])
    for step in range(6):
        [proposal] = kept.propose([sequence], [4])
        assert proposal == DraftProposer(draft, loaded, config, target_tokens=512).propose([sequence], [4])[0]
        sequence.generated += [*proposal[: step % 3], 100 + step]  # some taken, then the target's own token
    kept.forget(sequence)
    other = _sequence(list(range(4, 500)))  # its draft needs 16 of the 16 blocks: the first's are free again
    assert len(kept.propose([other], [2])[0]) == 2
    assert kept.propose([_sequence([5, 6])], [2]) == [[]]  # no room left: nothing proposed


_GIB = 2**30


def test_a_draft_models_cache_of_as_many_tokens_and_its_steps_are_counted_in_the_targets_budget():
    """An 8B target (131 KB of KV per token) with a 1B draft (22.5 KB), on an H100 with 60 GiB free after both
    models' weights. Sized alone, the target's cache took the whole budget, and the draft's, 17 % of it more,
    found no memory at start."""
    target = DeviceMemory(bytes_per_token=131072, step=3 * _GIB, graphs=_GIB)
    draft = DeviceMemory(bytes_per_token=22528, step=_GIB, graphs=_GIB // 4)
    tokens = gpu_kv_cache_tokens(60 * _GIB, 0.9, target, draft)
    budget = 0.9 * (60 * _GIB - (3 * _GIB + _GIB + _GIB // 4))  # one step at a time (the larger), both graphs held
    assert tokens * (131072 + 22528) <= budget < (tokens + 1) * (131072 + 22528)
    alone = gpu_kv_cache_tokens(60 * _GIB, 0.9, target)
    assert alone == int(0.9 * (60 * _GIB - 4 * _GIB)) // 131072  # without a draft, the budget is the target's


def test_a_target_cache_sized_by_free_gpu_memory_counts_its_drafts_cache_and_steps(loaded, monkeypatch):  # noqa: F811
    """The GPU's sizing, on the CPU: the memory counters report the peaks below, in the order the profile asks for
    them (the target's prompt step and decode step, then the draft's), and the target's runner, given the draft,
    leaves the draft's cache of as many tokens and its steps their room."""
    peaks = iter([40 << 20, 10 << 20, 30 << 20, 5 << 20])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (_GIB, 2 * _GIB))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    for unused in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, unused, lambda device=None: None)
    draft = load_model(str(BUNDLED_DRAFT_MODEL), "cpu", "float64")
    config = EngineConfig(max_batch_size=2, max_tokens_per_step=32, attention="triton", gpu_memory_fraction=0.5)
    runner = ModelRunner(loaded, replace(config.for_device("cpu"), kv_cache_bytes=None), replay_eagerly, draft)
    assert next(peaks, None) is None  # all four measured
    per_token = KVGeometry.of(loaded.model).bytes_per_token + KVGeometry.of(draft.model).bytes_per_token
    tokens = int(0.5 * (_GIB - (40 << 20) - (10 << 20) - (5 << 20))) // per_token
    assert runner.num_blocks == tokens // runner.block_size


def test_a_draft_whose_output_is_nan_proposes_nothing_more_and_the_others_go_on(loaded, monkeypatch):  # noqa: F811
    """The CPU's fast greedy head answers None for a NaN row (output_head.py); a draft's None is no proposal."""
    monkeypatch.setattr(model_runner, "OutputHead", functools.partial(OutputHead, fast=True))
    draft = load_model(str(BUNDLED_DRAFT_MODEL), "cpu", "float32")  # the fast head's dtype
    config = EngineConfig(max_seq_len=512, kv_cache_bytes=1 << 20).for_device("cpu")
    prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    healthy = DraftProposer(draft, loaded, config, target_tokens=512).propose(
        [_sequence(p) for p in prompts[:2]], [4, 4]
    )
    _poison_embedding(draft.model, next(t for t in prompts[2] if all(t not in other for other in prompts[:2])))
    proposals = DraftProposer(draft, loaded, config, target_tokens=512).propose(
        [_sequence(p) for p in prompts], [4] * 3
    )
    assert proposals == [*healthy, []]


# -- rejection sampling's distribution


def _draw(logits: torch.Tensor, seed: int) -> int:
    params = SamplingParams(seed=seed, do_sample=True)
    return int(choose(logits[None], DrawBatch.of([Draw(params, (), 0)], logits.shape[0], logits.device))[0])


def _chi_square(counts: Counter, probabilities: list[float], draws: int) -> float:
    return sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in enumerate(probabilities))


@pytest.mark.parametrize("rule", ["the engine's", "without the correction"])
def test_the_proposal_rule_keeps_the_targets_distribution_and_fails_the_test_without_its_correction(rule):
    """A proposer whose q puts all its mass on token x. The engine's rule: accept x if the target's own draw is
    x, else take that draw, which is then distributed as the residual max(0, p - q), renormalised. The rule
    without the correction accepts x with probability p(x) and otherwise draws anew from p (x included): x
    comes out with probability p(x)(2 - p(x)). Chi-square over 6 tokens, 5 degrees of freedom; 20.5 is its
    99.9 % point."""
    logits = torch.tensor([1.5, 0.2, 0.9, -0.4, 0.0, 0.7], dtype=torch.float64)
    probabilities = logits.softmax(dim=-1).tolist()
    proposed, draws = 2, 6000
    uniform = random.Random(1)
    counts: Counter = Counter()
    for seed in range(draws):
        drawn = _draw(logits, seed)
        if rule == "the engine's":
            token = proposed if accepted_length((proposed,), [drawn]) == 1 else drawn
        else:
            token = proposed if uniform.random() < probabilities[proposed] else _draw(logits, seed + 10**9)
        counts[token] += 1
    statistic = _chi_square(counts, probabilities, draws)
    if rule == "the engine's":
        assert statistic < 20.5, (statistic, counts)
    else:
        assert statistic > 100, (statistic, counts)  # x comes out ~990 times more than its ~1250: over 700


# -- serving


def test_serve_speculates_exactly_counts_it_in_metrics_and_a_request_may_opt_out(tmp_path):
    """With the bundled draft model (the failover tests' workers use prompt lookup)."""
    draft = ["--speculative-model", str(BUNDLED_DRAFT_MODEL), "--num-speculative-tokens", "3", "--speculative-always"]
    with serving(tmp_path, *draft) as served:
        body = {"model": "tokenrelay-tiny", "prompt": PROMPTS[1], "max_tokens": 48, "temperature": 0, "seed": 5}
        speculated = httpx.post(served.url("/v1/completions"), json=body, timeout=60).json()
        metrics = httpx.get(served.url("/metrics")).text
        proposed, accepted, verified = (
            metric(metrics, f"tokenrelay_worker_speculative_{name}_total", model="tokenrelay-tiny")
            for name in ("proposed_tokens", "accepted_tokens", "verifications")
        )
        assert 0 < accepted <= proposed <= 3 * verified, metrics
        plain = httpx.post(served.url("/v1/completions"), json=body | {"speculative": False}, timeout=60).json()
        assert plain["choices"][0]["text"] == speculated["choices"][0]["text"]
        native = {"text_input": PROMPTS[1], "parameters": {"max_new_tokens": 48, "speculative": False}}
        answer = httpx.post(served.url("/v2/models/tokenrelay-tiny/generate"), json=native, timeout=60).json()
        assert answer["text_output"] == speculated["choices"][0]["text"]
        after = httpx.get(served.url("/metrics")).text
        assert metric(after, "tokenrelay_worker_speculative_proposed_tokens_total", model="tokenrelay-tiny") == proposed
        refused = httpx.post(served.url("/generate"), json={"inputs": "a", "parameters": {"speculative": "yes"}})
        assert refused.status_code == 422 and "speculative" in refused.text, refused.text
