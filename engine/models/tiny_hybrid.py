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
remember several tokens back and dt rarely falls under time_step_min (transformers <= 5.24 clamped its
chunked path there and not its one-token path; keeping that clamp out of reach kept its cached generate()
equal to a full forward. The model's own clamp is time_step_limit's, none by default). Measured with transformers (fp32, eager) on 16 random 12-token prompts x 32 greedy steps
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
# MoE blocks (tiny_hybrid_moe.py): router logits spread enough that the chosen experts differ from token to
# token; the routed experts' sum (weights summing to routed_scaling_factor) and the shared expert each about
# as strong as a dense MLP block.
ROUTER_GAIN = 2.0
EXPERT_GAIN = 2.0
SHARED_GAIN = 2.0


class _Draws:
    """Seeded float32 draws from one CPU generator, in call order (so a fixed order gives fixed bytes)."""

    def __init__(self, seed: int):
        import torch

        self.torch = torch
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, shape: tuple[int, ...], std: float):
        return self.torch.randn(shape, generator=self.gen, dtype=self.torch.float32) * std

    def uniform(self, n: int, low: float, high: float):
        return low + (high - low) * self.torch.rand(n, generator=self.gen, dtype=self.torch.float32)

    def norm_weight(self, size: int, scale: float = 1.0):
        return scale * self.uniform(size, 1 - NORM_JITTER, 1 + NORM_JITTER)


def _mamba(d: _Draws, config: dict, p: str) -> dict:
    hidden, m_heads = config["hidden_size"], config["mamba_num_heads"]
    m_inter = m_heads * config["mamba_head_dim"]
    conv_dim = m_inter + 2 * config["n_groups"] * config["ssm_state_size"]
    kernel = config["conv_kernel"]
    torch = d.torch
    state = {p + "mixer.in_proj.weight": torch.cat([
        d.normal((m_inter + conv_dim, hidden), INPUT_GAIN / math.sqrt(hidden)),
        d.normal((m_heads, hidden), DT_GAIN / math.sqrt(hidden)),
    ])}
    state[p + "mixer.conv1d.weight"] = d.normal((conv_dim, 1, kernel), 1 / math.sqrt(kernel))
    state[p + "mixer.conv1d.bias"] = d.normal((conv_dim,), 0.1)
    dt = torch.exp(d.uniform(m_heads, math.log(DT_RANGE[0]), math.log(DT_RANGE[1])))
    state[p + "mixer.dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    state[p + "mixer.A_log"] = torch.log(torch.arange(1, m_heads + 1, dtype=torch.float32))
    state[p + "mixer.D"] = d.uniform(m_heads, 0.5, 1.5)
    state[p + "mixer.norm.weight"] = d.norm_weight(m_inter)
    state[p + "mixer.out_proj.weight"] = d.normal((hidden, m_inter), OUTPUT_GAIN / math.sqrt(m_inter))
    return state


def _attention(d: _Draws, config: dict, p: str) -> dict:
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    return {
        p + "mixer.q_proj.weight": d.normal((heads * head_dim, hidden), INPUT_GAIN / math.sqrt(hidden)),
        p + "mixer.k_proj.weight": d.normal((kv_heads * head_dim, hidden), INPUT_GAIN / math.sqrt(hidden)),
        p + "mixer.v_proj.weight": d.normal((kv_heads * head_dim, hidden), 1 / math.sqrt(hidden)),
        p + "mixer.o_proj.weight": d.normal((hidden, heads * head_dim), OUTPUT_GAIN / math.sqrt(heads * head_dim)),
    }


def _mlp(d: _Draws, config: dict, p: str, width: int | None = None, gain: float = OUTPUT_GAIN) -> dict:
    hidden, inter = config["hidden_size"], width or config["intermediate_size"]
    return {
        p + "up_proj.weight": d.normal((inter, hidden), 1 / math.sqrt(hidden)),
        # relu(h)^2 of h ~ N(0, 1) has second moment 3/2.
        p + "down_proj.weight": d.normal((hidden, inter), gain / math.sqrt(1.5 * inter)),
    }


def _moe(d: _Draws, config: dict, p: str) -> dict:
    """Router (with a correction bias), routed relu2 experts (in the latent space when moe_latent_size is set),
    shared expert: engine/models/nemotron_moe.py's names (tiny_hybrid_moe.py)."""
    hidden, experts, width = config["hidden_size"], config["n_routed_experts"], config["moe_intermediate_size"]
    latent = config.get("moe_latent_size")
    inner = latent or hidden
    state = {p + "mixer.gate.weight": d.normal((experts, hidden), ROUTER_GAIN / math.sqrt(hidden)),
             p + "mixer.gate.e_score_correction_bias": d.normal((experts,), 0.1)}
    if latent:
        state[p + "mixer.fc1_latent_proj.weight"] = d.normal((latent, hidden), 1 / math.sqrt(hidden))
        state[p + "mixer.fc2_latent_proj.weight"] = d.normal((hidden, latent), 1 / math.sqrt(latent))
    for e in range(experts):
        state.update(_mlp(d, {"hidden_size": inner}, f"{p}mixer.experts.{e}.", width, EXPERT_GAIN))
    state.update(_mlp(d, config, p + "mixer.shared_experts.", config["moe_shared_expert_intermediate_size"],
                      SHARED_GAIN))
    return state


# layers_block_type -> the initialiser of one block's mixer under prefix p (the block's norm is drawn before).
# The MTP layers (mtp.layers.{j}., mtp_layers_block_type) are blocks of these same kinds.
LAYER_INITS = {"linear_attention": _mamba, "full_attention": _attention,
               "mlp": lambda d, config, p: _mlp(d, config, p + "mixer."), "moe": _moe}


def tiny_hybrid_state_dict(config: dict = TINY_HYBRID_CONFIG, seed: int = SEED) -> dict:
    """float32 weights (transformers' names, ``backbone.`` prefix) from one seeded CPU generator, drawn
    in a fixed order (so always the same bytes)."""
    d = _Draws(seed)
    hidden = config["hidden_size"]
    embed = d.normal((config["vocab_size"], hidden), EMBED_STD)
    state = {"backbone.embeddings.weight": embed}
    for i, kind in enumerate(config["layers_block_type"]):
        p = f"backbone.layers.{i}."
        state[p + "norm.weight"] = d.norm_weight(hidden)
        if kind not in LAYER_INITS:
            raise ValueError(f"tiny-hybrid: layer type {kind!r} has no initialiser")
        state.update(LAYER_INITS[kind](d, config, p))
    state["backbone.norm_f.weight"] = d.norm_weight(hidden, scale=FINAL_NORM_SCALE)
    state["lm_head.weight"] = embed.clone()  # tied, stored (module docstring)
    return state


def build_tiny_hybrid(out_dir: str | os.PathLike, gguf_path: str | os.PathLike) -> None:
    """Write the complete tiny-hybrid HF directory into `out_dir`; the tokenizer comes from `gguf_path`."""
    write_tiny_model(out_dir, gguf_path, TINY_HYBRID_CONFIG, tiny_hybrid_state_dict)
