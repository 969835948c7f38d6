"""Next-token choice for a batch: greedy, and seeded sampling that depends on (seed, index) alone."""

import pytest
import torch
from transformers import TypicalLogitsWarper

from schemas.messages import SamplingParams
from tests.devices import TEST_DEVICE
from workers.engine.sampler import Draw, DrawBatch, _typical, choose, noise_seed


def sample_logits(logits: torch.Tensor, draws: list[Draw]) -> list[int]:
    """The tokens the batch sampler draws for these rows, on the test device (TOKENRELAY_TEST_DEVICE)."""
    logits = logits.to(TEST_DEVICE)
    return choose(logits, DrawBatch.of(draws, logits.shape[-1], logits.device)).tolist()


def _logits(seed: int = 0, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def _draw(params: SamplingParams, logits: torch.Tensor, history=(1, 2, 3), index=0) -> int:
    return sample_logits(logits.unsqueeze(0), [Draw(params, history, index)])[0]


def test_greedy_is_argmax():
    logits = _logits()
    assert _draw(SamplingParams(seed=1), logits) == int(logits.argmax())


def test_repetition_penalty_steers_greedy_away_from_seen_tokens():
    logits = torch.zeros(10)
    logits[4], logits[7] = 5.0, 4.0
    params = SamplingParams(seed=1, repetition_penalty=2.0)
    assert _draw(params, logits, history=(4,)) == 7
    assert _draw(params, logits, history=(1,)) == 4


def test_same_seed_and_index_draw_the_same_token_whatever_came_before():
    params = SamplingParams(seed=123, do_sample=True, temperature=1.5)
    logits = _logits()
    first = [_draw(params, logits, index=i) for i in range(50)]
    again = [_draw(params, logits, history=(9, 9), index=i) for i in range(50)]
    assert first == again
    assert len(set(first)) > 10  # and it does sample


def test_a_row_draws_the_same_token_whatever_else_is_in_the_batch():
    params = [SamplingParams(seed=s, do_sample=True, top_k=40, top_p=0.9, temperature=0.7) for s in range(1, 9)]
    logits = torch.stack([_logits(s) for s in range(8)])
    together = sample_logits(logits, [Draw(p, (), 5) for p in params])
    alone = [sample_logits(logits[i : i + 1], [Draw(params[i], (), 5)])[0] for i in range(8)]
    mixed = sample_logits(logits[[3, 0]], [Draw(SamplingParams(seed=99), (), 5), Draw(params[0], (), 5)])
    assert together == alone and mixed[1] == alone[0]


def test_different_seeds_draw_differently():
    logits = _logits()
    a = [_draw(SamplingParams(seed=1, do_sample=True), logits, index=i) for i in range(30)]
    b = [_draw(SamplingParams(seed=2, do_sample=True), logits, index=i) for i in range(30)]
    assert a != b


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    params = SamplingParams(seed=11, do_sample=True)
    draws = [_draw(params, logits, index=i) for i in range(3000)]
    shares = [draws.count(t) / len(draws) for t in range(3)]
    assert abs(shares[0] - 0.7) < 0.03 and abs(shares[1] - 0.2) < 0.03 and abs(shares[2] - 0.1) < 0.03


def test_top_k_one_samples_the_argmax():
    logits = _logits(3)
    params = SamplingParams(seed=5, do_sample=True, top_k=1)
    assert {_draw(params, logits, index=i) for i in range(20)} == {int(logits.argmax())}


def test_top_p_keeps_only_the_nucleus():
    logits = torch.full((100,), -10.0)
    logits[10], logits[20] = 5.0, 4.9  # together far above 0.9 of the mass
    params = SamplingParams(seed=9, do_sample=True, top_p=0.9)
    assert {_draw(params, logits, index=i) for i in range(40)} == {10, 20}


def test_typical_p_drops_unusual_tokens():
    logits = torch.log(torch.tensor([0.45, 0.45, 0.05, 0.05]))
    params = SamplingParams(seed=2, do_sample=True, typical_p=0.5)
    assert {_draw(params, logits, index=i) for i in range(60)} <= {0, 1}


def test_min_p_drops_tokens_far_less_likely_than_the_likeliest():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))
    params = SamplingParams(seed=4, do_sample=True, min_p=0.2)  # keeps p >= 0.1
    assert {_draw(params, logits, index=i) for i in range(200)} == {0, 1, 2}


def test_presence_and_frequency_penalties_subtract_from_generated_tokens_logits():
    logits = torch.tensor([5.0, 4.0, 3.5, 0.0])

    def greedy(generated, **penalties) -> int:
        params = SamplingParams(seed=1, **penalties)
        return sample_logits(logits.unsqueeze(0), [Draw(params, (), 0, generated)])[0]

    assert greedy((0,), presence_penalty=0.9) == 0 and greedy((0,), presence_penalty=1.1) == 1
    assert greedy((0, 0, 1), frequency_penalty=0.8) == 2  # 5 - 1.6 and 4 - 0.8 fall below 3.5
    assert greedy((0, 0), frequency_penalty=0.4, presence_penalty=0.3) == 1  # 5 - 0.8 - 0.3 < 4
    assert greedy((), presence_penalty=2.0, frequency_penalty=2.0) == 0  # nothing generated yet


