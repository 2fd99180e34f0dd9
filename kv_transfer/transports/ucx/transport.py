"""UCX transport over the ucxx core (non-asyncio) API.

Wiring: no listener (``create_listener`` binds every interface). The receiver's descriptor carries its
UCX worker address; the sender builds an endpoint from it and sends a HELLO with its own worker
address, from which the receiver builds the endpoint it acks on.

Per chunk the sender gathers the blocks into a staging buffer and posts two tagged sends: a header
on ``CONTROL_TAG`` and the payload on a tag unique to the chunk. The receiver probes ``CONTROL_TAG``,
posts a receive for the payload tag into a staging buffer, scatters it into its cache, and acks on
``ACK_TAG``. Several chunks are in flight, so gathering, moving and scattering overlap.

Threading: UCX workers are not thread-safe, so one IO thread owns the worker and every UCX call;
callers only queue commands. The thread sleeps in epoll on the worker's event fd and a Waker
(blocking progress mode: it beat a progress thread on our 2 cores, FIELD_NOTES).

Failure: endpoint error handling is on by default (UCXOptions.error_handling), so a peer's death can
never abort this process; UCX notices it by keepalive (UCX_KEEPALIVE_INTERVAL, 20 s by default) and
fails the endpoint's requests, and the ack deadline in SendTracker reports a silent peer sooner. An
endpoint UCX closed that way is not closed again (that crashed ucxx). With error handling off, UCX
reports nothing when a peer dies (a send to it never completes; the ack deadline turns that into an
error in poll_sent; stuck requests are cancelled at close) but aborts the process on a failed CMA copy.

Admission (common/admission.py): UCX lands a payload in a staging buffer; only the IO thread's scatter
writes the cache, through the receiver's admission gate, so ``revoke`` always returns True here.

Authentication (common/sealing.py): every message on CONTROL_TAG (HELLO, chunk header) and ACK_TAG is a
sealed envelope. A receiver builds a reply endpoint only for a HELLO that verifies, posts a payload
receive only for a header that verifies, and acks to the endpoint of the header's (authenticated)
sender. Messages are matched in probe order, which need not be send order: the replay window takes
that. Residual: the payload travels on a tag named in the header, so a process that learned a
header's tag (UCX traffic is not encrypted) could race the real payload with its own.
"""

from __future__ import annotations

import logging
import secrets
import select
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from ..base import Role, TransportConfig, replaced_link_reason
from ..common.block_copy import buffer_rows, gather_rows
from ..common.io_thread import IOThreadTransport
from ..common.layout import KVLayout, chunk_problem
from ..common.sealing import ACK, HEADER, HELLO, Opened
from ..common.send_job import Chunk, SendJob
from ..common.wire import ChunkAck, ChunkHeader

log = logging.getLogger(__name__)

CONTROL_TAG = 0x5044_0001  # HELLO and chunk headers, sender -> receiver
ACK_TAG = 0x5044_0002  # acks, receiver -> sender
_PAYLOAD_TAG_BIT = 1 << 63  # payload tags: this bit + 31 random bits + a 32-bit counter
_IDLE_WAIT_S = 0.05  # epoll cap; only stop requests and deadline-free bookkeeping wait on it


@dataclass
class _Op:
    """A posted UCX request and what must stay alive until it completes."""

    # "ctrl_send" | "payload_send" | "ack_send" | "ctrl_recv" | "payload_recv" | "ack_recv" | "drain"
    kind: str
    request: Any
    buffer: Any
    seq: int = -1
    header: Opened | None = None  # payload_recv: the verified header it belongs to
    extra: dict = field(default_factory=dict)


def _host_bytes(data: bytes) -> np.ndarray:
    # Writable, owned memory: ucxx's Array wants a buffer it can keep a pointer into.
    return np.frombuffer(bytearray(data), dtype=np.uint8)


def _close_endpoint(ep: Any) -> None:
    """Close an endpoint unless UCX already did: with error handling on, a peer's failure closes
    it, and closing it again crashed ucxx 0.52 (SIGSEGV in close, after a receiver was killed)."""
    if ep.alive:
        ep.close()


