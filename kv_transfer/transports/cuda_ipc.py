"""Same-host transport that writes KV straight into the decode worker's cache: CUDA IPC.

The receiver (decode) shares its whole cache through a handle made by torch's own reduction
(cuda_ipc_handle.py): a CUDA IPC memory handle for a CUDA cache, a shared-memory file name for a CPU
cache (tests, CPU-only hosts). The sender (prefill) maps it once per connection and copies each chunk
from its own cache into the destination blocks itself, on its device: a gather of the source rows
into a staging buffer and a scatter into the mapped cache (block_copy.py; torch index kernels, so on
one GPU a device-to-device copy, no host memory, no second copy on the receiver). This is shm's
"push" mode (shm.py) with device memory; everything else is shm's:

* Control: one SOCK_SEQPACKET unix socket per sender-receiver pair in the abstract namespace; the
  HELLO / WELCOME / HANDOVER handshake in which the receiver hands its cache handle (inside the sealed
  WELCOME) only to a sender that proved the cluster secret; one sealed notice and one ack per chunk.
  The receiver's side of it is shm's (shm_inbox.py, which also checks each pushed chunk's admission).
* Admission (admission.py, shm_grants.py): the sender pushes only chunks of transfers the receiver
  granted it (``expect`` puts the grant on every sender's socket before it returns) and only into
  the granted blocks; ``revoke`` has every sender confirm it dropped the grant, so it returns False
  while a sender is connected and ``poll_revoked`` lists the transfer once every sender confirmed or
  its connection closed. Until then the decode worker keeps the blocks quarantined.
* Where it runs: one host (the boot id in the descriptor must match ours, else ``connect`` refuses
  with one line) and caches of one kind (both CUDA, or both CPU). On CUDA the decode worker's GPU must
  be visible in the prefill process: the same GPU (two workers sharing one), or another GPU of the
  node that the prefill process can see (peer access makes the copy direct; without it torch routes
  it through host memory). Ray gives each actor only its own GPU, so under Ray that means one GPU.

Ordering (why the decode worker never reads half-written KV, and why a revoke means what it says):

1. Source ready. ``send`` runs on the prefill engine's thread after the forward pass wrote the
   blocks (enqueued on the engine's stream). It records a CUDA event on that stream there, and the
   IO thread makes its copy stream wait for the event before the copy: the gather reads the blocks
   after the kernels that wrote them, without blocking the engine.
2. Copy complete before anyone hears of it. The IO thread enqueues the gather and the scatter on its
   copy stream and then synchronises that stream (and the destination device's stream when the
   destination is another GPU) before it sends the chunk's notice. So when the notice leaves, every
   byte of the chunk is in the decode worker's memory.
3. Notice -> ack -> TransferDone -> decode. The receiver acks the notice; the sender reports the
   transfer delivered only after every chunk's ack (poll_sent), and the prefill worker sends
   TransferDone only then (connector.py). The decode worker schedules the request, and launches the
   kernels that read those blocks, only after TransferDone. Each arrow is a message read by a host
   thread after the previous step finished, so the decode's reads are issued after the copy
   completed: they see the whole chunk, on the same GPU or across a peer link.
4. Revoke. The IO thread is the only thread that copies; it copies one chunk at a time and returns
   from the synchronisation of step 2 before it reads the socket again. It answers REVOKED (dropping
   the grant) only between chunks, so when REVOKED leaves, no copy of that transfer is running on
   the GPU nor will one start. Without the synchronisation of step 2 a REVOKED could overtake a
   copy still queued on the device: that is why it is per chunk and not per transfer.
5. Peer death. A sender that dies cannot copy any more; the receiver learns it when the kernel
   closes the sender's socket. On CUDA that relies on the driver ending the dead process's work as
   it tears down its context, which happens while the kernel closes the process's descriptors; a
   copy is only in flight between its launch and step 2's synchronisation (microseconds to a few
   milliseconds). This is the one point only a GPU run can show (tests/test_cuda_ipc_transport.py,
   gpu-marked tests).
6. Blocks the decode worker reserves are idle on its side: it frees a request's blocks after the
   step that last read them has been synchronised (it reads the sampled ids), and reuses revoked
   ones only after ``poll_revoked``.

The decode side never copies: its IO thread only checks admission and acks. A sender whose cache
is on a CUDA device holds a mapping of each receiver's cache until the link is dropped or closed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import selectors
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from .base import Role, TransportConfig, replaced_link_reason
from .block_copy import gather_rows, scatter_rows
from .cuda_ipc_handle import HandleError, export_handle, is_shared_cpu_cache, open_handle, shared_cpu_cache
from .io_thread import IOThreadTransport
from .layout import KVLayout
from .sealing import ACK, GRANT, HANDOVER, HEADER, HELLO, REVOKE, REVOKED, SYNC, WELCOME
from .send_job import Chunk, SendJob
from .shm import _boot_id
from .shm_grants import Grants, decode_grant, decode_transfer_id, encode_transfer_id
from .shm_inbox import MAX_MSG_BYTES, PUSH, ShmInbox
from .wire import ChunkAck

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


def other_host_reason(peer_id: str) -> str:
    return (
        f"cuda_ipc: {peer_id} runs on another host (its boot id differs from ours); cuda_ipc moves KV "
        "only between workers on one host: choose nccl, ucx or tcp for workers on different hosts"
    )


@dataclass
class _Peer:
    """Sender side: one receiver, its cache mapped here."""

    sock: socket.socket
    nonce: bytes  # the receiver's: notices are sealed to it, acks must come from it
    layout: KVLayout
    rows: torch.Tensor | None  # the receiver's cache as uint8 rows [num_rows, block_bytes]; None once dropped
    grants: Grants  # transfers the receiver lets us push, and their blocks (shm_grants.py)
    dead: str | None = None


class CudaIpcTransport(IOThreadTransport):
    name = "cuda_ipc"

    @classmethod
    def allocate_kv_cache(
        cls, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """A zeroed cache a receiver can share: plain device memory on CUDA (any CUDA allocation can
        be shared), shared memory named by a file on CPU. Workers on both sides may use it."""
        if torch.device(device).type == "cuda":
            return torch.zeros(tuple(shape), dtype=dtype, device=device)
        if torch.device(device).type != "cpu":
            raise ValueError(f"cuda_ipc moves CUDA caches (or CPU caches, for tests), not {device}")
        return shared_cpu_cache(shape, dtype)

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        if role == "receiver" and not kv_cache.is_cuda and not is_shared_cpu_cache(kv_cache):
            raise ValueError(
                "a cuda_ipc receiver's CPU cache must come from CudaIpcTransport.allocate_kv_cache (shared "
                "memory its senders can map); on a GPU any CUDA cache will do"
            )
        super().__init__(kv_cache, role, config)
        # The copies use torch index kernels on both devices (the CPU path runs the same lines).
        self._src_rows = kv_cache.view(torch.uint8).view(-1, self._layout.block_bytes)
        self._stream = torch.cuda.Stream(self._device) if kv_cache.is_cuda else None
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._waker.fileno(), selectors.EVENT_READ, ("waker", None))
        self._socket_name = f"pdcluster-kv-ipc-{self._id}"
        self._listener: socket.socket | None = None
        if role == "receiver":
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._listener.bind(b"\0" + self._socket_name.encode())
            self._listener.listen(64)
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, ("listener", None))
        self._peers: dict[str, _Peer] = {}  # IO thread
        self._inbox = ShmInbox(
            self._landing,
            self._cache_share,
            sealer=self._sealer,
            selector=self._selector,
            receiver_id=self._id,
            timeout_s=self.config.timeout_s,
            shared=role == "receiver",
        )
        self._start_io()

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {
            "socket": self._socket_name if self._listener is not None else "",
            "boot_id": _boot_id(),
            "device": self._device.type,
        }

    def _cache_share(self) -> tuple[dict, list[int]]:
        """Receiver, IO thread, once per sender handshake: the WELCOME's fields. A fresh handle per
        sender: on CUDA torch counts the openings of each one it makes."""
        if self.role != "receiver":
            return {"kv_offset": 0, "kv_bytes": 0}, []
        try:
            handle = export_handle(self.kv_cache)
        except HandleError:
            raise  # already says what is wrong
        except Exception as e:  # noqa: BLE001 - the inbox logs ValueErrors and drops the sender
            raise HandleError(f"cannot share our cache: {type(e).__name__}: {e}") from e
        return {"kv_offset": 0, "kv_bytes": 0, "ipc": handle}, []

    def _link(self, peer_id: str, peer_descriptor: dict, peer_layout: KVLayout, nonce: bytes) -> None:
        """The handshake runs here, on the caller's thread (it blocks); the IO thread then adopts
        the connected socket."""
        if peer_descriptor.get("boot_id") != _boot_id():
            raise ConnectionError(other_host_reason(peer_id))
        if peer_descriptor.get("device") != self._device.type:
            raise ConnectionError(
                f"cuda_ipc: {peer_id}'s cache is on {peer_descriptor.get('device')!r}, ours on "
                f"{self._device.type!r}: both caches must be on CUDA (or both on CPU)"
            )
        if not peer_descriptor.get("socket"):
            raise ConnectionError(f"cuda_ipc: {peer_id}'s descriptor names no socket (it is not a receiver)")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(self.config.timeout_s)
        try:
            sock.connect(b"\0" + str(peer_descriptor["socket"]).encode())
            reply, rows = self._handshake(peer_id, sock, nonce, peer_layout)
            grants = self._initial_grants(peer_id, sock, nonce, Grants(open_receiver=bool(reply.get("open"))))
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        self._connect_on_io(peer_id, self._adopt_peer, peer_id, _Peer(sock, nonce, peer_layout, rows, grants))

    def _handshake(
        self, peer_id: str, sock: socket.socket, nonce: bytes, peer_layout: KVLayout
    ) -> tuple[dict, torch.Tensor]:
        """HELLO (we share nothing), WELCOME (the receiver's cache handle), HANDOVER. Returns the
        receiver's reply and its cache mapped here, as rows."""
        hello = {
            "sender_id": self._id, "layout": self._layout.to_dict(), "ring_bytes": 0, "kv_offset": 0, "kv_bytes": 0,
        }
        sock.send(self._sealer.seal(HELLO, nonce, msgpack.packb(hello)))
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG_BYTES, 1)
        for fd in fds:  # cuda_ipc hands out no descriptors
            os.close(fd)
        if not data:
            raise ConnectionError(
                f"{peer_id} closed the connection during the handshake (it does when our cluster "
                "secret differs from its own: see its log)"
            )
        welcome = self._sealer.open(data, {WELCOME: msgpack.unpackb}, (nonce,))
        if welcome is None:
            raise ConnectionError(f"{peer_id} did not prove the cluster secret; we map nothing of it")
        try:
            cache = open_handle(welcome.message.get("ipc"), peer_layout)
        except HandleError as e:
            log.warning("cuda_ipc sender: refused the cache handle of %s: %s", peer_id, e)
            raise ConnectionError(f"cuda_ipc: refused the cache handle of {peer_id}: {e}") from e
        if cache.device.type != self._device.type:
            raise ConnectionError(f"cuda_ipc: {peer_id}'s cache maps on {cache.device}, ours is on {self._device}")
        sock.send(self._sealer.seal(HANDOVER, nonce, b""))
        return welcome.message, cache.view(torch.uint8).view(-1, peer_layout.block_bytes)

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

    def _submit(self, job: SendJob) -> None:
        """On the caller's thread: mark where the caller's stream is (step 1 of the ordering)."""
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
        self._on_io(self._queue_after, job, ready)

    # receiver admission (shm.py's, every sender pushes) -----------------------------------------

    def expect(self, transfer_id: str, dst_block_ids: np.ndarray | Sequence[int]) -> None:
        self._admission.expect(transfer_id, dst_block_ids)
        blocks = np.unique(np.asarray(dst_block_ids, dtype=np.int64))
        # The grant must be on every sender's socket before the block ids can reach it.
        if not self._wait_io("grant", transfer_id, self._grant_io, transfer_id, blocks):
            self._admission.revoke(transfer_id)
            raise TimeoutError(f"cuda_ipc IO thread did not grant {transfer_id!r} within {self.config.timeout_s}s")

    def revoke(self, transfer_id: str) -> bool:
        if not self._admission.revoke(transfer_id):
            return True  # no sender holds a grant for it
        return self._wait_io("revoke", transfer_id, self._inbox.revoke, transfer_id, True)

    def complete(self, transfer_id: str) -> None:
        if self._admission.revoke(transfer_id):
            # Senders drop the grant; nothing to wait for (base.py: a delivered transfer is final).
            self._on_io(self._inbox.revoke, transfer_id, False)

    def poll_revoked(self) -> list[str]:
        out = []
        while self._inbox.revoked:
            out.append(self._inbox.revoked.popleft())
        return out

    @property
    def num_pending_revokes(self) -> int:
        """Revoked transfers still waiting for a sender's confirmation."""
        return self._inbox.num_pending_revokes

    def _wait_io(self, kind: str, transfer_id: str, run: Callable[..., object], *args: object) -> bool:
        """Run a grant or revoke on the IO thread and wait (bounded) for its result; a revoke the IO
        thread settles after the caller gave up is reported through poll_revoked."""
        call = self._ask_io(run, *args, on_late=functools.partial(self._answered_late, transfer_id))
        if call.wait(self.config.timeout_s):
            return bool(call.result)
        log.warning(
            "cuda_ipc IO thread did not answer a %s of %s within %.1fs", kind, transfer_id, self.config.timeout_s
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

    def _adopt_peer(self, peer_id: str, peer: _Peer) -> None:
        """connect(), on the IO thread: the handshaken socket replaces any link to the peer id."""
        if peer_id in self._peers:
            self._drop_link(peer_id)
        self._peers[peer_id] = peer
        self._selector.register(peer.sock, selectors.EVENT_READ, ("peer", peer_id))

    def _grant_io(self, transfer_id: str, blocks: np.ndarray) -> bool:
        self._inbox.grant(transfer_id, blocks)
        return True  # every sender has the grant on its socket (or queued for it)

    def _answered_late(self, transfer_id: str, result: object) -> None:
        if result:
            self._inbox.revoked.append(transfer_id)

    def _queue_after(self, job: SendJob, ready: torch.cuda.Event | None) -> None:
        if ready is not None and self._stream is not None:
            self._stream.wait_event(ready)  # every later copy starts after the caller's writes
        self._queue_job(job)

    def _peer_problem(self, peer_id: str) -> str | None:
        peer = self._peers.get(peer_id)
        return f"not connected to {peer_id}" if peer is None else peer.dead

    def _post_chunk(self, job: SendJob, chunk: Chunk) -> bool:
        peer = self._peers[job.peer_id]
        if not self._may_push(job, peer, chunk.dst_block_ids):
            return True  # the send failed; the queue drops it
        self._push(job, chunk, peer)
        job.next_chunk += 1
        header = job.header(chunk, self._id, self._layout, {"mode": PUSH}).encode()
        self._notify(job.peer_id, peer, self._sealer.seal(HEADER, peer.nonce, header))
        return True

    def _push(self, job: SendJob, chunk: Chunk, peer: _Peer) -> None:
        """Copy one chunk into the receiver's cache and wait until it is there (ordering, step 2)."""
        assert peer.rows is not None
        stage = self._pool.take(job.payload_bytes(chunk, self._layout)).view(-1, self._layout.block_bytes)
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                gather_rows(self._src_rows, self._layout.row_ids(job.layer_ids, chunk.src_block_ids), stage)
                scatter_rows(stage, peer.rows, peer.layout.row_ids(job.layer_ids, chunk.dst_block_ids))
            if self._stream is not None:
                self._stream.synchronize()
            if peer.rows.is_cuda and peer.rows.device != self._device:  # another GPU: its stream ran the scatter
                torch.cuda.current_stream(peer.rows.device).synchronize()
        finally:
            self._pool.give(stage)

    def _may_push(self, job: SendJob, peer: _Peer, dst_block_ids: np.ndarray) -> bool:
        """Push only under a grant (shm_grants.py). Read what waits on the socket first: a REVOKE
        takes effect before the next copy, and a grant sent before the reservation was answered is
        there by now."""
        self._on_peer_readable(job.peer_id)
        if peer.dead or not self._tracker.is_live(job.seq):
            return False
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
                # Chunks are copied on this thread, one at a time, each finished on the device before
                # we get here (ordering, step 4): none of this transfer is being copied, and without
                # the grant none will be.
                peer.grants.drop(opened.message)
                self._notify(peer_id, peer, self._sealer.seal(REVOKED, peer.nonce, encode_transfer_id(opened.message)))
            else:
                self._tracker.chunk_acked(opened.message.send_seq, opened.message.error)

    def _peer_lost(self, peer_id: str, peer: _Peer, reason: str) -> None:
        if peer.dead:
            return
        peer.dead = reason
        peer.rows = None  # unmap: we never write to a lost peer again
        self._tracker.fail_peer(peer_id, reason)
        self._selector.unregister(peer.sock)
        # Closing tells a live receiver we stopped, which settles the revokes it waits on us for.
        peer.sock.close()

    def _drop_link(self, peer_id: str) -> None:
        """The peer restarted and connect() was given its new descriptor: fail what is in flight to
        the old incarnation and close its socket (before the new link takes the peer id)."""
        old = self._peers.pop(peer_id)
        old.rows = None
        if not old.dead:
            self._tracker.fail_peer(peer_id, replaced_link_reason(peer_id))
            self._selector.unregister(old.sock)
        old.sock.close()
