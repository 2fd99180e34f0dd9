"""Space management for the sender's shared-memory staging ring.

Chunks are allocated in FIFO order around a fixed region and usually released in that order (acks
from one receiver arrive in order); acks from several receivers interleave, so a release may come
early: it is remembered, and space is reclaimed once everything older is released too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class _Span:
    offset: int
    size: int
    released: bool = False


class RingAllocator:
    def __init__(self, capacity_bytes: int, align_bytes: int = 4096) -> None:
        self.capacity_bytes = capacity_bytes
        self._align = align_bytes
        self._spans: deque[_Span] = deque()  # allocation order, oldest first
        self._by_offset: dict[int, _Span] = {}

    def alloc(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` of free space, or None until older chunks are released."""
        size = -(-max(nbytes, 1) // self._align) * self._align
        if size > self.capacity_bytes:
            raise ValueError(f"chunk of {nbytes} bytes exceeds the {self.capacity_bytes}-byte ring")
        if not self._spans:
            offset: int | None = 0
        else:
            oldest, newest = self._spans[0].offset, self._spans[-1]
            end = newest.offset + newest.size
            if newest.offset < oldest:  # wrapped: free space is the gap up to the oldest span
                offset = end if end + size <= oldest else None
            elif end + size <= self.capacity_bytes:
                offset = end
            else:  # wrap to the front (the tail gap stays unused until everything before it drains)
                offset = 0 if size <= oldest else None
        if offset is None:
            return None
        span = _Span(offset, size)
        self._spans.append(span)
        self._by_offset[offset] = span
        return offset

    def release(self, offset: int) -> None:
        span = self._by_offset.pop(offset, None)
        if span is None:
            return
        span.released = True
        while self._spans and self._spans[0].released:
            self._spans.popleft()

    @property
    def used_spans(self) -> int:
        return len(self._spans)
