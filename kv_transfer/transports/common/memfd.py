"""Shared memory for the shm transport (its caches and staging ring, made in shm/transport.py and
mapped by the receiver in inbox.py): anonymous memfd segments, passed between processes as file
descriptors over a unix socket (SCM_RIGHTS).

Why memfd rather than named /dev/shm segments: a memfd has no name to unlink, so nothing leaks when a
worker is killed; the memory is freed when the last descriptor and mapping are gone, whichever
process held them.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.kv_transfer.transports.common.tensor_registry import TensorRegistry


@dataclass
class Segment:
    fd: int
    nbytes: int
    address: int  # where this process mapped it


# address -> segment, for tensors made by shared_tensor(); a collected tensor's descriptor is closed.
_segments: TensorRegistry[Segment] = TensorRegistry(on_drop=lambda seg: os.close(seg.fd))


def create_segment(nbytes: int, name: str) -> tuple[int, mmap.mmap]:
    """A new zero-filled memfd of ``nbytes`` and a shared read-write mapping of it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def map_fd(fd: int, nbytes: int) -> mmap.mmap:
    """Map a segment received from a peer, then close our descriptor: the mapping keeps it alive."""
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def mapping_address(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, dtype=np.uint8).ctypes.data


def shared_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a memfd segment, registered so a transport built on it can hand the
    segment to senders (see find_segment)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    fd, mm = create_segment(max(nbytes, 1), "pdcluster-kv-cache")
    tensor = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes].view(dtype).view(tuple(shape))
    # The descriptor is only needed to share the segment; it is closed once the tensor is collected
    # (the tensor keeps the mapping alive through torch.frombuffer's reference to ``mm``).
    _segments.add(tensor, Segment(fd, nbytes, tensor.data_ptr()))
    return tensor


def find_segment(tensor: torch.Tensor) -> tuple[Segment, int] | None:
    """The registered segment holding all of ``tensor``, and the tensor's byte offset in it."""
    if tensor.is_cuda:
        return None
    for _, seg in _segments.find(tensor, lambda seg: seg.nbytes):
        return seg, tensor.data_ptr() - seg.address
    return None


def map_cache(fd: int, offset: int, nbytes: int, num_rows: int, num_blocks: int, block_bytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Map a peer's shared cache (received as ``fd``) as ``[num_rows, num_blocks, block_bytes]`` bytes, ``num_rows``
    its layers times its planes (K, V). Returns the mapping too: it must outlive the array."""
    mapping = map_fd(fd, offset + nbytes)
    flat = np.frombuffer(mapping, dtype=np.uint8)[offset : offset + nbytes]
    return mapping, flat.reshape(num_rows, num_blocks, block_bytes)
