"""KV events: which blocks a worker's engine holds, by tier, as they change (stored / removed), for the
router's global index (cluster/router/kv_index.py). The block manager reports the device pool, the tiers
report host and disk (the disk tier from its writer thread: hence the lock)."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from typing import Sequence

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.kv_offload.manager import OffloadManager
from pdcluster.engine.kv_offload.tiers import OffloadEvent

MAX_PENDING_EVENTS = 100_000  # an undrained log drops its oldest (the router's index is a hint, not truth)


class KVEventLog:
    """Entries (kind, tier, block hashes, runs): ``runs`` the device tier's StoredRuns (engine/block_manager.py)
    where the engine describes its stores for events published outside the cluster, else None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Bounded: an engine nobody drains (offline generate) drops its oldest events in O(1) each.
        self._events: deque[tuple[str, str, list[int], list | None]] = deque(maxlen=MAX_PENDING_EVENTS)
        self.num_dropped = 0

    def record(self, kind: str, tier: str, block_hashes: list[int], runs: list | None = None) -> None:
        with self._lock:
            if len(self._events) == MAX_PENDING_EVENTS:
                self.num_dropped += 1
            self._events.append((kind, tier, list(block_hashes), runs))

    def on_offload_event(self, event: OffloadEvent) -> None:
        self.record(event.kind, event.tier, event.block_hashes)

    def drain(self) -> list[tuple[str, str, list[int]]]:
        """Every event since the last drain, oldest first: (kind "stored"|"removed", tier, block hashes)."""
        return [entry[:3] for entry in self.drain_described()]

    def drain_described(self) -> list[tuple[str, str, list[int], list | None]]:
        """``drain`` with each entry's StoredRuns (or None) as a fourth item."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events


def layout_namespace(model_dir: str, dtype_name: str, kv_cache: torch.Tensor, kv_fingerprint: str = "",
                     tensor_parallel_size: int = 1) -> str:
    """The disk tier's folder for this KV layout: another model's or shape's blocks are never read as ours, nor
    blocks made by other LoRA adapters (a changed adapter file) under a name we serve, nor blocks of another RoPE
    table (``kv_fingerprint``: CausalLM.kv_fingerprint), nor blocks of the model split another way
    (``tensor_parallel_size``; ``kv_cache`` is then rank 0's): past the first layer a split model's KV rounds as its
    all-reduces do, and a block from another split would break the token-exact promise."""
    key = f"{model_dir}|{dtype_name}|{tuple(kv_cache.shape[:2])}|{tuple(kv_cache.shape[3:])}"
    if kv_fingerprint:
        key += f"|kv:{kv_fingerprint}"
    if tensor_parallel_size > 1:
        key += f"|tp:{tensor_parallel_size}"
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def make_offload_manager(config: EngineConfig, kv_caches: Sequence[torch.Tensor], model_dir: str, dtype_name: str,
                         events: KVEventLog, kv_fingerprint: str = "", loader: bool = False) -> OffloadManager | None:
    """``kv_caches``: the engine's cache, or every rank's of a split model (rank 0's first). ``loader``: a manager
    (its loader thread) even without tiers, for a connector that loads prompts' KV from elsewhere."""
    offload = config.offload_config()
    if not offload.enabled and not loader:
        return None
    namespace = layout_namespace(model_dir, dtype_name, kv_caches[0], kv_fingerprint, len(kv_caches))
    return OffloadManager(offload, kv_caches, namespace, on_event=events.on_offload_event)
