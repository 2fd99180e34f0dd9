"""Same-host shared-memory transport (CPU caches).

A cache allocated with :meth:`ShmTransport.allocate_kv_cache` lives in a memfd segment that peers map.
Each chunk of a send moves in one of three ways, picked per receiver at connect time:

* push: the receiver's cache is shared. The sender copies its source blocks straight into the
  destination blocks (one pass over the bytes); the receiver only records the notice and acks.
* pull: the sender's cache is shared. The receiver copies from the sender's blocks into its own.
  When both caches are shared, chunks alternate between push and pull (``ShmOptions.pull_share``)
  so both processes copy at once, on two cores.
* ring: neither cache is shared. The sender gathers each chunk into a staging ring (its own memfd,
  mapped by the receiver) and the receiver scatters it out: one copy in, one copy out, overlapping
  across chunks.

Control: a SOCK_SEQPACKET unix socket per sender-receiver pair in the abstract namespace (no file to
clean up; the kernel drops it with the process). It carries the handshake with the memfd descriptors
(SCM_RIGHTS), one notice per chunk and one ack per chunk. A peer that dies closes its end, so the
other side learns at once; the ack deadline covers a peer that hangs.

Nothing is created under /dev/shm: memfd segments vanish when the last process holding them exits,
also on SIGKILL. Sources must stay unchanged until poll_sent reports them (a receiver may pull late).

Admission (admission.py, shm_grants.py). Pull and ring chunks are copied by the receiver through its
admission gate, so ``revoke`` stops them at once. A push is written by the sender itself: it pushes
only chunks of transfers the receiver granted it (``expect`` sends the grant before it returns), and
``revoke`` has every pushing sender confirm it dropped the grant. So ``revoke`` returns True when our
cache is not shared (or no sender is connected), else False, and ``poll_revoked`` lists the transfer
once every pushing sender confirmed or closed its connection.

Authentication (sealing.py). Mapping a peer's memory is the whole game here (a push writes straight
into the receiver's cache), so memory descriptors go only to a peer that proved the cluster secret,
in a three-step handshake: the sender's HELLO (no descriptors), the receiver's WELCOME (with its
cache, sent only if the HELLO verified), the sender's HANDOVER (with its ring and cache, sent only if
the WELCOME verified). Notices and acks are sealed too, so a socket cannot be used to make a
receiver pull or scatter what the sender never sent. The abstract socket name stays guessable; a
stranger who connects gets nothing but a closed socket.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from .base import Role, TransportConfig, replaced_link_reason
from .block_copy import blocks_view, copy_blocks, gather_rows
from .io_thread import IOThreadTransport
from .layout import KVLayout
from .sealing import ACK, GRANT, HANDOVER, HEADER, HELLO, REVOKE, REVOKED, SYNC, WELCOME
from .send_job import Chunk, SendJob
from .shm_grants import Grants, decode_grant, decode_transfer_id, encode_transfer_id
from .shm_inbox import MAX_MSG_BYTES, PULL, PUSH, RING, ShmInbox
from .shm_memory import create_segment, find_segment, map_cache, shared_tensor
from .shm_ring import RingAllocator
from .wire import ChunkAck

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class _Peer:
    """Sender side: one receiver."""

    sock: socket.socket
    nonce: bytes  # the receiver's: notices are sealed to it, acks must come from it
    layout: KVLayout
    blocks: np.ndarray | None  # the receiver's cache [layers * 2, blocks, bytes] when shared
    mapping: mmap.mmap | None
    pulls: bool  # the receiver mapped our cache and copies pull chunks itself
    grants: Grants  # transfers the receiver lets us push, and their blocks (shm_grants.py)
    dead: str | None = None


class ShmTransport(IOThreadTransport):
    name = "shm"

    @classmethod
    def allocate_kv_cache(
        cls, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """A zeroed cache in shared memory, which peers on this host copy into (receiver) or out of
        (sender) directly. Keep this tensor (not just a view of it) alive while peers connect: the
        segment's descriptor is released with it."""
        if torch.device(device).type != "cpu":
            raise ValueError("the shm transport moves CPU caches only")
        return shared_tensor(shape, dtype)

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        if kv_cache.is_cuda:
            raise ValueError("the shm transport moves CPU caches only; use ucx or nccl for GPU memory")
        super().__init__(kv_cache, role, config)
        self._blocks = blocks_view(self._rows, self._layout)
        found = find_segment(kv_cache)
        # Our own descriptor of the cache's segment (dup): the registry closes its copy when the
        # tensor that allocate_kv_cache returned is collected, and a closed number may be reused.
        self._kv_fd = os.dup(found[0].fd) if found else -1
        self._kv_offset = found[1] if found else 0
        self._peer_modes: dict[str, str] = {}  # caller thread: "push", "pull", "push+pull" or "ring"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._waker.fileno(), selectors.EVENT_READ, ("waker", None))
        self._socket_name = f"pdcluster-kv-{self._id}"
        self._listener: socket.socket | None = None
        if role == "receiver":
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._listener.bind(b"\0" + self._socket_name.encode())
            self._listener.listen(64)
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, ("listener", None))
        # Sender: the staging ring, made at the first connect to a peer that needs it.
        self._ring_fd = -1
        self._ring_map: mmap.mmap | None = None
        self._ring_bytes: np.ndarray | None = None
        self._ring: RingAllocator | None = None
        self._ring_lock = threading.Lock()
        # IO thread state.
        self._peers: dict[str, _Peer] = {}
        self._inbox = ShmInbox(
            self._landing,
            self._cache_share,
            sealer=self._sealer,
            selector=self._selector,
            receiver_id=self._id,
            timeout_s=self.config.timeout_s,
        )
        self._ring_spans: dict[tuple[int, int], tuple[str, int]] = {}  # (seq, chunk) -> (peer, offset)
        self._start_io()

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {
            "socket": self._socket_name if self._listener is not None else "",
            "boot_id": _boot_id(),
            "kv_in_shm": self._kv_fd >= 0,
        }

    def peer_mode(self, peer_id: str) -> str:
        """How chunks to ``peer_id`` move: "push", "pull", "push+pull" or "ring" (see module doc)."""
        return self._peer_modes[peer_id]

    def _cache_share(self) -> tuple[dict, list[int]]:
        """Handshake fields and descriptor that let the peer map our cache, if it is shared."""
        if self._kv_fd < 0:
            return {"kv_offset": 0, "kv_bytes": 0}, []
        nbytes = self.kv_cache.numel() * self.kv_cache.element_size()
        return {"kv_offset": self._kv_offset, "kv_bytes": nbytes}, [self._kv_fd]

    def _link(self, peer_id: str, peer_descriptor: dict, peer_layout: KVLayout, nonce: bytes) -> None:
        """The handshake runs here, on the caller's thread (it blocks); the IO thread then adopts
        the connected socket."""
        if peer_descriptor.get("boot_id") != _boot_id():
            raise ConnectionError(f"{peer_id} runs on another host (or boot): shm needs the same host")
        needs_ring = not peer_descriptor.get("kv_in_shm") and self._kv_fd < 0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(self.config.timeout_s)
        try:
            sock.connect(b"\0" + str(peer_descriptor["socket"]).encode())
            reply, mapping, blocks = self._handshake(peer_id, sock, nonce, peer_layout, needs_ring)
            grants = self._initial_grants(peer_id, sock, nonce, Grants(open_receiver=bool(reply.get("open"))))
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        peer = _Peer(sock, nonce, peer_layout, blocks, mapping, pulls=bool(reply.get("pulls")), grants=grants)
        self._connect_on_io(peer_id, self._adopt_peer, peer_id, peer)
        modes = [m for m, ok in ((PUSH, blocks is not None), (PULL, peer.pulls)) if ok]
        self._peer_modes[peer_id] = "+".join(modes) or RING

    def _handshake(
        self, peer_id: str, sock: socket.socket, nonce: bytes, peer_layout: KVLayout, needs_ring: bool
    ) -> tuple[dict, mmap.mmap | None, np.ndarray | None]:
        """HELLO, WELCOME, HANDOVER (module docstring). Returns the receiver's reply and, if it shared
        its cache, the mapping and the ``[layers * 2, blocks, bytes]`` view of it."""
        share, fds = self._cache_share()
        ring_bytes = self.config.shm.ring_bytes if needs_ring else 0
        if needs_ring:
            fds = [self._ensure_ring(), *fds]
        hello = {"sender_id": self._id, "layout": self._layout.to_dict(), "ring_bytes": ring_bytes, **share}
        sock.send(self._sealer.seal(HELLO, nonce, msgpack.packb(hello)))
        data, got_fds, _, _ = socket.recv_fds(sock, MAX_MSG_BYTES, 1)
        try:
            if not data:
                raise ConnectionError(
                    f"{peer_id} closed the connection during the handshake (it does when our cluster "
                    "secret differs from its own: see its log)"
                )
            welcome = self._sealer.open(data, {WELCOME: msgpack.unpackb}, (nonce,))
            if welcome is None:
                raise ConnectionError(f"{peer_id} did not prove the cluster secret; our memory stays ours")
            reply = welcome.message
            socket.send_fds(sock, [self._sealer.seal(HANDOVER, nonce, b"")], fds)
            if not got_fds:
                return reply, None, None
            fd = got_fds.pop()
        finally:
            for fd_left in got_fds:
                os.close(fd_left)
        mapping, blocks = map_cache(
            fd, reply["kv_offset"], reply["kv_bytes"],
            peer_layout.num_layers, peer_layout.num_blocks, peer_layout.block_bytes,
        )  # fmt: skip
        return reply, mapping, blocks

    def _initial_grants(self, peer_id: str, sock: socket.socket, nonce: bytes, grants: Grants) -> Grants:
        """After the handover the receiver sends the grants in force, then SYNC (shm_grants.py)."""
        while True:
            data = sock.recv(MAX_MSG_BYTES)
            if not data:
                raise ConnectionError(f"{peer_id} closed the connection during the handshake")
            opened = self._sealer.open(data, {GRANT: decode_grant, SYNC: bytes}, (nonce,))
            if opened is None:
                raise ConnectionError(f"{peer_id} sent a handshake message that fails authentication")
            if opened.kind == SYNC:
                return grants
            grants.add(*opened.message)

    def _ensure_ring(self) -> int:
        with self._ring_lock:
            if self._ring_map is None:
                ring_bytes = self.config.shm.ring_bytes
                self._ring_fd, self._ring_map = create_segment(ring_bytes, "pdcluster-kv-ring")
                self._ring_bytes = np.frombuffer(self._ring_map, dtype=np.uint8)
                self._ring = RingAllocator(ring_bytes)
            return self._ring_fd

    def _chunk_bytes_to(self, peer_id: str) -> int:
        if self._peer_modes[peer_id] == RING:
            # At least two chunks fit in the ring, so gathering one overlaps scattering another.
            return min(self.config.chunk_bytes, self.config.shm.ring_bytes // 2)
        return self.config.chunk_bytes

    # receiver admission (module docstring) ---------------------------------------------------

    def expect(self, transfer_id: str, dst_block_ids: np.ndarray | Sequence[int]) -> None:
        self._admission.expect(transfer_id, dst_block_ids)
        if self._kv_fd < 0:
            return  # nobody writes into our cache but us
        blocks = np.unique(np.asarray(dst_block_ids, dtype=np.int64))
        # The grant must be on every pushing sender's socket before the block ids can reach it.
        if not self._wait_io("grant", transfer_id, self._grant_io, transfer_id, blocks):
            self._admission.revoke(transfer_id)
            raise TimeoutError(f"shm IO thread did not grant {transfer_id!r} within {self.config.timeout_s}s")

    def revoke(self, transfer_id: str) -> bool:
        was_expected = self._admission.revoke(transfer_id)  # pull and ring copies stop here
        if self._kv_fd < 0 or not was_expected:
            return True  # no sender holds a grant for it
        return self._wait_io("revoke", transfer_id, self._inbox.revoke, transfer_id, True)

    def complete(self, transfer_id: str) -> None:
        if self._admission.revoke(transfer_id) and self._kv_fd >= 0:
            # Senders drop the grant; nothing to wait for (base.py: a delivered transfer is final).
            self._on_io(self._inbox.revoke, transfer_id, False)

    def poll_revoked(self) -> list[str]:
        out = []
        while self._inbox.revoked:
            out.append(self._inbox.revoked.popleft())
        return out

    @property
    def num_pending_revokes(self) -> int:
        """Revoked transfers still waiting for a pushing sender's confirmation."""
        return self._inbox.num_pending_revokes

    def _wait_io(self, kind: str, transfer_id: str, run: Callable[..., object], *args: object) -> bool:
        """Run a grant or revoke on the IO thread and wait (bounded) for its result. If none comes
        in time the caller takes False, and a revoke the IO thread settles later is reported
        through poll_revoked instead."""
        call = self._ask_io(run, *args, on_late=functools.partial(self._answered_late, transfer_id))
        if call.wait(self.config.timeout_s):
            return bool(call.result)
        log.warning("shm IO thread did not answer a %s of %s within %.1fs", kind, transfer_id, self.config.timeout_s)
        return False

    def _release(self) -> None:
        self._selector.close()
        super()._release()
        for fd in (self._ring_fd, self._kv_fd):
            if fd >= 0:
                os.close(fd)
        self._ring_fd = self._kv_fd = -1
        # Mappings are left to the garbage collector: numpy views of them may still be referenced,
        # and mmap.close() fails while buffers are exported.
        self._peers.clear()
        self._ring_bytes = None
        self._ring_map = None

    # ---------------------------------------------------------------- IO thread

    def _io_step(self, busy: bool) -> None:
        busy |= self._post_chunks()
        for key, mask in self._selector.select(0 if busy else _IDLE_WAIT_S):
            kind, obj = key.data
            if kind == "waker":
                self._waker.drain()
            elif kind == "listener":
                self._inbox.accept(key.fileobj)
            elif kind == "sender":
                self._inbox.on_ready(key.fileobj, mask)
            elif kind == "peer":
                self._on_peer_readable(obj)

    def _io_shutdown(self) -> None:
        for peer in self._peers.values():
            peer.sock.close()
        self._inbox.close()
        if self._listener is not None:
            self._listener.close()

    def _adopt_peer(self, peer_id: str, peer: _Peer) -> None:
        """connect(), on the IO thread: the handshaken socket replaces any link to the peer id."""
        if peer_id in self._peers:
            self._drop_link(peer_id)
        self._peers[peer_id] = peer
        self._selector.register(peer.sock, selectors.EVENT_READ, ("peer", peer_id))

    def _grant_io(self, transfer_id: str, blocks: np.ndarray) -> bool:
        self._inbox.grant(transfer_id, blocks)
        return True  # every pushing sender has the grant on its socket (or queued for it)

    def _answered_late(self, transfer_id: str, result: object) -> None:
        """A grant or revoke answered after its caller took False: report the id once it is safe."""
        if result:
            self._inbox.revoked.append(transfer_id)

    # sender ------------------------------------------------------------------------------

    def _chunk_mode(self, peer: _Peer, chunk_index: int) -> str:
        if peer.blocks is not None and peer.pulls:
            share = self.config.shm.pull_share
            return PULL if int((chunk_index + 1) * share) > int(chunk_index * share) else PUSH
        if peer.blocks is not None:
            return PUSH
        return PULL if peer.pulls else RING

    def _queue_job(self, job: SendJob) -> None:
        """Pull notices first: they cost the sender nothing, and the receiver starts copying while
        the sender pushes its own share."""
        peer = self._peers.get(job.peer_id)
        if peer is not None:
            job.chunks.sort(key=lambda c: self._chunk_mode(peer, c.index) != PULL)
        super()._queue_job(job)

    def _peer_problem(self, peer_id: str) -> str | None:
        peer = self._peers.get(peer_id)
        return f"not connected to {peer_id}" if peer is None else peer.dead

    def _post_chunk(self, job: SendJob, chunk: Chunk) -> bool:
        peer = self._peers[job.peer_id]
        mode = self._chunk_mode(peer, chunk.index)
        extra: dict = {"mode": mode}
        if mode == PUSH:
            assert peer.blocks is not None
            if not self._may_push(job, peer, chunk.dst_block_ids):
                return True  # the send failed; the queue drops it
            copy_blocks(self._blocks, chunk.src_block_ids, peer.blocks, chunk.dst_block_ids, job.layer_ids)
        elif mode == PULL:
            extra["src"] = chunk.src_block_ids.astype("<i4").tobytes()
        else:
            assert self._ring is not None and self._ring_bytes is not None
            nbytes = job.payload_bytes(chunk, self._layout)
            offset = self._ring.alloc(nbytes)
            if offset is None:
                return False  # wait for acks to free ring space
            out = self._ring_bytes[offset : offset + nbytes].reshape(-1, self._layout.block_bytes)
            gather_rows(self._rows, self._layout.row_ids(job.layer_ids, chunk.src_block_ids), out)
            self._ring_spans[(job.seq, chunk.index)] = (job.peer_id, offset)
            extra["offset"] = offset
        job.next_chunk += 1
        header = job.header(chunk, self._id, self._layout, extra).encode()
        self._notify(job.peer_id, peer, self._sealer.seal(HEADER, peer.nonce, header))
        return True

    def _may_push(self, job: SendJob, peer: _Peer, dst_block_ids: np.ndarray) -> bool:
        """Push only under a grant (shm_grants.py). Read what waits on the socket first (one syscall
        when nothing does): a REVOKE takes effect before the next copy, not after the whole queue,
        and a grant the receiver sent before its reservation was answered is there by now."""
        self._on_peer_readable(job.peer_id)
        if peer.dead or not self._tracker.is_live(job.seq):
            return False  # already failed (peer lost, or a chunk of the transfer refused)
        if peer.grants.allows(job.transfer_id, dst_block_ids):
            return True
        self._tracker.fail_send(
            job.seq,
            f"{job.peer_id} has not granted transfer {job.transfer_id!r} these blocks (not reserved "
            "there, revoked after an abort or deadline, or complete): nothing was written",
        )
        return False

    def _notify(self, peer_id: str, peer: _Peer, msg: bytes) -> None:
        try:
            peer.sock.send(msg)
        except BlockingIOError:
            # Only a receiver that stopped reading fills a socket buffer with notices this small.
            # Block for the rest of the deadline rather than drop the notice.
            peer.sock.settimeout(self.config.timeout_s)
            try:
                peer.sock.send(msg)
            except OSError as e:
                self._peer_lost(peer_id, peer, f"notice to {peer_id} failed: {e}")
            finally:
                peer.sock.setblocking(False)
        except OSError as e:
            self._peer_lost(peer_id, peer, f"notice to {peer_id} failed: {e}")

    def _on_peer_readable(self, peer_id: str) -> None:
        peer = self._peers[peer_id]
        while not peer.dead:
            try:
                data = peer.sock.recv(MAX_MSG_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                self._peer_lost(peer_id, peer, f"connection to {peer_id} failed: {e}")
                return
            if not data:
                self._peer_lost(peer_id, peer, f"{peer_id} closed the connection")
                return
            opened = self._sealer.open(
                data, {ACK: ChunkAck.decode, GRANT: decode_grant, REVOKE: decode_transfer_id}, (peer.nonce,)
            )
            if opened is None:
                continue  # forged or replayed: the chunk stays unacknowledged
            if opened.kind == GRANT:
                peer.grants.add(*opened.message)
                continue
            if opened.kind == REVOKE:
                # Chunks are copied on this thread, one at a time: none of this transfer is being
                # copied now, and without the grant none will be.
                peer.grants.drop(opened.message)
                self._notify(peer_id, peer, self._sealer.seal(REVOKED, peer.nonce, encode_transfer_id(opened.message)))
                continue
            ack = opened.message
            span = self._ring_spans.pop((ack.send_seq, ack.chunk_index), None)
            if span is not None and self._ring is not None:
                self._ring.release(span[1])
            self._tracker.chunk_acked(ack.send_seq, ack.error)

    def _peer_lost(self, peer_id: str, peer: _Peer, reason: str) -> None:
        if peer.dead:
            return
        peer.dead = reason
        self._tracker.fail_peer(peer_id, reason)
        self._selector.unregister(peer.sock)
        self._release_ring_spans(peer_id)
        # We never push to a dead peer again; closing tells a live receiver so, which settles the
        # revokes it may be waiting on us for (shm_grants.py).
        peer.sock.close()

    def _drop_link(self, peer_id: str) -> None:
        """The peer restarted and connect() was given its new descriptor: fail what is in flight to
        the old incarnation and close its socket (before the new link takes the peer id)."""
        old = self._peers.pop(peer_id)
        if not old.dead:
            self._tracker.fail_peer(peer_id, replaced_link_reason(peer_id))
            self._selector.unregister(old.sock)
            self._release_ring_spans(peer_id)
        old.sock.close()

    def _release_ring_spans(self, peer_id: str) -> None:
        # Its unacked ring chunks will never be acked: reclaim them (a dead receiver reads nothing).
        for key in [k for k, (p, _) in self._ring_spans.items() if p == peer_id]:
            if self._ring is not None:
                self._ring.release(self._ring_spans.pop(key)[1])
