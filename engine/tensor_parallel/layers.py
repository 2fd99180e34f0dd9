"""A rank's slice of a split model, and the layers that sum over the ranks (Megatron's row-parallel linear, its MoE
and the norm over heads split between ranks). Apart from shard.py (what splits, and how a checkpoint is cut) so that
shard_hybrid.py and the LoRA code import these without the rules that hand hybrids over to shard_hybrid.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int

    def part(self, total: int) -> slice:
        """This rank's equal part of ``total`` rows (``total`` divisible: check_shardable)."""
        size = total // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def rows(self, count: int, width: int) -> slice:
        """This rank's rows of ``count`` runs of ``width`` rows each (heads of head_dim rows, Mamba groups, gpt-oss's
        interleaved (gate, up) pairs)."""
        part = self.part(count)
        return slice(part.start * width, part.stop * width)

    def halves(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A gate-then-up tensor (two halves along ``dim``) cut to this rank's part of each half."""
        gate, up = t.chunk(2, dim=dim)
        part = self.part(gate.shape[dim])
        return torch.cat([h.narrow(dim, part.start, part.stop - part.start) for h in (gate, up)], dim=dim)

    def summed_bias(self, t: torch.Tensor) -> torch.Tensor:
        """A bias added inside a layer's one sum over the ranks: rank 0's is the bias, the others' zeros, so the sum
        adds it once (vLLM's RowParallelLinear adds its bias on rank 0 alone)."""
        return t if self.rank == 0 else torch.zeros_like(t)


class RowParallelLinear:
    """A projection whose input is split over the ranks (o_proj, down_proj): the local matmul gives a partial sum,
    the all-reduce the whole output on every rank. Not a ``Linear``: the layer then takes its plain path (matmul,
    then the residual add and norm apart) instead of fusing them into a kernel that would run before the sum."""

    def __init__(self, linear, group) -> None:
        self.linear, self.group = linear, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(self.linear(x))


class SplitWidthNorm:
    """An RMSNorm over all of a token's heads (OLMo 2's q_norm / k_norm) where each rank holds some of them: each rank
    sums its channels' squares, one all-reduce of that [tokens, 1] float32 sum makes the whole row's, and each rank
    scales its own channels, as the unsplit norm does (float32, then the model dtype, then the weight)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = heads.reshape(heads.shape[0], -1).float()  # a copy: the heads are a strided view of qkv
        sum_sq = self.group.all_reduce_(rows.pow(2).sum(dim=-1, keepdim=True))
        mean_sq = sum_sq / (rows.shape[1] * self.group.world_size)
        return (weight * (rows * torch.rsqrt(mean_sq + eps)).to(heads.dtype)).view(heads.shape)


class SummedMoe:
    """A sparse layer whose experts hold this rank's slice of their rows: its output (routed plus shared, each a
    linear function of the experts' partial sums) summed over the ranks. Everything else is the layer's own."""

    def __init__(self, moe, group) -> None:
        self.inner, self.group = moe, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(self.inner(x))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
