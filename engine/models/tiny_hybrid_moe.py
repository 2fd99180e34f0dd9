"""`tiny-hybrid-moe` and `tiny-hybrid-moe-plain`: small, deterministic, randomly initialised NemotronH models
with Mamba2, attention, MLP and MoE blocks, the MoE siblings of `tiny-hybrid` (engine/models/tiny_hybrid.py,
whose shapes, tokenizer and init reasoning they share).

Pattern "ME*ME-M*E": 3 Mamba2, 2 attention, 1 relu2 MLP and 3 MoE blocks; hidden 128. Each MoE block: 16
routed relu2 experts of width 64, 4 per token, chosen by sigmoid scores plus a correction bias among the best
2 of 4 expert groups, weights renormalised and scaled by 2.5, plus a shared expert of width 128.
transformers' config has one ``moe_latent_size`` for all MoE blocks, so there are two models:
- `tiny-hybrid-moe`: latent MoE (moe_latent_size 64: the experts run in 64 dims between fc1/fc2_latent_proj),
  the shape of the Nemotron-3 models with latent MoE, and one MTP step of their shape (num_nextn_predict_layers
  1, mtp_layers_block_type attention + moe; engine/models/nemotron_mtp.py) whose drafts are mostly accepted;
- `tiny-hybrid-moe-plain`: the experts run in the hidden size (no latent projection), no MTP layers; its bytes
  are those it had before tiny-hybrid-moe got its MTP step.

Why tiny-hybrid-moe's target is not quite tiny-hybrid's init: an MTP step sees the target's final hidden state
h_p and the next token, not the Mamba states, and a random target at tiny-hybrid's gains is chaotic in them.
Measured before settling on this: an attention + MoE step trained on 80 greedy sequences of the target (MSE to
h_{p+1}) drafted 0-1% of held-out tokens right; even a copy of the target's last two blocks (attention, MoE) fed
the token's embedding, with every earlier block's output scaled down to 1% (so near the truth), agreed on 21%.
So the target gets a *successor prior*, as real text has predictable continuations: the LM head is the
embedding with its rows permuted by a seeded permutation sigma (untied: ``lm_head[sigma[t]] = embed[t]``), and
the embedding is scaled by SUCCESSOR_SCALE (11) against the mixers in the residual stream. A token's own
embedding then votes for sigma(token) with a large margin, and the mixers (Mamba state, attention, routing)
overrule it on about a fifth of the steps (measured below: 18%): they still decide real tokens, and a broken
mixer still changes the output. Scale 8 made the target follow sigma on 36% of steps, 10 on 68%, 12 on 90%.
The MTP step is constructed, not trained: eh_proj is MTP_TOKEN_GAIN * identity on the token half (its hidden
half small and random), its attention and MoE blocks drawn by tiny_hybrid.LAYER_INITS as the target's are, and
final_layernorm like norm_f; it so predicts sigma(next token), and its blocks move about 7% of drafts off it.

Measured with our engine (fp32, seed 0; 16 random 12-token prompts x 32 greedy steps):
    tiny-hybrid-moe:       top1 - top2 logit gap median 9.59, 5th percentile 0.50, 0.6% of steps under 0.05;
                           32 distinct tokens per 32, longest run of one token 1; follows sigma on 82% of steps;
                           each routed expert is among a token's 4 for 11% to 38% of tokens (no dead expert);
                           --spec mtp drafts accepted: 0.82 (k = 1), 0.74 (k = 2), 0.70 (k = 3);
    tiny-hybrid-moe-plain: (transformers, before: median 1.69, 5th percentile 0.12, 1.2% under 0.05; 31.1
                           distinct, run 3, std ~11; each expert among a token's 4 for 8% to 44% of tokens);
    per token, the routed experts' weighted sum has norm ~27 and the shared expert's ~21 against ~11 for the
    block's normed input, so routing decides the next token where the mixers do.
"""

from __future__ import annotations

import os

