"""Which models split over ranks, and how (Megatron's layout, vLLM's): each rank holds num_heads / n query heads and
num_kv_heads / n KV heads of every attention layer (its q/k/v rows, its o_proj columns) and intermediate_size / n of
every MLP (its gate/up rows, its down_proj columns); norms, the embedding and the LM head are whole on every rank.
o_proj and down_proj then give each rank a partial sum, which one all-reduce makes whole (layers.py RowParallelLinear).

The cut is made on the checkpoint's own tensors (Hugging Face names), before the loader fuses and packs them, so the
layer code runs unchanged over a rank's slice (its arch says how many heads it has: ``shard_arch``). Hybrids (NemotronH,
Granite 4.0-H) are cut by shard_hybrid.py: each function here hands their arch over to it."""

from __future__ import annotations

from dataclasses import replace

import torch

from pdcluster.engine.tensor_parallel.layers import RowParallelLinear, Shard, SplitWidthNorm, SummedMoe


def check_shardable(model_class: type, arch, world_size: int) -> None:
    """ValueError naming why a model does not split ``world_size`` ways (nothing for 1)."""
    if world_size == 1:
        return
    name = model_class.__name__
    # Read from the class itself, not inherited: a subclass may compute across heads (the split would be wrong).
    split = vars(model_class).get("TENSOR_PARALLEL_SPLIT")
    if split == "hybrid":
        from pdcluster.engine.tensor_parallel.shard_hybrid import check_hybrid_shardable

        return check_hybrid_shardable(arch, world_size)
    if split != "layers":
        raise ValueError(f"tensor_parallel_size {world_size}: tensor parallelism splits the Llama family's models "
                         f"(Llama, Mistral, Qwen2/3, Phi-3, Granite, Mixtral, Qwen-MoE, Gemma 2/3, ...), DeepSeek and "
                         f"NemotronH hybrids; {name} runs "
                         "with --tensor-parallel-size 1")
    moe = arch.moe
    if moe is not None and moe.layout not in SPLIT_MOE_LAYOUTS:
        raise ValueError(f"tensor_parallel_size {world_size}: this model's MoE layers ({moe.layout}) do not split "
                         f"yet ({', '.join(SPLIT_MOE_LAYOUTS)} do); run it with --tensor-parallel-size 1")
    counts = [("attention heads", arch.num_heads), ("MLP intermediate_size", arch.intermediate_size)]
    if not _is_mla(arch):  # MLA's one latent "KV head" is every rank's whole (its heads all read it)
        counts.append(("KV heads", arch.num_kv_heads))
    if moe is not None:
        counts += [("experts' moe_intermediate_size", moe.intermediate_size),
                   ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size)]
    for what, count in counts:
        if count % world_size:
            raise ValueError(f"tensor_parallel_size {world_size}: the model's {count} {what} do not split "
                             f"{world_size} ways; choose a size that divides {count}")


# MoE layouts whose experts split (each expert's intermediate rows, as vLLM's tensor-parallel MoE): the router stays
# whole, so every rank routes a token to the same experts and the layer's output is a sum like a dense MLP's (an
# expert's down bias, gpt-oss's, added by rank 0 alone). Every layout engine/models/moe.py reads.
SPLIT_MOE_LAYOUTS = ("qwen3", "qwen2_moe", "mixtral", "granitemoe", "gpt_oss", "llama4", "glm4_moe", "qwen3_vl_moe")


