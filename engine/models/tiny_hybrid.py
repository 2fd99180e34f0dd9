"""`tiny-hybrid`: a small, deterministic, randomly initialised NemotronHForCausalLM (Mamba2 + attention +
MLP blocks) for fast tests of the hybrid path, the sibling of `tiny-random` (engine/models/tiny_random.py).

Pattern "M-M*M-M*": 4 Mamba2 blocks (8 heads x 16, state 16, 2 groups, conv kernel 4), 2 attention
blocks (4 heads / 2 KV heads x 32, no RoPE), 2 relu2 MLP blocks (256 wide); hidden 128. The chunk size
is 16, small, so the chunked scan crosses chunk boundaries inside ordinary test prompts. SmolLM2's
tokenizer (vocab 49152), extracted from the GGUF's metadata as for tiny-random.

The init follows tiny-random's reasoning (read its docstring): embeddings std 0.5 tied to the head, and
blocks scaled up (input gain on in_proj/q/k/up, output gain on out_proj/o_proj/down) so the mixers, not
the token's own embedding, decide the next token and greedy has clear top1-top2 gaps. The Mamba
layers' dt_bias puts softplus(dt) around 0.01..0.1 (decay per token exp(-dt * A), A = 1..8), so they
remember several tokens back and dt rarely reaches the time_step_min clamp (transformers' one-token
path does not clamp; keeping the clamp out of reach keeps its cached generate() equal to a full
forward). Measured with transformers (fp32, eager) on 16 random 12-token prompts x 32 greedy steps
(seed 0; our engine's model gives the same numbers):
    top1 - top2 logit gap: median 1.92, 5th percentile 0.16, 1.0% of steps under 0.05;
    31.0 distinct tokens per 32 generated, longest run of one repeated token 2; logit std ~11;
    transformers' cached generate() == its full-forward greedy on all of the first 4 prompts.
(Final norm scale 1.5, as tiny-random, gave median 1.44 / 5th pct 0.12 / 1.6% under 0.05.)
Norm weights are random around 1 (not all ones) so a loader that forgets one is caught.

transformers' NemotronH never ties the LM head to the embedding (it loads ``lm_head.weight`` whatever
tie_word_embeddings says), so the directory stores lm_head.weight as a copy of the embedding; our
loader shares one tensor when the two are equal.
"""

from __future__ import annotations

import math
import os

from .tiny_random import write_tiny_model

SEED = 0
PATTERN = "M-M*M-M*"
_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}

TINY_HYBRID_CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 49152,
    "hidden_size": 128,
    "layers_block_type": [_LAYER_TYPES[c] for c in PATTERN],
    "num_hidden_layers": len(PATTERN),
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attention_bias": False,
    "intermediate_size": 256,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 16,
    "mamba_hidden_act": "silu",
    "use_conv_bias": True,
    "use_bias": False,
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 0.0001,
    "layer_norm_epsilon": 1e-5,
    "residual_in_fp32": False,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "num_nextn_predict_layers": 0,
    "use_cache": True,
    "torch_dtype": "float32",
}

# Init scales (see the module docstring for what they buy).
EMBED_STD = 0.5
INPUT_GAIN = 2.0  # in_proj (z, xBC), q, k, up: sharper gating/attention than a variance-preserving init
OUTPUT_GAIN = 4.0  # out_proj, o_proj, down_proj: blocks outweigh the token's own embedding
DT_GAIN = 0.5  # std of the in_proj rows that make dt (before dt_bias)
DT_RANGE = (0.01, 0.1)  # softplus(dt_bias) drawn log-uniform in this range
FINAL_NORM_SCALE = 2.0  # sets the logit scale (std ~11)
NORM_JITTER = 0.2  # norm weights uniform in [1 - j, 1 + j]


def tiny_hybrid_state_dict(config: dict = TINY_HYBRID_CONFIG, seed: int = SEED) -> dict:
    """float32 weights (transformers' names, ``backbone.`` prefix) from one seeded CPU generator, drawn
    in a fixed order (so always the same bytes)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    m_heads, m_head_dim = config["mamba_num_heads"], config["mamba_head_dim"]
    m_inter = m_heads * m_head_dim
    conv_dim = m_inter + 2 * config["n_groups"] * config["ssm_state_size"]
    kernel = config["conv_kernel"]

    def normal(shape: tuple[int, ...], std: float):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def uniform(n: int, low: float, high: float):
        return low + (high - low) * torch.rand(n, generator=gen, dtype=torch.float32)

    def norm_weight(size: int = hidden, scale: float = 1.0):
        return scale * uniform(size, 1 - NORM_JITTER, 1 + NORM_JITTER)

    embed = normal((config["vocab_size"], hidden), EMBED_STD)
    state = {"backbone.embeddings.weight": embed}
    for i, kind in enumerate(config["layers_block_type"]):
        p = f"backbone.layers.{i}."
        state[p + "norm.weight"] = norm_weight()
        if kind == "linear_attention":
            state[p + "mixer.in_proj.weight"] = torch.cat([
                normal((m_inter + conv_dim, hidden), INPUT_GAIN / math.sqrt(hidden)),
                normal((m_heads, hidden), DT_GAIN / math.sqrt(hidden)),
            ])
            state[p + "mixer.conv1d.weight"] = normal((conv_dim, 1, kernel), 1 / math.sqrt(kernel))
            state[p + "mixer.conv1d.bias"] = normal((conv_dim,), 0.1)
            dt = torch.exp(uniform(m_heads, math.log(DT_RANGE[0]), math.log(DT_RANGE[1])))
            state[p + "mixer.dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            state[p + "mixer.A_log"] = torch.log(torch.arange(1, m_heads + 1, dtype=torch.float32))
            state[p + "mixer.D"] = uniform(m_heads, 0.5, 1.5)
            state[p + "mixer.norm.weight"] = norm_weight(m_inter)
            state[p + "mixer.out_proj.weight"] = normal((hidden, m_inter), OUTPUT_GAIN / math.sqrt(m_inter))
        elif kind == "full_attention":
            state[p + "mixer.q_proj.weight"] = normal((heads * head_dim, hidden), INPUT_GAIN / math.sqrt(hidden))
            state[p + "mixer.k_proj.weight"] = normal((kv_heads * head_dim, hidden), INPUT_GAIN / math.sqrt(hidden))
            state[p + "mixer.v_proj.weight"] = normal((kv_heads * head_dim, hidden), 1 / math.sqrt(hidden))
            state[p + "mixer.o_proj.weight"] = normal((hidden, heads * head_dim),
                                                      OUTPUT_GAIN / math.sqrt(heads * head_dim))
        elif kind == "mlp":
            state[p + "mixer.up_proj.weight"] = normal((inter, hidden), 1 / math.sqrt(hidden))
            # relu(h)^2 of h ~ N(0, 1) has second moment 3/2.
            state[p + "mixer.down_proj.weight"] = normal((hidden, inter), OUTPUT_GAIN / math.sqrt(1.5 * inter))
        else:
            raise ValueError(f"tiny-hybrid: layer type {kind!r} has no initialiser")
    state["backbone.norm_f.weight"] = norm_weight(scale=FINAL_NORM_SCALE)
    state["lm_head.weight"] = embed.clone()  # tied, stored (module docstring)
    return state


def build_tiny_hybrid(out_dir: str | os.PathLike, gguf_path: str | os.PathLike) -> None:
    """Write the complete tiny-hybrid HF directory into `out_dir`; the tokenizer comes from `gguf_path`."""
    write_tiny_model(out_dir, gguf_path, TINY_HYBRID_CONFIG, tiny_hybrid_state_dict)
