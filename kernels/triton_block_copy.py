"""Triton kernels: pack scattered KV blocks into one contiguous buffer and back (KV transfer).

Same semantics as :func:`pdcluster.kernels.reference.gather_blocks` / ``scatter_blocks``:

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    buffer:   [num_layers, 2, n,          block_size, num_kv_heads, head_dim]

``gather``: buffer[:, :, i] = kv_cache[:, :, block_ids[i]];  ``scatter``: the reverse.

One kernel serves both directions: only which side is indexed through ``block_ids`` changes. One
program per (list entry, layer, K-or-V) copies one block's ``block_size * num_kv_heads * head_dim``
elements, which are contiguous in both tensors, in fixed-size chunks. That makes every program a plain
contiguous memcpy, and one launch moves every layer (no per-layer Python loop on the transfer path).

Block ids are not bounds-checked here (that would need a device sync); the caller owns them.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
import triton.language as tl

# Elements per chunk: large enough to keep a GPU's loads wide, small enough to stay in registers.
_MAX_CHUNK_ELEMS = 1024


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,
    block_elems,
    stride_src_layer,
    stride_src_kv,
    stride_src_block,
    stride_dst_layer,
    stride_dst_kv,
    stride_dst_block,
    INDEX_SRC: tl.constexpr,  # True: gather (read block_ids[i], write i); False: scatter
    CHUNK: tl.constexpr,
    NUM_PLANES: tl.constexpr,  # K and V: 2; MLA's latent cache: 1
):
    entry = tl.program_id(0)
    layer_kv = tl.program_id(1)
    layer = (layer_kv // NUM_PLANES).to(tl.int64)
    kv = (layer_kv % NUM_PLANES).to(tl.int64)
    # int64: a whole-model cache easily exceeds 2**31 elements.
    block_id = tl.load(block_ids_ptr + entry).to(tl.int64)
    if INDEX_SRC:
        src_block = block_id
        dst_block = entry.to(tl.int64)
    else:
        src_block = entry.to(tl.int64)
        dst_block = block_id
    src_base = src_ptr + layer * stride_src_layer + kv * stride_src_kv + src_block * stride_src_block
    dst_base = dst_ptr + layer * stride_dst_layer + kv * stride_dst_kv + dst_block * stride_dst_block
    dst_dtype = dst_ptr.dtype.element_ty
    offsets = tl.arange(0, CHUNK)
    for start in range(0, block_elems, CHUNK):
        idx = start + offsets
        mask = idx < block_elems
        chunk = tl.load(src_base + idx, mask=mask)
        tl.store(dst_base + idx, chunk.to(dst_dtype), mask=mask)


def _check_inner_contiguous(name: str, t: Tensor) -> None:
    """Each block's [block_size, num_kv_heads, head_dim] must be one contiguous run (the kernel copies
    it flat); the outer dims may be strided."""
    _, _, _, block_size, num_kv_heads, head_dim = t.shape
    if t.stride()[3:] != (num_kv_heads * head_dim, head_dim, 1):
        raise ValueError(f"{name}: inner block dims must be contiguous, strides are {t.stride()}")


def _launch(src: Tensor, dst: Tensor, block_ids: Tensor, index_src: bool) -> None:
    num_layers = src.shape[0]
    num_entries = block_ids.shape[0]
    if num_entries == 0 or num_layers == 0:
        return
    _check_inner_contiguous("src", src)
    _check_inner_contiguous("dst", dst)
    block_elems = src.shape[3] * src.shape[4] * src.shape[5]
    _copy_blocks_kernel[(num_entries, num_layers * src.shape[1])](
        src,
        dst,
        block_ids,
        block_elems,
        src.stride(0),
        src.stride(1),
        src.stride(2),
        dst.stride(0),
        dst.stride(1),
        dst.stride(2),
        INDEX_SRC=index_src,
        NUM_PLANES=src.shape[1],
        CHUNK=min(triton.next_power_of_2(block_elems), _MAX_CHUNK_ELEMS),
    )


def gather_blocks_triton(kv_cache: Tensor, block_ids: Tensor, out: Tensor | None = None) -> Tensor:
    """Copy the listed blocks (all layers, K and V) into one contiguous buffer, in list order."""
    num_layers, num_planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    expected = (num_layers, num_planes, block_ids.shape[0], block_size, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty(expected, dtype=kv_cache.dtype, device=kv_cache.device)
    elif tuple(out.shape) != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {expected}")
    _launch(kv_cache, out, block_ids, index_src=True)
    return out


def scatter_blocks_triton(buffer: Tensor, kv_cache: Tensor, block_ids: Tensor) -> None:
    """Inverse of :func:`gather_blocks_triton`: write buffer entry ``i`` into block ``block_ids[i]``."""
    num_layers, num_planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    expected = (num_layers, num_planes, block_ids.shape[0], block_size, num_kv_heads, head_dim)
    if tuple(buffer.shape) != expected:
        raise ValueError(f"buffer has shape {tuple(buffer.shape)}, expected {expected}")
    _launch(buffer, kv_cache, block_ids, index_src=False)
