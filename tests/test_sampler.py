"""The batched sampler: right distribution, exact nucleus / top-k, draws keyed by (seed, position)."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.sampler import batch_probs, position_uniform, probs_for, sample
from pdcluster.engine.sampling_params import SamplingParams


def _reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Sort-based top-k / top-p on one row (the textbook definition)."""
    x = row.float() / p.temperature
    if 0 < p.top_k < x.shape[0]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        sorted_x = sorted_x.masked_fill(probs.cumsum(-1) - probs >= p.top_p, float("-inf"))
        x = torch.empty_like(x).scatter_(0, order, sorted_x)
    return x.softmax(-1)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.5),
    SamplingParams(temperature=2.0, top_p=0.999),  # a wide nucleus: most of the vocabulary sorted
]


@pytest.mark.parametrize("params", PARAMS)
def test_batch_probs_equal_the_sort_based_definition(params):
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)) * 3
    got = batch_probs(logits, [params] * 6)
    for r in range(6):
        torch.testing.assert_close(got[r], _reference_probs(logits[r], params), rtol=1e-5, atol=1e-7)


def test_a_mixed_batch_gives_each_row_its_own_distribution():
    logits = torch.randn(len(PARAMS), 500, generator=torch.Generator().manual_seed(1)) * 2
    got = batch_probs(logits, PARAMS)
    for r, p in enumerate(PARAMS):
        torch.testing.assert_close(got[r], probs_for(logits[r], p), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("params", PARAMS[:4])
def test_draws_follow_the_distribution(params):
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(2)) * 2
    n = 40_000
    tokens = sample(logits.expand(n, 40).contiguous(), [params] * n, [11] * n, list(range(n)))
    empirical = torch.bincount(torch.tensor(tokens), minlength=40).double() / n
    expected = probs_for(logits[0], params).double()
    assert (empirical[expected == 0] == 0).all(), "a token outside top-k / top-p was drawn"
    # 5 standard deviations of a binomial proportion, per token.
    bound = 5 * (expected * (1 - expected) / n).sqrt() + 1e-9
    assert ((empirical - expected).abs() <= bound).all()


def test_draws_are_keyed_by_seed_and_position_not_by_batch():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(8)]
    seeds, positions = list(range(8)), [5, 9, 9, 0, 3, 7, 2, 1]
    together = sample(logits, params, seeds, positions)
    alone = [sample(logits[i : i + 1], [params[i]], [seeds[i]], [positions[i]])[0] for i in range(8)]
    assert together == alone
    shuffled = sample(logits.flip(0), params[::-1], seeds[::-1], positions[::-1])
    assert shuffled == together[::-1]


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=3)]
    tokens = sample(logits, params, [1, 2, 3, 4], [0, 0, 0, 0])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[3] in torch.topk(logits[3], 3).indices.tolist()


def test_position_uniform_is_uniform_and_distinct():
    values = [position_uniform(seed, pos) for seed in range(20) for pos in range(500)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    mean = sum(values) / len(values)
    assert abs(mean - 0.5) < 0.01
