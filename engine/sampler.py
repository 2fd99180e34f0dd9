"""Token sampling: greedy, temperature, top-k, top-p, with position-keyed randomness.

The random draw for a request's output position ``n`` comes from a generator seeded with
``(seed, n)`` only, so a seeded request samples the same tokens whatever the batch it runs in, however
often it is preempted, and whichever worker (prefill or decode) produces the token.
"""

from __future__ import annotations

import torch

from pdcluster.engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def position_generator(seed: int, position: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position * 7_919 + 12_345) & _MASK64)
    return g


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k / nucleus of one row's logits [V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays).
        remove = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def probs_for(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution of one row [V] after temperature, top-k and top-p."""
    row = apply_top_k_top_p(logits_row.float() / params.temperature, params.top_k, params.top_p)
    return row.softmax(-1)


def sample_from_probs(probs: torch.Tensor, seed: int, position: int) -> int:
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws exactly from p.
    noise = torch.empty_like(probs).exponential_(generator=position_generator(seed, position))
    return int((probs / noise).argmax())


def sample(
    logits: torch.Tensor,  # float32 [num_rows, vocab]
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
) -> list[int]:
    """One token per row. Greedy rows take a single batched argmax."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = sample_from_probs(probs_for(logits[i], p), seeds[i], positions[i])
    return tokens
