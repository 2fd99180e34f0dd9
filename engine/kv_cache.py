"""The paged KV cache tensor.

Layout (shared with kernels/reference.py and every transport):

    kv_cache: [num_layers, num_planes, num_blocks, block_size, num_kv_heads, head_dim]

``num_planes`` is 2 (K, then V), or 1 where the values are the keys themselves: MLA caches one latent vector per
token (engine/models/deepseek.py), and its attention reads that plane as both (kernels/reference.py
``layer_planes``). ``num_layers`` counts the target model's layers followed by the draft (MTP) layers, so a request's
draft-layer KV lives in the same blocks and travels with the target's in a KV transfer (S2).

A draft model whose KV of one token is smaller than the target's (SmolLM2 135M's 3 x 64 for SmolLM2 1.7B's 32 x 64,
Llama 3.2 1B's 8 x 64 for Llama 3.1 8B's 8 x 128) packs ``per_slot`` of its layers into each draft layer of the
target's shape (``packed_layer_views``): within each target block of a slot, draft layer ``i`` holds its own block
(block_size tokens of its shape) at offset ``i % per_slot`` of the draft's block size. Its views keep the shared
block ids and slots (a block further apart than the draft's own block size: the kernels take the plane's strides),
so whatever moves a block (a transfer, the offload tiers, a prefix-cache hit) moves the draft's entries of it with
the target's.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int  # target + draft layers
    num_draft_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_planes: int = 2

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_planes, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_planes * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype, arch=None) -> torch.dtype:
    """The cache's element type for EngineConfig.kv_cache_dtype ``name``: the model's dtype for "auto", else the fp8
    format. fp8 entries are the K and V values themselves (per-tensor scale 1.0, as vLLM without calibrated
    scales), written saturating and widened exactly to the model's dtype as attention reads them. A latent (MLA)
    cache stays in the model's dtype: asking for fp8 there is an error naming it. ``name`` is one EngineConfig
    validated (config.KV_CACHE_DTYPES)."""
    if name == "auto":
        return model_dtype
    if arch is not None and kv_planes(arch) != 2:
        raise ValueError(f"kv_cache_dtype {name}: this model caches one latent vector a token (MLA); that cache is "
                         "kept in the model's dtype only: drop --kv-cache-dtype")
    return FP8_KV_DTYPES[name]


def kv_planes(arch) -> int:
    """The planes an arch's cache keeps: its ``kv_planes`` (DeepSeek's latents: 1), else K and V."""
    return getattr(arch, "kv_planes", 2)


def num_blocks_for_budget(bytes_per_block: int, memory_gib: float) -> int:
    return max(1, int(memory_gib * (1 << 30)) // bytes_per_block)


def allocate_kv_cache(spec: KVCacheSpec, device: str | torch.device = "cpu") -> torch.Tensor:
    # Zeroed, not empty: padded slots of a gathered block are masked out in attention, but reading
    # uninitialised NaNs there would still poison a masked softmax on some backends.
    if torch.device(device).type == "cpu":
        return _zeroed_huge_page_tensor(spec.shape, spec.dtype)
    return torch.zeros(spec.shape, dtype=spec.dtype, device=device)


def _zeroed_huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """CPU cache memory from an anonymous mapping backed by 2 MiB pages where the kernel allows.

    Decode attention touches a few KB in each of thousands of scattered blocks per layer; with 4 KiB
    pages nearly every block costs a TLB miss and a page walk (measured: attention at batch 32 took
    ~2x longer in the engine than on a warm microbenchmark). The pages are touched here, once, as vLLM
    does with its cache: the block allocator hands out blocks round-robin, so lazily faulted pages
    would cost every early request a page fault and a 2 MiB clear per new block (measured: the KV
    write of a 32 x 200-token prefill took 8 ms a layer instead of <1)."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off: 4 KiB pages, same contents
    tensor = torch.frombuffer(buf, dtype=dtype).view(shape)
    tensor._pdcluster_mapping = buf  # the mapping lives exactly as long as the tensor
    tensor.zero_()  # fault every page in now (already zero: the mapping is anonymous)
    return tensor


def packed_layers_per_slot(target_token_kv: tuple[int, int], draft_token_kv: tuple[int, int]) -> int:
    """How many layers of a draft whose KV of one token is ``draft_token_kv`` (KV heads, head size) pack into one
    cache layer of the target's ``target_token_kv`` (see the module); ValueError naming both where the draft's is
    larger."""
    target, draft = target_token_kv[0] * target_token_kv[1], draft_token_kv[0] * draft_token_kv[1]
    if draft > target:
        raise ValueError(f"its KV is {draft_token_kv[0]} heads x {draft_token_kv[1]} a token, the target's "
                         f"{target_token_kv[0]} x {target_token_kv[1]}: a draft keeps its KV in the target's paged "
                         "cache, which holds no more than the target's KV of a token a layer (the same shape or less: "
                         "e.g. Llama 3.2 1B's 8 x 64 for Llama 3.1 8B's 8 x 128)")
    return target // draft


def num_packed_slots(num_layers: int, per_slot: int) -> int:
    return -(-num_layers // per_slot)


def packed_layer_views(slots: torch.Tensor, num_layers: int, per_slot: int, num_kv_heads: int,
                       head_dim: int) -> torch.Tensor | list[torch.Tensor]:
    """``num_layers`` draft layers of ``num_kv_heads`` x ``head_dim`` a token over ``slots`` (the cache's draft layers,
    [slots, planes, num_blocks, block_size, target heads, target head size]): ``slots`` itself where a layer has the
    target's shape, else one view a layer, [planes, num_blocks, block_size, heads, head size], its blocks at the
    target's block stride and offset by its place in its slot (see the module)."""
    if tuple(slots.shape[-2:]) == (num_kv_heads, head_dim):
        return slots[:num_layers]
    num_planes, num_blocks, block_size = slots.shape[1:4]
    draft_block = block_size * num_kv_heads * head_dim
    views = []
    for i in range(num_layers):
        flat = slots[i // per_slot].view(num_planes, num_blocks, -1)
        start = (i % per_slot) * draft_block
        views.append(flat[:, :, start:start + draft_block].view(num_planes, num_blocks, block_size, num_kv_heads,
                                                                head_dim))
    return views
