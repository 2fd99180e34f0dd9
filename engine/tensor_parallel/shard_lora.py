"""A LoRA adapter cut for one rank of a split model (vLLM's layout for LoRA under tensor parallelism).

An adapter adds ``scale * B @ A`` to a projection's weight [out, in]. Where the ranks split a projection's output rows
(q/k/v, gate/up, a Mamba layer's in_proj: column-parallel) each rank takes those rows of B and the whole A: its update
is the update of its own rows. Where they split its input columns (o_proj, down_proj: row-parallel) each rank takes
those columns of A and the whole B: its update is a partial sum, added to the projection's own partial sum before the
one all-reduce that makes both whole (sum over ranks of x_r A_r^T B^T = x A^T B^T). So an adapter costs no
communication beyond the model's own, and each rank's update runs through the same LoraLinear as an unsplit model's.

The rows and columns are cut by the checkpoint's own cut (shard.py ``shard_tensor``): B of a column-parallel module
is cut as the module's weight (its rows), A of a row-parallel one as the weight (its columns), so every layout the
weights split in (heads, fused Phi-3 projections, a hybrid's z | x | B | C | dt, Granite's gate | up halves) holds for
adapters too."""

from __future__ import annotations

from dataclasses import replace

from pdcluster.engine.lora.adapter import LoraAdapter
from pdcluster.engine.tensor_parallel.layers import Shard
from pdcluster.engine.tensor_parallel.shard import shard_tensor

# Modules whose input the ranks split (their output is a sum over the ranks); every other adaptable one is
# split by its output rows.
ROW_PARALLEL = frozenset({"o_proj", "down_proj", "out_proj", "output_linear"})
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")


def checkpoint_name(arch, layer: int, module: str) -> str:
    """The checkpoint name of layer ``layer``'s projection ``module`` (what shard_tensor knows how to cut)."""
    if getattr(arch, "granite", None) is not None:  # Granite 4.0 hybrid: its own names (shard_hybrid.py renames them)
        part = "self_attn" if module in _ATTENTION else "mamba" if module in ("in_proj", "out_proj") else "shared_mlp"
        return f"model.layers.{layer}.{part}.{module}.weight"
    if hasattr(arch, "mamba_num_heads"):  # NemotronH: every block's projections sit under its mixer
        return f"backbone.layers.{layer}.mixer.{module}.weight"
    block = "self_attn" if module in _ATTENTION else "mlp"
    return f"model.layers.{layer}.{block}.{module}.weight"


def full_shape(module: str, rank_width: int, rank_in: int, world_size: int) -> tuple[int, int]:
    """The unsplit [out, in] of a projection a rank holds as ``rank_width`` outputs by ``rank_in`` inputs."""
    if module in ROW_PARALLEL:
        return rank_width, rank_in * world_size
    return rank_width * world_size, rank_in


def shard_adapter(adapter: LoraAdapter, arch, shard: Shard) -> LoraAdapter:
    """``adapter`` (checked against the whole model: engine/lora/__init__.py check_fits) as rank ``shard.rank`` runs
    it; ``arch``: the whole model's. Name and digest stay: every rank holds the same adapter under one fingerprint."""
    modules = {}
    for (layer, module), w in adapter.modules.items():
        name = checkpoint_name(arch, layer, module)
        if module in ROW_PARALLEL:
            modules[(layer, module)] = replace(w, a=shard_tensor(name, w.a, arch, shard).contiguous())
        else:
            modules[(layer, module)] = replace(w, b=shard_tensor(name, w.b, arch, shard).contiguous())
    return replace(adapter, modules=modules)
