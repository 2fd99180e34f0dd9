"""Tensors registered by the address of their memory, each entry dropped when its tensor is collected
(the shared caches of shm's memfd.py and cuda_ipc's handle.py, found again by address).

The drop runs from the garbage collector, and a collection may start at any allocation: also on a
thread that holds the registry's lock, inside a lookup (CI hung so: a finalizer waiting for the lock
its own thread held). So the finalizer only queues the address (``deque.append`` takes no lock), and
whoever takes the lock next applies the queue first, before reading or adding an entry (an address
freed and reused is thus dropped before it is registered again).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

V = TypeVar("V")


class TensorRegistry(Generic[V]):
    """address -> value. ``on_drop(value)`` runs, outside the lock, for each entry dropped."""

    def __init__(self, on_drop: Callable[[V], None] | None = None):
        self._lock = threading.Lock()
        self._entries: dict[int, V] = {}
        self._dropped: deque[int] = deque()  # addresses whose tensor was collected, not yet removed
        self._on_drop = on_drop

    def add(self, tensor: torch.Tensor, value: V) -> None:
        address = tensor.data_ptr()
        with self._lock:
            gone = self._apply_drops()
            self._entries[address] = value
        self._after(gone)
        weakref.finalize(tensor, self._dropped.append, address)

    def items(self) -> list[tuple[int, V]]:
        """A snapshot of the live entries."""
        with self._lock:
            gone = self._apply_drops()
            items = list(self._entries.items())
        self._after(gone)
        return items

    def find(self, tensor: torch.Tensor, size_of: Callable[[V], int]) -> Iterator[tuple[int, V]]:
        """Entries whose memory (``size_of(value)`` bytes from their address) holds all of ``tensor``."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return ((a, v) for a, v in self.items() if a <= start and end <= a + size_of(v))

    def _apply_drops(self) -> list[V]:
        gone = []
        while self._dropped:
            value = self._entries.pop(self._dropped.popleft(), None)
            if value is not None:
                gone.append(value)
        return gone

    def _after(self, gone: list[V]) -> None:
        if self._on_drop is not None:
            for value in gone:
                self._on_drop(value)
