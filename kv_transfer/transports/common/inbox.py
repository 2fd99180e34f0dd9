"""Receiver side of the shm transport, and of cuda_ipc's (``shared=True``: push only): accepts
senders (handshake with memfd descriptors), makes each chunk land in the cache (nothing to do for
push, copy for pull, scatter for ring) and acks it. Runs on the transport's IO thread; see
shm/transport.py for the modes, the protocol and its authentication.

Admission: pull and ring chunks are copied through the admission gate (admission.py); pushing
senders are granted and revoked transfers over their socket (grants.py)."""

from __future__ import annotations

import logging
import mmap
import os
import selectors
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .block_copy import blocks_view, copy_blocks
from .grants import PendingRevokes, decode_transfer_id, encode_grant, encode_transfer_id
from .landing import Landing
from .layout import KVLayout, chunk_problem
from .memfd import map_cache, map_fd
from .sealing import ACK, GRANT, HANDOVER, HEADER, HELLO, REVOKE, REVOKED, SYNC, WELCOME, Opened, Sealer, decode_raw
from .wire import ChunkHeader

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
    blocks: np.ndarray | None  # the sender's cache [layers * planes, blocks, bytes] when shared
    mappings: list[mmap.mmap]
    # Sealed messages waiting for room in the socket (a sender that stopped reading): acks, grants
    # and revokes are never dropped, a revoke least of all.
    outbox: deque[bytes] = field(default_factory=deque)


class _Refused(Exception):
    """A handshake message failed authentication (the sealer has counted and logged it)."""


