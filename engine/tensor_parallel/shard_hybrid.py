"""How a NemotronH hybrid (and a Granite 4.0 hybrid, on the same blocks) splits over ranks, vLLM's layout for
NemotronH and Mamba2: each rank holds ``mamba_num_heads / n`` of every Mamba layer's heads with their ``n_groups / n``
groups of B and C, ``num_heads / n`` query and ``num_kv_heads / n`` KV heads of every attention layer, and
``intermediate_size / n`` of every MLP and of every expert (the shared one too; a Granite layer's SwiGLU experts and
shared MLP by their gate and up rows alike). The routers, the latent projections, the norms, the embedding and the LM
head are whole on every rank, so every rank routes a token to the same experts.

A Mamba layer's in_proj rows are z | x | B | C | dt (transformers' NemotronHMamba2Mixer): a rank takes its heads' z,
x and dt rows and its groups' B and C rows, the same channels of the causal conv, its heads' A, D and dt_bias, and its
heads' channels of the gated norm's weight. The gated norm normalises each group of ``intermediate / n_groups``
channels alone, and a rank's heads are whole groups (``n_groups`` divisible by n), so a rank computes its channels'
norm without the others. Each rank's Mamba state then holds its heads' conv and SSM state only.

out_proj, o_proj and down_proj give each rank a partial sum, which one all-reduce makes whole; a MoE layer's output
(routed experts through fc2_latent_proj, plus the shared expert) is one sum. A bias after such a sum is added once:
the MLP's and Mamba's after the all-reduce (their layers add it after the projection), fc2_latent_proj's and the
shared expert's down bias by rank 0 alone (the others' are zeros), as vLLM's RowParallelLinear adds its bias on rank 0.

Cuts are made on the checkpoint's tensors (``backbone.`` or ``model.`` names) as the loader reads them."""

from __future__ import annotations

from dataclasses import replace

import torch

from pdcluster.engine.models.granite_hybrid import nemotron_names
from pdcluster.engine.tensor_parallel.layers import RowParallelLinear, Shard, SummedMoe