def _decode_hello(body: bytes) -> tuple[str, bytes]:
    sender_id, address = msgpack.unpackb(body)
    return str(sender_id), bytes(address)


def _decode_header(body: bytes) -> ChunkHeader:
    header = ChunkHeader.decode(body)
    if not isinstance(header.extra.get("tag"), int) or not 0 <= header.extra["tag"] < 1 << 64:
        raise ValueError("header without a 64-bit payload tag")
    return header


class UCXTransport(IOThreadTransport):
    name = "ucx"

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        super().__init__(kv_cache, role, config)
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self._api = ucx_api
        self._Array = Array
        opts = self.config.ucx
        tls = opts.tls or ("sm,self,tcp,cuda_copy,cuda_ipc" if kv_cache.is_cuda else "sm,self,tcp")
        ucx_options = {"TLS": tls, "NET_DEVICES": opts.net_devices, **opts.extra}
        if opts.rndv_scheme:
            ucx_options.setdefault("RNDV_SCHEME", opts.rndv_scheme)
        if opts.error_handling:
            # posix/sysv support peer failure (keepalive by pid) but only advertise it when asked;
            # without these, shared memory is "unreachable" under error handling (UCXOptions).
            ucx_options.setdefault("POSIX_ERROR_HANDLING", "y")
            ucx_options.setdefault("SYSV_ERROR_HANDLING", "y")
        self._ctx = ucx_api.UCXContext(ucx_options, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._address = bytes(self._worker.address.tobytes())

        self._epoll = select.epoll()
        self._epoll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._waker.fileno(), select.EPOLLIN)
        # Everything below belongs to the IO thread.
        self._endpoints: dict[str, Any] = {}  # sender: peer_id -> endpoint
        self._peer_nonces: dict[str, bytes] = {}  # sender: peer_id -> the nonce we seal to
        self._retired_endpoints: list[Any] = []  # sender: links connect() replaced, closed at shutdown
        self._reply_endpoints: dict[bytes, Any] = {}  # receiver: sender's nonce -> endpoint
        self._ops: list[_Op] = []
        self._ctrl_recvs: deque[_Op] = deque()  # handled strictly in arrival order
        self._tag_base = _PAYLOAD_TAG_BIT | (secrets.randbits(31) << 32)
        self._tag_counter = 0
        self._start_io()

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {"worker_address": self._address}

    def _link(self, peer_id: str, peer_descriptor: dict, peer_layout: KVLayout, nonce: bytes) -> None:
        self._connect_on_io(peer_id, self._connect_io, peer_id, bytes(peer_descriptor["worker_address"]), nonce)

    def _release(self) -> None:
        self._epoll.close()
        super()._release()
        # Endpoints before the worker before the context: ucxx tears down in reference order.
        self._endpoints.clear()
        self._retired_endpoints.clear()
        self._reply_endpoints.clear()
        self._ops.clear()
        self._ctrl_recvs.clear()
        self._worker = None
        self._ctx = None

    # ---------------------------------------------------------------- IO thread

    def _io_step(self, busy: bool) -> None:
        self._worker.progress()
        busy |= self._probe(CONTROL_TAG, "ctrl_recv")
        busy |= self._probe(ACK_TAG, "ack_recv")
        busy |= self._complete_ops()
        busy |= self._post_chunks()
        if not busy and self._worker.arm():
            self._epoll.poll(_IDLE_WAIT_S)
            self._waker.drain()

    def _io_shutdown(self) -> None:
        try:
            self._drain_unexpected()
            self._worker.cancel_inflight_requests()
            for ep in [*self._endpoints.values(), *self._reply_endpoints.values()]:
                _close_endpoint(ep)
            # Retired endpoints were closed when replaced; they are only kept alive until here.
            self._worker.progress()
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.debug("UCX shutdown", exc_info=True)

    def _drain_unexpected(self) -> None:
        """Match every message no receive was posted for (the payloads behind rejected headers, a
        stranger's tags) into a byte of scratch: UCX truncates them, and its worker teardown no longer
        blocks on rendezvous messages left unmatched (it did, for a receiver that had dropped a
        wrong-secret sender's headers)."""
        api = self._api
        while True:
            probe = self._worker.tag_probe(api.UCXXTag(0), api.UCXXTagMask(0), remove=True)
            if not probe.matched:
                return
            scratch = np.empty(1, dtype=np.uint8)
            self._ops.append(_Op("drain", self._worker.tag_recv_with_handle(self._Array(scratch), probe), scratch))

    def _connect_io(self, peer_id: str, address: bytes, nonce: bytes) -> None:
        api = self._api
        ep = api.UCXEndpoint.create_from_worker_address(
            self._worker, api.UCXAddress.create_from_buffer(address), self.config.ucx.error_handling
        )
        if peer_id in self._endpoints:
            self._drop_link(peer_id)
        hello = _host_bytes(self._sealer.seal(HELLO, nonce, msgpack.packb([self._id, self._address])))
        self._ops.append(_Op("ctrl_send", ep.tag_send(self._Array(hello), api.UCXXTag(CONTROL_TAG)), hello))
        self._endpoints[peer_id] = ep
        self._peer_nonces[peer_id] = nonce

    def _drop_link(self, peer_id: str) -> None:
        """The peer restarted and connect() was given its new descriptor: fail what is in flight to
        the old incarnation and close the old endpoint (its stuck requests complete cancelled or
        never; their sends are dead either way, so they stop counting against max_inflight_chunks)."""
        self._tracker.fail_peer(peer_id, replaced_link_reason(peer_id))
        old = self._endpoints.pop(peer_id)
        del self._peer_nonces[peer_id]
        try:
            _close_endpoint(old)
        except Exception:  # noqa: BLE001 - a dead peer's endpoint may refuse; it is dropped anyway
            log.debug("closing the replaced endpoint to %s", peer_id, exc_info=True)
        self._retired_endpoints.append(old)

    def _probe(self, tag: int, kind: str) -> bool:
        found = False
        while True:
            probe = self._worker.tag_probe(self._api.UCXXTag(tag), remove=True)
            if not probe.matched:
                return found
            found = True
            buf = np.empty(probe.length, dtype=np.uint8)
            op = _Op(kind, self._worker.tag_recv_with_handle(self._Array(buf), probe), buf)
            (self._ctrl_recvs if kind == "ctrl_recv" else self._ops).append(op)

    def _ucx_array(self, buf: torch.Tensor) -> Any:
        # Host buffers go through numpy (buffer protocol); CUDA tensors expose __cuda_array_interface__.
        return self._Array(buf if buf.is_cuda else buf.numpy())

    # sender: post chunks while staging allows ------------------------------------------------

    def _has_room(self) -> bool:
        live = sum(1 for op in self._ops if op.kind == "payload_send" and self._tracker.is_live(op.seq))
        return live < self.config.max_inflight_chunks

    def _peer_problem(self, peer_id: str) -> str | None:
        return None if peer_id in self._endpoints else f"not connected to {peer_id}"

    def _post_chunk(self, job: SendJob, chunk: Chunk) -> bool:
        ep = self._endpoints[job.peer_id]
        job.next_chunk += 1
        nbytes = job.payload_bytes(chunk, self._layout)
        buf = self._pool.take(nbytes)
        gather_rows(
            self._rows,
            self._layout.row_ids(job.layer_ids, chunk.src_block_ids),
            buffer_rows(buf, self._layout.block_bytes),
        )
        if buf.is_cuda:
            torch.cuda.current_stream().synchronize()  # UCX reads the buffer outside the stream
        tag = self._tag_base | (self._tag_counter & 0xFFFF_FFFF)
        self._tag_counter += 1
        header = job.header(chunk, self._id, self._layout, {"tag": tag}).encode()
        ctrl = _host_bytes(self._sealer.seal(HEADER, self._peer_nonces[job.peer_id], header))
        api = self._api
        self._ops.append(_Op("ctrl_send", ep.tag_send(self._Array(ctrl), api.UCXXTag(CONTROL_TAG)), ctrl))
        req = ep.tag_send(self._ucx_array(buf), api.UCXXTag(tag))
        self._ops.append(_Op("payload_send", req, buf, seq=job.seq))
        return True

    # completions ------------------------------------------------------------------------------

    def _complete_ops(self) -> bool:
        busy = False
        while self._ctrl_recvs and self._ctrl_recvs[0].request.completed:
            self._on_control(self._ctrl_recvs.popleft())
            busy = True
        pending: list[_Op] = []
        done: list[_Op] = []
        for op in self._ops:
            (done if op.request.completed else pending).append(op)
        self._ops = pending
        for op in done:
            busy = True
            self._on_done(op)
        return busy

    def _error_of(self, op: _Op) -> str | None:
        try:
            op.request.check_error()
            return None
        except Exception as e:  # noqa: BLE001 - UCX errors become strings for poll_sent
            return f"UCX {op.kind} failed: {e}"

    def _on_done(self, op: _Op) -> None:
        error = self._error_of(op)
        if op.kind == "payload_send":
            self._pool.give(op.buffer)
            if error:
                self._tracker.fail_send(op.seq, error)
        elif op.kind == "ack_recv":
            if error is None:
                # Acks come from every receiver on one tag; each must be sealed by a current peer.
                opened = self._sealer.open(op.buffer, {ACK: ChunkAck.decode}, self._peer_nonces.values())
                if opened is not None:
                    self._tracker.chunk_acked(opened.message.send_seq, opened.message.error)
        elif op.kind == "payload_recv":
            self._on_payload(op, error)
        elif error:  # ctrl_send / ack_send: the ack deadline reports the consequence
            log.debug("%s", error)

    def _on_control(self, op: _Op) -> None:
        if self._error_of(op):
            return
        opened = self._sealer.open(op.buffer, {HELLO: _decode_hello, HEADER: _decode_header})
        if opened is None:
            return  # no reply endpoint, no payload receive, no ack
        api = self._api
        if opened.kind == HELLO:
            _, address = opened.message
            self._reply_endpoints[opened.from_nonce] = api.UCXEndpoint.create_from_worker_address(
                self._worker, api.UCXAddress.create_from_buffer(address), self.config.ucx.error_handling
            )
            return
        header = opened.message
        buf = self._pool.take(header.payload_bytes)
        req = self._worker.tag_recv(self._ucx_array(buf), api.UCXXTag(header.extra["tag"]))
        self._ops.append(_Op("payload_recv", req, buf, header=opened))

    def _on_payload(self, op: _Op, error: str | None) -> None:
        assert op.header is not None
        sender_nonce, header = op.header.from_nonce, op.header.message
        if error is None:
            error = self._scatter(header, op.buffer)
        self._pool.give(op.buffer)
        ack = self._landing.settle(sender_nonce, header, error)
        ep = self._reply_endpoints.get(sender_nonce)
        if ep is None:
            log.warning("chunk from sender %s, whose HELLO never came, not acknowledged", header.sender_id)
            return
        sealed = _host_bytes(self._sealer.seal(ACK, sender_nonce, ack.encode()))
        self._ops.append(_Op("ack_send", ep.tag_send(self._Array(sealed), self._api.UCXXTag(ACK_TAG)), sealed))

    def _scatter(self, header: ChunkHeader, buf: torch.Tensor) -> str | None:
        problem = chunk_problem(self._layout, header.layer_ids, header.dst_block_ids, buf.numel())
        if problem:
            return problem
        # Admission: UCX wrote the payload into our staging buffer, never into the cache; only this
        # scatter does, under the gate a revoke() waits for.
        return self._landing.scatter(header, buffer_rows(buf, self._layout.block_bytes))
