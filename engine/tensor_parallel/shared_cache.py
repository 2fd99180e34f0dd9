"""Rank caches in shared memory, for a tensor-parallel engine whose KV a transport moves (disaggregated serving).

The KV transport lives in rank 0's process (the connector, the scheduler and the control plane do), but each rank's
heads live in that rank's cache. So rank 0 makes every rank's cache as an anonymous memfd segment, keeps a mapping of
each (its transport reads and writes them all: kv_transfer/transports/ranked.py), and hands rank r the descriptor of its
segment down r's pipe (SCM_RIGHTS); rank r maps it and computes in it. A memfd has no name to leak when a process is
killed: the memory goes when the last mapping does.

Rank r writes a layer's KV before its share of that layer's all-reduce, and rank 0 sends the layer after the layer
ends (``on_layer_done``): the all-reduce orders rank r's writes before rank 0's reads, as it does on a GPU with NCCL.
CPU only: on GPUs a rank's cache is device memory on its own GPU (CUDA IPC would be the way there; not written yet).
"""

from __future__ import annotations

import mmap
import os

import torch

from pdcluster.engine.kv_cache import KVCacheSpec


def cache_nbytes(spec: KVCacheSpec) -> int:
    return int(torch.Size(spec.shape).numel()) * torch.empty((), dtype=spec.dtype).element_size()


def create_shared_cache(spec: KVCacheSpec) -> tuple[torch.Tensor, int]:
    """A zeroed cache of ``spec`` in a new memfd segment, and the segment's descriptor (the caller closes it once
    the rank that computes in it has its own)."""
    nbytes = max(cache_nbytes(spec), 1)
    fd = os.memfd_create("pdcluster-tp-kv-cache", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return _tensor(_map(fd, nbytes), spec), fd
    except BaseException:
        os.close(fd)
        raise


def map_shared_cache(fd: int, spec: KVCacheSpec) -> torch.Tensor:
    """Rank r: its cache from the descriptor rank 0 sent (which is closed here: the mapping keeps the memory)."""
    try:
        cache = _tensor(_map(fd, max(cache_nbytes(spec), 1)), spec)
    finally:
        os.close(fd)
    # Fault every page in now, as allocate_kv_cache does: lazily faulted pages cost early requests a fault per block.
    cache.view(torch.uint8).zero_()
    return cache


def _map(fd: int, nbytes: int) -> mmap.mmap:
    if os.fstat(fd).st_size < nbytes:
        raise ValueError(f"a shared KV cache segment of {os.fstat(fd).st_size} bytes, {nbytes} expected")
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # attention reads a few KB per block across thousands of blocks: fewer TLB misses
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mapping


def _tensor(mapping: mmap.mmap, spec: KVCacheSpec) -> torch.Tensor:
    # The tensor keeps ``mapping`` alive (torch.frombuffer holds the buffer).
    return torch.frombuffer(mapping, dtype=torch.uint8)[:cache_nbytes(spec)].view(spec.dtype).view(spec.shape)
