"""torch.distributed point-to-point transport: NCCL for CUDA caches, gloo for CPU caches.

Every sender-receiver pair gets its own 2-rank process group (sender rank 0, receiver rank 1), so
nothing clashes with a default group or another pair. The receiver hosts a TCPStore on a socket we
bind to ``config.host`` ourselves (``master_listen_fd``: TCPStore would otherwise listen on every
interface); a sender takes the next pair number from a counter in that store and both sides build
the group under the prefix ``pair<k>/``. gloo's own sockets are bound to the same host.

Per chunk the sender writes the chunk header (transfer id, layers, destination blocks) into the
store under ``bell<n>``, then sends the gathered payload over the group; the receiver, seeing the
bell, receives the payload, scatters it and sends an ack back over the group.

Why the header goes through the store and not the group: a gloo receive cannot be polled
(``is_completed`` stays False until ``wait``) and a ``wait`` that times out closes the pair, so a
receiver cannot wait, interruptibly, for a message that may never come. The bell is polled with
``check``; every group receive is posted only when its message is known to be on the way and is
waited on with the deadline. A pair whose group wait fails is dead: its sends fail at once.

On GPUs the payload goes over NCCL and the control messages (acks) stay on gloo, since a pending
NCCL receive would hold up later operations of the same communicator. The NCCL path is written for
real but untested here (no GPU).

Admission (common/admission.py): a pair's thread receives a payload into a staging buffer and scatters
it only through the receiver's admission gate; ``revoke`` takes the gate's lock, so once it returns no
thread scatters the transfer any more (always True here). A refused chunk is acked ``refused``.

Authentication (common/sealing.py). The store answers anyone who reaches its port, so nothing read from
it is trusted unsealed. Before a pair's group is built, the sender writes a sealed HELLO under the
pair's prefix and the receiver answers a sealed WELCOME (or ``refused``): neither side joins a group
with a peer that has not proved the secret. Every bell is a sealed header; one that fails is deleted and
the receiver waits for that bell number again (the real one may still come), so a stranger writing into
a pair's keys can delay or fail a transfer but never land bytes. Acks are fixed-size sealed envelopes on
the pair's group. Residual: gloo's own rendezvous addresses travel through the same open store, so
someone racing the group's setup could still sit on the payload connection.
"""

from __future__ import annotations

import datetime
import logging
import queue
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..base import Role, TransportConfig, replaced_link_reason
from ..common.block_copy import buffer_rows, gather_rows
from ..common.layout import KVLayout, chunk_problem
from ..common.sealing import ACK, HEADER, HELLO, WELCOME, decode_raw, sealed_size
from ..common.send_job import SendJob
from ..common.threaded import ThreadedTransport
from ..common.wire import ChunkHeader

log = logging.getLogger(__name__)

