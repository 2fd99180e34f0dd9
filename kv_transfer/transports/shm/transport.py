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

Control (common/mapped_push.py, shared with cuda_ipc): a SOCK_SEQPACKET unix socket per sender-receiver
pair in the abstract namespace (no file to clean up; the kernel drops it with the process). It
carries the handshake with the memfd descriptors (SCM_RIGHTS), one notice per chunk and one ack per
chunk. A peer that dies closes its end, so the other side learns at once; the ack deadline covers a
peer that hangs.

Nothing is created under /dev/shm: memfd segments vanish when the last process holding them exits,
also on SIGKILL. Sources must stay unchanged until poll_sent reports them (a receiver may pull late).

Admission (common/admission.py, common/grants.py, common/mapped_push.py). Pull and ring chunks are
copied by the receiver through its admission gate, so ``revoke`` stops them at once. A push is written
by the sender itself: it pushes only chunks of transfers the receiver granted it (``expect`` sends the
grant before it returns), and ``revoke`` has every pushing sender confirm it dropped the grant. So
``revoke`` returns True when our cache is not shared (or no sender is connected), else False, and
``poll_revoked`` lists the transfer once every pushing sender confirmed or closed its connection.

Authentication (common/sealing.py). Mapping a peer's memory is the whole game here (a push writes
straight into the receiver's cache), so memory descriptors go only to a peer that proved the cluster
secret, in a three-step handshake: the sender's HELLO (no descriptors), the receiver's WELCOME (with its
cache, sent only if the HELLO verified), the sender's HANDOVER (with its ring and cache, sent only if
the WELCOME verified). Notices and acks are sealed too, so a socket cannot be used to make a receiver
pull or scatter what the sender never sent. The abstract socket name stays guessable; a stranger who
connects gets nothing but a closed socket.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..base import Role, TransportConfig
from ..common.block_copy import blocks_view, copy_blocks, gather_rows
from ..common.grants import Grants
from ..common.inbox import PULL, PUSH, RING
from ..common.layout import KVLayout
from ..common.mapped_push import MappedPushTransport, PushPeer, same_host
from ..common.memfd import create_segment, find_segment, map_cache, shared_tensor
from ..common.sealing import HANDOVER
from ..common.send_job import Chunk, SendJob
from ..common.wire import ChunkAck
from .ring import RingAllocator


@dataclass
class _Peer(PushPeer):
    """Sender side: one receiver."""

    blocks: np.ndarray | None = None  # the receiver's cache [layers * planes, blocks, bytes] when shared
    mapping: mmap.mmap | None = None
    pulls: bool = False  # the receiver mapped our cache and copies pull chunks itself


