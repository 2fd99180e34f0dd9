"""One transport per tensor-parallel rank, driven as one: the KV of a worker whose model is split across ranks.

With tensor parallelism (engine/tensor_parallel/) rank r of a worker holds KV heads ``[r * h, (r + 1) * h)`` of every
layer in its own cache, block for block like rank 0's. Rank r of the prefill worker therefore pairs with rank r of
the decode worker: the same heads, the same per-rank layout, the same block ids. Rank 0's process holds every rank's
cache (the others map theirs from shared memory, engine/tensor_parallel/shared_cache.py) and drives one transport of
the configured kind per rank cache. Each call goes to every part with the same transfer id and blocks; a transfer is
delivered (or received) once every rank's part of it is, and failed as soon as any part fails. The connectors and the
control plane see one ``KVTransport``: the KV of a request still moves as one transfer with one TransferDone.

Both workers must split the same number of ways (``KVLayout.tensor_parallel_size``, checked in the handshake; ``connect``
checks it again on the descriptors). Heterogeneous splits (prefill 2 ways, decode 4) are not handled: they need a rank to
take a slice of a peer rank's heads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from .base import KVTransport

_FORGET_FAILED_AFTER = 4096  # failed ids kept to drop the other parts' late reports (most recent first)


def check_rank_transport(transport: str, num_ranks: int) -> None:
    """ValueError for a transport that cannot be one of a ranked transport's parts (asked before a model loads)."""
    if num_ranks > 1 and transport == "cuda_ipc":
        raise ValueError(f"tensor_parallel_size {num_ranks}: cuda_ipc moves one cache on one GPU (its CPU form is for "
                         "tests); move the ranks' KV over tcp, shm, ucx or nccl")


