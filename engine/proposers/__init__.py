"""Draft proposers for speculative decoding. The runner calls ``propose`` in ``sample_tokens`` after
verification and before the KV connector's ``post_forward`` (S2)."""

from __future__ import annotations

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.proposers.base import ProposeBatch, Proposer

__all__ = ["ProposeBatch", "Proposer", "make_proposer", "num_draft_layers"]


def num_draft_layers(config: EngineConfig) -> int:
    """Layers the proposer adds to the paged KV cache (after the target's)."""
    return 1 if config.spec_method == "mtp" else 0


def make_proposer(config: EngineConfig, model, kv_cache: torch.Tensor, mtp_weights: dict | None = None) -> Proposer:
    """The proposer for ``config.spec_method``. For MTP without ``mtp_weights``: a random head seeded
    with ``config.seed``."""
    if config.spec_method == "none":
        return Proposer()
    if config.spec_method == "ngram":
        from pdcluster.engine.proposers.ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.spec_method == "mtp":
        from pdcluster.engine.models.mtp import MTPHead, random_mtp_weights
        from pdcluster.engine.proposers.mtp import MTPProposer

        weights = mtp_weights if mtp_weights is not None else random_mtp_weights(model.arch, config.seed)
        return MTPProposer(MTPHead(model, weights), kv_cache, config.block_size)
    raise ValueError(f"spec_method: {config.spec_method!r} has no proposer")
