"""Turning one send() call into chunks: validated, numbered, and registered with the tracker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .layout import KVLayout, check_blocks, check_layers
from .tracking import SendTracker
from .wire import ChunkHeader


@dataclass
class Chunk:
    index: int
    src_block_ids: np.ndarray
    dst_block_ids: np.ndarray


@dataclass
class SendJob:
    seq: int
    peer_id: str
    transfer_id: str
    layer_ids: list[int]
    chunks: list[Chunk]
    next_chunk: int = 0  # the next chunk to post; IO threads advance it

    def payload_bytes(self, chunk: Chunk, layout: KVLayout) -> int:
        return layout.payload_bytes(len(self.layer_ids), len(chunk.src_block_ids))

    def header(self, chunk: Chunk, sender_id: str, layout: KVLayout, extra: dict | None = None) -> ChunkHeader:
        return ChunkHeader(
            sender_id=sender_id,
            send_seq=self.seq,
            chunk_index=chunk.index,
            num_chunks=len(self.chunks),
            transfer_id=self.transfer_id,
            layer_ids=self.layer_ids,
            dst_block_ids=chunk.dst_block_ids,
            payload_bytes=self.payload_bytes(chunk, layout),
            extra=extra or {},
        )


def split_blocks(
    num_layers: int, src: np.ndarray, dst: np.ndarray, block_bytes: int, chunk_bytes: int, num_planes: int = 2
) -> list[Chunk]:
    """Chunks of whole blocks (all listed layers each), at most ``chunk_bytes`` of payload unless a
    single block is larger."""
    per_block = num_layers * num_planes * block_bytes
    blocks_per_chunk = max(1, chunk_bytes // per_block)
    return [
        Chunk(i, src[start : start + blocks_per_chunk], dst[start : start + blocks_per_chunk])
        for i, start in enumerate(range(0, len(src), blocks_per_chunk))
    ]


def prepare_send(
    *,
    layout: KVLayout,
    peer_layout: KVLayout,
    tracker: SendTracker,
    peer_id: str,
    transfer_id: str,
    layer_ids: Sequence[int] | range,
    src_block_ids: np.ndarray | Sequence[int],
    dst_block_ids: np.ndarray | Sequence[int],
    chunk_bytes: int,
    timeout_s: float,
) -> SendJob:
    """Check a send() call's arguments (raising ValueError) and register it with ``tracker``."""
    layers = check_layers(layout, layer_ids)
    check_layers(peer_layout, layers)
    src = check_blocks(src_block_ids, layout.num_blocks, "source")
    dst = check_blocks(dst_block_ids, peer_layout.num_blocks, "destination")
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    if len(src) == 0:
        raise ValueError("no blocks to send")
    chunks = split_blocks(len(layers), src, dst, layout.block_bytes, chunk_bytes, layout.num_planes)
    seq = tracker.begin(transfer_id, peer_id, len(chunks), timeout_s)
    return SendJob(seq=seq, peer_id=peer_id, transfer_id=transfer_id, layer_ids=layers, chunks=chunks)
