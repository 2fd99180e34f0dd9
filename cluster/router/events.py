"""The worker -> router event stream: a zmq PULL socket read on the router's asyncio loop, each message
decoded into a typed event (node/events.py) and handed to the router. A malformed message is dropped and
logged; the receiver lives on.

Read on the loop, not by a thread of its own: the loop is where every event ends up, so a burst costs no
hand-over (the reader thread woke the loop with a self-pipe write a burst and took the GIL from it to
decode), and the router's handler can pass each token on at once (ClusterRouter.deliver). With the push
path, the router process behind two API processes spends 0.81x the CPU per streamed token
(bench/results/served_router_push_s40.json).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

import zmq

from pdcluster.wire.records import ProtocolError
from pdcluster.node.events import EVENT_CODEC, MAX_EVENT_BYTES, Event

log = logging.getLogger(__name__)

# Messages read in one turn of the loop before others get theirs (the rest: next turn). A decode step of a
# big batch is one StepTokens plus a Tokens per finished or logprobs row.
MAX_BURST = 1024


class EventReceiver:
    def __init__(self, host: str, on_event: Callable[[Event], None]):
        self._on_event = on_event
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pull = zmq.Context.instance().socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._fd = self._pull.getsockopt(zmq.FD)
        # The socket is read by whichever loop is bound; the lock covers the moment a router moves from a
        # loop that still runs to another (bind), so two threads never read it at once.
        self._lock = threading.Lock()
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver events on ``loop`` from now on (call it on that loop's thread). A router may be rebound
        to a new loop after the old one closed (each ``asyncio.run`` is a new loop): events that arrived in
        between are delivered on the new one."""
        with self._lock:
            old, self._loop = self._loop, loop
        if old is loop or self._closed:
            return
        if old is not None and not old.is_closed():
            old.call_soon_threadsafe(old.remove_reader, self._fd)
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # the FD signals edges: messages already queued raised theirs before

    def close(self) -> None:
        with self._lock:
            self._closed = True
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if loop.is_running() and here is not loop:
                # Another thread's loop watches the socket's FD: it stops watching, then closes it there
                # (closing it here could leave that loop polling a closed FD).
                try:
                    loop.call_soon_threadsafe(self._close_on, loop)
                    return
                except RuntimeError:  # it closed meanwhile: its readers went with it
                    pass
            else:
                loop.remove_reader(self._fd)
        self._pull.close(0)

    def _close_on(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._fd)
        self._pull.close(0)

    def _drain(self) -> None:
        """On the bound loop: read what is queued (a bounded burst), then hand it over in arrival order."""
        events: list[Event] = []
        with self._lock:
            if self._closed or self._loop is not asyncio.get_running_loop():
                return  # a loop this receiver left: its reader is being removed
            for _ in range(MAX_BURST):
                try:
                    data = self._pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    events.append(EVENT_CODEC.decode(data, MAX_EVENT_BYTES))
                except ProtocolError as e:
                    log.warning("dropping malformed worker event (%d bytes): %s", len(data), e)
            # zmq's FD signals edges, and only reading EVENTS re-arms it: whatever is still queued (the rest
            # of a long burst, or what came after the last recv) is read on the next turn of the loop.
            if self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._loop.call_soon(self._drain)
        for event in events:
            try:
                self._on_event(event)
            except Exception:  # noqa: BLE001 - one failing event must not cost the others
                log.exception("router failed on a worker event %s", type(event).__name__)
