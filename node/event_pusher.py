"""Worker -> router event stream: typed events (node/events.py) over a zmq PUSH socket (the
per-token path stays off Ray's object store). Sending never blocks the engine thread: when the
router is gone the high-water mark drops events rather than stall decoding."""

from __future__ import annotations

import threading

import zmq

from pdcluster.node.events import EVENT_CODEC, Event


class EventPusher:
    def __init__(self, address: str, sndhwm: int = 100_000):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.connect(address)
        self._lock = threading.Lock()  # zmq sockets are not thread-safe; events may come from two threads

    def __call__(self, event: Event) -> None:
        data = EVENT_CODEC.encode(event)
        with self._lock:
            try:
                self._sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                pass  # router not draining: it will time the request out; never block decoding

    def close(self) -> None:
        with self._lock:
            self._sock.close(0)
