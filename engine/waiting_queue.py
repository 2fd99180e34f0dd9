"""The scheduler's waiting queue, ordered by request priority (vLLM's ``priority``: lower runs first).

One FIFO deque per priority value, walked from the lowest value up. Within a priority it is exactly the
deque the scheduler always used (``append`` for arrivals, ``appendleft`` for a preempted request, which
was first in line, ``extendleft`` for requests whose wait ended), so with every request at the default
priority 0 the order is the first-come-first-served order unchanged.

A request's priority is its SamplingParams' (it never changes). The scheduler also walks its running
requests in priority order (stable: admission order within a priority), so a step's token budget goes to
the most urgent first and the request preempted when blocks run out is the least urgent, admitted last
(with one priority: the last admitted, as always).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

from pdcluster.engine.request import Request


def priority_of(request: Request) -> int:
    return request.sampling_params.priority


class WaitingQueue:
    """The deque operations the scheduler uses, over one deque per priority."""

    def __init__(self) -> None:
        self._bands: dict[int, deque[Request]] = {}
        self._order: list[int] = []  # the priorities with waiting requests, ascending (empty bands are dropped)
        # Whether any request with a priority other than 0 ever entered: until one does, nothing needs
        # ordering by priority (the scheduler skips sorting its running requests, a per-step cost).
        self.prioritized = False

    def _band(self, priority: int) -> deque[Request]:
        band = self._bands.get(priority)
        if band is None:
            self.prioritized = self.prioritized or priority != 0
            band = self._bands[priority] = deque()
            self._order.append(priority)
            self._order.sort()
        return band

    def _drop_if_empty(self, priority: int) -> None:
        if not self._bands[priority]:
            del self._bands[priority]
            self._order.remove(priority)

    def append(self, request: Request) -> None:
        self._band(priority_of(request)).append(request)

    def appendleft(self, request: Request) -> None:
        self._band(priority_of(request)).appendleft(request)

    def extendleft(self, requests: Iterable[Request]) -> None:
        """As deque.extendleft: each goes to the front of its priority in turn (pass them reversed to keep
        their order)."""
        for request in requests:
            self.appendleft(request)

    def popleft(self) -> Request:
        if not self._order:
            raise IndexError("pop from an empty waiting queue")
        priority = self._order[0]
        request = self._bands[priority].popleft()
        self._drop_if_empty(priority)
        return request

    def remove(self, request: Request) -> None:
        priority = priority_of(request)
        band = self._bands.get(priority)
        if band is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        band.remove(request)
        self._drop_if_empty(priority)

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of the waiting queue is read (index 0)")
        if not self._order:
            raise IndexError("the waiting queue is empty")
        return self._bands[self._order[0]][0]

    def __iter__(self) -> Iterator[Request]:
        for priority in list(self._order):
            yield from self._bands[priority]

    def __reversed__(self) -> Iterator[Request]:
        for priority in reversed(list(self._order)):
            yield from reversed(self._bands[priority])

    def __len__(self) -> int:
        return sum(len(self._bands[p]) for p in self._order)

    def __bool__(self) -> bool:
        return bool(self._order)

