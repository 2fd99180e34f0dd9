"""`tiny-hybrid-moe` and `tiny-hybrid-moe-plain`: small, deterministic, randomly initialised NemotronH models
with Mamba2, attention, MLP and MoE blocks, the MoE siblings of `tiny-hybrid` (engine/models/tiny_hybrid.py,
whose shapes, tokenizer and init reasoning they share).

Pattern "ME*ME-M*E": 3 Mamba2, 2 attention, 1 relu2 MLP and 3 MoE blocks; hidden 128. Each MoE block: 16
routed relu2 experts of width 64, 4 per token, chosen by sigmoid scores plus a correction bias among the best
2 of 4 expert groups, weights renormalised and scaled by 2.5, plus a shared expert of width 128.
transformers' config has one ``moe_latent_size`` for all MoE blocks, so there are two models:
- `tiny-hybrid-moe`: latent MoE (moe_latent_size 64: the experts run in 64 dims between fc1/fc2_latent_proj),
  the shape of the Nemotron-3 models with latent MoE;
- `tiny-hybrid-moe-plain`: the experts run in the hidden size (no latent projection).
No MTP layers yet (num_nextn_predict_layers 0): they would be blocks drawn by tiny_hybrid.LAYER_INITS under
``mtp.layers.{j}.`` (mtp_layers_block_type attention + moe) plus the MTP projection and norms.

Measured with transformers (fp32, eager) on 16 random 12-token prompts x 32 greedy steps (seed 0), as
tiny_hybrid.py measures:
    tiny-hybrid-moe:       top1 - top2 logit gap median 1.92, 5th percentile 0.16, 0.8% of steps under 0.05;
                           31.1 distinct tokens per 32, longest run of one token 2, logit std ~12;
    tiny-hybrid-moe-plain: median 1.69, 5th percentile 0.12, 1.2% under 0.05; 31.1 distinct, run 3, std ~11;
    each routed expert is among a token's 4 for 8% to 44% of tokens (no dead expert); per token, the routed
    experts' weighted sum has norm ~27 and the shared expert's ~21 against ~11 for the block's normed input,
    so routing decides the next token.
"""

from __future__ import annotations

import os

from .tiny_hybrid import TINY_HYBRID_CONFIG, tiny_hybrid_state_dict
from .tiny_random import write_tiny_model

PATTERN = "ME*ME-M*E"
_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}

TINY_HYBRID_MOE_CONFIG = {
    **TINY_HYBRID_CONFIG,
    "layers_block_type": [_LAYER_TYPES[c] for c in PATTERN],
    "num_hidden_layers": len(PATTERN),
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 128,
    "moe_latent_size": 64,
    "n_shared_experts": 1,
}
TINY_HYBRID_MOE_PLAIN_CONFIG = {**TINY_HYBRID_MOE_CONFIG, "moe_latent_size": None}


def build_tiny_hybrid_moe(out_dir: str | os.PathLike, gguf_path: str | os.PathLike, latent: bool = True) -> None:
    """Write the complete tiny-hybrid-moe (``latent``) or tiny-hybrid-moe-plain HF directory into `out_dir`;
    the tokenizer comes from `gguf_path`."""
    config = TINY_HYBRID_MOE_CONFIG if latent else TINY_HYBRID_MOE_PLAIN_CONFIG
    write_tiny_model(out_dir, gguf_path, config, tiny_hybrid_state_dict)
