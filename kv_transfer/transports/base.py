"""The KV data-plane interface every transport implements, and its configuration.

A transport moves paged-KV blocks from a sender's cache (prefill) into a receiver's cache (decode).
It knows nothing of the control plane (handshake, heartbeat): peers swap the msgpack-able dict from
:meth:`KVTransport.local_descriptor` out of band, and the sender calls :meth:`KVTransport.connect`
with the receiver's dict.

Contract (the same for every transport):

* ``kv_cache`` is the worker's whole paged cache, contiguous,
  ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (1 plane instead of 2 where V is K:
  MLA). Sender and receiver must agree on dtype, planes and ``(block_size, num_kv_heads, head_dim)``;
  ``num_blocks`` may differ.
* ``send`` never blocks on the network. The listed source blocks must stay unchanged until
  ``poll_sent`` reports the transfer (a transport may read them lazily, as RDMA would).
* ``poll_sent`` returns ``(delivered, failed)``. A transfer id is *delivered* when every ``send`` for
  it issued before this ``poll_sent`` call has landed in the receiver's ``kv_cache`` (the receiver
  acknowledged it). The check is made at poll time, so a caller sending layer by layer treats the
  first report that follows its last ``send`` as completion. An id is reported once per time it
  drains. ``failed`` lists ``(transfer_id, reason)`` for peer loss, timeouts and receiver-side
  rejections; a failed id is reported once and forgotten.
* ``poll_received`` returns ``(transfer_id, layer_ids)`` once per ``send`` call whose bytes are fully
  in ``kv_cache``; a request sent layer by layer shows up once per layer batch, and the caller
  accumulates layers until it has them all.
* Every wait is bounded by ``TransportConfig.timeout_s``; a send not acknowledged within it fails.
* ``close`` stops background threads within about a second and releases OS resources.
* ``allocate_kv_cache(shape, dtype, device)`` (classmethod) allocates the cache the transport moves
  best; plain memory except for shm, whose shared caches are copied into (receiver) and out of
  (sender) directly, one pass instead of two, and cuda_ipc, whose receiver's CPU cache must be shared
  memory named by a file (a CUDA cache is plain device memory). Workers on both sides should use it.
* Authentication: both ends prove ``TransportConfig.secret`` on every chunk header and every ack
  (common/sealing.py: HMAC with a per-incarnation nonce from the descriptor, replay window; the payload
  bytes themselves are not MAC'd). A message that fails is dropped, never acked and never touches
  the cache, and counts in ``num_rejected``; a sender whose secret differs sees its connect refused
  (shm, nccl: they prove the secret at connect) or its sends time out (tcp, ucx). No secret on both
  sides still works (empty key); a secret on one side only does not.
* Admission (receiver; common/admission.py). A chunk lands only if its transfer is *expected* and names
  only blocks expected for it; anything else (never expected, revoked, completed, blocks outside the
  set) is refused: never written, acked with the reason (the sender's send fails), counted in
  ``num_refused``, logged at most once a second. Sealing is checked first. (An shm sender that
  pushes into the receiver's memory checks a grant the receiver sent it, and refuses itself.)

  - ``expect(transfer_id, dst_block_ids)``: chunks of this transfer may land in these blocks, from
    now on. Call it before the sender can learn the block ids (shm hands the grant to its pushing
    senders before it returns). A block belongs to at most one open transfer.
  - ``revoke(transfer_id) -> bool``: the transfer is given up (abort, deadline, dead peer). True:
    no byte of it will be written into the cache any more (the check and the scatter of a chunk
    share a lock with ``revoke``, so a chunk mid-scatter finished first); the blocks may be reused
    now. False: a live sender may still write directly (shm push, cuda_ipc): keep the blocks out of use until
    ``poll_revoked`` lists the id, which it does once every such sender has confirmed it stopped
    writing the transfer, or its connection closed.
  - ``complete(transfer_id)``: the sender reported delivery (TransferDone): the KV is final and
    stray chunks of the transfer are refused from now on. Nothing to wait for: the sender declares
    a transfer done only after every one of its sends was acknowledged, so it writes nothing after.
  - ``TransportConfig.admit_unexpected`` turns refusals of unexpected transfers off, for benchmarks
    that drive a receiver without reservations; never in a worker.
* Re-connect: ``connect`` again with the same ``peer_id`` and an equal descriptor does nothing; with
  a different descriptor (the peer restarted: new addresses, new nonce) it replaces the link. Sends
  still in flight on the old link are reported failed by ``poll_sent``; later sends go to the new
  peer. A receiver needs nothing: a restarted sender is a new nonce, with its own replay window.

Caller errors (unknown peer, block id out of range, mismatched lengths, no blocks) raise from
``send`` at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import torch

from .common.admission import Admission
from .common.sealing import Sealer

Role = Literal["sender", "receiver"]


@dataclass
class UCXOptions:
    # Comma list for UCX_TLS; None picks "sm,self,tcp" on CPU and adds cuda_copy,cuda_ipc on GPU.
    tls: str | None = None
    # Loopback only by default: UCX must not pick a routable interface on shared machines.
    net_devices: str = "lo"
    # Endpoint error handling (UCX "peer" mode): a peer's death fails our requests instead of
    # aborting this process. Off, UCX treats any transport error as fatal: a rendezvous put by CMA
    # (process_vm_writev) into a decode worker that had just been killed aborted the surviving
    # prefill (bench/recovery.py, 2 of 12 kills; tests/test_ucx_peer_death.py). On, ucx/transport.py
    # also sets UCX_{POSIX,SYSV}_ERROR_HANDLING=y so the shared-memory transports stay usable (UCX
    # otherwise calls them unreachable and falls back to TCP, FIELD_NOTES). CMA then carries nothing: UCX
    # wants memory invalidation for rendezvous lanes under peer error handling and CMA has none, so
    # large messages on one host go as eager fragments through the shared-memory FIFO (sender
    # copies in, receiver copies out). bench/kv_transfer.py's 64 MiB transfer, runs interleaved on
    # 2 shared cores: 0.82-1.13 GB/s against 1.04-1.34 GB/s with error handling off and CMA, about
    # 80%; TCP alone with error handling 0.65-0.84. Turn it off only where no peer can die mid-transfer.
    error_handling: bool = True
    # Rendezvous by put: the sender's process does the cross-process copy, the receiver only
    # scatters. With UCX's default (get) the receiver did both and was the bottleneck (1.8 vs 0.9
    # GB/s, CMA with error handling off). Moot on one host with error handling on (no rendezvous
    # lane, see above); kept for transports that have one. None leaves UCX's choice.
    rndv_scheme: str | None = "put_zcopy"
    # Extra UCX options (without the "UCX_" prefix), e.g. {"RNDV_THRESH": "8192"}.
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class ShmOptions:
    # Staging ring the sender gathers into when neither cache is in shared memory.
    ring_bytes: int = 64 << 20
    # When both caches are shared, the share of chunks the receiver copies itself (the sender copies
    # the rest), so two cores copy at once. 0 keeps all copying on the sender, 1 all on the receiver.
    pull_share: float = 0.5


@dataclass
class TransportConfig:
    # Bound on every wait: connect handshakes and the delivery of each send (ack deadline).
    timeout_s: float = 30.0
    # A send is cut into messages of at most this many payload bytes, so gathering the next chunk,
    # moving one and scattering the previous one overlap across the two processes.
    chunk_bytes: int = 4 << 20
    # Chunks in flight per transport before the sender waits for acks (bounds staging memory).
    max_inflight_chunks: int = 8
    # Address listening sockets bind to. Loopback by default; never a wildcard.
    host: str = "127.0.0.1"
    # Cluster secret every header and ack is sealed with (see the module docstring). Out of repr,
    # so a logged config does not leak it.
    secret: bytes | str | None = field(default=None, repr=False)
    # Receiver: land chunks of transfers nobody expect()ed (see the module docstring). Benchmarks
    # only: a worker must leave it off, or late chunks of a given-up transfer corrupt reused blocks.
    admit_unexpected: bool = False
    ucx: UCXOptions = field(default_factory=UCXOptions)
    shm: ShmOptions = field(default_factory=ShmOptions)


class KVTransport(ABC):
    """One endpoint (sender or receiver) of the KV data plane. See the module docstring."""

    name: ClassVar[str]

    def __init__(self, kv_cache: torch.Tensor, role: Role, config: TransportConfig | None = None) -> None:
        if role not in ("sender", "receiver"):
            raise ValueError(f"role must be 'sender' or 'receiver', got {role!r}")
        if kv_cache.dim() != 6 or kv_cache.shape[1] not in (1, 2):
            raise ValueError(
                "kv_cache must be [num_layers, 2 (or 1: MLA), num_blocks, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(kv_cache.shape)}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        self.kv_cache = kv_cache
        self.role: Role = role
        self.config = config or TransportConfig()
        # Seals what we send, checks what we receive; its nonce goes into local_descriptor().
        self._sealer = Sealer(self.config.secret, owner=f"{self.name} {role}")
        self._peer_descriptors: dict[str, dict] = {}  # sender: what connect() last linked each peer to
        # Receiver: which transfers may write which blocks; IO threads scatter through its gate.
        self._admission = Admission(
            kv_cache.shape[2], owner=f"{self.name} {role}", admit_unexpected=self.config.admit_unexpected
        )

    def _already_linked(self, peer_id: str, peer_descriptor: dict) -> bool:
        """connect() with the descriptor the current link was made from: nothing to do."""
        return self._peer_descriptors.get(peer_id) == peer_descriptor

    @property
    def num_rejected(self) -> int:
        """Messages dropped because they failed authentication (bad tag, replay, undecodable)."""
        return self._sealer.num_rejected

    @property
    def num_refused(self) -> int:
        """Authenticated chunks the receiver refused: transfer not expected, or blocks outside its set."""
        return self._admission.num_refused

    def block_layer_bytes(self) -> int:
        """Bytes one block of one layer (every plane) takes in the cache: what a send moves per block and layer."""
        kv = self.kv_cache
        return kv.shape[1] * kv.shape[3] * kv.shape[4] * kv.shape[5] * kv.element_size()

    def block_layer_bytes_to(self, peer_id: str) -> int:
        """Sender: bytes a send to ``peer_id`` moves per block and layer (a re-laying sender's peers may hold MLA's
        latent on more or fewer ranks than we do: kv_transfer/transports/resplit.py)."""
        return self.block_layer_bytes()

    def expect(self, transfer_id: str, dst_block_ids: np.ndarray | Sequence[int]) -> None:
        """Receiver: chunks of ``transfer_id`` may land in ``dst_block_ids`` (module docstring)."""
        self._admission.expect(transfer_id, dst_block_ids)

    def revoke(self, transfer_id: str) -> bool:
        """Receiver: give the transfer up. True: nothing of it is written any more; False: wait for
        ``poll_revoked`` to list it before reusing its blocks. The base receiver scatters every chunk
        itself, under the admission lock, so it always returns True."""
        self._admission.revoke(transfer_id)
        return True

    def complete(self, transfer_id: str) -> None:
        """Receiver: the transfer was delivered; its chunks are refused from now on."""
        self._admission.revoke(transfer_id)

    def poll_revoked(self) -> list[str]:
        """Receiver: ids whose ``revoke`` returned False and that are now safe (reported once)."""
        return []

    @classmethod
    def allocate_kv_cache(
        cls, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """Allocate a zeroed KV cache this transport moves best. The default is plain memory; the
        shm transport returns memory a sender on the same host can write into directly."""
        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    @abstractmethod
    def local_descriptor(self) -> dict:
        """What a peer needs to connect: msgpack-able (str, int, bytes, lists, dicts)."""

    @abstractmethod
    def connect(self, peer_id: str, peer_descriptor: dict) -> None:
        """Sender: open a path to receiver ``peer_id`` (blocks at most ``timeout_s``). Again with an
        equal descriptor: nothing; with a new one: replace the link (see the module docstring).
        Receivers accept senders without calling this; on a receiver it only checks the descriptor."""

    @abstractmethod
    def send(
        self,
        peer_id: str,
        transfer_id: str,
        layer_ids: Sequence[int] | range,
        src_block_ids: np.ndarray,
        dst_block_ids: np.ndarray,
    ) -> None:
        """Queue a copy of ``kv_cache[layer_ids, :, src_block_ids]`` into the peer's
        ``kv_cache[layer_ids, :, dst_block_ids]``. Non-blocking."""

    def send_state(self, peer_id: str, transfer_id: str, src_block_ids: np.ndarray, dst_block_ids: np.ndarray) -> None:
        """Queue a hybrid prompt's Mamba state blocks (engine/mamba_state_blocks.py): every layer of them, as ``send``
        would; a sender that re-lays its KV out for a peer re-packs the state for it (resplit.py)."""
        self.send(peer_id, transfer_id, range(self.kv_cache.shape[0]), src_block_ids, dst_block_ids)

    @abstractmethod
    def poll_sent(self) -> tuple[list[str], list[tuple[str, str]]]:
        """``(delivered transfer ids, [(transfer id, error)])``; see the module docstring."""

    @abstractmethod
    def poll_received(self) -> list[tuple[str, list[int]]]:
        """``[(transfer id, layer ids)]`` whose bytes are now in ``kv_cache``, one per send call."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads and release sockets, memory maps and process groups."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replaced_link_reason(peer_id: str) -> str:
    """poll_sent's error for sends in flight on a link that connect() replaced."""
    return (
        f"{peer_id} re-connected with a new descriptor (the peer restarted): this send went to its "
        "previous incarnation and is abandoned"
    )


class TransportUnavailable(RuntimeError):
    """A transport's library is missing or unusable here."""
