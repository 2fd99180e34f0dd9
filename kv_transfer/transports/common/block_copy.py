"""Gather and scatter of KV rows (see layout.py) without a per-block round trip.

On CPU the copies go through numpy, not torch: on our machines ``Tensor.copy_`` ran at a third of
``np.copyto`` and ``index_copy_`` of 16 KiB rows at half of numpy's fancy assignment, while
``np.take(..., mode="clip", out=...)`` gathers at memcpy speed. (``mode="raise"``, the default,
buffers the whole output through a temporary and is 4x slower; bounds are checked before we get
here, see layout.check_blocks.) On CUDA the same operations are torch index kernels on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import KVLayout

Rows = np.ndarray | torch.Tensor  # [num_rows, block_bytes] uint8: numpy on CPU, torch on CUDA


def rows_view(kv_cache: torch.Tensor, block_bytes: int) -> Rows:
    """The cache as a uint8 row table sharing its memory."""
    flat = kv_cache.view(torch.uint8).view(-1, block_bytes)
    return flat if kv_cache.is_cuda else flat.numpy()


def blocks_view(rows: np.ndarray, layout: KVLayout) -> np.ndarray:
    """A CPU cache's rows as ``[num_layers * num_planes, num_blocks, block_bytes]``: copy_blocks' view."""
    return rows.reshape(layout.num_layers * layout.num_planes, layout.num_blocks, -1)


def buffer_rows(buf: np.ndarray | torch.Tensor, block_bytes: int) -> Rows:
    """A staging buffer (uint8, any shape) as rows; torch CPU tensors become numpy views."""
    if isinstance(buf, torch.Tensor) and not buf.is_cuda:
        buf = buf.numpy()
    return buf.reshape(-1, block_bytes)


def _index(ids: np.ndarray, like: Rows) -> np.ndarray | torch.Tensor:
    if isinstance(like, torch.Tensor):
        return torch.from_numpy(ids).to(like.device, non_blocking=True)
    return ids


def gather_rows(rows: Rows, row_ids: np.ndarray, out: Rows) -> None:
    """``out[i] = rows[row_ids[i]]``; ``out`` is contiguous ``[len(row_ids), block_bytes]``."""
    if isinstance(rows, torch.Tensor):
        torch.index_select(rows, 0, _index(row_ids, rows), out=out)
    else:
        np.take(rows, row_ids, axis=0, out=out, mode="clip")


def scatter_rows(src: Rows, rows: Rows, row_ids: np.ndarray) -> None:
    """``rows[row_ids[i]] = src[i]``."""
    if isinstance(rows, torch.Tensor):
        rows.index_copy_(0, _index(row_ids, rows), src.to(rows.device, non_blocking=True))
    else:
        rows[row_ids] = src


def layer_runs(layer_ids: list[int]) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5]`` -> ``[(0, 3), (5, 6)]``: maximal runs of consecutive layers."""
    runs: list[tuple[int, int]] = []
    for layer in layer_ids:
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


def copy_blocks(
    src: np.ndarray,
    src_blocks: np.ndarray,
    dst: np.ndarray,
    dst_blocks: np.ndarray,
    layer_ids: list[int],
    num_planes: int = 2,
) -> None:
    """Copy blocks between two CPU caches seen as ``[num_layers * num_planes, num_blocks, block_bytes]``
    (e.g. into a peer's cache mapped from shared memory): one pass over the bytes.

    One ``np.copyto`` per block and run of consecutive layers moves all of that run's K and V rows
    of the block (a strided 2-D copy), so the Python cost is per block, not per row: this ran at
    0.85x memcpy against 0.6x for gather-then-scatter through a temporary (two passes)."""
    s_list, d_list = src_blocks.tolist(), dst_blocks.tolist()
    for lo, hi in layer_runs(layer_ids):
        s_run, d_run = src[num_planes * lo : num_planes * hi], dst[num_planes * lo : num_planes * hi]
        for s, d in zip(s_list, d_list):
            np.copyto(d_run[:, d], s_run[:, s])
