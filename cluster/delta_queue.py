"""A request's stream queue: unbounded, one consumer, on the event loop that made it.

Every streamed token passes through one (the routers' per-request queues, the API process's
RemoteRouter). ``asyncio.Queue`` checks its loop and keeps a deque of getters on every call; a stream
has one getter, so this keeps one waiter and no checks: a router process behind two API processes spent
8.8% of its Python time in asyncio.Queue's loop check alone (py-spy, 128 streams).
"""

from __future__ import annotations

import asyncio
from collections import deque


class DeltaQueue:
    """``put_nowait`` from the loop's thread only (other threads: ``loop.call_soon_threadsafe``)."""

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._loop = asyncio.get_running_loop()

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self):
        items = self._items
        while not items:
            if self._waiter is not None:
                raise RuntimeError("DeltaQueue has one consumer: get() while another get() waits")
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled: no put resolved it
                    self._waiter = None
        return items.popleft()

    def peek(self):
        """The next item without taking it (the queue must not be empty)."""
        return self._items[0]

    def get_nowait(self):
        """The next item (the queue must not be empty): a consumer taking what is already there."""
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
