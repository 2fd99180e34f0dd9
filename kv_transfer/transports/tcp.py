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

Admission (admission.py): the IO thread scatters a chunk only through the receiver's admission gate,
after the sealing check; ``revoke`` takes the same lock, so it returns once no chunk of the transfer
can be scattered any more (always True here). A refused chunk is acked with the reason.

Authentication (sealing.py): the header frame is a sealed envelope, checked before the payload frame
is looked at; a message that fails is dropped without an ack. zmq keeps one connection's messages in
order, and a message's payload frame cannot be separated from its header frame. Acks are sealed to
the sender and must come from the receiver the DEALER was connected to.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from .base import KVTransport, Role, TransportConfig, replaced_link_reason
from .block_copy import buffer_rows, gather_rows, rows_view, scatter_rows
from .layout import KVLayout, chunk_problem
from .sealing import ACK, HEADER, peer_nonce
from .send_job import QueuedSendMixin, SendJob
from .staging import BufferPool
from .tracking import ReceiveTracker, SendTracker
from .waker import Waker
from .wire import ChunkAck, ChunkHeader

log = logging.getLogger(__name__)

_IDLE_WAIT_MS = 50
_CLOSE_JOIN_S = 2.0


class ZmqTransport(QueuedSendMixin, KVTransport):
    name = "tcp"

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        super().__init__(kv_cache, role, config)
        self._layout = KVLayout.of(kv_cache)
        self._rows = rows_view(kv_cache, self._layout.block_bytes)
        self._device = kv_cache.device
        self._id = uuid.uuid4().hex
        self._zctx = zmq.Context()
        self._waker = Waker()
        self._tracker = SendTracker()
        self._received = ReceiveTracker()
        self._pool = BufferPool(
            torch.device("cpu"), self.config.max_inflight_chunks * self.config.chunk_bytes
        )
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._peer_layouts: dict[str, KVLayout] = {}  # caller thread
        self._port = 0
        self._router: zmq.Socket | None = None
        if role == "receiver":
            # Bound here, not in the IO thread, so the descriptor is ready when __init__ returns.
            self._router = self._zctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.RCVHWM, 0)
            self._router.setsockopt(zmq.SNDHWM, 0)
            self._port = self._router.bind_to_random_port(f"tcp://{self.config.host}")
        # IO thread state.
        self._dealers: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> peer id
        self._peer_nonces: dict[str, bytes] = {}  # peer id -> the nonce we seal to, acks come from
        self._dead_peers: dict[str, str] = {}
        self._jobs: deque[SendJob] = deque()
        self._unacked: dict[tuple[int, int], str] = {}  # (send seq, chunk) -> peer id
        self._tracked: list[tuple[zmq.MessageTracker, torch.Tensor]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"tcp-kv-{role}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- caller-side API

    def local_descriptor(self) -> dict:
        return {
            "transport": self.name,
            "layout": self._layout.to_dict(),
            "host": self.config.host,
            "port": self._port,
            "nonce": self._sealer.nonce,
        }

    def connect(self, peer_id: str, peer_descriptor: dict) -> None:
        peer_layout = KVLayout.from_dict(peer_descriptor["layout"])
        self._layout.check_peer(peer_layout)
        nonce = peer_nonce(peer_id, peer_descriptor)
        if self.role == "receiver" or self._already_linked(peer_id, peer_descriptor):
            return
        endpoint = f"tcp://{peer_descriptor['host']}:{int(peer_descriptor['port'])}"
        done = threading.Event()
        result: dict[str, BaseException] = {}
        self._commands.put(("connect", peer_id, endpoint, nonce, done, result))
        self._waker.wake()
        if not done.wait(self.config.timeout_s):
            raise TimeoutError(f"connect to {peer_id} timed out")
        if "error" in result:
            raise ConnectionError(f"connect to {peer_id} failed: {result['error']}") from result["error"]
        self._peer_layouts[peer_id] = peer_layout
        self._peer_descriptors[peer_id] = peer_descriptor

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._waker.wake()
        self._thread.join(_CLOSE_JOIN_S)
        if self._thread.is_alive():
            log.warning("tcp IO thread did not stop within %.1fs", _CLOSE_JOIN_S)
            return
        self._waker.close()
        self._pool.clear()
        self._zctx.destroy(linger=0)  # closes any socket still open; nothing waits on unsent data

    # ---------------------------------------------------------------- IO thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._waker.fileno(), zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stopping:
                busy = self._drain_commands(poller)
                busy |= self._post_chunks()
                self._release_sent_buffers()
                events = dict(poller.poll(0 if busy else _IDLE_WAIT_MS))
                if self._waker.fileno() in events:
                    self._waker.drain()
                if self._router is not None and self._router in events:
                    self._receive_chunks()
                for peer_id, sock in list(self._dealers.items()):
                    if sock in events:
                        self._receive_acks(sock, peer_id)
                for mon, peer_id in list(self._monitors.items()):
                    if mon in events:
                        self._on_monitor(mon, peer_id, poller)
        except Exception as e:  # noqa: BLE001 - surface in poll_sent rather than die silently
            log.exception("tcp IO thread failed")
            for peer_id in list(self._dealers):
                self._tracker.fail_peer(peer_id, f"tcp IO thread failed: {e}")
        finally:
            for peer_id in list(self._dealers):
                self._tracker.fail_peer(peer_id, "transport closed")
            for sock in [*self._dealers.values(), *self._monitors]:
                sock.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)

    def _drain_commands(self, poller: zmq.Poller) -> bool:
        busy = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return busy
            busy = True
            if cmd[0] == "send":
                self._jobs.append(cmd[1])
            elif cmd[0] == "connect":
                _, peer_id, endpoint, nonce, done, result = cmd
                try:
                    self._connect_io(peer_id, endpoint, nonce, poller)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    result["error"] = e
                done.set()

    def _connect_io(self, peer_id: str, endpoint: str, nonce: bytes, poller: zmq.Poller) -> None:
        if peer_id in self._dealers:
            self._drop_link(peer_id, poller)
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
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)

    def _drop_link(self, peer_id: str, poller: zmq.Poller) -> None:
        """The peer restarted and connect() was given its new descriptor: fail what is in flight to
        the old incarnation (its unacked chunks stop counting against max_inflight_chunks as their
        sends die) and close the old socket, so nothing from the old link is taken for the new one."""
        self._tracker.fail_peer(peer_id, replaced_link_reason(peer_id))
        sock = self._dealers.pop(peer_id)
        for mon in [m for m, p in self._monitors.items() if p == peer_id]:
            del self._monitors[mon]
            poller.unregister(mon)
            mon.close(linger=0)
        poller.unregister(sock)
        sock.close(linger=0)

    def _on_monitor(self, mon: zmq.Socket, peer_id: str, poller: zmq.Poller) -> None:
        while mon.poll(0):
            event = recv_monitor_message(mon)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # zmq would reconnect and resend silently; a lost receiver has lost our chunks.
                reason = f"connection to {peer_id} dropped"
                self._dead_peers[peer_id] = reason
                self._tracker.fail_peer(peer_id, reason)

    # sender ------------------------------------------------------------------------------

    def _live_unacked(self) -> int:
        dead = [k for k in self._unacked if not self._tracker.is_live(k[0])]
        for k in dead:
            del self._unacked[k]
        return len(self._unacked)

    def _post_chunks(self) -> bool:
        posted = False
        while self._jobs and self._live_unacked() < self.config.max_inflight_chunks:
            job = self._jobs[0]
            if job.peer_id in self._dead_peers:
                self._tracker.fail_send(job.seq, self._dead_peers[job.peer_id])
            if not self._tracker.is_live(job.seq) or job.next_chunk >= len(job.chunks):
                self._jobs.popleft()
                continue
            chunk = job.chunks[job.next_chunk]
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
            posted = True
        return posted

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
            error = self._scatter(header, payload)
            if error is None:
                self._received.chunk_landed(
                    opened.from_nonce, header.send_seq, header.num_chunks, header.transfer_id, header.layer_ids
                )
            ack = ChunkAck(header.send_seq, header.chunk_index, error).encode()
            self._router.send_multipart([identity.bytes, self._sealer.seal(ACK, opened.from_nonce, ack)])

    def _scatter(self, header: ChunkHeader, payload: Any) -> str | None:
        layout = self._layout
        data = np.frombuffer(payload.buffer, dtype=np.uint8)
        problem = chunk_problem(layout, header.layer_ids, header.dst_block_ids, data.size)
        if problem:
            return problem
        rows = layout.row_ids(header.layer_ids, header.dst_block_ids)
        src = data.reshape(-1, layout.block_bytes)
        if self._device.type == "cuda":
            src = torch.from_numpy(src.copy())  # zmq's frame is read-only; torch wants writable memory
        # Admission: a revoke() waits for this scatter, and refuses every chunk after it.
        with self._admission.gate(header.transfer_id, header.dst_block_ids) as refusal:
            if refusal:
                return refusal
            scatter_rows(src, self._rows, rows)
            if self._device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # bytes in kv_cache before we ack (or revoke)
        return None