_TAG_PAYLOAD = 1
_TAG_ACK = 2
_PAIRS_KEY = "pairs"
_ACK_OK, _ACK_REJECTED, _ACK_REFUSED = 0, 1, 2  # refused: admission (transfer not expected here)
_ACK_ERRORS = {
    _ACK_OK: None,
    _ACK_REFUSED: "receiver refused the chunk: its transfer is not expected there (aborted, timed out, "
    "complete, or never reserved) or it names blocks outside the reservation",
}
_ACK_BODY = struct.Struct("<qqq")  # send seq, chunk index, status
_ACK_BYTES = sealed_size(_ACK_BODY.size)  # gloo receives need the size up front
_HELLO_KEY, _ANSWER_KEY = "hello", "answer"  # under the pair's prefix: the mutual proof
_REFUSED = b"refused"
_STOP_POLL_S = 0.1  # how often blocked-on-queue threads look at the stop flag
_BELL_POLL_MAX_S = 0.005  # receiver's longest sleep between store checks when idle
_SEND_WINDOW = 2  # payload sends in flight per peer: gather the next chunk while one moves


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _gloo_group(store: Any, rank: int, host: str, timeout_s: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = _td(timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _nccl_group(store: Any, rank: int, timeout_s: float) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _td(timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, opts)


@dataclass
class _PeerLink:
    """Sender side: the group to one receiver and its two threads."""

    peer_id: str
    peer_nonce: bytes  # the receiver's: bells are sealed to it, acks must come from it
    store: Any
    ctrl: Any  # gloo group
    data: Any  # NCCL group on GPU, else ``ctrl``
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    expected_acks: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    dead: str | None = None
    replaced: bool = False  # connect() gave the peer id a new link: this one's threads wind down
    bell_no: int = 0
    threads: list[threading.Thread] = field(default_factory=list)


class TorchDistTransport(ThreadedTransport):
    name = "nccl"
    close_join_s = 1.5  # its threads look at _stop every _STOP_POLL_S; a collective wait does not

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        super().__init__(kv_cache, role, config)
        self._backend = "nccl" if kv_cache.is_cuda else "gloo"
        self._links: dict[str, _PeerLink] = {}
        # Replacing a link and an old link's thread giving up must not interleave: the thread would
        # fail the peer id's sends after the new link took it.
        self._links_lock = threading.Lock()
        self._store: Any = None
        self._port = 0
        if role == "receiver":
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.config.host, 0))
            listener.listen(128)
            self._port = listener.getsockname()[1]
            self._store = dist.TCPStore(
                self.config.host,
                self._port,
                None,
                True,
                _td(self.config.timeout_s),
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
            self._spawn(self._accept_pairs, "nccl-kv-accept")

    # ---------------------------------------------------------------- caller side

    def _descriptor_fields(self) -> dict:
        return {"backend": self._backend, "host": self.config.host, "port": self._port}

    def _link(self, peer_id: str, peer_descriptor: dict, peer_layout: KVLayout, nonce: bytes) -> None:
        if peer_descriptor["backend"] != self._backend:
            raise ValueError(f"{peer_id} uses {peer_descriptor['backend']}, this side {self._backend}")
        timeout_s = self.config.timeout_s
        store = dist.TCPStore(str(peer_descriptor["host"]), int(peer_descriptor["port"]), None, False, _td(timeout_s))
        pair = store.add(_PAIRS_KEY, 1) - 1
        pair_store = dist.PrefixStore(f"pair{pair}/", store)
        self._prove_pair(peer_id, pair_store, nonce)
        # Blocks until the receiver's acceptor builds its side (it polls every few ms).
        ctrl = _gloo_group(pair_store, 0, self.config.host, timeout_s)
        data = _nccl_group(pair_store, 0, timeout_s) if self._backend == "nccl" else ctrl
        link = _PeerLink(peer_id, nonce, pair_store, ctrl, data)
        link.threads = [
            self._spawn(self._send_loop, f"nccl-kv-send-{peer_id}", link),
            self._spawn(self._ack_loop, f"nccl-kv-ack-{peer_id}", link),
        ]
        with self._links_lock:
            old = self._links.get(peer_id)
            if old is not None:
                self._drop_link(old)
            self._links[peer_id] = link

    def _prove_pair(self, peer_id: str, pair_store: Any, nonce: bytes) -> None:
        """HELLO out, WELCOME in: both sides hold the secret before either joins the pair's group."""
        pair_store.set(_HELLO_KEY, self._sealer.seal(HELLO, nonce, self._id.encode()))
        pair_store.wait([_ANSWER_KEY], _td(self.config.timeout_s))
        answer = pair_store.get(_ANSWER_KEY)
        if answer == _REFUSED:
            raise ConnectionError(f"{peer_id} refused us: our cluster secret differs from its own (see its log)")
        if self._sealer.open(answer, {WELCOME: decode_raw}, (nonce,)) is None:
            raise ConnectionError(f"{peer_id} did not prove the cluster secret; not joining a group with it")

    def _drop_link(self, link: _PeerLink) -> None:
        """The peer restarted and connect() was given its new descriptor: fail what is in flight to
        the old incarnation; the old link's threads see ``replaced``/``dead`` and end. Caller holds
        ``_links_lock``."""
        link.replaced = True
        if link.dead is None:
            link.dead = replaced_link_reason(link.peer_id)
        self._tracker.fail_peer(link.peer_id, link.dead)

    def _submit(self, job: SendJob) -> None:
        link = self._links[job.peer_id]
        if link.dead:
            self._tracker.fail_send(job.seq, link.dead)
            return
        link.jobs.put(job)

    def _release(self) -> None:
        super()._release()
        self._links.clear()
        self._store = None

    # ---------------------------------------------------------------- sender threads

    def _link_lost(self, link: _PeerLink, reason: str) -> None:
        with self._links_lock:
            if link.dead is None:
                link.dead = reason
            if not link.replaced:  # a replaced link's sends already failed; the peer id is the new link's
                self._tracker.fail_peer(link.peer_id, link.dead)

    def _send_loop(self, link: _PeerLink) -> None:
        self._cuda_thread_setup()
        in_flight: deque[tuple[Any, torch.Tensor, SendJob, int, float]] = deque()
        while not self._stop.is_set() and not link.replaced:
            try:
                job: SendJob | None = link.jobs.get(timeout=0 if in_flight else _STOP_POLL_S)
            except queue.Empty:
                job = None
            if job is None:
                if in_flight:
                    self._finish_send(link, in_flight.popleft())
                continue
            for chunk in job.chunks:
                if link.dead:
                    self._tracker.fail_send(job.seq, link.dead)
                if not self._tracker.is_live(job.seq):
                    break
                while len(in_flight) >= _SEND_WINDOW:
                    self._finish_send(link, in_flight.popleft())
                try:
                    in_flight.append(self._post_chunk(link, job, chunk))
                except Exception as e:  # noqa: BLE001 - any failure of the group ends the pair
                    self._link_lost(link, f"send to {link.peer_id} failed: {e}")
        while in_flight and not link.dead:
            self._finish_send(link, in_flight.popleft())

    def _post_chunk(self, link: _PeerLink, job: SendJob, chunk: Any) -> tuple[Any, torch.Tensor, SendJob, int, float]:
        nbytes = job.payload_bytes(chunk, self._layout)
        buf = self._pool.take(nbytes)
        gather_rows(
            self._rows, self._layout.row_ids(job.layer_ids, chunk.src_block_ids), buffer_rows(buf, self._layout.block_bytes)
        )
        header = job.header(chunk, self._id, self._layout).encode()
        link.store.set(f"bell{link.bell_no}", self._sealer.seal(HEADER, link.peer_nonce, header))
        link.bell_no += 1
        # Ack expectation first: acks come back in chunk order on the control group.
        deadline = time.monotonic() + self.config.timeout_s
        link.expected_acks.put((job.seq, chunk.index, deadline))
        work = link.data.send([buf], 1, _TAG_PAYLOAD)
        return work, buf, job, chunk.index, deadline

    def _finish_send(self, link: _PeerLink, item: tuple[Any, torch.Tensor, SendJob, int, float]) -> None:
        work, buf, job, _, deadline = item
        try:
            work.wait(_td(deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - closed pair or timeout: the pair is gone
            self._link_lost(link, f"payload to {link.peer_id} failed: {e}")
            return
        self._pool.give(buf)

    def _ack_loop(self, link: _PeerLink) -> None:
        ack = torch.zeros(_ACK_BYTES, dtype=torch.uint8)
        while not self._stop.is_set() and link.dead is None:
            try:
                seq, chunk_index, deadline = link.expected_acks.get(timeout=_STOP_POLL_S)
            except queue.Empty:
                continue
            try:
                link.ctrl.recv([ack], 1, _TAG_ACK).wait(_td(deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - closed pair or timeout: the pair is gone
                self._link_lost(link, f"ack from {link.peer_id} failed: {e}")
                return
            opened = self._sealer.open(ack.numpy(), {ACK: _ACK_BODY.unpack}, (link.peer_nonce,))
            if opened is None:  # on a proven pair: the stream is not what the receiver sent
                self._link_lost(link, f"ack from {link.peer_id} failed authentication")
                return
            got_seq, got_chunk, status = opened.message
            if (got_seq, got_chunk) != (seq, chunk_index):
                self._link_lost(link, f"ack out of order from {link.peer_id}")
                return
            self._tracker.chunk_acked(seq, _ACK_ERRORS.get(status, "receiver rejected the chunk"))

    # ---------------------------------------------------------------- receiver threads

    def _accept_pairs(self) -> None:
        store = dist.TCPStore(self.config.host, self._port, None, False, _td(self.config.timeout_s))
        known = 0
        while not self._stop.wait(_BELL_POLL_MAX_S * 4):
            try:
                count = store.add(_PAIRS_KEY, 0)
            except Exception:  # noqa: BLE001 - store gone: we are closing
                return
            for pair in range(known, count):
                self._spawn(self._receive_loop, f"nccl-kv-recv-{pair}", pair)
            known = count

    def _receive_loop(self, pair: int) -> None:
        self._cuda_thread_setup()
        timeout_s = self.config.timeout_s
        client = dist.TCPStore(self.config.host, self._port, None, False, _td(timeout_s))
        store = dist.PrefixStore(f"pair{pair}/", client)
        sender_nonce = self._admit_pair(pair, store)
        if sender_nonce is None:
            return
        try:
            ctrl = _gloo_group(store, 1, self.config.host, timeout_s)
            data = _nccl_group(store, 1, timeout_s) if self._backend == "nccl" else ctrl
        except Exception as e:  # noqa: BLE001 - sender vanished during setup
            log.warning("pair %d setup failed: %s", pair, e)
            return
        bell_no = 0
        sleep_s = 0.0002
        while not self._stop.is_set():
            key = f"bell{bell_no}"
            try:
                if not store.check([key]):
                    time.sleep(sleep_s)
                    sleep_s = min(sleep_s * 2, _BELL_POLL_MAX_S)
                    continue
                sealed = store.get(key)
                store.delete_key(key)
            except Exception as e:  # noqa: BLE001 - our own store failing: closing down
                log.debug("pair %d store: %s", pair, e)
                return
            sleep_s = 0.0002
            opened = self._sealer.open(sealed, {HEADER: ChunkHeader.decode}, (sender_nonce,))
            if opened is None:
                continue  # written by someone else: wait for this bell number again
            bell_no += 1
            try:
                self._receive_chunk(ctrl, data, opened.message, sender_nonce)
            except Exception as e:  # noqa: BLE001 - the sender died mid-chunk: drop the pair
                log.warning("pair %d: %s", pair, e)
                self._received.drop_sender(sender_nonce)
                return

    def _admit_pair(self, pair: int, store: Any) -> bytes | None:
        """Wait for the pair's HELLO; answer WELCOME if it verifies (returning the sender's nonce),
        else ``refused`` (returning None: no group is built with a sender that has not proved itself)."""
        deadline = time.monotonic() + self.config.timeout_s
        try:
            while not store.check([_HELLO_KEY]):
                if self._stop.is_set() or time.monotonic() > deadline:
                    log.warning("pair %d: no hello within %.1fs; dropped", pair, self.config.timeout_s)
                    return None
                time.sleep(_BELL_POLL_MAX_S)
            hello = self._sealer.open(store.get(_HELLO_KEY), {HELLO: decode_raw})
            if hello is None:
                store.set(_ANSWER_KEY, _REFUSED)
                return None
            store.set(_ANSWER_KEY, self._sealer.seal(WELCOME, hello.from_nonce, b""))
            return hello.from_nonce
        except Exception as e:  # noqa: BLE001 - our own store failing: closing down
            log.debug("pair %d store: %s", pair, e)
            return None

    def _receive_chunk(self, ctrl: Any, data: Any, header: ChunkHeader, sender_nonce: bytes) -> None:
        layout = self._layout
        deadline = time.monotonic() + self.config.timeout_s
        buf = self._pool.take(header.payload_bytes)
        try:
            # With a timeout, wait() blocks this thread until the receive has completed (torch's WorkNCCL::wait), not
            # only the current stream: the landing scatters on a stream of its own, which nothing else orders after it.
            data.recv([buf], 0, _TAG_PAYLOAD).wait(_td(deadline - time.monotonic()))
            problem = chunk_problem(layout, header.layer_ids, header.dst_block_ids, buf.numel())
            # Through the admission gate: a revoke() waits for it, on whichever pair's thread it runs.
            refusal = None if problem else self._landing.scatter(header, buffer_rows(buf, layout.block_bytes))
        finally:
            self._pool.give(buf)
        self._landing.settle(sender_nonce, header, problem or refusal)  # the ack goes as a status, below
        if problem:
            log.warning("rejected chunk of %s: %s", header.transfer_id, problem)
        status = _ACK_REJECTED if problem else _ACK_REFUSED if refusal else _ACK_OK
        body = _ACK_BODY.pack(header.send_seq, header.chunk_index, status)
        ack = torch.frombuffer(bytearray(self._sealer.seal(ACK, sender_nonce, body)), dtype=torch.uint8)
        ctrl.send([ack], 0, _TAG_ACK).wait(_td(deadline - time.monotonic()))
