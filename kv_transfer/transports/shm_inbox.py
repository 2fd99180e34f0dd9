"""Receiver side of the shm transport: accepts senders (handshake with memfd descriptors), makes
each chunk land in the cache (nothing to do for push, copy for pull, scatter for ring) and acks it.
Runs on the transport's IO thread; see shm.py for the modes, the protocol and its authentication."""

from __future__ import annotations

import logging
import mmap
import os
import selectors
import socket
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np

from .block_copy import copy_blocks, scatter_rows
from .layout import KVLayout, chunk_problem
from .sealing import ACK, HANDOVER, HEADER, HELLO, WELCOME, Opened, Sealer, decode_raw
from .shm_memory import map_cache, map_fd
from .tracking import ReceiveTracker
from .wire import ChunkAck, ChunkHeader

log = logging.getLogger(__name__)

MAX_MSG_BYTES = 1 << 20  # one chunk notice; the ids of a 4 MiB chunk take a few KiB
PUSH, PULL, RING = "push", "pull", "ring"


@dataclass
class _Sender:
    """One connected sender."""

    sender_id: str
    nonce: bytes  # the sender's incarnation: its notices must be sealed by it, acks are sealed to it
    layout: KVLayout
    ring: np.ndarray | None  # the sender's staging ring as bytes
    blocks: np.ndarray | None  # the sender's cache [layers * 2, blocks, bytes] when shared
    mappings: list[mmap.mmap]


class _Refused(Exception):
    """A handshake message failed authentication (the sealer has counted and logged it)."""


class ShmInbox:
    def __init__(
        self,
        *,
        receiver_id: str,
        layout: KVLayout,
        rows: np.ndarray,
        blocks: np.ndarray,
        cache_share: Callable[[], tuple[dict, list[int]]],
        received: ReceiveTracker,
        sealer: Sealer,
        selector: selectors.BaseSelector,
        timeout_s: float,
    ) -> None:
        self._id = receiver_id
        self._layout = layout
        self._rows = rows
        self._blocks = blocks
        self._cache_share = cache_share  # handshake fields + fd letting a sender map our cache
        self._shared = bool(cache_share()[1])
        self._received = received
        self._sealer = sealer
        self._selector = selector
        self._timeout_s = timeout_s
        self._senders: dict[socket.socket, _Sender] = {}

    def close(self) -> None:
        for sock in self._senders:
            sock.close()
        self._senders.clear()

    def accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            try:
                self._handshake(sock)
            except _Refused:
                sock.close()  # a stranger, or a sender with another secret: it learns nothing more
            except (OSError, ValueError, KeyError) as e:
                log.warning("shm handshake failed: %s", e)
                sock.close()

    def _receive(
        self, sock: socket.socket, kind: bytes, decode: Callable[[bytes], object], expect_from: bytes | None = None
    ) -> tuple[Opened, list[int]]:
        """One sealed handshake message and the descriptors that came with it (ours to close)."""
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG_BYTES, 2)
        opened = self._sealer.open(data, {kind: decode}, None if expect_from is None else (expect_from,))
        if opened is None:
            for fd in fds:
                os.close(fd)
            raise _Refused
        return opened, fds

    def _handshake(self, sock: socket.socket) -> None:
        """HELLO in, WELCOME (with our cache) out, HANDOVER (with the sender's ring and cache) in."""
        sock.settimeout(self._timeout_s)  # the sender writes its hello right after connecting
        hello, fds = self._receive(sock, HELLO, msgpack.unpackb)
        for fd in fds:  # descriptors belong in the HANDOVER, not here
            os.close(fd)
        info = hello.message
        layout = KVLayout.from_dict(info["layout"])
        self._layout.check_peer(layout)
        share, out_fds = self._cache_share()
        reply = {"receiver_id": self._id, "pulls": bool(info["kv_bytes"]), **share}
        socket.send_fds(sock, [self._sealer.seal(WELCOME, hello.from_nonce, msgpack.packb(reply))], out_fds)
        _, fds = self._receive(sock, HANDOVER, decode_raw, expect_from=hello.from_nonce)
        try:
            if len(fds) != bool(info["ring_bytes"]) + bool(info["kv_bytes"]):
                raise ValueError(f"handover carried {len(fds)} descriptors, its hello announced otherwise")
            ring = blocks = None
            mappings = []
            if info["ring_bytes"]:
                mappings.append(map_fd(fds.pop(0), int(info["ring_bytes"])))
                ring = np.frombuffer(mappings[-1], dtype=np.uint8)
            if info["kv_bytes"]:
                mapping, blocks = map_cache(
                    fds.pop(0), info["kv_offset"], info["kv_bytes"],
                    layout.num_layers, layout.num_blocks, layout.block_bytes,
                )  # fmt: skip
                mappings.append(mapping)
        finally:
            for fd in fds:  # not (or no longer) ours to keep
                os.close(fd)
        sock.setblocking(False)
        self._senders[sock] = _Sender(info["sender_id"], hello.from_nonce, layout, ring, blocks, mappings)
        self._selector.register(sock, selectors.EVENT_READ, ("sender", None))

    def on_readable(self, sock: socket.socket) -> None:
        sender = self._senders[sock]
        while True:
            try:
                data = sock.recv(MAX_MSG_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the sender went away; chunks it did not finish are forgotten
                self._selector.unregister(sock)
                del self._senders[sock]
                sock.close()
                self._received.drop_sender(sender.nonce)
                return
            opened = self._sealer.open(data, {HEADER: ChunkHeader.decode}, (sender.nonce,))
            if opened is None:
                continue  # no ack; nothing copied
            header = opened.message
            error = self._land(header, sender)
            if error is None:
                self._received.chunk_landed(
                    sender.nonce, header.send_seq, header.num_chunks, header.transfer_id, header.layer_ids
                )
            try:
                ack = ChunkAck(header.send_seq, header.chunk_index, error).encode()
                sock.send(self._sealer.seal(ACK, sender.nonce, ack))
            except OSError as e:
                log.warning("ack to sender %s failed: %s", sender.sender_id, e)

    def _land(self, header: ChunkHeader, sender: _Sender) -> str | None:
        """Make the chunk's bytes land in our cache (or check they did); None on success."""
        layout = self._layout
        problem = chunk_problem(layout, header.layer_ids, header.dst_block_ids, header.payload_bytes)
        if problem:
            return problem
        mode = header.extra.get("mode")
        if mode == PUSH:
            return None if self._shared else "push into a cache that is not shared"
        if mode == PULL:
            src = np.frombuffer(header.extra["src"], dtype="<i4").astype(np.int64)
            if sender.blocks is None:
                return "pull from a sender whose cache is not mapped"
            bad_ids = src.size and (src.min() < 0 or src.max() >= sender.layout.num_blocks)
            if len(src) != len(header.dst_block_ids) or bad_ids:
                return "pull chunk with bad source block ids"
            if any(x >= sender.layout.num_layers for x in header.layer_ids):
                return "pull chunk with a layer the sender does not have"
            copy_blocks(sender.blocks, src, self._blocks, header.dst_block_ids, header.layer_ids)
            return None
        if sender.ring is None:
            return "ring chunk from a sender without a ring"
        offset, nbytes = int(header.extra["offset"]), header.payload_bytes
        if offset < 0 or offset + nbytes > sender.ring.size:
            return "ring offset out of range"
        src_rows = sender.ring[offset : offset + nbytes].reshape(-1, layout.block_bytes)
        scatter_rows(src_rows, self._rows, layout.row_ids(header.layer_ids, header.dst_block_ids))
        return None
