"""DeepSeek-V3's own multi-token-prediction layer (config ``num_nextn_predict_layers``: DeepSeek-V3 / V3.1 / R1,
Kimi K2) as the MTP draft model, computed as vLLM's DeepSeekMTP computes it (vllm/model_executor/models/
deepseek_mtp.py): transformers' DeepseekV3 drops those weights at load, so vLLM is the reference for what they mean.

One MTP step at position ``p`` takes the target's final hidden state ``h_p`` (after the final norm, what the LM head
reads) and the embedding of the next token ``t_{p+1}`` (zeroed at position 0, as vLLM does)::

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])    # 2H -> H, the embedding half first
    x = x + the block's output                         # one DeepSeek block: MLA at position p, then the MoE
    logits = shared_head.head(shared_head.norm(x))      # -> t_{p+2}

The next chained step takes ``x`` (before shared_head.norm) as its hidden state, as vLLM chains it. The block is
the target's code (engine/models/deepseek.py) on the target's RoPE table and attention scale; its MLA latents are
one draft layer of the paged cache, after the target's layers, so they travel with the target's in a KV transfer
(S2). engine/proposers/mtp.py drives it, as it drives NemotronH's layers.

Weights, as the published checkpoints name them, under ``model.layers.{num_hidden_layers}.``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, ``shared_head.head`` (the target's lm_head where absent) and the block's own
names (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``); the layer's copy of
``embed_tokens`` is the target's and is not kept. One MTP layer (``num_nextn_predict_layers`` 1, every published
checkpoint's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.deepseek import DeepseekArch, DeepseekLayer, take_weight
from pdcluster.engine.models.quantized import dequantize_weights, scaled_weights_of
from pdcluster.kernels import ops


def mtp_prefix(arch: DeepseekArch) -> str:
    return f"model.layers.{arch.num_layers}"


def own_mtp_problem(arch: DeepseekArch) -> str | None:
    """Why the arch's own MTP layers cannot draft (one line naming the field), or None."""
    if arch.num_nextn_predict_layers != 1:
        return (f"num_nextn_predict_layers {arch.num_nextn_predict_layers}: one DeepSeek MTP layer is supported "
                "(every published checkpoint has one)")
    return None


def is_own_mtp_weights(weights: dict, arch) -> bool:
    """Whether ``weights`` are a DeepSeek checkpoint's MTP layer for ``arch``."""
    return isinstance(arch, DeepseekArch) and f"{mtp_prefix(arch)}.eh_proj.weight" in weights


def own_mtp_weight_names(model_dir: str | Path, arch: DeepseekArch) -> list[str]:
    """The MTP layer's tensor names in the directory's safetensors files (headers only: nothing is read)."""
    from safetensors import safe_open

    prefix = mtp_prefix(arch) + "."
    return sorted(name for f in sorted(Path(model_dir).glob("*.safetensors"))
                  for name in safe_open(str(f), "pt").keys() if name.startswith(prefix))


def load_own_mtp_weights(model_dir: str | Path, arch: DeepseekArch) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors as stored (on the host; DeepseekMTP casts them), from the files that hold them."""
    from safetensors import safe_open

    prefix, weights = mtp_prefix(arch) + ".", {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.startswith(prefix):
                    weights[name] = st.get_tensor(name)
    scaled = scaled_weights_of(json.loads((Path(model_dir) / "config.json").read_text()))
    if scaled is not None:  # DeepSeek's own FP8 release quantizes the MTP layer too: float32 here, cast by the head
        dequantize_weights(weights, scaled, torch.float32)
    return weights


class DeepseekMTP:
    """Inference form of the MTP layer (module docstring), with MTPHead's interface (engine/models/mtp.py)."""

    num_draft_layers = 1  # the block's MLA latents

    def __init__(self, target, weights: dict[str, torch.Tensor]):
        arch = target.arch
        problem = own_mtp_problem(arch)
        if problem is not None:
            raise ValueError(problem)
        prefix = mtp_prefix(arch)
        weights = {n: t.to(target.device, target.dtype) for n, t in weights.items() if n.startswith(prefix + ".")}

        take = lambda name: take_weight(weights, prefix, name)  # noqa: E731
        det = target.deterministic
        self.target, self.eps = target, arch.rms_norm_eps
        self.enorm, self.hnorm = take("enorm.weight"), take("hnorm.weight")
        self.eh_proj = Linear(take("eh_proj.weight"), deterministic=det)
        self.head_norm = take("shared_head.norm.weight")
        head = weights.pop(f"{prefix}.shared_head.head.weight", None)
        self.head = (target.lm_head_proj if head is None else
                     Linear(head, keep_weight=True, pack_float32=True, deterministic=det))
        weights.pop(f"{prefix}.embed_tokens.weight", None)  # the target's, shared
        self.block = DeepseekLayer(arch, weights, prefix, det, sparse=arch.moe is not None)

    def draft_cache(self, kv_cache: torch.Tensor, first_layer: int) -> torch.Tensor:
        """This layer's plane of the paged cache: the draft layer at ``first_layer``."""
        return kv_cache[first_layer : first_layer + 1]

    def forward(
        self,
        hidden: torch.Tensor,  # [n, H]: the target's final hidden at position p, or the previous step's x
        next_token_ids: torch.Tensor,  # int64 [n]: token at p + 1
        positions: torch.Tensor,  # int64 [n]: p
        draft_cache: torch.Tensor,  # draft_cache(kv_cache, num_target_layers)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes the draft layer's latents at ``meta.slot_mapping`` and returns ``x`` [n, H] (before
        shared_head.norm: what the next chained step takes)."""
        emb = F.embedding(next_token_ids, self.target.embed_tokens)
        emb = emb.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([ops.rms_norm(emb, self.enorm, self.eps),
                                    ops.rms_norm(hidden, self.hnorm, self.eps)], dim=-1))
        out, residual = self.block.forward(x, None, positions, self.target.rope, draft_cache[0], meta)
        return residual.add_(out)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(ops.rms_norm(x, self.head_norm, self.eps)).float()

    def draft_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy drafts over the whole vocabulary."""
        return self.compute_logits(x).argmax(dim=-1)
