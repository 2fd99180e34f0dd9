"""The one thread that owns an endpoint's zmq sockets: its poller, its wake-ups and its command queue.

zmq sockets are not thread-safe, so callers' threads never touch them: they ``_post`` a command
(run on this thread as ``_cmd_<name>``) and wake the thread through a socketpair. Every wait is
bounded by ``POLL_CAP_S``, so the timer (heartbeats) and ``close()`` are never late by more than
that. What the thread does with what it reads is the subclass's (endpoint.py); this module knows
nothing of messages.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any

import zmq

log = logging.getLogger(__name__)

POLL_CAP_S = 0.1  # longest the I/O thread sleeps
RECV_BATCH = 256  # messages read from one socket per loop turn, so one busy peer cannot starve the rest


class IOLoop:
    """The I/O thread and what feeds it. Subclasses read their sockets in ``_receive`` and act on the
    timer in ``_on_timer`` (every ``timer_interval_s``) and after every turn in ``_after_turn``."""

    def __init__(self, name: str, *, thread_name: str, timer_interval_s: float, max_frame_bytes: int):
        self._name = name
        self._timer_interval_s = timer_interval_s
        self._frame_cap = max_frame_bytes
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # pyzmq's poller reports a plain socket by its fd, so the fd is what is registered and compared.
        self._wake_fd = self._wake_r.fileno()
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = threading.Event()
        # daemon: an endpoint someone forgot to close must not keep the worker process from exiting.
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    # --- any thread ------------------------------------------------------------------------------------

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the I/O thread and close every socket (linger 0). Idempotent."""
        self._closing.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("%s: I/O thread still running %.1f s after close()", self._name, timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _post(self, command: str, *args: Any) -> None:
        """Have the I/O thread run ``self._cmd_<command>(*args)``."""
        if self._closing.is_set() or not self._thread.is_alive():
            raise RuntimeError(f"{self._name} is closed")
        self._commands.put((command, args))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # buffer full (a wake-up is already pending) or already closed: both fine
            pass

    def _start(self) -> None:
        self._thread.start()

    def _release(self) -> None:
        """Close the context (and every socket in it) and the wake-up pair: when the thread ends, or
        when construction fails before it started."""
        self._ctx.destroy(linger=0)
        self._wake_r.close()
        self._wake_w.close()

    def _new_socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._frame_cap)
        return sock

    # --- the I/O thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        next_timer = time.monotonic()
        try:
            while not self._closing.is_set():
                wait = min(max(next_timer - time.monotonic(), 0.0), POLL_CAP_S)
                backlog = False
                for sock, _ in self._poller.poll(wait * 1000):
                    if sock == self._wake_fd:
                        self._drain_wakeups()
                    else:
                        backlog |= self._receive(sock)
                self._run_commands()
                now = time.monotonic()
                if now >= next_timer:
                    self._on_timer()
                    next_timer = now + self._timer_interval_s
                self._after_turn(now, backlog)
        except Exception:
            log.exception("%s: control-plane I/O thread crashed; the endpoint is unusable", self._name)
        finally:
            self._closing.set()
            self._on_shutdown()
            self._release()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _run_commands(self) -> None:
        while True:
            try:
                command, args = self._commands.get_nowait()
            except queue.Empty:
                return
            getattr(self, f"_cmd_{command}")(*args)

    # --- the subclass's part ---------------------------------------------------------------------------

    def _receive(self, sock: zmq.Socket) -> bool:
        """Read up to RECV_BATCH messages from ``sock``; True when more may be waiting."""
        raise NotImplementedError

    def _on_timer(self) -> None:
        """Runs every ``timer_interval_s`` (at the first turn too)."""

    def _after_turn(self, now: float, backlog: bool) -> None:
        """Runs after every turn; ``backlog``: a socket may hold messages not read yet."""

    def _on_shutdown(self) -> None:
        """Last words before the sockets close (in the I/O thread)."""