def check_hybrid_shardable(arch, world_size: int) -> None:
    """ValueError naming why a NemotronH (or Granite 4.0 hybrid) model does not split ``world_size`` ways."""
    counts = [("Mamba heads (mamba_num_heads)", arch.mamba_num_heads),
              ("Mamba groups (n_groups; each rank's heads must be whole groups: its gated norm's)", arch.n_groups)]
    if arch.num_layers or "*" in arch.mtp_layer_types:
        counts += [("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads)]
    if "-" in arch.layer_types + arch.mtp_layer_types:
        counts.append(("MLP intermediate_size", arch.intermediate_size))
    granite = arch.granite
    if granite is not None:
        counts.append(("shared_intermediate_size", granite.shared_intermediate_size))
        if granite.moe is not None:
            counts.append(("experts' intermediate_size", granite.moe.intermediate_size))
    if arch.routed_experts is not None:
        counts += [("experts' moe_intermediate_size", arch.routed_experts.intermediate_size),
                   ("moe_shared_expert_intermediate_size", arch.routed_experts.shared_intermediate_size)]
    for what, count in counts:
        if count % world_size:
            raise ValueError(f"tensor_parallel_size {world_size}: the model's {count} {what} do not split "
                             f"{world_size} ways; choose a size that divides {count}")


def shard_hybrid_arch(arch, world_size: int):
    """The arch one rank runs: its Mamba heads and groups (its state's shape follows), attention heads and widths."""
    if world_size == 1:
        return arch
    moe, granite = arch.routed_experts, arch.granite
    if moe is not None:
        moe = replace(moe, intermediate_size=moe.intermediate_size // world_size,
                      shared_intermediate_size=moe.shared_intermediate_size // world_size)
    if granite is not None:
        granite_moe = granite.moe and replace(granite.moe, intermediate_size=granite.moe.intermediate_size // world_size)
        granite = replace(granite, moe=granite_moe,
                          shared_intermediate_size=granite.shared_intermediate_size // world_size)
    return replace(arch, num_heads=arch.num_heads // world_size, num_kv_heads=arch.num_kv_heads // world_size,
                   intermediate_size=arch.intermediate_size // world_size,
                   mamba_num_heads=arch.mamba_num_heads // world_size, n_groups=arch.n_groups // world_size,
                   routed_experts=moe, granite=granite)


_PREFIXES = ("backbone.layers.", "model.layers.", "mtp.layers.")  # the model's blocks; its own MTP step's


def shard_hybrid_tensor(name: str, t: torch.Tensor, arch, shard: Shard) -> torch.Tensor:
    """``shard``'s slice of one NemotronH checkpoint tensor (a compact copy), or the tensor as it is where every rank
    holds it whole. ``arch``: the whole model's. A Granite hybrid's tensor is cut by its NemotronH name (two blocks a
    Granite layer: granite_hybrid.py)."""
    if arch.granite is not None:
        (name,) = nemotron_names({name: t})
    prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
    if prefix is None:
        return t  # the embedding, the final norm, the LM head; mtp.* (not loaded with the model)
    layer, _, leaf = name[len(prefix):].partition(".")
    if not leaf.startswith("mixer."):
        return t  # the block's own norm (the mixer's gated norm is mixer.norm.weight); an MTP step's eh_proj, norms
    kind = (arch.mtp_layer_types if prefix == "mtp.layers." else arch.layer_types)[int(layer)]
    leaf = leaf.removeprefix("mixer.")
    if kind == "M":
        cut = _mamba(leaf, t, arch, shard)
    elif kind == "*":
        cut = _attention(leaf, t, arch, shard)
    elif kind == "-":
        cut = _mlp(leaf, t, shard)
    elif kind == "E":
        cut = _moe(leaf, t, shard)
    elif kind == "G":
        cut = _granite_mlp(leaf, t, shard)
    else:
        cut = None
    return t if cut is None else cut.clone(memory_format=torch.contiguous_format)


def _mamba(leaf: str, t: torch.Tensor, arch, shard: Shard) -> torch.Tensor | None:
    heads = shard.part(arch.mamba_num_heads)
    channels = shard.rows(arch.mamba_num_heads, arch.mamba_head_dim)  # z, x, the norm weight: its heads' channels
    group_rows = shard.rows(arch.n_groups, arch.ssm_state_size)
    inner, gn = arch.mamba_intermediate_size, arch.n_groups * arch.ssm_state_size
    if leaf in ("in_proj.weight", "in_proj.bias"):
        z, x, B, C, dt = t.split([inner, inner, gn, gn, arch.mamba_num_heads])
        return torch.cat([z[channels], x[channels], B[group_rows], C[group_rows], dt[heads]])
    if leaf in ("conv1d.weight", "conv1d.bias"):
        x, B, C = t.split([inner, gn, gn])
        return torch.cat([x[channels], B[group_rows], C[group_rows]])
    if leaf in ("dt_bias", "A_log", "D"):
        return t[heads]
    if leaf == "norm.weight":
        return t[channels]
    if leaf == "out_proj.weight":
        return t[:, channels]
    return None  # out_proj.bias: added after the sum


def _attention(leaf: str, t: torch.Tensor, arch, shard: Shard) -> torch.Tensor | None:
    q_rows, kv_rows = shard.rows(arch.num_heads, arch.head_dim), shard.rows(arch.num_kv_heads, arch.head_dim)
    if leaf == "q_proj.weight":
        return t[q_rows]
    if leaf in ("k_proj.weight", "v_proj.weight"):
        return t[kv_rows]
    if leaf == "o_proj.weight":
        return t[:, q_rows]
    return None


def _mlp(leaf: str, t: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """A relu2 MLP's (or an expert's) ``up_proj`` rows and ``down_proj`` columns; its down bias as it is (its layer
    adds it after the sum)."""
    if leaf in ("up_proj.weight", "up_proj.bias"):
        return t[shard.part(t.shape[0])]
    if leaf == "down_proj.weight":
        return t[:, shard.part(t.shape[1])]
    return None


def _moe(leaf: str, t: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    if leaf.startswith("experts.") and leaf.count(".") == 3:  # experts.<e>.up_proj.weight: [I, L], [L, I]
        return _mlp(leaf.split(".", 2)[2], t, shard)
    if leaf == "experts.up_proj":  # stacked [E, I, L]
        return t[:, shard.part(t.shape[1])]
    if leaf == "experts.down_proj":  # stacked [E, L, I]
        return t[:, :, shard.part(t.shape[2])]
    if leaf.startswith("shared_experts."):
        leaf = leaf.removeprefix("shared_experts.")
        if leaf == "down_proj.bias":  # inside the MoE's one sum
            return shard.summed_bias(t)
        return _mlp(leaf, t, shard)
    if leaf == "fc2_latent_proj.bias":  # inside the MoE's one sum
        return shard.summed_bias(t)
    return None  # the router, its correction bias, fc1_latent_proj, fc2_latent_proj.weight: whole


def _granite_mlp(leaf: str, t: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """A Granite layer's MLP half: stacked SwiGLU experts (input_linear [E, 2I, H]: gate rows, then up rows;
    output_linear [E, H, I]) and the shared SwiGLU MLP ([2I, H], [H, I]); the router whole."""
    if leaf == "input_linear.weight":
        return shard.halves(t, dim=1)
    if leaf == "output_linear.weight":
        return t[:, :, shard.part(t.shape[2])]
    if leaf == "shared_mlp.input_linear.weight":
        return shard.halves(t)
    if leaf == "shared_mlp.output_linear.weight":
        return t[:, shard.part(t.shape[1])]
    return None


def split_hybrid_rows(model, group) -> None:
    """Makes each block's output projection of a sharded NemotronH model row-parallel over ``group``: Mamba's
    out_proj, attention's o_proj, the MLP's down_proj, a MoE layer's whole output."""
    split_hybrid_blocks(model.layers, group)


def split_hybrid_blocks(blocks, group) -> None:
    """split_hybrid_rows over a list of blocks (the model's, or its own MTP step's: engine/tensor_parallel/draft.py)."""
    for block in blocks:
        mixer = block.mixer
        if block.kind == "M":
            mixer.out_proj = RowParallelLinear(mixer.out_proj, group)
        elif block.kind == "*":
            mixer.o_proj = RowParallelLinear(mixer.o_proj, group)
        elif block.kind == "-":
            mixer.mixer.down_proj = RowParallelLinear(mixer.mixer.down_proj, group)  # inside its TokenChunked
        elif block.kind in ("E", "G"):  # a MoE layer; a Granite layer's MoE plus shared MLP: one sum
            mixer.mixer = SummedMoe(mixer.mixer, group)
