"""What a caller hands a transport's IO thread (io_thread.py), and how it waits for the answer.

Callers never touch the IO thread's sockets or UCX worker; they queue an :class:`IOCommand`. One that
needs an answer (a connect, an shm grant or revoke) carries an :class:`IOCall` its caller waits on,
bounded. A caller that stops waiting is not answered any more; what the IO thread finds later goes
to the call's ``on_late`` instead (shm reports a late revoke through ``poll_revoked`` that way).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class IOCall:
    """One caller waiting for the IO thread's answer to one command."""

    on_late: Callable[[object], None] | None = None  # gets the result when the caller gave up first
    result: object = None
    error: Exception | None = None  # what the command raised, for the caller to raise in turn
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # answering vs. giving up
    _abandoned: bool = False

    def wait(self, timeout_s: float) -> bool:
        """True once answered; False if no answer came within ``timeout_s`` (the caller gives up)."""
        if self._done.wait(timeout_s):
            return True
        with self._lock:
            if self._done.is_set():  # answered while we took the lock
                return True
            self._abandoned = True
            return False

    def answer(self, result: object, error: Exception | None = None) -> None:
        """IO thread: hand the caller its result (or the command's error)."""
        with self._lock:
            if not self._abandoned:
                self.result, self.error = result, error
                self._done.set()
                return
        if self.on_late is not None and error is None:
            self.on_late(result)


@dataclass
class IOCommand:
    """``run(*args)`` on the IO thread; its result or error goes to ``call`` when there is one."""

    run: Callable[..., object]
    args: tuple
    call: IOCall | None = None

    def execute(self) -> None:
        if self.call is None:
            self.run(*self.args)  # nobody waits: an error is the IO thread's own (io_thread.py)
            return
        try:
            result = self.run(*self.args)
        except Exception as e:  # noqa: BLE001 - handed to the waiting caller, who raises it
            self.call.answer(None, e)
            return
        self.call.answer(result)
