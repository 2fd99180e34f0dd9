"""The worker -> router event stream: a zmq PULL socket read by one thread, each message decoded into
a typed event (node/events.py) and handed to the asyncio loop. A malformed message is dropped and
logged; the thread lives on."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

import zmq

from pdcluster.wire.records import ProtocolError
from pdcluster.node.events import EVENT_CODEC, MAX_EVENT_BYTES, Event

log = logging.getLogger(__name__)


class EventReceiver:
    def __init__(self, host: str, on_event: Callable[[Event], None]):
        self._on_event = on_event
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pull = zmq.Context.instance().socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-events", daemon=True)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver events on ``loop`` from now on (starts the thread the first time). A router may be
        rebound to a new loop after the old one closed (each ``asyncio.run`` is a new loop): events that
        arrive between the two are dropped, and the thread keeps reading."""
        self._loop = loop
        if not self._thread.is_alive() and not self._stop.is_set():
            if self._thread.ident is not None:  # it ran and died: a Thread starts only once
                self._thread = threading.Thread(target=self._run, name="router-events", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # never started (no request came): nothing to join
            self._thread.join(2.0)
        self._pull.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            # A bounded burst (then check for stop again), handed to the loop in one callback: a decode
            # step of a big batch sends an event per request, and each wake-up of the loop costs a
            # write to its self-pipe.
            events: list[Event] = []
            for _ in range(1024):
                try:
                    data = self._pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    events.append(EVENT_CODEC.decode(data, MAX_EVENT_BYTES))
                except ProtocolError as e:
                    log.warning("dropping malformed worker event (%d bytes): %s", len(data), e)
            if not events:
                continue
            loop = self._loop
            try:
                loop.call_soon_threadsafe(self._deliver, events)
            except RuntimeError:  # that loop closed; a later bind() brings a new one
                log.debug("dropping %d worker events: the router's event loop is closed", len(events))

    def _deliver(self, events: list[Event]) -> None:
        """On the loop: each event in arrival order; one that fails is logged and the rest still go."""
        for event in events:
            try:
                self._on_event(event)
            except Exception:  # noqa: BLE001 - as the loop's handler did for a callback per event
                log.exception("router failed on a worker event %s", type(event).__name__)
