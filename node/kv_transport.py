"""The KV transport a worker moves its cache with, built the same way by both roles: one transport over the cache, or
with tensor parallelism one per rank's cache, driven as one (kv_transfer/transports/ranked.py)."""

from __future__ import annotations

from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.transports import KVTransport, get_transport_class
from pdcluster.kv_transfer.transports.base import Role
from pdcluster.kv_transfer.transports.ranked import RankedTransport


def open_transport(transfer: TransferConfig, model: LoadedModel, role: Role) -> KVTransport:
    """``model`` loaded with ``share_rank_caches=True`` where it is split across ranks."""
    cls = get_transport_class(transfer.transport)
    config = transfer.transport_config()
    if not model.rank_kv_caches:
        return cls(model.kv_cache, role, config)
    parts: list[KVTransport] = []
    try:
        for cache in model.rank_kv_caches:
            parts.append(cls(cache, role, config))
    except BaseException:
        for part in parts:
            part.close()
        raise
    return RankedTransport(parts)
