"""A prefill worker's KV sent to a decode worker split another number of ways (heterogeneous tensor parallelism).

Every transport moves whole block rows: one layer's K or V of one block, every KV head a rank holds
(common/layout.py). When the decode worker splits the model ``D`` ways and we split it ``P`` ways, decode rank ``d``
needs KV heads ``[d * H / D, (d + 1) * H / D)`` of every block: a slice of one of our ranks' heads (``D > P``) or the
heads of several of our ranks side by side (``D < P``). Rank 0's process holds every rank's cache (the decode side
never needs to know how we split), so the re-layout happens here, on the sender, before the bytes leave:

* For each split ``D`` a peer has, we keep ``D`` *staging caches* laid out as the peer's ranks' caches are (their
  heads, our number of blocks), each moved by one transport of our kind (a ranked one where ``D > 1``), made when the
  first such peer connects. Block ``b`` of a staging cache mirrors our block ``b``: a send copies the listed blocks'
  heads, for the listed layers, from our rank caches into the staging caches, then hands the same block ids to the
  staging transports. The mirror needs no allocator and cannot run out: the contract keeps a sent block unchanged
  until its transfer is reported, so copying it again while an earlier send of it is still in flight writes the
  same bytes.
* Peers split like us go through our own transport, untouched: no copy, no staging.

Only the bytes each decode rank needs cross the wire (a receiver-side re-layout would move ``D / P`` times more),
and the receiver, its admission, revocation and completion rules are those of any transport. MLA's latent cache
(one plane) is whole on every rank: each decode rank gets rank 0's. A hybrid's Mamba state travels packed in blocks,
each rank's own heads' (engine/mamba_state_blocks.py): ``send_state`` has the node's ``relayout_state`` read every
rank's state from those blocks and pack each peer rank's slice into the staging caches' same blocks
(engine/mamba_state_resplit.py). The cost is memory: one more cache of our blocks' size per distinct peer split (the
prefill worker's pool holds prompts in flight only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import KVTransport
from .ranked import close_all, transport_over

HeadPiece = tuple[int, slice, slice]  # (our rank, its heads, the peer rank's heads they fill)
# (our rank caches, the peer split's staging caches, block ids): re-pack a hybrid's Mamba state packed in those blocks
# (engine/mamba_state_resplit.py; given by the node, which knows the model).
StateRelayout = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], np.ndarray], None]


def peer_num_ranks(peer_descriptor: dict) -> int:
    """How many ways a peer's cache is split, from its transport descriptor (a ranked one lists its ranks)."""
    ranks = peer_descriptor.get("ranks") if isinstance(peer_descriptor, dict) else None
    return len(ranks) if isinstance(ranks, list) else 1


def head_pieces(num_heads: int, num_ranks: int, num_peer_ranks: int, replicated: bool) -> list[list[HeadPiece]]:
    """For each peer rank, where its heads come from in our ranks' caches. ``num_heads``: all KV heads (one rank's
    where ``replicated``: every rank holds them all)."""
    if replicated:
        return [[(0, slice(None), slice(None))] for _ in range(num_peer_ranks)]
    if num_heads % num_ranks or num_heads % num_peer_ranks:
        raise ValueError(f"{num_heads} KV heads do not split {num_ranks} and {num_peer_ranks} ways")
    ours, theirs = num_heads // num_ranks, num_heads // num_peer_ranks
    pieces: list[list[HeadPiece]] = []
    for d in range(num_peer_ranks):
        d_lo, d_hi = d * theirs, (d + 1) * theirs
        rank_pieces = []
        for p in range(num_ranks):
            lo, hi = max(d_lo, p * ours), min(d_hi, (p + 1) * ours)
            if lo < hi:
                rank_pieces.append((p, slice(lo - p * ours, hi - p * ours), slice(lo - d_lo, hi - d_lo)))
        pieces.append(rank_pieces)
    return pieces


@dataclass
class _Split:
    """What peers split ``num_ranks`` ways are sent through: staging caches laid out their way, and their transport."""

    num_ranks: int
    staging: list[torch.Tensor]
    transport: KVTransport
    pieces: list[list[HeadPiece]]

    def stage(self, caches: Sequence[torch.Tensor], layer_ids: Sequence[int] | range, block_ids: np.ndarray) -> None:
        """Copy ``block_ids`` of ``layer_ids`` from our rank caches into the staging caches, each its heads."""
        index = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.staging[0].device)
        for layer in layer_ids:  # a layer at a time: the temporaries stay one layer's blocks (all at once: 2-6x slower)
            for staging, pieces in zip(self.staging, self.pieces):
                # Gather the blocks' heads into one contiguous piece (several ranks' side by side), then one
                # index_copy_ into the staging blocks: faster than a strided index_put per piece.
                layers = slice(layer, layer + 1)  # (a 5-d view's index_select over blocks is 3x slower here)
                heads = [caches[rank][layers, :, :, :, ours].index_select(2, index) for rank, ours, _ in pieces]
                staging[layers].index_copy_(2, index, heads[0] if len(heads) == 1 else torch.cat(heads, dim=4))


