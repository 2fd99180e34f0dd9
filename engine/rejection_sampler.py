"""Verification of draft tokens (speculative decoding), lossless for greedy and for sampling.

Output layout (invariant S3): one row per request, ``max_num_drafts + 1`` wide; valid tokens are
contiguous from position 0 (accepted drafts, then the target's own token at the first rejection or the
bonus token after the last draft) and every later position is -1. Hence the number of valid tokens is
``(output_token_ids != -1).sum(dim=1)``: no cat-a-sentinel-and-argmax.

Sampled verification of drafts that are a single token each (n-gram, and MTP's greedy drafts: no draft
distribution) draws the target's token at every position with the very uniform the same request would
use without speculation (keyed by seed and output position, engine/sampler.py) and accepts the draft
iff the draw equals it. That is exact sampling from the target (lossless) and, beyond that, the same
tokens as decoding without speculation, seed for seed. (Accepting with probability p(draft) from a
separate stream and resampling the residual is lossless in distribution only: a seeded request's
tokens changed with speculation on.) Drafts with a distribution q keep the standard rule.
"""

from __future__ import annotations

import torch

from pdcluster.engine.sampler import position_generator, probs_for, sample_from_probs
from pdcluster.engine.sampling_params import SamplingParams

PLACEHOLDER = -1


def num_valid_tokens(output_token_ids: torch.Tensor) -> torch.Tensor:
    """Accepted drafts + 1 per row (S3)."""
    return (output_token_ids != PLACEHOLDER).sum(dim=1)


def _verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    target = target_logits.argmax(dim=-1).tolist()  # [num_drafts + 1]
    out = []
    for i, draft in enumerate(drafts):
        out.append(target[i])
        if draft != target[i]:
            return out
    out.append(target[len(drafts)])
    return out


def _verify_sampled(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,  # [num_drafts, V]; None = deterministic drafts (n-gram)
    params: SamplingParams,
    seed: int,
    position: int,
) -> list[int]:
    out = []
    if draft_probs is None:  # single-token drafts: draw as without speculation, accept on equality
        for i, draft in enumerate(drafts):
            token = sample_from_probs(probs_for(target_logits[i], params), seed, position + i)
            out.append(token)
            if token != draft:
                return out
        out.append(sample_from_probs(probs_for(target_logits[len(drafts)], params), seed, position + len(drafts)))
        return out
    for i, draft in enumerate(drafts):
        p = probs_for(target_logits[i], params)
        q = draft_probs[i]
        q_x = float(q[draft])
        # Uniform for the accept test, from a stream keyed by (seed, position) and disjoint from the
        # stream used to sample the token at that position.
        u = torch.rand((), generator=position_generator(seed ^ 0x5DEECE66D, position + i)).item()
        if q_x > 0 and u < min(1.0, float(p[draft]) / q_x):
            out.append(draft)
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        out.append(sample_from_probs(residual, seed, position + i))
        return out
    out.append(sample_from_probs(probs_for(target_logits[len(drafts)], params), seed, position + len(drafts)))
    return out


def rejection_sample(
    target_logits: list[torch.Tensor],  # per request [num_drafts_r + 1, V]
    draft_token_ids: list[list[int]],
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],  # output position of each request's first token this step
    draft_probs: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Returns output_token_ids [num_reqs, max_num_drafts + 1] with -1 at rejected positions."""
    width = max((len(d) for d in draft_token_ids), default=0) + 1
    output = torch.full((len(draft_token_ids), width), PLACEHOLDER, dtype=torch.int64)
    for r, drafts in enumerate(draft_token_ids):
        if params[r].greedy:
            tokens = _verify_greedy(target_logits[r], drafts)
        else:
            q = draft_probs[r] if draft_probs is not None else None
            tokens = _verify_sampled(target_logits[r], drafts, q, params[r], seeds[r], positions[r])
        output[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return output
