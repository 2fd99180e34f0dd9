"""Draft-model proposer: a separate, smaller causal LM (engine/draft_model.py) completes its own KV for every
position the target verified this step, then drafts k tokens greedily, one forward each.

Its layers keep their KV in the paged cache's draft layers, right after the target's (several to a layer where its KV
of a token is a fraction of the target's: engine/kv_cache.py ``packed_layer_views``); its entry at position ``p``
depends on tokens ``0..p`` only (unlike MTP's, which reads token ``p + 1``), so a prefix-cache hit shares every
block whole.

Pass 1 (varlen, one row per request with verified positions): the tokens at the step's verified positions
``starts .. starts + n - 1``, and for a row that drafts also the token it just sampled at ``starts + n``. After it the
draft layers hold a final entry for every position below the scheduler's new ``num_computed_tokens``: that is what
post_forward may hand to the KV transport (S2), so the runner calls post_forward only after this. The logits at a
drafting row's last position give its first draft.

Chain (q_len 1 per row): step j >= 1 feeds draft j at position ``starts + n + j`` and takes draft j + 1. Those entries
lie past the new ``num_computed_tokens`` (speculative): the next step's pass 1 overwrites them with the verified
ones. The sampled token's entry and the k - 1 drafts' make k lookahead slots (Scheduler.num_lookahead_tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from pdcluster.engine.kv_cache import num_packed_slots, packed_layer_views, packed_layers_per_slot
from pdcluster.engine.proposers.base import ProposeBatch, Proposer
from pdcluster.engine.proposers.paged import PagedDraftRows


class DraftModelProposer(Proposer):
    def __init__(self, draft: torch.nn.Module, kv_cache: torch.Tensor, num_target_layers: int, block_size: int):
        arch = draft.arch
        self.per_slot = packed_layers_per_slot(tuple(kv_cache.shape[-2:]), (arch.num_kv_heads, arch.head_dim))
        self.num_draft_layers = num_packed_slots(arch.num_layers, self.per_slot)  # the cache layers it takes
        if kv_cache.shape[0] < num_target_layers + self.num_draft_layers:
            raise ValueError(
                f"kv_cache has {kv_cache.shape[0]} layers but the draft model needs {num_target_layers} target "
                f"layers + {self.num_draft_layers} draft layers; allocate it with KVCacheSpec.num_draft_layers="
                f"{self.num_draft_layers}")
        self.draft = draft
        self.layer_cache = packed_layer_views(kv_cache[num_target_layers:], arch.num_layers, self.per_slot,
                                              arch.num_kv_heads, arch.head_dim)
        self.rows = PagedDraftRows(kv_cache.device, block_size, draft.scale, "draft model")

    def _draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy drafts (the rejection sampler keeps the target's distribution whatever the draft proposes)."""
        return self.draft.compute_logits(hidden).argmax(dim=-1)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        st, rows_of = batch.states, self.rows
        num_rows = len(batch.idx_mapping_np)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        rows = np.flatnonzero(batch.num_verified_np > 0)
        if rows.size == 0:
            return drafts

        # ---- pass 1: the verified positions, and a drafting row's sampled token --------------------
        idx = batch.idx_mapping_np[rows]
        k_rows = batch.num_drafts_np[rows].astype(np.int64)
        n = batch.num_verified_np[rows].astype(np.int64) + (k_rows > 0)
        starts = batch.starts_np[rows].astype(np.int64)
        qsl, row_of, _, positions, meta = rows_of.spans(st, idx, starts, n)
        ids = st.token_ids_np[idx[row_of], positions].astype(np.int64)
        assert (ids >= 0).all(), "draft model input past the committed tokens"
        hidden = self.draft.forward(rows_of.t(ids), rows_of.t(positions), self.layer_cache, meta)

        # ---- chain: k drafts per drafting row ------------------------------------------------------
        live = np.flatnonzero(k_rows > 0)  # indices into `rows`
        if live.size == 0:
            return drafts
        tokens = self._draft_tokens(hidden[rows_of.t(qsl[1:][live] - 1)])
        pos = starts[live] + n[live] - 1  # the sampled token's position
        for r, t in zip(live, tokens.tolist()):
            drafts[rows[r]].append(t)
        for j in range(1, int(k_rows.max())):
            keep = k_rows[live] > j
            if not keep.any():
                break
            live, pos, tokens = live[keep], pos[keep] + 1, tokens[rows_of.t(keep)]
            meta = rows_of.one_token_meta(st, idx[live], pos)
            hidden = self.draft.forward(tokens, rows_of.t(pos), self.layer_cache, meta)
            tokens = self._draft_tokens(hidden)
            for r, t in zip(live, tokens.tolist()):
                drafts[rows[r]].append(t)
        return drafts
