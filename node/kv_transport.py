"""The KV transport a worker moves its cache with, built the same way by both roles: one transport over the cache, or
with tensor parallelism one per rank's cache, driven as one (kv_transfer/transports/ranked.py)."""

from __future__ import annotations

import functools
import os

import torch

from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.engine.mamba_state_resplit import resplit_state
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.transports import KVTransport, get_transport_class
from pdcluster.kv_transfer.transports.base import Role
from pdcluster.kv_transfer.transports.common.memfd import find_segment, shared_tensor
from pdcluster.kv_transfer.transports.ranked import transport_over
from pdcluster.kv_transfer.transports.resplit import ResplitSender


def rank_cache_allocator(transfer: TransferConfig):
    """How rank 0 makes the other ranks' caches for ``transfer``'s transport (LoadedModel.load's
    ``rank_cache_allocator``): shm's own segments, which its peers copy into and out of directly (one copy a chunk
    instead of two through its staging ring); None (the engine's memfd) for the others."""
    if transfer.transport != "shm":
        return None

    def allocate(kv_spec) -> tuple[torch.Tensor, int]:
        cache = shared_tensor(kv_spec.shape, kv_spec.dtype)
        segment, offset = find_segment(cache)
        assert offset == 0, "shared_tensor maps each cache at the start of its own segment"
        return cache, os.dup(segment.fd)  # the rank's descriptor; the registry keeps its own for the transport

    return allocate


def open_transport(transfer: TransferConfig, model: LoadedModel, role: Role) -> KVTransport:
    """``model`` loaded with ``share_rank_caches=True`` where it is split across ranks. A sender also reaches decode
    workers split another number of ways (kv_transfer/transports/resplit.py)."""
    cls = get_transport_class(transfer.transport)
    config = transfer.transport_config()
    caches = model.rank_kv_caches or (model.kv_cache,)
    transport = transport_over(caches, lambda cache: cls(cache, role, config))
    if role != "sender":
        return transport
    # A hybrid's Mamba state is packed per rank: re-packed for a peer split another way.
    relayout_state = functools.partial(resplit_state, shape=model.state_shape) if model.num_state_blocks else None
    return ResplitSender(transport, caches,
                         make_part=lambda cache: cls(cache, "sender", config), allocate=cls.allocate_kv_cache,
                         relayout_state=relayout_state)
