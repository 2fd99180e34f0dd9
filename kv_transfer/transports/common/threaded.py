"""What the four transports share around their background threads: state, connect, send, close.

Every transport moves a send as chunks on threads of its own (one IO thread for tcp, ucx and shm,
see io_thread.py; threads per peer for nccl). This class is the part around those threads:

* connect: read and check the peer's descriptor; a receiver, or a descriptor equal to the one the
  current link was made from, needs nothing (base.py's re-connect rule); else ``_link`` wires the
  peer up (the transport's own handshake) and only then does ``send`` accept the peer.
* send: the one path every send takes. The arguments are checked and the send registered with the
  tracker here (send_job.prepare_send), on the caller's thread, so caller errors raise at once;
  ``_submit`` then hands the job to the transport's threads.
* close: set ``_stop``, ``_wake_threads``, give all threads ``close_join_s`` together to end, fail
  what is still in flight, and ``_release`` the OS resources only if every thread ended (a thread
  stuck in a wait that cannot be interrupted may still use them; it ends at its own deadline).
* receive: ``_landing`` (landing.py) puts verified chunks into the cache through admission.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..base import KVTransport, Role, TransportConfig
from .block_copy import rows_view
from .landing import Landing
from .layout import KVLayout
from .sealing import peer_nonce
from .send_job import SendJob, prepare_send
from .staging import BufferPool
from .tracking import ReceiveTracker, SendTracker

log = logging.getLogger(__name__)


class ThreadedTransport(KVTransport):
    # How long close() waits for all threads together, in seconds.
    close_join_s: ClassVar[float] = 2.0

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        super().__init__(kv_cache, role, config)
        self._layout = KVLayout.of(kv_cache)
        self._rows = rows_view(kv_cache, self._layout.block_bytes)
        self._device = kv_cache.device
        self._id = uuid.uuid4().hex  # the sender id our chunk headers carry
        self._tracker = SendTracker()
        self._received = ReceiveTracker()
        self._landing = Landing(self._layout, self._rows, self._admission, self._received)
        # Staging for gathered and received payloads (allocated on first use; shm stages in its ring).
        # Host staging for a GPU cache is pinned (fast, asynchronous device/host copies).
        self._pool = BufferPool(self._staging_device(), self.config.max_inflight_chunks * self.config.chunk_bytes,
                                pin=self._device.type == "cuda")
        self._peer_layouts: dict[str, KVLayout] = {}  # caller thread: the peers send() accepts
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- the transport's part

    @abstractmethod
    def _descriptor_fields(self) -> dict:
        """What a peer needs to reach us, beyond the transport name, layout and nonce."""

    @abstractmethod
    def _link(self, peer_id: str, peer_descriptor: dict, peer_layout: KVLayout, nonce: bytes) -> None:
        """Sender: wire up receiver ``peer_id`` (replacing a link it had), within ``timeout_s``;
        raise if that fails. ``nonce`` is the receiver's: what we seal to it, what its acks carry."""

    @abstractmethod
    def _submit(self, job: SendJob) -> None:
        """Hand a checked and registered send to the threads that move it. Must not block."""

    def _staging_device(self) -> torch.device:
        return self._device

    def _chunk_bytes_to(self, peer_id: str) -> int:
        """The most payload bytes per chunk to ``peer_id``."""
        return self.config.chunk_bytes

    def _wake_threads(self) -> None:
        """close(): make sleeping threads look at ``_stop`` now rather than at their next poll."""

    def _release(self) -> None:
        """close(), once every thread has ended: release what the threads used."""
        self._pool.clear()

    # ---------------------------------------------------------------- caller-side API

    def local_descriptor(self) -> dict:
        return {
            "transport": self.name,
            "layout": self._layout.to_dict(),
            "nonce": self._sealer.nonce,
            **self._descriptor_fields(),
        }

    def connect(self, peer_id: str, peer_descriptor: dict) -> None:
        peer_layout = KVLayout.from_dict(peer_descriptor["layout"])
        self._layout.check_peer(peer_layout)
        nonce = peer_nonce(peer_id, peer_descriptor)
        if self.role == "receiver" or self._already_linked(peer_id, peer_descriptor):
            return
        self._link(peer_id, peer_descriptor, peer_layout, nonce)
        self._peer_layouts[peer_id] = peer_layout
        self._peer_descriptors[peer_id] = peer_descriptor

    def send(self, peer_id, transfer_id, layer_ids, src_block_ids, dst_block_ids) -> None:  # typed in base.py
        if peer_id not in self._peer_layouts:
            raise KeyError(f"unknown peer {peer_id!r}: call connect() first")
        job = prepare_send(
            layout=self._layout,
            peer_layout=self._peer_layouts[peer_id],
            tracker=self._tracker,
            peer_id=peer_id,
            transfer_id=transfer_id,
            layer_ids=layer_ids,
            src_block_ids=src_block_ids,
            dst_block_ids=dst_block_ids,
            chunk_bytes=self._chunk_bytes_to(peer_id),
            timeout_s=self.config.timeout_s,
        )
        self._submit(job)

    def poll_sent(self) -> tuple[list[str], list[tuple[str, str]]]:
        return self._tracker.poll()

    def poll_received(self) -> list[tuple[str, list[int]]]:
        return self._received.poll()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_threads()
        deadline = time.monotonic() + self.close_join_s
        for t in self._threads:  # live: a thread may still spawn one (nccl accepts pairs)
            t.join(max(0.0, deadline - time.monotonic()))
        self._tracker.fail_all("transport closed")
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            # A gloo/NCCL wait cannot be interrupted; such a thread ends at its own deadline.
            log.warning("%s: threads still running %.1fs after close: %s", self.name, self.close_join_s, stuck)
            return  # leave sockets, workers and buffers alone: those threads may still use them
        self._release()

    # ---------------------------------------------------------------- threads

    def _spawn(self, target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
        """Start a daemon thread that close() waits for."""
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _cuda_thread_setup(self) -> None:
        """First thing on every thread that touches the cache: CUDA calls go to the cache's device."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
