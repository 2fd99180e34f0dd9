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
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Segment:
    fd: int
    nbytes: int
    address: int  # where this process mapped it


_lock = threading.Lock()
_segments: dict[int, Segment] = {}  # address -> segment, for tensors made by shared_tensor()


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
    address = tensor.data_ptr()
    with _lock:
        _segments[address] = Segment(fd, nbytes, address)
    # The descriptor is only needed to share the segment; drop it with the tensor (the tensor keeps
    # the mapping alive through torch.frombuffer's reference to ``mm``).
    weakref.finalize(tensor, _forget, address)
    return tensor


def _forget(address: int) -> None:
    with _lock:
        seg = _segments.pop(address, None)
    if seg is not None:
        os.close(seg.fd)


def find_segment(tensor: torch.Tensor) -> tuple[Segment, int] | None:
    """The registered segment holding all of ``tensor``, and the tensor's byte offset in it."""
    if tensor.is_cuda:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock:
        for seg in _segments.values():
            if seg.address <= start and end <= seg.address + seg.nbytes:
                return seg, start - seg.address
    return None


def map_cache(fd: int, offset: int, nbytes: int, num_layers: int, num_blocks: int, block_bytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Map a peer's shared cache (received as ``fd``) as ``[num_layers * 2, num_blocks, block_bytes]``
    bytes. Returns the mapping too: it must outlive the array."""
    mapping = map_fd(fd, offset + nbytes)
    flat = np.frombuffer(mapping, dtype=np.uint8)[offset : offset + nbytes]
    return mapping, flat.reshape(num_layers * 2, num_blocks, block_bytes)
