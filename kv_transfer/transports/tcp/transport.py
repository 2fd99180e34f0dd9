"""TCP transport over pyzmq.

The receiver binds a ROUTER on ``config.host`` (127.0.0.1 by default; never a wildcard); each sender
connects a DEALER per receiver. A chunk is one two-frame message, [msgpack header, payload], the
payload handed to zmq without a copy (``copy=False``, ``track=True``: the staging buffer goes back to
the pool only once zmq is done with it). The receiver scatters straight from zmq's frame and answers
with an ack on the same socket.

Flow control: at most ``max_inflight_chunks`` unacknowledged chunks per transport, so a slow receiver
holds up the sender instead of growing zmq's queues without bound (HWMs are off).

Failure: a socket monitor on each DEALER reports a dropped connection at once (peer killed); the ack
deadline covers everything else (peer hung, never reachable).

Admission (common/admission.py): the IO thread scatters a chunk only through the receiver's admission
gate, after the sealing check; ``revoke`` takes the same lock, so it returns once no chunk of the
transfer can be scattered any more (always True here). A refused chunk is acked with the reason.

Authentication (common/sealing.py): the header frame is a sealed envelope, checked before the payload
frame is looked at; a message that fails is dropped without an ack. zmq keeps one connection's messages
in order, and a message's payload frame cannot be separated from its header frame. Acks are sealed to
the sender and must come from the receiver the DEALER was connected to.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..base import Role, TransportConfig, replaced_link_reason
from ..common.block_copy import buffer_rows, gather_rows
from ..common.io_thread import IOThreadTransport
from ..common.layout import KVLayout, chunk_problem
from ..common.sealing import ACK, HEADER
from ..common.send_job import Chunk, SendJob
from ..common.wire import ChunkAck, ChunkHeader

log = logging.getLogger(__name__)

_IDLE_WAIT_MS = 50


class ZmqTransport(IOThreadTransport):
    name = "tcp"

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        super().__init__(kv_cache, role, config)
        self._zctx = zmq.Context()
        self._poller = zmq.Poller()  # IO thread
        self._poller.register(self._waker.fileno(), zmq.POLLIN)
        self._port = 0
        self._router: zmq.Socket | None = None
        if role == "receiver":
            # Bound here, not in the IO thread, so the descriptor is ready when __init__ returns.
            self._router = self._zctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.RCVHWM, 0)
            self._router.setsockopt(zmq.SNDHWM, 0)
            self._port = self._router.bind_to_random_port(f"tcp://{self.config.host}")
            self._poller.register(self._router, zmq.POLLIN)
        # IO thread state.
        self._dealers: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> peer id
        self._peer_nonces: dict[str, bytes] = {}  # peer id -> the nonce we seal to, acks come from
        self._dead_peers: dict[str, str] = {}
        self._unacked: dict[tuple[int, int], str] = {}  # (send seq, chunk) -> peer id
        self._tracked: list[tuple[zmq.MessageTracker, torch.Tensor]] = []
        self._start_io()

    def _staging_device(self) -> torch.device:
        return torch.device("cpu")  # zmq sends from host memory

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {"host": self.config.host, "port": self._port}

    def _link(self, peer_id: str, peer_descriptor: dict, peer_layout: KVLayout, nonce: bytes) -> None:
        endpoint = f"tcp://{peer_descriptor['host']}:{int(peer_descriptor['port'])}"
        self._connect_on_io(peer_id, self._connect_io, peer_id, endpoint, nonce)

    def _release(self) -> None:
        super()._release()
        self._zctx.destroy(linger=0)  # closes any socket still open; nothing waits on unsent data

    # ---------------------------------------------------------------- IO thread

    def _io_step(self, busy: bool) -> None:
        busy |= self._post_chunks()
        self._release_sent_buffers()
        events = dict(self._poller.poll(0 if busy else _IDLE_WAIT_MS))
        if self._waker.fileno() in events:
            self._waker.drain()
        if self._router is not None and self._router in events:
            self._receive_chunks()
        for peer_id, sock in list(self._dealers.items()):
            if sock in events:
                self._receive_acks(sock, peer_id)
        for mon, peer_id in list(self._monitors.items()):
            if mon in events:
                self._on_monitor(mon, peer_id)

    def _io_shutdown(self) -> None:
        for sock in [*self._dealers.values(), *self._monitors]:
            sock.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def _connect_io(self, peer_id: str, endpoint: str, nonce: bytes) -> None:
        if peer_id in self._dealers:
            self._drop_link(peer_id)
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            mon.close(linger=0)
            sock.close(linger=0)
            raise
        self._dealers[peer_id] = sock
        self._monitors[mon] = peer_id
        self._peer_nonces[peer_id] = nonce
        self._dead_peers.pop(peer_id, None)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)

    def _drop_link(self, peer_id: str) -> None:
        """The peer restarted and connect() was given its new descriptor: fail what is in flight to
        the old incarnation (its unacked chunks stop counting against max_inflight_chunks as their
        sends die) and close the old socket, so nothing from the old link is taken for the new one."""
        self._tracker.fail_peer(peer_id, replaced_link_reason(peer_id))
        sock = self._dealers.pop(peer_id)
        for mon in [m for m, p in self._monitors.items() if p == peer_id]:
            del self._monitors[mon]
            self._poller.unregister(mon)
            mon.close(linger=0)
        self._poller.unregister(sock)
        sock.close(linger=0)

    def _on_monitor(self, mon: zmq.Socket, peer_id: str) -> None:
        while mon.poll(0):
            event = recv_monitor_message(mon)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # zmq would reconnect and resend silently; a lost receiver has lost our chunks.
                reason = f"connection to {peer_id} dropped"
                self._dead_peers[peer_id] = reason
                self._tracker.fail_peer(peer_id, reason)

    # sender ------------------------------------------------------------------------------

    def _has_room(self) -> bool:
        for key in [k for k in self._unacked if not self._tracker.is_live(k[0])]:
            del self._unacked[key]  # its send failed: no ack will come
        return len(self._unacked) < self.config.max_inflight_chunks

    def _peer_problem(self, peer_id: str) -> str | None:
        return self._dead_peers.get(peer_id)

    def _post_chunk(self, job: SendJob, chunk: Chunk) -> bool:
        job.next_chunk += 1
        buf = self._pool.take(job.payload_bytes(chunk, self._layout))
        rows = self._layout.row_ids(job.layer_ids, chunk.src_block_ids)
        if self._device.type == "cuda":
            gathered = torch.empty((len(rows), self._layout.block_bytes), dtype=torch.uint8, device=self._device)
            gather_rows(self._rows, rows, gathered)
            buf.view(-1, self._layout.block_bytes).copy_(gathered)  # device -> host, synchronous
        else:
            gather_rows(self._rows, rows, buffer_rows(buf, self._layout.block_bytes))
        header = job.header(chunk, self._id, self._layout).encode()
        sealed = self._sealer.seal(HEADER, self._peer_nonces[job.peer_id], header)
        tracker = self._dealers[job.peer_id].send_multipart([sealed, buf.numpy()], copy=False, track=True)
        self._tracked.append((tracker, buf))
        self._unacked[(job.seq, chunk.index)] = job.peer_id
        return True

    def _release_sent_buffers(self) -> None:
        still: list[tuple[zmq.MessageTracker, torch.Tensor]] = []
        for tracker, buf in self._tracked:
            if tracker.done:
                self._pool.give(buf)
            else:
                still.append((tracker, buf))
        self._tracked = still

    def _receive_acks(self, sock: zmq.Socket, peer_id: str) -> None:
        expect_from = (self._peer_nonces[peer_id],)
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            opened = self._sealer.open(frames[-1], {ACK: ChunkAck.decode}, expect_from)
            if opened is None:
                continue  # a forged or replayed ack: the send stays outstanding
            ack = opened.message
            self._unacked.pop((ack.send_seq, ack.chunk_index), None)
            self._tracker.chunk_acked(ack.send_seq, ack.error)

    # receiver ----------------------------------------------------------------------------

    def _receive_chunks(self) -> None:
        assert self._router is not None
        while True:
            try:
                identity, header_frame, payload = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except ValueError:
                self._sealer.reject("message without exactly a header and a payload frame")
                continue
            opened = self._sealer.open(header_frame.buffer, {HEADER: ChunkHeader.decode})
            if opened is None:
                continue  # not from a holder of the secret, or a replay: no ack, cache untouched
            header = opened.message
            ack = self._landing.settle(opened.from_nonce, header, self._scatter(header, payload))
            self._router.send_multipart([identity.bytes, self._sealer.seal(ACK, opened.from_nonce, ack.encode())])

    def _scatter(self, header: ChunkHeader, payload: Any) -> str | None:
        data = np.frombuffer(payload.buffer, dtype=np.uint8)
        problem = chunk_problem(self._layout, header.layer_ids, header.dst_block_ids, data.size)
        if problem:
            return problem
        src = data.reshape(-1, self._layout.block_bytes)
        if self._device.type != "cuda":
            return self._landing.scatter(header, src)
        # Through a pinned staging buffer (zmq's frame is read-only and pageable): the copy to the device is then
        # a DMA, not a staged pageable copy. The landing has synchronised its stream when it returns.
        staged = self._pool.take(data.size)
        try:
            staged.numpy()[:] = data
            return self._landing.scatter(header, staged.view(-1, self._layout.block_bytes))
        finally:
            self._pool.give(staged)
