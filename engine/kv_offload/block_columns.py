"""One block's column of KV (every layer's K and V rows of one block), as the offload tiers read and write it.

An unsplit engine has one cache and a column is a view of it. A model split over tensor-parallel ranks has a cache
per rank, each holding its share of the KV heads (rank r: heads [r*h, (r+1)*h)), all within rank 0's reach on a CPU
(engine/tensor_parallel/shared_cache.py). Its column is every rank's column laid side by side along the head axis:
the tiers hold what the unsplit model's block would, and a block loads back into every rank at once, so a request
never finds some ranks' heads cached and others' not."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class BlockColumns:
    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        # each [num_layers, num_planes, num_blocks, block_size, num_kv_heads, head_dim]
        self.caches = tuple(caches)
        first = self.caches[0]
        if any(c.shape[:-2] != first.shape[:-2] or c.shape[-1] != first.shape[-1] or c.dtype != first.dtype
               for c in self.caches):
            raise ValueError("KV offload: the rank caches of a split model differ in more than their heads: "
                             f"{[tuple(c.shape) for c in self.caches]}")
        if len(self.caches) > 1 and first.device.type != "cpu":
            raise ValueError("KV offload: the caches of a split model are read from rank 0 on CPUs only")
        self.heads_per_cache = [c.shape[-2] for c in self.caches]
        self.block_shape = (*first.shape[:2], *first.shape[3:-2], sum(self.heads_per_cache), first.shape[-1])
        self.dtype, self.device = first.dtype, first.device

    def read(self, block_id: int) -> torch.Tensor:
        """The column of ``block_id``: a view of the cache where there is one, else a new tensor."""
        if len(self.caches) == 1:
            return self.caches[0][:, :, block_id]
        return torch.cat([c[:, :, block_id] for c in self.caches], dim=-2)

    def write(self, block_id: int, load: Callable[[torch.Tensor], bool]) -> bool:
        """``load(column)`` fills a column; its result lands in ``block_id`` of every cache unless it returns False
        (nothing is written then: no rank holds part of a block)."""
        if len(self.caches) == 1:
            return load(self.caches[0][:, :, block_id])
        column = torch.empty(self.block_shape, dtype=self.dtype)
        if not load(column):
            return False
        for cache, part in zip(self.caches, column.split(self.heads_per_cache, dim=-2)):
            cache[:, :, block_id].copy_(part)
        return True

    def read_many(self, block_ids: list[int]) -> torch.Tensor:
        """The columns of ``block_ids`` as one new tensor [n, *block_shape], one gather per cache."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        # the cache's [layers, planes, n, block, heads, dim] -> [n, layers, planes, block, heads, dim]
        parts = [cache.index_select(2, index).movedim(2, 0) for cache in self.caches]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def write_many(self, block_ids: list[int], blocks_kv: torch.Tensor) -> None:
        """``blocks_kv`` ([n, *block_shape], any device) into blocks ``block_ids`` of every cache, one copy per cache."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        start = 0
        for cache, heads in zip(self.caches, self.heads_per_cache):
            part = blocks_kv[..., start:start + heads, :] if len(self.caches) > 1 else blocks_kv
            # [n, layers, planes, block, heads, dim] -> the cache's [layers, planes, n, block, heads, dim]
            cache.index_copy_(2, index, part.movedim(0, 2).to(cache.device, non_blocking=True))
            start += heads