def shard_arch(arch, world_size: int):
    """The arch one rank runs: its heads and MLP widths (what its layers, kernels and KV cache are sized by)."""
    if world_size == 1:
        return arch
    if _is_hybrid(arch):
        from pdcluster.engine.tensor_parallel.shard_hybrid import shard_hybrid_arch

        return shard_hybrid_arch(arch, world_size)
    moe = arch.moe
    if moe is not None:
        moe = replace(moe, intermediate_size=moe.intermediate_size // world_size,
                      shared_expert_intermediate_size=moe.shared_expert_intermediate_size // world_size)
    kv_heads = arch.num_kv_heads if _is_mla(arch) else arch.num_kv_heads // world_size
    return replace(arch, num_heads=arch.num_heads // world_size, num_kv_heads=kv_heads,
                   intermediate_size=arch.intermediate_size // world_size, moe=moe)


def shard_weights(weights: dict[str, torch.Tensor], arch, shard: Shard) -> None:
    """Cuts each layer tensor of ``weights`` (the full checkpoint's, Hugging Face names) to ``shard``'s slice, in
    place; the others stay whole. ``arch``: the full model's."""
    for name in list(weights):
        weights[name] = shard_tensor(name, weights[name], arch, shard)


def shard_tensor(name: str, t: torch.Tensor, arch, shard: Shard) -> torch.Tensor:
    """``shard``'s slice of one checkpoint tensor (text model names), a compact copy so the whole tensor can be freed
    as soon as it is cut (the loader cuts each tensor as it reads it: no rank holds the whole checkpoint); a tensor no
    rank splits, as it is."""
    if _is_hybrid(arch):
        from pdcluster.engine.tensor_parallel.shard_hybrid import shard_hybrid_tensor

        return shard_hybrid_tensor(name, t, arch, shard)
    return shard_layer_tensor(name, t, arch, shard)


def shard_layer_tensor(name: str, t: torch.Tensor, arch, shard: Shard) -> torch.Tensor:
    """shard_tensor by the Llama family's rules, whatever the arch: also a draft head's decoder layer (a Llama layer of
    the target's heads and MLP width, engine/models/mtp.py) on a hybrid target."""
    if not name.startswith("model.layers."):
        return t
    num_heads, num_kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    q_rows, kv_rows = shard.rows(num_heads, head_dim), shard.rows(num_kv_heads, head_dim)
    leaf = name.split(".", 3)[3]  # model.layers.<i>.<leaf>
    if leaf.startswith("feed_forward."):  # Llama 4's name for the MLP block (LlamaModel renames it after the cut)
        leaf = "mlp." + leaf[len("feed_forward."):]
    moe = getattr(arch, "moe", None)  # a hybrid's (a draft head's layer on it) is named routed_experts
    in_out = moe is not None and moe.layout in ("gpt_oss", "llama4")  # transformers' [E, in, out] experts
    if moe is not None and moe.layout == "qwen3_vl_moe" and leaf == "mlp.experts.gate_up_proj":
        in_out = t.shape[1] == arch.hidden_size  # the Hub's [E, H, 2I] (take_expert_weights reads either way)
    elif moe is not None and moe.layout == "qwen3_vl_moe" and leaf == "mlp.experts.down_proj":
        in_out = t.shape[2] == arch.hidden_size  # the Hub's [E, I, H]
    if _is_mla(arch) and leaf.startswith("self_attn."):
        cut = _mla_part(leaf, t, arch, shard)
        if cut is t:
            return t
        t = cut
    elif leaf in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
        t = t[q_rows]
    elif leaf in ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                  "self_attn.v_proj.bias"):
        t = t[kv_rows]
    elif leaf == "self_attn.qkv_proj.weight":  # Phi-3's fused checkpoint
        q, k, v = t.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
        t = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
    elif leaf == "self_attn.o_proj.weight":
        t = t[:, q_rows]
    elif leaf in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        t = t[shard.part(arch.intermediate_size)]
    elif leaf == "mlp.gate_up_proj.weight":  # Phi-3's, GLM-4's fused checkpoints
        t = shard.halves(t)
    elif leaf == "mlp.down_proj.weight":
        t = t[:, shard.part(arch.intermediate_size)]
    elif leaf == "self_attn.sinks":
        t = t[shard.part(num_heads)]
    elif leaf in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and _norm_spans_heads(arch):
        # OLMo 2's norm over all of q's (k's) heads: this rank's heads' channels (SplitWidthNorm sums the squares)
        t = t[shard.rows(num_heads if leaf.startswith("self_attn.q") else num_kv_heads, head_dim)]
    elif leaf in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        cut = _head_norm_part(t, shard, num_heads if leaf.startswith("self_attn.q") else num_kv_heads, head_dim)
        if cut is t:
            return t
        t = cut
    elif in_out and leaf == "mlp.experts.gate_up_proj":  # [E, H, 2I]
        if moe.layout == "gpt_oss":  # gate and up columns interleaved: this rank's (gate, up) pairs lie side by side
            t = t[:, :, shard.rows(t.shape[2] // 2, 2)]
        else:  # Llama 4: the gate columns, then the up columns
            t = shard.halves(t, dim=2)
    elif in_out and leaf == "mlp.experts.gate_up_proj_bias":  # gpt-oss's [E, 2I], interleaved as its weight
        t = t[:, shard.rows(t.shape[1] // 2, 2)]
    elif in_out and leaf == "mlp.experts.down_proj":  # [E, I, H]
        t = t[:, shard.part(t.shape[1])]
    elif leaf == "mlp.experts.down_proj_bias":  # gpt-oss's [E, H], inside the MoE's one sum
        t = shard.summed_bias(t)
    elif _is_expert(leaf) and leaf.endswith(EXPERT_IN):  # an expert's (or the shared one's) [I, H]
        t = t[shard.part(t.shape[0])]
    elif _is_expert(leaf) and leaf.endswith(EXPERT_OUT):  # [H, I]
        t = t[:, shard.part(t.shape[1])]
    elif leaf in ("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"):
        # Stacked [E, 2I, H] (GraniteMoe's, a fused Qwen MoE checkpoint's): gate rows, then up rows
        t = shard.halves(t, dim=1)
    elif leaf in ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"):  # [E, H, I]
        t = t[:, :, shard.part(t.shape[2])]
    else:
        return t
    return t.clone(memory_format=torch.contiguous_format)


EXPERT_IN = (".gate_proj.weight", ".up_proj.weight", ".w1.weight", ".w3.weight")
EXPERT_OUT = (".down_proj.weight", ".w2.weight")


def _is_expert(leaf: str) -> bool:
    """A routed expert's or the shared expert's projection (Qwen's mlp.experts.<e>.*, mlp.shared_expert.*; Mixtral's
    block_sparse_moe.experts.<e>.w1/w2/w3; GLM-4.5's mlp.shared_experts.*; Llama 4's feed_forward.shared_expert.*); the
    shared expert's gate [1, H] stays whole."""
    return ".experts." in leaf or ".shared_expert." in leaf or ".shared_experts." in leaf


def _head_norm_part(weight: torch.Tensor, shard: Shard, num_heads: int, head_dim: int) -> torch.Tensor:
    """A q/k norm's weight for this rank's heads: one [head_dim] shared by every head (Qwen3) stays whole, a per-head
    [heads, head_dim] (Cohere) is cut. A norm over all heads at once is cut by shard_tensor where the arch says so
    (``qk_norm_spans_heads``: OLMo 2/3, OLMoE; SplitWidthNorm computes it); any other width is refused."""
    if weight.dim() == 2:
        return weight[shard.part(num_heads)]
    if weight.shape[0] == head_dim:
        return weight
    raise ValueError(f"tensor parallelism: this model's q/k norm weight has {weight.shape[0]} channels, a norm over "
                     "all heads at once as OLMo 2's, in a family not known to split one (OLMo 2/3 and OLMoE do); run "
                     "it with --tensor-parallel-size 1")


def _is_mla(arch) -> bool:
    """A DeepSeek arch (Multi-head Latent Attention, engine/models/deepseek.py)."""
    return getattr(arch, "mla", None) is not None


def _mla_part(leaf: str, t: torch.Tensor, arch, shard: Shard) -> torch.Tensor:
    """This rank's heads of an MLA layer (vLLM's split): q_b_proj's (V2-Lite: q_proj's) and kv_b_proj's rows, o_proj's
    columns. The latent path (q_a, kv_a_proj_with_mqa, their norms) is whole on every rank: each rank caches the whole
    latent, which all its heads read."""
    m, num_heads = arch.mla, arch.num_heads
    if leaf in ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight"):
        return t[shard.rows(num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)]
    if leaf == "self_attn.kv_b_proj.weight":
        return t[shard.rows(num_heads, m.qk_nope_head_dim + m.v_head_dim)]
    if leaf == "self_attn.o_proj.weight":
        return t[:, shard.rows(num_heads, m.v_head_dim)]
    return t


def _norm_spans_heads(arch) -> bool:
    """OLMo 2's q/k norm over all heads at once (ModelArch.qk_norm_spans_heads; a hybrid's draft head has none)."""
    return getattr(arch, "qk_norm_spans_heads", False)


def _is_hybrid(arch) -> bool:
    """A NemotronH arch (engine/tensor_parallel/shard_hybrid.py splits it), not a Llama-family ModelArch."""
    return hasattr(arch, "mamba_num_heads")


def split_rows(model, group) -> None:
    """Makes each layer's o_proj and down_proj (a sparse layer's MoE) of a sharded model row-parallel over ``group``."""
    if _is_hybrid(model.arch):
        from pdcluster.engine.tensor_parallel.shard_hybrid import split_hybrid_rows

        return split_hybrid_rows(model, group)
    for layer in model.layers:
        split_layer(layer, group)


def split_layer(layer, group) -> None:
    """split_rows for one layer (a model's, or a DeepSeek MTP layer's: engine/tensor_parallel/draft.py)."""
    if hasattr(layer, "attention"):  # DeepseekLayer: MLA, then a dense SwiGLU or the MoE, each one sum
        layer.attention.o_proj = RowParallelLinear(layer.attention.o_proj, group)
        layer.mlp = SummedMoe(layer.mlp, group)
        return
    if _norm_spans_heads(layer.arch):
        layer.split_norm = SplitWidthNorm(group)
    layer.o_proj = RowParallelLinear(layer.o_proj, group)
    if layer.moe is not None:
        layer.moe = SummedMoe(layer.moe, group)
    else:
        layer.down_proj = RowParallelLinear(layer.down_proj, group)