class ShmTransport(MappedPushTransport):
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
        found = find_segment(kv_cache)
        super().__init__(kv_cache, role, config, shared=found is not None)
        self._blocks = blocks_view(self._rows, self._layout)
        # Our own descriptor of the cache's segment (dup): the registry closes its copy when the
        # tensor that allocate_kv_cache returned is collected, and a closed number may be reused.
        self._kv_fd = os.dup(found[0].fd) if found else -1
        self._kv_offset = found[1] if found else 0
        self._peer_modes: dict[str, str] = {}  # caller thread: "push", "pull", "push+pull" or "ring"
        # Sender: the staging ring, made at the first connect to a peer that needs it.
        self._ring_fd = -1
        self._ring_map: mmap.mmap | None = None
        self._ring_bytes: np.ndarray | None = None
        self._ring: RingAllocator | None = None
        self._ring_lock = threading.Lock()
        self._ring_spans: dict[tuple[int, int], tuple[str, int]] = {}  # IO thread: (seq, chunk) -> (peer, offset)
        self._start_io()

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {**super()._descriptor_fields(), "kv_in_shm": self._kv_fd >= 0}

    def peer_mode(self, peer_id: str) -> str:
        """How chunks to ``peer_id`` move: "push", "pull", "push+pull" or "ring" (see module doc)."""
        return self._peer_modes[peer_id]

    def _cache_share(self) -> tuple[dict, list[int]]:
        """Handshake fields and descriptor that let the peer map our cache, if it is shared."""
        if self._kv_fd < 0:
            return {"kv_offset": 0, "kv_bytes": 0}, []
        nbytes = self.kv_cache.numel() * self.kv_cache.element_size()
        return {"kv_offset": self._kv_offset, "kv_bytes": nbytes}, [self._kv_fd]

    def _check_peer(self, peer_id: str, peer_descriptor: dict) -> None:
        if not same_host(peer_descriptor):
            raise ConnectionError(f"{peer_id} runs on another host (or boot): shm needs the same host")

    def _handshake(
        self, peer_id: str, sock: socket.socket, nonce: bytes, peer_layout: KVLayout, peer_descriptor: dict
    ) -> _Peer:
        """HELLO, WELCOME, HANDOVER (module docstring). The receiver as a peer: if it shared its
        cache, with the mapping and the ``[layers * 2, blocks, bytes]`` view of it."""
        needs_ring = not peer_descriptor.get("kv_in_shm") and self._kv_fd < 0
        share, fds = self._cache_share()
        ring_bytes = self.config.shm.ring_bytes if needs_ring else 0
        if needs_ring:
            fds = [self._ensure_ring(), *fds]
        hello = {"sender_id": self._id, "layout": self._layout.to_dict(), "ring_bytes": ring_bytes, **share}
        reply, got_fds = self._greet(peer_id, sock, nonce, hello)
        grants = Grants(open_receiver=bool(reply.get("open")))
        peer = _Peer(sock, nonce, peer_layout, grants, pulls=bool(reply.get("pulls")))
        try:
            socket.send_fds(sock, [self._sealer.seal(HANDOVER, nonce, b"")], fds)
            if not got_fds:
                return peer
            fd = got_fds.pop()
        finally:
            for fd_left in got_fds:
                os.close(fd_left)
        peer.mapping, peer.blocks = map_cache(
            fd, reply["kv_offset"], reply["kv_bytes"],
            peer_layout.num_layers * peer_layout.num_planes, peer_layout.num_blocks, peer_layout.block_bytes,
        )  # fmt: skip
        return peer

    def _linked(self, peer_id: str, peer: _Peer) -> None:
        modes = [m for m, ok in ((PUSH, peer.blocks is not None), (PULL, peer.pulls)) if ok]
        self._peer_modes[peer_id] = "+".join(modes) or RING

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

    def _release(self) -> None:
        super()._release()
        for fd in (self._ring_fd, self._kv_fd):
            if fd >= 0:
                os.close(fd)
        self._ring_fd = self._kv_fd = -1
        # Mappings are left to the garbage collector: numpy views of them may still be referenced,
        # and mmap.close() fails while buffers are exported.
        self._ring_bytes = None
        self._ring_map = None

    # ---------------------------------------------------------------- IO thread: sender

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

    def _post_chunk(self, job: SendJob, chunk: Chunk) -> bool:
        peer = self._peers[job.peer_id]
        mode = self._chunk_mode(peer, chunk.index)
        if mode == PUSH:
            return super()._post_chunk(job, chunk)  # under a grant (common/mapped_push.py)
        extra: dict = {"mode": mode}
        if mode == PULL:
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
        self._announce(job, chunk, peer, extra)
        return True

    def _push(self, job: SendJob, chunk: Chunk, peer: _Peer) -> None:
        """A CPU copy: every byte is in the receiver's memory when it returns."""
        assert peer.blocks is not None
        copy_blocks(self._blocks, chunk.src_block_ids, peer.blocks, chunk.dst_block_ids, job.layer_ids,
                    self._layout.num_planes)

    def _on_ack(self, ack: ChunkAck) -> None:
        span = self._ring_spans.pop((ack.send_seq, ack.chunk_index), None)
        if span is not None and self._ring is not None:
            self._ring.release(span[1])
        super()._on_ack(ack)

    def _peer_gone(self, peer_id: str, peer: _Peer) -> None:
        # Its unacked ring chunks will never be acked: reclaim them (a dead receiver reads nothing).
        for key in [k for k, (p, _) in self._ring_spans.items() if p == peer_id]:
            if self._ring is not None:
                self._ring.release(self._ring_spans.pop(key)[1])
