"""The host-memory tier: one preallocated tensor of block slots, least recently used evicted first.

A slot holds one block's KV for every layer, ``[num_layers, 2, block_size, num_kv_heads, head_dim]``
(the block's column of the paged cache, engine/kv_cache.py). The memory is pinned when the device
cache is on a GPU, so the copies in and out are DMA transfers that do not stall the host.

On a GPU a block's copy out is only queued (on the engine's compute stream, which orders it before any
later write to the device block); a CUDA event recorded after it marks when the slot holds the block.
Whoever reads the slot waits for that event: a load's stream on the device (no host stall), the spill of
an old slot to disk on the host (by then its copy has almost always ended)."""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict

import torch

log = logging.getLogger(__name__)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Pinned host memory of exactly this size. torch's pinned allocator rounds every allocation up to a power of
    two (a 40 GiB tier would pin 64, a 70 GiB one all of a 128 GiB host), so this is ordinary memory registered with
    CUDA; ``unpin`` unregisters it. Where registering fails: torch's pinned allocation, said once."""
    data = torch.empty(shape, dtype=dtype)
    num_bytes = data.numel() * data.element_size()
    error = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), num_bytes, 0)
    if int(error) == 0:
        return data
    log.warning("KV offload: registering %d bytes of host memory with CUDA failed (%s); pinning through torch's "
                "allocator, which rounds the size up to a power of two", num_bytes, error)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def unpin(data: torch.Tensor) -> None:
    """Undo ``pinned_empty``'s registration once nothing on the device may still copy to or from ``data``."""
    try:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(data.data_ptr())  # an error for torch's own pinned memory: ignored
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the process frees the memory anyway
        pass


class HostTier:
    name = "host"

    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool = False) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"host tier capacity must be at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        shape = (capacity_blocks, *block_shape)
        self.data = pinned_empty(shape, dtype) if pin_memory else torch.empty(shape, dtype=dtype)
        # Unregistered when the tier is closed or collected (the finalizer holds the tensor until then).
        self._unpin = weakref.finalize(self, unpin, self.data) if pin_memory else None
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # block hash -> slot; order = LRU first
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self._copied: dict[int, torch.cuda.Event] = {}  # slot -> recorded after its queued copy in (GPU)

    @property
    def num_blocks(self) -> int:
        return len(self._slot_of)

    @property
    def bytes_per_block(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def hashes(self) -> list[int]:
        return list(self._slot_of)

    def touch(self, block_hash: int) -> None:
        self._slot_of.move_to_end(block_hash)

    def store(self, block_hash: int, block_kv: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """Copy one block in. Returns the least recently used block it pushed out, as
        ``(hash, a CPU copy of its KV)``, for the tier below; None when a slot was free."""
        if block_hash in self._slot_of:
            self.touch(block_hash)
            return None
        evicted = None
        if not self._free_slots:
            old_hash, old_slot = self._slot_of.popitem(last=False)
            copied = self._copied.pop(old_slot, None)
            if copied is not None:
                copied.synchronize()  # the least recently used slot: its copy ended long ago, as a rule
            evicted = (old_hash, self.data[old_slot].clone())
            self._free_slots.append(old_slot)
        slot = self._free_slots.pop()
        if block_kv.is_cuda:
            self.data[slot].copy_(block_kv, non_blocking=self.data.is_pinned())
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()  # on the current (compute) stream, after the copy
        else:
            self.data[slot].copy_(block_kv)
        self._slot_of[block_hash] = slot
        return evicted

    def load(self, block_hash: int, out: torch.Tensor) -> bool:
        slot = self._slot_of.get(block_hash)
        if slot is None:
            return False
        copied = self._copied.get(slot)
        if copied is not None and out.is_cuda:
            torch.cuda.current_stream(out.device).wait_event(copied)  # the loader's stream, on the device
        out.copy_(self.data[slot], non_blocking=self.data.is_pinned())
        if out.is_cuda:
            # Ended before the caller lets go of the tiers' lock: the engine thread may reuse the slot
            # right after (one block, microseconds).
            torch.cuda.current_stream(out.device).synchronize()
        self.touch(block_hash)
        return True

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()

    def clear(self) -> list[int]:
        """Forget every block (a prefix-cache reset: engine/llm_engine.py ``reset_prefix_cache``); returns their
        hashes. Each slot is freed as ``drop`` frees it, so used + free stays the capacity (audit.py)."""
        block_hashes = list(self._slot_of)
        for block_hash in block_hashes:
            self.drop(block_hash)
        return block_hashes

    def drop(self, block_hash: int) -> bool:
        slot = self._slot_of.pop(block_hash, None)
        if slot is None:
            return False
        copied = self._copied.pop(slot, None)
        if copied is not None:
            copied.synchronize()  # a slot is reused only once its copy in has ended
        self._free_slots.append(slot)
        return True
