"""Same-host transport that writes KV straight into the decode worker's cache: CUDA IPC.

The receiver (decode) shares its whole cache through a handle made by torch's own reduction
(handle.py): a CUDA IPC memory handle for a CUDA cache, a shared-memory file name for a CPU
cache (tests, CPU-only hosts). The sender (prefill) maps it once per connection and copies each chunk
from its own cache into the destination blocks itself, on its device: a gather of the source rows
into a staging buffer and a scatter into the mapped cache (common/block_copy.py; torch index
kernels, so on one GPU a device-to-device copy, no host memory, no second copy on the receiver).
This is shm's "push" mode (shm/transport.py) with device memory; everything else is shared with shm
(common/mapped_push.py):

* Control: one SOCK_SEQPACKET unix socket per sender-receiver pair in the abstract namespace; the
  HELLO / WELCOME / HANDOVER handshake in which the receiver hands its cache handle (inside the sealed
  WELCOME) only to a sender that proved the cluster secret; one sealed notice and one ack per chunk.
  The receiver's side of it is shm's (common/inbox.py, which also checks each pushed chunk's admission).
* Admission (common/admission.py, common/grants.py, common/mapped_push.py): the sender pushes
  only chunks of transfers the receiver granted it (``expect`` puts the grant on every sender's
  socket before it returns) and only into the granted blocks; ``revoke`` has every sender confirm it
  dropped the grant, so it returns False while a sender is connected and ``poll_revoked`` lists the
  transfer once every sender confirmed or its connection closed. Until then the decode worker keeps
  the blocks quarantined.
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
   TransferDone only then (connector/prefill.py). The decode worker schedules the request, and launches the
   kernels that read those blocks, only after TransferDone. Each arrow is a message read by a host
   thread after the previous step finished, so the decode's reads are issued after the copy
   completed: they see the whole chunk, on the same GPU or across a peer link.
4. Revoke. The IO thread is the only thread that copies; it copies one chunk at a time and returns
   from the synchronisation of step 2 (the end of ``_push``) before it reads the socket again. It
   answers REVOKED (dropping the grant, common/mapped_push.py) only between chunks, so when
   REVOKED leaves, no copy of that transfer is running on the GPU nor will one start. Without the
   synchronisation of step 2 a REVOKED could overtake a copy still queued on the device: that is why
   it is per chunk and not per transfer.
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
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..base import Role, TransportConfig
from ..common.block_copy import gather_rows, scatter_rows
from ..common.grants import Grants
from ..common.layout import KVLayout
from ..common.mapped_push import MappedPushTransport, PushPeer, same_host
from ..common.sealing import HANDOVER
from ..common.send_job import Chunk, SendJob
from .handle import HandleError, export_handle, is_shared_cpu_cache, open_handle, shared_cpu_cache

log = logging.getLogger(__name__)


def other_host_reason(peer_id: str) -> str:
    return (
        f"cuda_ipc: {peer_id} runs on another host (its boot id differs from ours); cuda_ipc moves KV "
        "only between workers on one host: choose nccl, ucx or tcp for workers on different hosts"
    )


@dataclass
class _Peer(PushPeer):
    """Sender side: one receiver, its cache mapped here."""

    rows: torch.Tensor | None = None  # the receiver's cache as uint8 rows [num_rows, block_bytes]; None once dropped


class CudaIpcTransport(MappedPushTransport):
    name = "cuda_ipc"
    socket_prefix = "pdcluster-kv-ipc"

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
        # Every sender pushes: a receiver's cache is always shared.
        super().__init__(kv_cache, role, config, shared=role == "receiver")
        # The copies use torch index kernels on both devices (the CPU path runs the same lines).
        self._src_rows = kv_cache.view(torch.uint8).view(-1, self._layout.block_bytes)
        self._stream = torch.cuda.Stream(self._device) if kv_cache.is_cuda else None
        self._start_io()

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {**super()._descriptor_fields(), "device": self._device.type}

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

    def _check_peer(self, peer_id: str, peer_descriptor: dict) -> None:
        if not same_host(peer_descriptor):
            raise ConnectionError(other_host_reason(peer_id))
        if peer_descriptor.get("device") != self._device.type:
            raise ConnectionError(
                f"cuda_ipc: {peer_id}'s cache is on {peer_descriptor.get('device')!r}, ours on "
                f"{self._device.type!r}: both caches must be on CUDA (or both on CPU)"
            )
        if not peer_descriptor.get("socket"):
            raise ConnectionError(f"cuda_ipc: {peer_id}'s descriptor names no socket (it is not a receiver)")

    def _handshake(
        self, peer_id: str, sock: socket.socket, nonce: bytes, peer_layout: KVLayout, peer_descriptor: dict
    ) -> _Peer:
        """HELLO (we share nothing), WELCOME (the receiver's cache handle), HANDOVER. The receiver as
        a peer, its cache mapped here as rows."""
        hello = {
            "sender_id": self._id, "layout": self._layout.to_dict(), "ring_bytes": 0, "kv_offset": 0, "kv_bytes": 0,
        }
        reply, fds = self._greet(peer_id, sock, nonce, hello)
        for fd in fds:  # cuda_ipc hands out no descriptors
            os.close(fd)
        try:
            cache = open_handle(reply.get("ipc"), peer_layout)
        except HandleError as e:
            log.warning("cuda_ipc sender: refused the cache handle of %s: %s", peer_id, e)
            raise ConnectionError(f"cuda_ipc: refused the cache handle of {peer_id}: {e}") from e
        if cache.device.type != self._device.type:
            raise ConnectionError(f"cuda_ipc: {peer_id}'s cache maps on {cache.device}, ours is on {self._device}")
        sock.send(self._sealer.seal(HANDOVER, nonce, b""))
        rows = cache.view(torch.uint8).view(-1, peer_layout.block_bytes)
        return _Peer(sock, nonce, peer_layout, Grants(open_receiver=bool(reply.get("open"))), rows=rows)

    def _submit(self, job: SendJob) -> None:
        """On the caller's thread: mark where the caller's stream is (step 1 of the ordering)."""
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
        self._on_io(self._queue_after, job, ready)

    # ---------------------------------------------------------------- IO thread: sender

    def _queue_after(self, job: SendJob, ready: torch.cuda.Event | None) -> None:
        if ready is not None and self._stream is not None:
            self._stream.wait_event(ready)  # every later copy starts after the caller's writes
        self._queue_job(job)

    def _push(self, job: SendJob, chunk: Chunk, peer: _Peer) -> None:
        """Copy one chunk into the receiver's cache and wait until it is there (ordering, step 2)."""
        assert peer.rows is not None
        stage = self._pool.take(job.payload_bytes(chunk, self._layout)).view(-1, self._layout.block_bytes)
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                gather_rows(self._src_rows, self._layout.row_ids(job.layer_ids, chunk.src_block_ids), stage)
                scatter_rows(stage, peer.rows, peer.layout.row_ids(job.layer_ids, chunk.dst_block_ids))
        finally:
            # Before the buffer goes back to the pool, whether the copies ran or one of them raised: a copy still
            # queued on it would read what the next chunk stages there.
            if self._stream is not None:
                self._stream.synchronize()
            if peer.rows is not None and peer.rows.is_cuda and peer.rows.device != self._device:
                torch.cuda.current_stream(peer.rows.device).synchronize()  # another GPU: its stream ran the scatter
            self._pool.give(stage)

    def _peer_gone(self, peer_id: str, peer: _Peer) -> None:
        peer.rows = None  # unmap: we never write to this peer again
