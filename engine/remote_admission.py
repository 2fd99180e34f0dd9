"""Decode side of a KV transfer: where a request's prompt KV is to land, and how much of it this worker
already holds (decode-side prefix reuse, as SGLang's decode-side reuse and vLLM's NIXL connector with a
local prefix hit do).

The prompt is matched against this worker's own prefix cache first; the matched blocks are taken by
reference (as the scheduler's waiting loop takes a prefix-cache hit) and only the rest is reserved for
the KV that the prefill worker sends. The prefill worker still computes the whole prompt (the first
token needs it) but sends only the blocks after the reused ones.

Why this is token-exact against a transfer of the whole prompt: deterministic mode (the default on CPU,
EngineConfig.deterministic) makes every KV entry bitwise independent of the batch, the chunking and the
worker that computed it (same model, same kernels), so a block this worker computed while decoding an
earlier turn holds the very bytes the prefill worker would have sent. Without deterministic mode the
reuse is as exact as a local prefix-cache hit, no more.

A prefix that continues past the device pool in this worker's offload tiers (engine/kv_offload/: host
memory, disk) counts too: those blocks are reserved with the rest and loaded back on the loader thread
(the engine keeps stepping), and only when the load ends does the worker ask the prefill worker, for the
blocks after the ones that arrived intact. Asking after the load, not during it, is what keeps a
deleted or corrupt disk block harmless: the prefill worker is then simply asked for it (a host-memory
load takes microseconds a block; the prefill worker's compute, which the ask starts, is what the first
token waits for either way). Hybrids never reuse: they have no prefix cache (engine/loaded_model.py),
and their Mamba state travels in blocks after the prompt's, which the prefill worker always sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.kv_offload.gate import NoOffload
from pdcluster.engine.mamba_state_blocks import tokens_with_state
from pdcluster.engine.request import Request


@dataclass
class RemoteReservation:
    """A remote request's admission: the blocks its KV lands in, in prompt order after the reused ones
    (then a hybrid's state blocks), and how many leading prompt blocks are already here (reused).
    While ``num_loading_blocks`` > 0 the blocks after the reused ones are first loaded from the offload
    tiers; the final split comes with the load's end (``for_request`` then)."""

    dst_block_ids: list[int]
    num_reused_blocks: int
    num_reused_tokens: int  # num_reused_blocks * block_size: always fewer than the prompt's tokens
    num_loading_blocks: int = 0

    @classmethod
    def for_request(cls, request: Request, num_reused_blocks: int, block_size: int) -> "RemoteReservation":
        return cls(list(request.block_ids[num_reused_blocks:]), num_reused_blocks, num_reused_blocks * block_size)


def reserve_remote(block_manager: BlockManager, config: EngineConfig, request: Request,
                   num_state_blocks: int, offload: NoOffload | None = None) -> RemoteReservation | None:
    """Take the request's cached prefix (``config.decode_prefix_reuse``) and reserve blocks for the rest
    of its prompt (and a hybrid's state blocks right after), only if the pool also has room for its first
    decode step (first token + drafts); start loading what the offload tiers hold after the cached
    prefix. None, nothing changed, when it cannot hold it now."""
    bs, n = config.block_size, request.num_prompt_tokens
    offload = offload or NoOffload()
    cached, hashes, num_lower = [], [], 0
    if config.decode_prefix_reuse and not num_state_blocks:
        # At least one prompt token is left out of the match (usable_block_hashes), so the prefill worker
        # always sends the tail block: its TransferDone then follows a send from post_forward (S2).
        hashes = block_manager.usable_block_hashes(request)
        cached = block_manager.find_cached_prefix(request, hashes)
        mtp = config.spec_method == "mtp"
        if cached and mtp:
            # The MTP layer's entry at position p depends on token p + 1: the last matched block's last
            # entry was written for whatever followed it where it was computed (see Scheduler.schedule).
            cached = cached[:-1]
        num_lower = offload.num_lower_blocks(cached, hashes, keep_last=mtp)
    need = -(-(n + 1 + config.num_spec_steps) // bs)
    num_tokens = n
    if num_state_blocks:
        num_tokens = tokens_with_state(n, bs, num_state_blocks)
        need = max(need, num_tokens // bs)
    # Cached blocks in use by another request cost no free block; those with no owner leave the free queue.
    num_revived = sum(block_manager.blocks[b].ref_count == 0 for b in cached)
    if block_manager.num_free_blocks_for(out_of_stream=True) < need - len(cached) + num_revived:
        return None
    if not block_manager.reserve(request, num_tokens, cached):
        return None
    offload.settle_evictions()  # the reserved blocks' old KV copied out before a sender writes them
    reservation = RemoteReservation.for_request(request, len(cached), bs)
    if num_lower:
        offload.start_remote(request, len(cached), hashes[len(cached): len(cached) + num_lower])
        reservation.num_loading_blocks = num_lower
    return reservation


def reservation_after_load(request: Request, block_size: int) -> RemoteReservation:
    """A remote request whose lower-tier prefix load ended: the blocks after those that arrived intact
    (engine/kv_offload/gate.py sets ``num_offloaded_tokens``) are what the prefill worker is to send."""
    num_reused = request.num_offload_base_blocks + request.num_offloaded_tokens // block_size
    return RemoteReservation.for_request(request, num_reused, block_size)