class ShmInbox:
    def __init__(
        self,
        landing: Landing,
        cache_share: Callable[[], tuple[dict, list[int]]],
        *,
        sealer: Sealer,
        selector: selectors.BaseSelector,
        receiver_id: str,
        timeout_s: float,
        shared: bool | None = None,
    ) -> None:
        """``shared``: whether senders write into our cache themselves (push); None: when
        ``cache_share`` hands out a descriptor (shm). cuda_ipc shares its cache without one."""
        self._landing = landing  # our cache, and what a chunk passes through to land in it
        self._layout = landing.layout
        self._blocks = blocks_view(landing.rows, landing.layout)
        self._admission = landing.admission
        self._cache_share = cache_share  # handshake fields + fd letting a sender map our cache
        self._shared = bool(cache_share()[1]) if shared is None else shared
        self._id = receiver_id
        self._sealer = sealer
        self._selector = selector
        self._timeout_s = timeout_s
        self._senders: dict[socket.socket, _Sender] = {}
        self._pending_revokes = PendingRevokes()
        self.revoked: deque[str] = deque()  # poll_revoked's ids; the IO thread appends, callers pop

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
        # "open": we admit unexpected transfers (TransportConfig.admit_unexpected): push without grants.
        reply = {
            "receiver_id": self._id,
            "pulls": bool(info["kv_bytes"]),
            "open": self._admission.admits_unexpected,
            **share,
        }
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
                    layout.num_layers * layout.num_planes, layout.num_blocks, layout.block_bytes,
                )  # fmt: skip
                mappings.append(mapping)
        finally:
            for fd in fds:  # not (or no longer) ours to keep
                os.close(fd)
        sock.setblocking(False)
        sender = _Sender(info["sender_id"], hello.from_nonce, layout, ring, blocks, mappings)
        self._senders[sock] = sender
        self._selector.register(sock, selectors.EVENT_READ, ("sender", None))
        # The grants in force, then SYNC: the sender's connect() returns only after reading them, so
        # it never misses a grant made before it joined (later ones come after, on the same socket).
        if self._shared:
            for transfer_id, expected_blocks in self._admission.expected():
                self._send(sock, self._sealer.seal(GRANT, sender.nonce, encode_grant(transfer_id, expected_blocks)))
        self._send(sock, self._sealer.seal(SYNC, sender.nonce, b""))

    # admission of pushing senders (grants.py) --------------------------------------------

    def grant(self, transfer_id: str, blocks: np.ndarray) -> None:
        """Let every pushing sender write ``blocks`` for ``transfer_id``."""
        if not self._shared:
            return
        for sock, sender in list(self._senders.items()):
            self._send(sock, self._sealer.seal(GRANT, sender.nonce, encode_grant(transfer_id, blocks)))

    def revoke(self, transfer_id: str, track: bool) -> bool:
        """Tell every pushing sender to stop writing ``transfer_id``. True if none can write it now;
        False if ``track`` and some must confirm first (the id then appears in ``revoked``)."""
        if not self._shared or not self._senders:
            return True
        for sock, sender in list(self._senders.items()):
            self._send(sock, self._sealer.seal(REVOKE, sender.nonce, encode_transfer_id(transfer_id)))
        if not track:
            return True
        self._pending_revokes.start(transfer_id, set(self._senders))
        return False

    @property
    def num_pending_revokes(self) -> int:
        return len(self._pending_revokes)

    # sender sockets ---------------------------------------------------------------------------

    def on_ready(self, sock: socket.socket, mask: int) -> None:
        if mask & selectors.EVENT_WRITE and sock in self._senders:
            self._flush(sock)
        if mask & selectors.EVENT_READ and sock in self._senders:
            self._on_readable(sock)

    def _on_readable(self, sock: socket.socket) -> None:
        sender = self._senders[sock]
        while True:
            try:
                data = sock.recv(MAX_MSG_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the sender went away; chunks it did not finish are forgotten
                self._drop_sender(sock, sender)
                return
            opened = self._sealer.open(
                data, {HEADER: ChunkHeader.decode, REVOKED: decode_transfer_id}, (sender.nonce,)
            )
            if opened is None:
                continue  # no ack; nothing copied
            if opened.kind == REVOKED:
                if self._pending_revokes.confirm(opened.message, sock):
                    self.revoked.append(opened.message)
                continue
            header = opened.message
            ack = self._landing.settle(sender.nonce, header, self._land(header, sender))
            self._send(sock, self._sealer.seal(ACK, sender.nonce, ack.encode()))

    def _drop_sender(self, sock: socket.socket, sender: _Sender) -> None:
        """Its connection closed: its IO thread, the only one that copies, has ended, so revokes
        waiting for it are settled."""
        self._selector.unregister(sock)
        del self._senders[sock]
        sock.close()
        self._landing.received.drop_sender(sender.nonce)
        self.revoked.extend(self._pending_revokes.sender_gone(sock))

    def _send(self, sock: socket.socket, msg: bytes) -> None:
        """Send now, or queue behind what is already waiting and send when the socket has room."""
        sender = self._senders[sock]
        if not sender.outbox:
            try:
                sock.send(msg)
                return
            except BlockingIOError:
                pass
            except OSError as e:  # the reader side sees the connection close and cleans up
                log.warning("message to sender %s failed: %s", sender.sender_id, e)
                return
        sender.outbox.append(msg)
        self._selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, ("sender", None))

    def _flush(self, sock: socket.socket) -> None:
        sender = self._senders[sock]
        while sender.outbox:
            try:
                sock.send(sender.outbox[0])
            except BlockingIOError:
                return
            except OSError as e:
                log.warning("message to sender %s failed: %s", sender.sender_id, e)
                sender.outbox.clear()
                break
            sender.outbox.popleft()
        self._selector.modify(sock, selectors.EVENT_READ, ("sender", None))

    def _land(self, header: ChunkHeader, sender: _Sender) -> str | None:
        """Make the chunk's bytes land in our cache (or check they did); None on success."""
        layout = self._layout
        problem = chunk_problem(layout, header.layer_ids, header.dst_block_ids, header.payload_bytes)
        if problem:
            return problem
        mode = header.extra.get("mode")
        if mode == PUSH:
            # The bytes are already in place; a sender pushes only with a grant, so a refusal here
            # means it raced a revoke (the blocks stay quarantined until it confirms) or misbehaves.
            return self._admission.check(header.transfer_id, header.dst_block_ids) if self._shared else (
                "push into a cache that is not shared"
            )
        if mode == PULL:
            src = np.frombuffer(header.extra["src"], dtype="<i4").astype(np.int64)
            if sender.blocks is None:
                return "pull from a sender whose cache is not mapped"
            bad_ids = src.size and (src.min() < 0 or src.max() >= sender.layout.num_blocks)
            if len(src) != len(header.dst_block_ids) or bad_ids:
                return "pull chunk with bad source block ids"
            if any(x >= sender.layout.num_layers for x in header.layer_ids):
                return "pull chunk with a layer the sender does not have"
            with self._admission.gate(header.transfer_id, header.dst_block_ids) as refusal:
                if refusal is None:
                    copy_blocks(sender.blocks, src, self._blocks, header.dst_block_ids, header.layer_ids,
                                self._layout.num_planes)
                return refusal
        if sender.ring is None:
            return "ring chunk from a sender without a ring"
        offset, nbytes = int(header.extra["offset"]), header.payload_bytes
        if offset < 0 or offset + nbytes > sender.ring.size:
            return "ring offset out of range"
        src_rows = sender.ring[offset : offset + nbytes].reshape(-1, layout.block_bytes)
        return self._landing.scatter(header, src_rows)