def test_logit_bias_and_banned_tokens_move_greedy_and_sampled_draws():
    logits = _logits(6)
    biased = SamplingParams(seed=3, do_sample=True, logit_bias={17: 100.0})
    assert {_draw(biased, logits, index=i) for i in range(20)} == {17}
    best = int(logits.argmax())
    against = SamplingParams(seed=3, logit_bias={best: -100.0})
    assert _draw(against, logits) == int(logits.clone().index_fill_(0, torch.tensor([best]), -1e9).argmax())
    banned = sample_logits(logits.unsqueeze(0), [Draw(SamplingParams(seed=1), (), 0, (), (best,))])[0]
    assert banned != best and banned == _draw(against, logits)


def test_banned_ids_outside_the_vocabulary_are_left_out():
    """min_tokens bans stop tokens; one past the vocabulary must neither index past the scores (an IndexError here,
    a device-side assert that poisons a GPU worker) nor ban a token of another row."""
    logits = torch.stack([_logits(7), _logits(8)])
    vocab = logits.shape[-1]
    logits[0, vocab - 1] = 10.0  # row 0's likeliest token, where row 1's -1 would land
    best = [int(row.argmax()) for row in logits]
    banned = [(99_999_999, vocab + best[1]), (-1,)]  # vocab + best[1]: where row 1's likeliest token is
    assert sample_logits(logits, [Draw(SamplingParams(seed=1), (), 0, (), ids) for ids in banned]) == best


def test_extreme_parameters_still_draw_a_token():
    logits = _logits(4)
    extremes = [
        SamplingParams(
            seed=1,
            do_sample=True,
            repetition_penalty=5e-324,
            temperature=1.0000000000000002e-06,
            top_p=1.0000000000000002e-06,
            typical_p=5e-324,
            top_k=1,
        ),
        SamplingParams(seed=1, do_sample=True, repetition_penalty=1e308),
        SamplingParams(seed=1, do_sample=True, temperature=1.0000000000000002e-06),
        SamplingParams(seed=1, repetition_penalty=5e-324),
    ]
    for params in extremes:
        assert 0 <= _draw(params, logits, history=(1, 2, 3)) < 1000


def test_an_overflowed_penalty_keeps_its_meaning():
    logits = torch.zeros(10)
    logits[4] = 1.0
    # Seen token 4 with a vanishing penalty: its score goes to +inf, so it must be drawn.
    params = SamplingParams(seed=3, do_sample=True, repetition_penalty=5e-324)
    assert {_draw(params, logits, history=(4,), index=i) for i in range(10)} == {4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_typical_p_filters_a_batch_as_transformers_filters_each_row(dtype):
    generator = torch.Generator().manual_seed(5)
    scores = (torch.randn(6, 500, generator=generator) * 3).to(dtype)
    scores[1, 100:] = float("-inf")  # a row already cut by top-k
    masses = [0.2, 0.5, 0.9, 0.95, 5e-324, 0.999]
    batched = _typical(scores.to(TEST_DEVICE), torch.tensor(masses, dtype=dtype, device=TEST_DEVICE).unsqueeze(1))
    for row, mass in enumerate(masses):
        expected = TypicalLogitsWarper(mass)(None, scores[row : row + 1])[0]
        assert torch.equal(batched[row].cpu(), expected), mass


def test_a_mixed_batch_draws_each_row_as_it_would_alone():
    """Greedy, penalised, typical, cut and whole-distribution sampling rows side by side (the sampler draws the
    last kind without sorting, apart from the others): each row's token is its own."""
    params = [
        SamplingParams(seed=1),
        SamplingParams(seed=6, do_sample=True, temperature=1.3),
        SamplingParams(seed=2, repetition_penalty=1.7),
        SamplingParams(seed=3, do_sample=True, typical_p=0.6, temperature=0.8),
        SamplingParams(seed=4, do_sample=True, top_k=5, repetition_penalty=0.7),
        SamplingParams(seed=7, do_sample=True, presence_penalty=1.0, min_tokens=20),
        SamplingParams(seed=5, do_sample=True, top_p=0.5),
    ]
    logits = torch.stack([_logits(s) for s in range(len(params))])
    draws = [Draw(p, (1, 2, 3, 500, int(logits[i].argmax())), 9, (1, 2), (7,)) for i, p in enumerate(params)]
    together = sample_logits(logits, draws)
    assert together == [sample_logits(logits[i : i + 1], [draws[i]])[0] for i in range(len(params))]
    assert together[0] == int(logits[0].argmax()) and together[1] != int(logits[1].argmax())


def test_the_gpu_noise_of_a_row_depends_on_its_seed_alone_and_is_exponential():
    """The Triton noise kernel (interpreted on the CPU): Exp(1) by token, keyed by the row's noise seed."""
    from workers.engine.triton_sampling import exponential_noise

    seeds = [noise_seed(7, 3), noise_seed(2**64 - 1, 10**6), noise_seed(7, 3), noise_seed(7, 4)]
    signed = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds], device=TEST_DEVICE)
    noise = exponential_noise(signed, 3000).cpu()
    alone = exponential_noise(signed[1:2], 3000).cpu()
    assert torch.equal(noise[0], noise[2]) and torch.equal(noise[1], alone[0])
    assert not torch.equal(noise[0], noise[3]) and not torch.equal(noise[0], noise[1])
    assert (noise > 0).all() and abs(noise.mean().item() - 1.0) < 0.05 and abs(noise.std().item() - 1.0) < 0.05


def test_largest_seed_is_usable():
    assert 0 <= noise_seed(2**64 - 1, 10**6) < 2**64
    _draw(SamplingParams(seed=2**64 - 1, do_sample=True), _logits(), index=3)
