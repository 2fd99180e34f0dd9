"""Draft-model speculation's draft (``spec_method="draft_model"``, vLLM's and SGLang's ``draft_model`` method): a
separate, smaller causal LM over the same tokenizer, loaded beside the target and run by
engine/proposers/draft_model.py.

Its layers keep their KV in the target's paged cache, as draft layers after the target's (as MTP's do): the same
blocks, block tables and slots, so the scheduler's blocks, prefix caching, preemption, the offload tiers and a KV
transfer carry the draft's KV with the target's (S2) and nothing else is allocated. A draft whose KV of one token has
the target's shape (KV heads x head size: Llama 3.2 3B for Llama 3.1 8B and 70B, Qwen3 0.6B-8B for each other and
for 14B and 32B) takes one cache layer a layer; one whose KV is smaller (Llama 3.2 1B's 8 x 64 for Llama 3.1 8B's 8 x 128, Qwen2.5
0.5B's 2 x 64 for Qwen2.5 7B's 4 x 128) packs as many of its layers into each as fit (engine/kv_cache.py
``packed_layer_views``). A draft whose KV of a token is larger is refused at start-up naming both shapes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.kv_cache import kv_planes, packed_layers_per_slot
from pdcluster.engine.models.architectures import arch_from_dir, is_encoder, is_hybrid, load_model
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def check_draft_target(config: EngineConfig, target_arch) -> None:
    """ConfigError where the target cannot keep a draft model's KV beside its own: a hybrid (Mamba state), latent
    attention (one plane), an encoder, or a split model (tensor parallelism)."""
    what = f"spec_method 'draft_model' on {config.model}"
    if is_hybrid(target_arch):
        raise ConfigError(f"{what}: a hybrid (Mamba) target keeps recurrent state a draft model's rejected drafts would "
                          "have to roll back; use --spec mtp (its own MTP layers) or --spec ngram")
    if kv_planes(target_arch) != 2:
        raise ConfigError(f"{what}: a latent-attention (MLA) target's cache has one plane a draft model's K and V do "
                          "not fit; use --spec mtp (its own MTP layer) or --spec ngram")
    if is_encoder(target_arch):
        raise ConfigError(f"{what}: an encoder generates nothing")
    if config.tensor_parallel_size > 1:
        raise ConfigError(f"{what}: a draft model on a tensor-parallel split is not supported yet; use "
                          "--tensor-parallel-size 1, or --spec mtp / ngram on the split")


def check_draft_model(config: EngineConfig, target_arch, target_tokenizer: Tokenizer,
                      progress: bool = True) -> tuple[Path, object]:
    """(directory, architecture) of the draft named by ``config.draft_model``, its config and tokenizer read (no
    weight); ConfigError (naming what differs) where it cannot draft for the target. A launcher calls it before any
    worker starts, each worker again before it reads any weight."""
    check_draft_target(config, target_arch)
    try:
        draft_dir: Path = resolve_model(config.draft_model, cache_dir=config.cache_dir or None, progress=progress,
                                        revision=None, download_dir=config.download_dir)
    except ValueError as e:
        raise ConfigError(f"draft_model: {e}") from None
    try:
        arch = arch_from_dir(draft_dir)
    except ValueError as e:
        raise ConfigError(f"draft_model {config.draft_model!r}: {e}") from None
    name = f"draft model {config.draft_model!r}"
    if is_hybrid(arch) or is_encoder(arch) or kv_planes(arch) != 2:
        raise ConfigError(f"{name}: only attention-only causal LMs (Llama-family) draft; this one is "
                          f"{type(arch).__name__}")
    try:
        packed_layers_per_slot((target_arch.num_kv_heads, target_arch.head_dim), (arch.num_kv_heads, arch.head_dim))
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    if arch.vocab_size > target_arch.vocab_size:
        raise ConfigError(f"{name}: its vocabulary ({arch.vocab_size}) is larger than the target's "
                          f"({target_arch.vocab_size}): it would draft ids the target has no logits for")
    differs = _vocab_difference(Tokenizer(draft_dir), target_tokenizer)
    if differs:
        raise ConfigError(f"{name}: its tokenizer differs from the target's ({differs}); a draft must share the "
                          "target's token ids")
    return draft_dir, arch


@dataclass(frozen=True)
class DraftSource:
    """Where a loaded draft came from and how it was loaded: a level-2 sleep reads it again (engine/sleep.py)."""

    directory: Path
    dtype: torch.dtype
    max_positions: int
    device: str
    deterministic: bool

    def load(self):
        return load_model(self.directory, self.dtype, self.max_positions, self.device,
                          deterministic=self.deterministic, max_model_len=self.max_positions)


def load_draft_model(config: EngineConfig, draft_dir: Path, arch, dtype: torch.dtype, max_positions: int,
                     deterministic: bool) -> object:
    """The draft ``check_draft_model`` found (``draft_dir``, its ``arch``), on the target's device and dtype."""
    name = f"draft model {config.draft_model!r}"
    if max_positions > arch.max_position_embeddings:
        log.info("%s: its own context is %d tokens, the engine's %d: drafts past it are rarely accepted",
                 name, arch.max_position_embeddings, max_positions)
    source = DraftSource(Path(draft_dir), dtype, max_positions, config.device, deterministic)
    draft = source.load()
    draft.source = source
    log.info("draft model %s: %d layers of width %d, from %s", config.draft_model, arch.num_layers,
             arch.hidden_size, draft_dir)
    return draft


def _vocab_difference(draft: Tokenizer, target: Tokenizer) -> str:
    """'' where every token of the draft's vocabulary has the target's id for it, else what differs first."""
    target_vocab = target.vocab()
    for token, token_id in sorted(draft.vocab().items(), key=lambda item: item[1]):  # the lowest id first
        if target_vocab.get(token) != token_id:
            return f"token {token!r} is id {token_id} in the draft's, " + (
                f"{target_vocab[token]} in the target's" if token in target_vocab else "absent from the target's")
    return ""
