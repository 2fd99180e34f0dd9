"""Draft proposers for speculative decoding. The runner calls ``propose`` in ``sample_tokens`` after
verification and before the KV connector's ``post_forward`` (S2)."""

from __future__ import annotations

import torch

from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.kv_cache import kv_planes, num_packed_slots, packed_layers_per_slot
from pdcluster.engine.models.deepseek_mtp import is_own_mtp_weights as is_own_deepseek_mtp_weights
from pdcluster.engine.models.mtp import (DRAFT_VOCAB_SIZE, latent_attention_refusal, random_mtp_weights,
                                         uses_own_mtp_layers)
from pdcluster.engine.models.nemotron_blocks import ATTENTION
from pdcluster.engine.models.nemotron_mtp import is_own_mtp_weights
from pdcluster.engine.proposers.base import ProposeBatch, Proposer
from pdcluster.engine.proposers.draft_model import DraftModelProposer
from pdcluster.engine.proposers.mtp import MTPProposer
from pdcluster.engine.proposers.ngram import NgramProposer
from pdcluster.engine.tensor_parallel.draft import draft_head, eagle3_buffer_tokens, own_mtp_head

__all__ = ["ProposeBatch", "Proposer", "make_proposer", "num_draft_layers"]


def num_draft_layers(config: EngineConfig, arch=None, draft_model=None) -> int:
    """Layers the proposer adds to the paged KV cache (after the target's): MTP's one, or one per attention
    block of a NemotronH's own MTP layers (``arch``: the model's), or a draft model's (``draft_model``) every layer,
    packed where smaller (engine/kv_cache.py)."""
    if config.spec_method == "draft_model":  # packed where its KV of a token is a fraction of the target's
        per_slot = packed_layers_per_slot((arch.num_kv_heads, arch.head_dim),
                                          (draft_model.arch.num_kv_heads, draft_model.arch.head_dim))
        return num_packed_slots(draft_model.arch.num_layers, per_slot)
    if config.spec_method != "mtp":
        return 0
    if uses_own_mtp_layers(config.mtp_checkpoint, arch):
        return arch.mtp_layer_types.count(ATTENTION)
    if kv_planes(arch) != 2:
        # Our MTP head is a Llama layer (separate K and V planes): latent-attention models draft with their own.
        raise ConfigError(latent_attention_refusal(config.mtp_checkpoint))
    return 1


def make_proposer(config: EngineConfig, model, kv_cache: torch.Tensor, mtp_weights: dict | None = None,
                  draft_model=None) -> Proposer:
    """The proposer for ``config.spec_method``. For MTP: a NemotronH's (DeepSeek's) own MTP layers when
    ``mtp_weights`` are those (engine/models/mtp.py resolve_mtp_weights), an EAGLE draft when they are its
    (engine/models/eagle.py), our MTP head otherwise (seeded random without weights). For a draft model: the one
    loaded beside the model (engine/draft_model.py)."""
    if config.spec_method == "none":
        return Proposer()
    if config.spec_method == "draft_model":
        if draft_model is None:
            raise ValueError("spec_method 'draft_model': no draft model loaded (LoadedModel.load loads it)")
        return DraftModelProposer(draft_model, kv_cache, model.arch.num_layers, config.block_size)
    if config.spec_method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.spec_method == "mtp":
        if mtp_weights is not None and (is_own_mtp_weights(mtp_weights)
                                        or is_own_deepseek_mtp_weights(mtp_weights, model.arch)):
            # The checkpoint's own MTP layers (NemotronH's, DeepSeek-V3's), sliced where the model is split.
            return MTPProposer(own_mtp_head(model, mtp_weights), kv_cache, config.block_size)
        # Drafts over the first DRAFT_VOCAB_SIZE ids on a CPU, where the lm_head is most of a draft step; on a GPU
        # the whole vocabulary (a Llama 3's common tokens lie far past 16k, and its lm_head costs a draft little).
        draft_vocab = DRAFT_VOCAB_SIZE if kv_cache.device.type == "cpu" else model.arch.vocab_size
        weights = (mtp_weights if mtp_weights is not None  # drawn at the whole model's shapes where it is split
                   else random_mtp_weights(model.unsplit_arch or model.arch, config.seed))
        # An EAGLE-3 draft, an EAGLE draft or our MTP head, by its weights (sliced where the model is split).
        head = draft_head(model, weights, draft_vocab, eagle3_buffer_tokens(config))
        return MTPProposer(head, kv_cache, config.block_size)
    raise ValueError(f"spec_method: {config.spec_method!r} has no proposer")
