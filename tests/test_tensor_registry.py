"""The registry of shared caches by address (kv_transfer/transports/common/tensor_registry.py): an entry
goes when its tensor is collected, also when the collection starts on a thread that holds the registry's
lock. CI hung there once: shm's and cuda_ipc's finalizers took the lock a lookup on the same thread held
(every cuda_ipc test after it timed out)."""

from __future__ import annotations

import gc
import threading

import torch

from pdcluster.kv_transfer.transports.common.tensor_registry import TensorRegistry


def test_entries_are_found_by_the_memory_they_cover():
    registry: TensorRegistry[int] = TensorRegistry()
    cache = torch.zeros(64)
    registry.add(cache, cache.numel() * cache.element_size())
    assert [a for a, _ in registry.find(cache[8:16], lambda n: n)] == [cache.data_ptr()]
    assert list(registry.find(torch.zeros(4), lambda n: n)) == []


def test_a_tensor_collected_while_the_registry_is_locked_is_dropped_without_deadlock():
    dropped = []
    registry: TensorRegistry[str] = TensorRegistry(on_drop=dropped.append)
    cycle = {"tensor": torch.zeros(16)}
    cycle["self"] = cycle  # only the cyclic collector frees it: the collection is ours to start
    registry.add(cycle["tensor"], "cache")
    del cycle

    def collect_inside_a_lookup():
        with registry._lock:  # as a lookup holds it when an allocation starts a collection
            gc.collect()

    worker = threading.Thread(target=collect_inside_a_lookup, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the finalizer waited for the lock its own thread holds"
    assert registry.items() == [] and dropped == ["cache"]
