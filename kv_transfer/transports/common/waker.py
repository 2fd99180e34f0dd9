"""Wake an IO thread that sleeps in select/epoll/zmq.poll when a caller queues work."""

from __future__ import annotations

import os


class Waker:
    """An eventfd: ``wake`` from any thread, the IO thread polls ``fileno`` and ``drain``s it."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def fileno(self) -> int:
        return self._fd

    def wake(self) -> None:
        try:
            os.eventfd_write(self._fd, 1)
        except (BlockingIOError, OSError):
            pass  # counter saturated or closed: the thread is awake or gone either way

    def drain(self) -> None:
        try:
            os.eventfd_read(self._fd)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
