"""What shm's push mode and cuda_ipc share: a sender that writes into a receiver's cache, mapped in
its own process, only under the receiver's grants; and the receiver's side of those grants.

How the receiver's cache gets mapped (a memfd segment for shm, a CUDA IPC handle for cuda_ipc), how one
chunk is copied into it and what else a transport moves (shm's pull and ring modes) stay in
shm/transport.py and cuda_ipc/transport.py; they implement ``_check_peer``, ``_cache_share``,
``_handshake`` and ``_push``.

Control: one SOCK_SEQPACKET unix socket per sender-receiver pair in the abstract namespace (no file
to clean up; the kernel drops it with the process). The sender connects and runs the handshake
(HELLO, WELCOME, HANDOVER: the transport's ``_handshake``, through ``_greet``) on the caller's
thread, reads the grants in force up to SYNC, and hands the socket to the IO thread. The socket
then carries one sealed notice and one ack per chunk, and the grants and revokes. A peer that dies
closes its end, so the other side learns at once; the ack deadline covers a peer that hangs. The
receiver's side of the socket is inbox.py.

Authentication (sealing.py): the receiver shares its cache (in the WELCOME) only with a sender whose
HELLO proved the cluster secret, and the sender maps nothing of a receiver whose WELCOME did not.

Admission (admission.py, grants.py). The receiver's admission gate cannot stop a sender that
writes its memory itself, so:

* the sender pushes a chunk only if it holds a grant naming the transfer and every destination
  block (``_may_push``); ``expect`` puts the grant on every sender's socket before it returns;
* ``revoke`` sends REVOKE to every sender, returns False while one is connected, and
  ``poll_revoked`` lists the transfer once every sender answered REVOKED or closed its connection.
  Until then the receiver keeps the blocks quarantined.

Why a REVOKED means no write of the transfer is under way or will start: the IO thread is the only
thread that pushes; it pushes one chunk at a time, and ``_push`` returns only once the chunk's bytes
are in the receiver's memory (shm: a CPU copy; cuda_ipc: its copy stream synchronised, ordering
step 2 there). The thread reads the socket, and answers REVOKED (dropping the grant), only between
chunks; and before each push it reads the socket again, so a REVOKE takes effect before the next
copy. A sender that dies or closes stops pushing; its closed socket settles the receiver's waits.
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import socket
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from ..base import Role, TransportConfig, replaced_link_reason
from .grants import Grants, decode_grant, decode_transfer_id, encode_transfer_id
from .inbox import MAX_MSG_BYTES, PUSH, ShmInbox
from .io_thread import IOThreadTransport
from .layout import KVLayout
from .sealing import ACK, GRANT, HEADER, HELLO, REVOKE, REVOKED, SYNC, WELCOME
from .send_job import Chunk, SendJob
from .wire import ChunkAck

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def same_host(peer_descriptor: dict) -> bool:
    return peer_descriptor.get("boot_id") == boot_id()


@dataclass
class PushPeer:
    """Sender side: one receiver. Transports add how its cache is mapped here."""

    sock: socket.socket
    nonce: bytes  # the receiver's: notices are sealed to it, acks must come from it
    layout: KVLayout
    grants: Grants  # transfers the receiver lets us push, and their blocks (grants.py)
    dead: str | None = None


class MappedPushTransport(IOThreadTransport):
    socket_prefix = "pdcluster-kv"  # the receiver's abstract socket is named this plus its id

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None, *, shared: bool) -> None:
        """``shared``: whether senders write into our cache themselves (it can be mapped)."""
        super().__init__(kv_cache, role, config)
        self._shared = shared
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._waker.fileno(), selectors.EVENT_READ, ("waker", None))
        self._socket_name = f"{self.socket_prefix}-{self._id}"
        self._listener: socket.socket | None = None
        if role == "receiver":
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._listener.bind(b"\0" + self._socket_name.encode())
            self._listener.listen(64)
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, ("listener", None))
        self._peers: dict[str, PushPeer] = {}  # IO thread
        self._inbox = ShmInbox(
            self._landing,
            self._cache_share,
            sealer=self._sealer,
            selector=self._selector,
            receiver_id=self._id,
            timeout_s=self.config.timeout_s,
            shared=shared,
        )

    # ---------------------------------------------------------------- the transport's part

    @abstractmethod
    def _check_peer(self, peer_id: str, peer_descriptor: dict) -> None:
        """Raise ConnectionError, in one line, if we cannot reach ``peer_id`` (another host...)."""

    @abstractmethod
    def _cache_share(self) -> tuple[dict, list[int]]:
        """Receiver, IO thread, per sender handshake: the WELCOME's fields and descriptors that let
        the sender map our cache (inbox.py)."""

    @abstractmethod
    def _handshake(
        self, peer_id: str, sock: socket.socket, nonce: bytes, peer_layout: KVLayout, peer_descriptor: dict
    ) -> PushPeer:
        """HELLO, WELCOME, HANDOVER on the connected ``sock`` (``_greet`` does the first two); the
        receiver as a peer, its cache mapped here if it shared it."""

    @abstractmethod
    def _push(self, job: SendJob, chunk: Chunk, peer: PushPeer) -> None:
        """Copy ``chunk`` into the receiver's mapped cache; return only once every byte is there."""

    def _peer_gone(self, peer_id: str, peer: PushPeer) -> None:
        """IO thread: we never write to ``peer`` again (lost, or replaced): release what it held."""

    def _linked(self, peer_id: str, peer: PushPeer) -> None:
        """Caller thread, at the end of connect()."""

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {"socket": self._socket_name if self._listener is not None else "", "boot_id": boot_id()}

    def _link(self, peer_id: str, peer_descriptor: dict, peer_layout: KVLayout, nonce: bytes) -> None:
        """The handshake runs here, on the caller's thread (it blocks); the IO thread then adopts
        the connected socket."""
        self._check_peer(peer_id, peer_descriptor)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(self.config.timeout_s)
        try:
            sock.connect(b"\0" + str(peer_descriptor["socket"]).encode())
            peer = self._handshake(peer_id, sock, nonce, peer_layout, peer_descriptor)
            self._initial_grants(peer_id, sock, nonce, peer.grants)
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        self._connect_on_io(peer_id, self._adopt_peer, peer_id, peer)
        self._linked(peer_id, peer)

    def _greet(self, peer_id: str, sock: socket.socket, nonce: bytes, hello: dict) -> tuple[dict, list[int]]:
        """Send our HELLO, read the receiver's WELCOME: its reply, and the descriptors that came with
        it (the caller's to close). Refuses a receiver that did not prove the cluster secret."""
        sock.send(self._sealer.seal(HELLO, nonce, msgpack.packb(hello)))
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG_BYTES, 1)
        try:
            if not data:
                raise ConnectionError(
                    f"{peer_id} closed the connection during the handshake (it does when our cluster "
                    "secret differs from its own: see its log)"
                )
            welcome = self._sealer.open(data, {WELCOME: msgpack.unpackb}, (nonce,))
            if welcome is None:
                raise ConnectionError(
                    f"{peer_id} did not prove the cluster secret; our memory stays ours and we map nothing of it"
                )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return welcome.message, fds

    def _initial_grants(self, peer_id: str, sock: socket.socket, nonce: bytes, grants: Grants) -> None:
        """After the handover the receiver sends the grants in force, then SYNC (grants.py)."""
        while True:
            data = sock.recv(MAX_MSG_BYTES)
            if not data:
                raise ConnectionError(f"{peer_id} closed the connection during the handshake")
            opened = self._sealer.open(data, {GRANT: decode_grant, SYNC: bytes}, (nonce,))
            if opened is None:
                raise ConnectionError(f"{peer_id} sent a handshake message that fails authentication")
            if opened.kind == SYNC:
                return
            grants.add(*opened.message)

    # receiver admission (module docstring) ---------------------------------------------------

    def expect(self, transfer_id: str, dst_block_ids: np.ndarray | Sequence[int]) -> None:
        self._admission.expect(transfer_id, dst_block_ids)
        if not self._shared:
            return  # nobody writes into our cache but us
        blocks = np.unique(np.asarray(dst_block_ids, dtype=np.int64))
        # The grant must be on every sender's socket before the block ids can reach it.
        if not self._wait_io("grant", transfer_id, self._grant_io, transfer_id, blocks):
            self._admission.revoke(transfer_id)
            raise TimeoutError(f"{self.name} IO thread did not grant {transfer_id!r} within {self.config.timeout_s}s")

    def revoke(self, transfer_id: str) -> bool:
        was_expected = self._admission.revoke(transfer_id)  # copies through the admission gate stop here
        if not self._shared or not was_expected:
            return True  # no sender holds a grant for it
        return self._wait_io("revoke", transfer_id, self._inbox.revoke, transfer_id, True)

    def complete(self, transfer_id: str) -> None:
        if self._admission.revoke(transfer_id) and self._shared:
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
        log.warning(
            "%s IO thread did not answer a %s of %s within %.1fs", self.name, kind, transfer_id, self.config.timeout_s
        )
        return False

    def _release(self) -> None:
        self._selector.close()
        super()._release()
        self._peers.clear()  # drops our mappings of the receivers' caches

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

    def _adopt_peer(self, peer_id: str, peer: PushPeer) -> None:
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

    def _peer_problem(self, peer_id: str) -> str | None:
        peer = self._peers.get(peer_id)
        return f"not connected to {peer_id}" if peer is None else peer.dead

    def _post_chunk(self, job: SendJob, chunk: Chunk) -> bool:
        """Push the chunk under its grant, then tell the receiver (True either way: a send without
        a grant has failed, and the queue drops it)."""
        peer = self._peers[job.peer_id]
        if self._may_push(job, peer, chunk.dst_block_ids):
            self._push(job, chunk, peer)
            self._announce(job, chunk, peer, {"mode": PUSH})
        return True

    def _announce(self, job: SendJob, chunk: Chunk, peer: PushPeer, extra: dict) -> None:
        """The chunk is posted: send the receiver its notice, sealed to it."""
        job.next_chunk += 1
        header = job.header(chunk, self._id, self._layout, extra).encode()
        self._notify(job.peer_id, peer, self._sealer.seal(HEADER, peer.nonce, header))

    def _may_push(self, job: SendJob, peer: PushPeer, dst_block_ids: np.ndarray) -> bool:
        """Push only under a grant (grants.py). Read what waits on the socket first (one syscall
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

    def _notify(self, peer_id: str, peer: PushPeer, msg: bytes) -> None:
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
            elif opened.kind == REVOKE:
                # Chunks are pushed on this thread, one at a time, each in the receiver's memory
                # before _push returned (module docstring): none of this transfer is being
                # written now, and without the grant none will be.
                peer.grants.drop(opened.message)
                self._notify(peer_id, peer, self._sealer.seal(REVOKED, peer.nonce, encode_transfer_id(opened.message)))
            else:
                self._on_ack(opened.message)

    def _on_ack(self, ack: ChunkAck) -> None:
        self._tracker.chunk_acked(ack.send_seq, ack.error)

    def _peer_lost(self, peer_id: str, peer: PushPeer, reason: str) -> None:
        if peer.dead:
            return
        peer.dead = reason
        self._tracker.fail_peer(peer_id, reason)
        self._selector.unregister(peer.sock)
        self._peer_gone(peer_id, peer)
        # We never push to a dead peer again; closing tells a live receiver so, which settles the
        # revokes it may be waiting on us for (grants.py).
        peer.sock.close()

    def _drop_link(self, peer_id: str) -> None:
        """The peer restarted and connect() was given its new descriptor: fail what is in flight to
        the old incarnation and close its socket (before the new link takes the peer id)."""
        old = self._peers.pop(peer_id)
        if not old.dead:
            self._tracker.fail_peer(peer_id, replaced_link_reason(peer_id))
            self._selector.unregister(old.sock)
            self._peer_gone(peer_id, old)
        old.sock.close()