from .tiny_hybrid import FINAL_NORM_SCALE, LAYER_INITS, TINY_HYBRID_CONFIG, _Draws, tiny_hybrid_state_dict
from .tiny_random import write_tiny_model

PATTERN = "ME*ME-M*E"
_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}

TINY_HYBRID_MOE_PLAIN_CONFIG = {
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
    "moe_latent_size": None,
    "n_shared_experts": 1,
}
TINY_HYBRID_MOE_CONFIG = {
    **TINY_HYBRID_MOE_PLAIN_CONFIG,
    "moe_latent_size": 64,
    "tie_word_embeddings": False,  # the successor prior's LM head is not the embedding (module docstring)
    "num_nextn_predict_layers": 1,
    "mtp_layers_block_type": ["full_attention", "moe"],
}

MTP_SEED = 1
SUCCESSOR_SCALE = 11.0  # the embedding's weight in the residual stream against the mixers'
MTP_TOKEN_GAIN = 8.0  # eh_proj's token half: a * I (module docstring)
MTP_HIDDEN_GAIN = 1.0  # eh_proj's hidden half: random, std MTP_HIDDEN_GAIN / sqrt(hidden)


def successor_of(vocab_size: int, seed: int = MTP_SEED):
    """The successor map sigma (a seeded permutation of the token ids): ``successor_of(v)[t]`` follows t."""
    import torch

    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))


def mtp_state_dict(config: dict, seed: int = MTP_SEED) -> dict:
    """One MTP step (config mtp_layers_block_type) under ``mtp.layers.{j}.`` with the published checkpoints'
    names: its blocks drawn by tiny_hybrid.LAYER_INITS like the target's, eh_proj mostly the token half."""
    d = _Draws(seed + 1)
    torch = d.torch
    hidden, kinds = config["hidden_size"], config["mtp_layers_block_type"]
    state = {"mtp.layers.0.enorm.weight": d.norm_weight(hidden), "mtp.layers.0.hnorm.weight": d.norm_weight(hidden),
             "mtp.layers.0.eh_proj.weight": torch.cat([MTP_TOKEN_GAIN * torch.eye(hidden),
                                                       d.normal((hidden, hidden), MTP_HIDDEN_GAIN / hidden**0.5)], 1)}
    for j, kind in enumerate(kinds):
        p = f"mtp.layers.{j}."
        state[p + "norm.weight"] = d.norm_weight(hidden)
        state.update(LAYER_INITS[kind](d, config, p))
    state[f"mtp.layers.{len(kinds) - 1}.final_layernorm.weight"] = d.norm_weight(hidden, scale=FINAL_NORM_SCALE)
    return state


def tiny_hybrid_moe_state_dict(config: dict = TINY_HYBRID_MOE_CONFIG) -> dict:
    """tiny-hybrid-moe's weights: tiny-hybrid's draws for the pattern, then the successor prior (the embedding
    scaled by SUCCESSOR_SCALE, the LM head its rows permuted by sigma) and the MTP step."""
    state = tiny_hybrid_state_dict(config)
    embed = state["backbone.embeddings.weight"]
    inverse = successor_of(config["vocab_size"]).argsort()
    state["lm_head.weight"] = embed[inverse].contiguous()  # row i: the embedding of the token i follows
    state["backbone.embeddings.weight"] = embed * SUCCESSOR_SCALE
    state.update(mtp_state_dict(config))
    return state


def build_tiny_hybrid_moe(out_dir: str | os.PathLike, gguf_path: str | os.PathLike, latent: bool = True) -> None:
    """Write the complete tiny-hybrid-moe (``latent``) or tiny-hybrid-moe-plain HF directory into `out_dir`;
    the tokenizer comes from `gguf_path`."""
    if latent:
        write_tiny_model(out_dir, gguf_path, TINY_HYBRID_MOE_CONFIG, tiny_hybrid_moe_state_dict)
    else:
        write_tiny_model(out_dir, gguf_path, TINY_HYBRID_MOE_PLAIN_CONFIG, tiny_hybrid_state_dict)