class RankedTransport(KVTransport):
    """``parts[r]`` moves rank r's cache; all are of one kind and one role (see the module docstring)."""

    def __init__(self, parts: Sequence[KVTransport]) -> None:  # noqa: D107 - the base's cache checks ran per part
        if len(parts) < 2:
            raise ValueError(f"a ranked transport joins 2 or more rank transports, got {len(parts)}")
        roles = {p.role for p in parts}
        if len(roles) != 1 or len({type(p) for p in parts}) != 1:
            raise ValueError("a ranked transport's parts must share one kind and one role")
        self.parts = list(parts)
        self.name = f"{parts[0].name} x{len(parts)} ranks"
        self.kv_cache = parts[0].kv_cache
        self.role = parts[0].role
        self.config = parts[0].config
        self._lock = threading.Lock()
        # Sender: transfer id -> ranks whose sends of it have not all been delivered since its last send.
        self._pending: dict[str, set[int]] = {}
        self._failed: OrderedDict[str, None] = OrderedDict()
        # Receiver: transfer id -> layer ids -> how many of that send each rank has reported.
        self._received: dict[str, dict[tuple[int, ...], list[int]]] = {}
        # Receiver: revoked transfer id -> ranks whose part may still be written (revoke returned False).
        self._revoking: dict[str, set[int]] = {}

    @property
    def num_ranks(self) -> int:
        return len(self.parts)

    @property
    def num_rejected(self) -> int:
        return sum(p.num_rejected for p in self.parts)

    @property
    def num_refused(self) -> int:
        return sum(p.num_refused for p in self.parts)

    def block_layer_bytes(self) -> int:
        return sum(p.block_layer_bytes() for p in self.parts)

    # ---- handshake ---------------------------------------------------------------------------------------------
    def local_descriptor(self) -> dict:
        return {"ranks": [p.local_descriptor() for p in self.parts]}

    def connect(self, peer_id: str, peer_descriptor: dict) -> None:
        ranks = peer_descriptor.get("ranks") if isinstance(peer_descriptor, dict) else None
        if not isinstance(ranks, list) or len(ranks) != self.num_ranks:
            theirs = len(ranks) if isinstance(ranks, list) else 1
            raise ConnectionError(
                f"{peer_id}'s KV cache is split {theirs} way(s) (tensor parallelism) and ours {self.num_ranks}: "
                "both workers need the same --tensor-parallel-size")
        for part, descriptor in zip(self.parts, ranks):
            part.connect(peer_id, descriptor)

    # ---- sender ------------------------------------------------------------------------------------------------
    def send(self, peer_id: str, transfer_id: str, layer_ids: Sequence[int] | range, src_block_ids: np.ndarray,
             dst_block_ids: np.ndarray) -> None:
        with self._lock:
            self._failed.pop(transfer_id, None)
            self._pending[transfer_id] = set(range(self.num_ranks))
            try:
                for part in self.parts:
                    part.send(peer_id, transfer_id, layer_ids, src_block_ids, dst_block_ids)
            except Exception:
                # Some ranks may have queued theirs: the caller fails the transfer, their reports are dropped.
                self._forget_failed(transfer_id)
                raise

    def poll_sent(self) -> tuple[list[str], list[tuple[str, str]]]:
        delivered_all: list[str] = []
        failed_any: list[tuple[str, str]] = []
        with self._lock:
            for rank, part in enumerate(self.parts):
                delivered, failed = part.poll_sent()
                for transfer_id, reason in failed:
                    if transfer_id not in self._failed:
                        self._forget_failed(transfer_id)
                        failed_any.append((transfer_id, f"rank {rank}: {reason}"))
                for transfer_id in delivered:
                    waiting = self._pending.get(transfer_id)
                    if waiting is None:
                        continue  # failed on another rank, or drained before and not sent since
                    waiting.discard(rank)
                    if not waiting:
                        del self._pending[transfer_id]
                        delivered_all.append(transfer_id)
        return delivered_all, failed_any

    def _forget_failed(self, transfer_id: str) -> None:
        self._pending.pop(transfer_id, None)
        self._failed[transfer_id] = None
        self._failed.move_to_end(transfer_id)
        while len(self._failed) > _FORGET_FAILED_AFTER:
            self._failed.popitem(last=False)

    # ---- receiver ----------------------------------------------------------------------------------------------
    def poll_received(self) -> list[tuple[str, list[int]]]:
        out: list[tuple[str, list[int]]] = []
        with self._lock:
            for rank, part in enumerate(self.parts):
                for transfer_id, layer_ids in part.poll_received():
                    counts = self._received.setdefault(transfer_id, {}).setdefault(tuple(layer_ids),
                                                                                   [0] * self.num_ranks)
                    counts[rank] += 1
                    if min(counts) > 0:  # every rank has this send's bytes: report it once
                        for r in range(self.num_ranks):
                            counts[r] -= 1
                        out.append((transfer_id, list(layer_ids)))
        return out

    def expect(self, transfer_id: str, dst_block_ids: np.ndarray | Sequence[int]) -> None:
        for part in self.parts:
            part.expect(transfer_id, dst_block_ids)

    def revoke(self, transfer_id: str) -> bool:
        still_writing = {rank for rank, part in enumerate(self.parts) if not part.revoke(transfer_id)}
        with self._lock:
            self._received.pop(transfer_id, None)
            if still_writing:
                self._revoking[transfer_id] = still_writing
        return not still_writing

    def poll_revoked(self) -> list[str]:
        safe: list[str] = []
        with self._lock:
            for rank, part in enumerate(self.parts):
                for transfer_id in part.poll_revoked():
                    waiting = self._revoking.get(transfer_id)
                    if waiting is None:
                        continue
                    waiting.discard(rank)
                    if not waiting:
                        del self._revoking[transfer_id]
                        safe.append(transfer_id)
        return safe

    def complete(self, transfer_id: str) -> None:
        for part in self.parts:
            part.complete(transfer_id)
        with self._lock:
            self._received.pop(transfer_id, None)

    def close(self) -> None:
        close_all(self.parts)


def transport_over(caches: Sequence, make_part) -> KVTransport:
    """``make_part(cache)`` for each cache, driven as one (a RankedTransport) where there are several; the parts
    made so far are closed if one cannot be."""
    parts: list[KVTransport] = []
    try:
        for cache in caches:
            parts.append(make_part(cache))
    except BaseException:
        close_all(parts)
        raise
    return RankedTransport(parts) if len(parts) > 1 else parts[0]


def close_all(transports: Sequence[KVTransport]) -> None:
    """Close every transport, then raise the first error any close raised."""
    errors = []
    for transport in transports:
        try:
            transport.close()
        except Exception as e:  # noqa: BLE001 - close the rest, then say what failed
            errors.append(e)
    if errors:
        raise errors[0]
