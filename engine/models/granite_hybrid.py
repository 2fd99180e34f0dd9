"""Granite 4.0 hybrids (transformers ``GraniteMoeHybridForCausalLM``: granite-4.0-h-micro / tiny / small, and the
attention-only granite-4.0-micro) served on NemotronH's blocks (engine/models/nemotron_h.py).

Each Granite layer is ``x = x + m * mixer(RMSNorm(x))`` with a Mamba2 mixer (transformers' GraniteMoeHybridMambaLayer
computes what NemotronH's does: one mixer serves both) or attention (RoPE only when ``position_embedding_type`` is
"rope"; the H models use none), then ``x = x + m * (moe(y) + shared_mlp(y))`` with ``y = RMSNorm(x)``: Granite's
sparse MoE (a softmax over the top-k router logits, engine/models/moe.py; absent when ``num_local_experts`` is 0)
beside a shared SwiGLU MLP. So layer i becomes two blocks, 2i (the mixer) and 2i + 1 ("G"), and the checkpoint's
names are renamed to NemotronH's at load. Around the layers: the embedding times ``embedding_multiplier``, attention
scores times ``attention_multiplier`` (not head_dim ** -0.5), ``m`` = ``residual_multiplier``, and the logits
divided by ``logits_scaling``. Defaults are GraniteMoeHybridConfig's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pdcluster.engine.models.moe import MoeArch
from pdcluster.engine.models.rope import RopeScaling, rope_from_config

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
# A Granite layer's parts -> (which of its two blocks, the name under that block)
_PARTS = (("input_layernorm.", 0, "norm."), ("mamba.", 0, "mixer."), ("self_attn.", 0, "mixer."),
          ("post_attention_layernorm.", 1, "norm."), ("block_sparse_moe.", 1, "mixer."),
          ("shared_mlp.", 1, "mixer.shared_mlp."))


@dataclass(frozen=True)
class GraniteHybrid:
    """What a Granite hybrid adds to HybridArch."""

    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    moe: MoeArch | None = None  # the routed experts (None: num_local_experts 0, the shared MLP alone)
    shared_intermediate_size: int = 1024
    rope: bool = False  # position_embedding_type "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None


def granite_fields(cfg: dict, where: str) -> dict:
    """HybridArch's fields for a GraniteMoeHybridConfig dict (NemotronH's names, two blocks a Granite layer);
    ValueError, one line naming the key, for what is not served."""
    def get(key: str, default):
        return default if cfg.get(key) is None else cfg[key]

    for key, expected in (("hidden_act", "silu"), ("attention_bias", False)):
        if get(key, expected) != expected:
            raise ValueError(f"{where}: {key} {cfg[key]!r} is not supported (only {expected!r})")
    num_layers = get("num_hidden_layers", 32)
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    kinds = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}
    unknown = sorted({t for t in types if t not in kinds})
    if unknown or len(types) != num_layers:
        raise ValueError(f"{where}: layer_types must name num_hidden_layers ({num_layers}) layers of 'mamba' or "
                         f"'attention' (got {len(types)}{', unknown ' + str(unknown) if unknown else ''})")
    position = get("position_embedding_type", None)
    if position not in (None, "nope", "rope"):
        raise ValueError(f"{where}: position_embedding_type {position!r} is not supported (None, 'nope' or 'rope')")
    dt_min = dt_lower_limit(get("time_step_limit", None), where)
    hidden, mamba_heads = get("hidden_size", 4096), get("mamba_n_heads", 128)
    mamba_intermediate = get("mamba_expand", 2) * hidden
    head_dim = get("mamba_d_head", "auto")
    head_dim = mamba_intermediate // mamba_heads if head_dim == "auto" else head_dim
    if head_dim * mamba_heads != mamba_intermediate:
        raise ValueError(f"{where}: mamba_n_heads {mamba_heads} x mamba_d_head {head_dim} != mamba_expand x "
                         f"hidden_size ({mamba_intermediate})")
    n_groups = get("mamba_n_groups", 1)
    if mamba_heads % n_groups:
        raise ValueError(f"{where}: mamba_n_heads {mamba_heads} is not a multiple of mamba_n_groups {n_groups}")
    num_experts = get("num_local_experts", 8)
    moe = MoeArch.granitemoe(cfg, 2 * num_layers, where) if num_experts > 0 else None
    theta, scaling = rope_from_config(cfg, where) if position == "rope" else (10000.0, None)
    num_heads = get("num_attention_heads", 32)
    granite = GraniteHybrid(
        embedding_multiplier=float(get("embedding_multiplier", 1.0)),
        attention_multiplier=float(get("attention_multiplier", 1.0)),
        residual_multiplier=float(get("residual_multiplier", 1.0)),
        logits_scaling=float(get("logits_scaling", 1.0)),
        moe=moe, shared_intermediate_size=get("shared_intermediate_size", 1024), rope=position == "rope",
        rope_theta=theta, rope_scaling=scaling)
    eos = get("eos_token_id", 2)
    layer_types = tuple(c for t in types for c in (kinds[t], "G"))
    return dict(
        vocab_size=get("vocab_size", 32000), hidden_size=hidden, intermediate_size=granite.shared_intermediate_size,
        num_layers=layer_types.count("*"), num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads", num_heads), head_dim=get("head_dim", hidden // num_heads),
        rms_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=theta,
        max_position_embeddings=get("max_position_embeddings", 2048),
        tie_word_embeddings=get("tie_word_embeddings", False), bos_token_id=get("bos_token_id", 1),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        layer_types=layer_types, num_hidden_layers=len(layer_types), mamba_num_heads=mamba_heads,
        mamba_head_dim=head_dim, ssm_state_size=get("mamba_d_state", 256), n_groups=n_groups,
        conv_kernel=get("mamba_d_conv", 4), chunk_size=get("mamba_chunk_size", 256), dt_min=dt_min,
        use_conv_bias=bool(get("mamba_conv_bias", True)), use_bias=bool(get("mamba_proj_bias", False)),
        mlp_bias=False, granite=granite)


def dt_lower_limit(limit, where: str) -> float:
    """The lower bound of dt's clamp from a config's time_step_limit (default (0, inf): no clamp, as mamba_ssm's Mamba2,
    vLLM's MambaMixer2 and transformers >= 5.25); ValueError for an upper bound other than inf, which no kernel of
    ours applies."""
    bounds = tuple(_number(x) for x in (limit if limit is not None else (0.0, float("inf"))))
    if len(bounds) != 2 or bounds[1] != float("inf"):
        raise ValueError(f"{where}: time_step_limit {list(bounds)} is not supported (an upper limit other than inf)")
    return bounds[0]


def _number(value) -> float:
    """A config number; transformers 5 writes infinity as {"__float__": "Infinity"} (JSON has no literal for it)."""
    return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else float(value)


def nemotron_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Granite hybrid checkpoint's tensors under NemotronH's names (module docstring)."""
    out = {}
    for name, tensor in weights.items():
        if name == "model.embed_tokens.weight":
            name = "model.embeddings.weight"
        elif name == "model.norm.weight":
            name = "model.norm_f.weight"
        elif (m := _LAYER.fullmatch(name)) is not None:
            layer, rest = int(m.group(1)), m.group(2)
            part = next(((block, under, rest[len(head):]) for head, block, under in _PARTS if rest.startswith(head)),
                        None)
            if part is not None:
                block, under, tail = part
                name = f"model.layers.{2 * layer + block}.{under}{tail}"
        out[name] = tensor
    return out