class ResplitSender(KVTransport):
    """Sender over our rank caches (one where we are whole): peers split our way go through ``inner``, the others
    through a staging cache per their split (see the module docstring). ``make_part(cache)`` builds one transport of
    our kind over a cache; ``allocate(shape, dtype, device)`` makes a cache that kind moves best."""

    def __init__(self, inner: KVTransport, rank_caches: Sequence[torch.Tensor],  # noqa: D107
                 make_part: Callable[[torch.Tensor], KVTransport],
                 allocate: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor],
                 relayout_state: StateRelayout | None = None) -> None:
        if inner.role != "sender":
            raise ValueError("only a sender re-lays its KV out for its peers")
        self.inner = inner
        self.name, self.kv_cache, self.role, self.config = inner.name, inner.kv_cache, inner.role, inner.config
        self._caches = list(rank_caches)
        self._make_part, self._allocate, self._relayout_state = make_part, allocate, relayout_state
        num_layers, num_planes, num_blocks, block_size, heads, head_dim = self._caches[0].shape
        self._replicated = num_planes == 1  # MLA: every rank's latent is the whole
        self._num_heads = heads if self._replicated else heads * len(self._caches)
        self._lock = threading.Lock()
        self._splits: dict[int, _Split] = {}  # a peer's rank count -> its staging and transport
        self._route: dict[str, _Split | None] = {}  # peer id -> its split (None: ours, the inner transport)

    @property
    def num_ranks(self) -> int:
        return len(self._caches)

    @property
    def num_rejected(self) -> int:
        return self.inner.num_rejected + sum(s.transport.num_rejected for s in self._all_splits())

    @property
    def num_refused(self) -> int:
        return self.inner.num_refused + sum(s.transport.num_refused for s in self._all_splits())

    def block_layer_bytes(self) -> int:
        return self.inner.block_layer_bytes()

    def block_layer_bytes_to(self, peer_id: str) -> int:
        with self._lock:
            split = self._route.get(peer_id)
        return (split.transport if split is not None else self.inner).block_layer_bytes()

    def _all_splits(self) -> list[_Split]:
        with self._lock:
            return list(self._splits.values())

    def local_descriptor(self) -> dict:
        return self.inner.local_descriptor()

    def connect(self, peer_id: str, peer_descriptor: dict) -> None:
        num_peer_ranks = peer_num_ranks(peer_descriptor)
        if num_peer_ranks == self.num_ranks:
            self.inner.connect(peer_id, peer_descriptor)
            split = None
        else:
            split = self._split_for(num_peer_ranks)
            split.transport.connect(peer_id, peer_descriptor)
        with self._lock:
            self._route[peer_id] = split

    def _split_for(self, num_peer_ranks: int) -> _Split:
        with self._lock:
            split = self._splits.get(num_peer_ranks)
        if split is not None:
            return split
        pieces = head_pieces(self._num_heads, self.num_ranks, num_peer_ranks, self._replicated)
        ours = self._caches[0]
        shape = (*ours.shape[:4], ours.shape[4] if self._replicated else self._num_heads // num_peer_ranks,
                 ours.shape[5])
        staging = [self._allocate(shape, ours.dtype, ours.device) for _ in range(num_peer_ranks)]
        split = _Split(num_peer_ranks, staging, transport_over(staging, self._make_part), pieces)
        with self._lock:
            self._splits[num_peer_ranks] = split
        return split

    def _split_of(self, peer_id: str) -> _Split | None:
        with self._lock:
            if peer_id not in self._route:
                raise KeyError(f"unknown peer {peer_id!r}: connect() first")
            return self._route[peer_id]

    def _checked(self, src_block_ids: np.ndarray) -> np.ndarray:
        src = np.asarray(src_block_ids, dtype=np.int64)
        if len(src) and (src.min() < 0 or src.max() >= self.kv_cache.shape[2]):
            raise IndexError(f"source block ids must be in [0, {self.kv_cache.shape[2]}), got {src.tolist()}")
        return src

    def send(self, peer_id: str, transfer_id: str, layer_ids: Sequence[int] | range, src_block_ids: np.ndarray,
             dst_block_ids: np.ndarray) -> None:
        split = self._split_of(peer_id)
        if split is None:
            self.inner.send(peer_id, transfer_id, layer_ids, src_block_ids, dst_block_ids)
            return
        src = self._checked(src_block_ids)
        split.stage(self._caches, layer_ids, src)
        split.transport.send(peer_id, transfer_id, layer_ids, src, dst_block_ids)  # staging block b mirrors ours

    def send_state(self, peer_id: str, transfer_id: str, src_block_ids: np.ndarray, dst_block_ids: np.ndarray) -> None:
        split = self._split_of(peer_id)
        if split is None:
            self.inner.send_state(peer_id, transfer_id, src_block_ids, dst_block_ids)
            return
        if self._relayout_state is None:
            raise ValueError("this sender cannot re-pack a Mamba state for a peer split another way")
        src = self._checked(src_block_ids)
        self._relayout_state(self._caches, split.staging, src)
        split.transport.send(peer_id, transfer_id, range(self.kv_cache.shape[0]), src, dst_block_ids)

    def poll_sent(self) -> tuple[list[str], list[tuple[str, str]]]:
        delivered, failed = self.inner.poll_sent()
        for split in self._all_splits():
            more_delivered, more_failed = split.transport.poll_sent()
            delivered += more_delivered
            failed += more_failed
        return delivered, failed

    def poll_received(self) -> list[tuple[str, list[int]]]:
        return []  # a sender receives nothing

    def close(self) -> None:
        close_all([self.inner] + [s.transport for s in self._all_splits()])
