"""Geometry of a paged KV cache as the data plane sees it: rows of bytes.

The cache ``[num_layers, num_planes, num_blocks, block_size, num_kv_heads, head_dim]`` is, byte for byte, a
table of ``num_layers * num_planes * num_blocks`` rows of ``block_bytes`` each; row
``(layer * num_planes + plane) * num_blocks + block`` is one layer's K (plane 0) or V (plane 1) slice of one block.
``num_planes`` is 2, or 1 where V is K (MLA's latents, engine/models/deepseek.py: one plane, moved once).
Transports move rows, so they are dtype-agnostic (bfloat16 has no numpy dtype) and a send of any
layers and blocks becomes one index array.

A payload for ``layer_ids`` x ``block_ids`` lists rows layer-major, then K/V, then block: the same
order as ``kernels.reference.gather_blocks`` on the selected layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_shape: tuple[int, int, int]  # (block_size, num_kv_heads, head_dim)
    dtype: str  # torch dtype name, e.g. "bfloat16"
    element_bytes: int
    num_planes: int = 2  # K and V; 1: one plane serves as both (MLA)

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> KVLayout:
        num_layers, num_planes, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(
            num_planes=int(num_planes),
            num_layers=int(num_layers),
            num_blocks=int(num_blocks),
            block_shape=(int(block_size), int(num_kv_heads), int(head_dim)),
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            element_bytes=kv_cache.element_size(),
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one row: one layer's K or V (plane) slice of one block."""
        block_size, num_kv_heads, head_dim = self.block_shape
        return block_size * num_kv_heads * head_dim * self.element_bytes

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_planes * self.num_blocks

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_shape": list(self.block_shape),
            "dtype": self.dtype,
            "element_bytes": self.element_bytes,
            "num_planes": self.num_planes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(
            num_layers=int(d["num_layers"]),
            num_blocks=int(d["num_blocks"]),
            block_shape=tuple(int(x) for x in d["block_shape"]),  # type: ignore[arg-type]
            dtype=str(d["dtype"]),
            element_bytes=int(d["element_bytes"]),
            num_planes=int(d.get("num_planes", 2)),
        )

    def check_peer(self, peer: KVLayout) -> None:
        """Blocks must mean the same bytes on both sides; cache sizes may differ."""
        if (peer.dtype, peer.block_shape, peer.num_planes) != (self.dtype, self.block_shape, self.num_planes):
            raise ValueError(
                f"incompatible KV layouts: local {self.dtype} blocks {self.block_shape} x {self.num_planes} planes, "
                f"peer {peer.dtype} blocks {peer.block_shape} x {peer.num_planes} planes"
            )

    def row_ids(self, layer_ids: Sequence[int], block_ids: np.ndarray) -> np.ndarray:
        """Row indices (int64) of ``layer_ids`` x planes (K, V) x ``block_ids``, payload order."""
        layers = np.asarray(layer_ids, dtype=np.int64)
        planes = self.num_planes
        kv_rows = (layers[:, None] * planes + np.arange(planes, dtype=np.int64)[None, :]) * self.num_blocks
        return (kv_rows[:, :, None] + np.asarray(block_ids, dtype=np.int64)[None, None, :]).reshape(-1)

    def payload_bytes(self, num_layers: int, num_blocks: int) -> int:
        return num_layers * self.num_planes * num_blocks * self.block_bytes


def check_layers(layout: KVLayout, layer_ids: Sequence[int] | range) -> list[int]:
    layers = [int(x) for x in layer_ids]
    if not layers:
        raise ValueError("layer_ids is empty")
    bad = [x for x in layers if not 0 <= x < layout.num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range [0, {layout.num_layers})")
    return layers


def check_blocks(block_ids: np.ndarray | Sequence[int], num_blocks: int, what: str) -> np.ndarray:
    ids = np.array(block_ids, dtype=np.int64).reshape(-1)  # a copy: callers may reuse their array
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"{what} block ids out of range [0, {num_blocks})")
    return ids


def chunk_problem(layout: KVLayout, layer_ids: Sequence[int], dst_block_ids: np.ndarray, payload_bytes: int) -> str | None:
    """Why a received chunk cannot be scattered into this cache (None if it can). The receiver checks
    even though the sender did: the ids come from another process."""
    if any(not 0 <= x < layout.num_layers for x in layer_ids):
        return "receiver rejected the chunk: layer id out of range"
    if dst_block_ids.size and (dst_block_ids.min() < 0 or dst_block_ids.max() >= layout.num_blocks):
        return "receiver rejected the chunk: block id out of range"
    if payload_bytes != layout.payload_bytes(len(layer_ids), len(dst_block_ids)):
        return "receiver rejected the chunk: payload size does not match its header"
    return None
