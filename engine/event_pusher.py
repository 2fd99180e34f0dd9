"""Worker -> router event stream: msgpack dicts over a zmq PUSH socket (the per-token path stays off
Ray's object store). Sending never blocks the engine thread: when the router is gone the high-water
mark drops events rather than stall decoding."""

from __future__ import annotations

import msgpack
import zmq


class EventPusher:
    def __init__(self, address: str, sndhwm: int = 100_000):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.connect(address)

    def __call__(self, event: dict) -> None:
        try:
            self._sock.send(msgpack.packb(event, use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            pass  # router not draining: it will time the request out; never block decoding

    def close(self) -> None:
        self._sock.close(0)
