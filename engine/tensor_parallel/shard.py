"""Which models split over ranks, and how (Megatron's layout, vLLM's): each rank holds num_heads / n query heads and
num_kv_heads / n KV heads of every attention layer (its q/k/v rows, its o_proj columns) and intermediate_size / n of
every MLP (its gate/up rows, its down_proj columns); norms, the embedding and the LM head are whole on every rank.
o_proj and down_proj then give each rank a partial sum, which one all-reduce makes whole (RowParallelLinear).

The cut is made on the checkpoint's own tensors (Hugging Face names), before the loader fuses and packs them, so the
layer code runs unchanged over a rank's slice (its arch says how many heads it has: ``shard_arch``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int

    def part(self, total: int) -> slice:
        """This rank's equal part of ``total`` rows (``total`` divisible: check_shardable)."""
        size = total // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)


def check_shardable(model_class: type, arch, world_size: int) -> None:
    """ValueError naming why a model does not split ``world_size`` ways (nothing for 1)."""
    if world_size == 1:
        return
    from pdcluster.engine.models.llama import LlamaModel

    name = model_class.__name__
    if model_class is not LlamaModel:
        raise ValueError(f"tensor_parallel_size {world_size}: tensor parallelism splits the Llama family's dense "
                         f"models (Llama, Mistral, Qwen2/3, Phi-3, Granite, ...); {name} runs with "
                         "--tensor-parallel-size 1")
    if arch.moe is not None or arch.group_router is not None:
        raise ValueError(f"tensor_parallel_size {world_size}: this model's MoE layers do not split yet (experts are "
                         "not sharded); run it with --tensor-parallel-size 1")
    for what, count in (("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
                        ("MLP intermediate_size", arch.intermediate_size)):
        if count % world_size:
            raise ValueError(f"tensor_parallel_size {world_size}: the model's {count} {what} do not split "
                             f"{world_size} ways; choose a size that divides {count}")


def shard_arch(arch, world_size: int):
    """The arch one rank runs: its heads and MLP width (what its layers, kernels and KV cache are sized by)."""
    if world_size == 1:
        return arch
    return replace(arch, num_heads=arch.num_heads // world_size, num_kv_heads=arch.num_kv_heads // world_size,
                   intermediate_size=arch.intermediate_size // world_size)


def shard_weights(weights: dict[str, torch.Tensor], arch, shard: Shard) -> None:
    """Cuts each layer tensor of ``weights`` (the full checkpoint's, Hugging Face names) to ``shard``'s slice, in
    place; the others stay whole. ``arch``: the full model's."""
    num_heads, num_kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    q_rows = _rows(shard.part(num_heads), head_dim)
    kv_rows = _rows(shard.part(num_kv_heads), head_dim)
    mlp_rows = shard.part(arch.intermediate_size)
    for name in [n for n in weights if n.startswith("model.layers.")]:
        leaf = name.split(".", 3)[3]  # model.layers.<i>.<leaf>
        t = weights[name]
        if leaf in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
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
            t = t[mlp_rows]
        elif leaf == "mlp.gate_up_proj.weight":  # Phi-3's, GLM-4's fused checkpoints
            gate, up = t.chunk(2)
            t = torch.cat([gate[mlp_rows], up[mlp_rows]])
        elif leaf == "mlp.down_proj.weight":
            t = t[:, mlp_rows]
        elif leaf == "self_attn.sinks":
            t = t[shard.part(num_heads)]
        elif leaf in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            t = _head_norm_part(t, shard, num_heads if leaf.startswith("self_attn.q") else num_kv_heads, head_dim)
        else:
            continue
        weights[name] = t.contiguous()


def _rows(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _head_norm_part(weight: torch.Tensor, shard: Shard, num_heads: int, head_dim: int) -> torch.Tensor:
    """A q/k norm's weight for this rank's heads: one [head_dim] shared by every head (Qwen3) stays whole, a per-head
    [heads, head_dim] (Cohere) is cut; a norm over all heads at once (OLMo 2's [heads * head_dim]) would need the
    other ranks' heads for its mean: refused."""
    if weight.dim() == 2:
        return weight[shard.part(num_heads)]
    if weight.shape[0] == head_dim:
        return weight
    raise ValueError("tensor parallelism: this model's q/k norm spans all heads at once (OLMo 2), which a rank's "
                     "slice of the heads cannot compute alone; run it with --tensor-parallel-size 1")


class RowParallelLinear:
    """A projection whose input is split over the ranks (o_proj, down_proj): the local matmul gives a partial sum,
    the all-reduce the whole output on every rank. Not a ``Linear``: the layer then takes its plain path (matmul,
    then the residual add and norm apart) instead of fusing them into a kernel that would run before the sum."""

    def __init__(self, linear, group) -> None:
        self.linear, self.group = linear, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(self.linear(x))


def split_rows(model, group) -> None:
    """Makes each layer's o_proj and down_proj of a sharded model row-parallel over ``group``."""
    for layer in model.layers:
        layer.o_proj = RowParallelLinear(layer.o_proj, group)
        layer.down_proj = RowParallelLinear(layer.down_proj, group)
