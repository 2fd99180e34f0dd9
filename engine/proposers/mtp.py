"""MTP proposer: completes the MTP layers' KV for every position the target verified this step, then
chains the head k times to draft k tokens. The head is our DeepSeek-style MTPHead (engine/models/mtp.py, one draft
layer), a NemotronH checkpoint's own MTP layers (engine/models/nemotron_mtp.py, one draft layer per attention
block) or a DeepSeek-V3 checkpoint's own MTP layer (engine/models/deepseek_mtp.py, its MLA latents one draft layer);
all write their KV in the draft layers of the paged cache, right after the target's.

Pass 1 (varlen, one row per request with verified positions): entry ``p`` for each verified position
``p`` of the step, from the target's hidden ``h_p`` and the committed token ``t_{p+1}`` (the next prompt
token inside a prefill; for the last verified position of a request that sampled, the token just
sampled). After it, the MTP layer's KV holds a correct entry for every position below the scheduler's
new ``num_computed_tokens``: that is what post_forward may hand to the KV transport (S2), so the runner
calls post_forward only after this.

Chain (q_len 1 per row): step j >= 1 runs at position ``p0 + j`` (``p0`` = the last verified position) on
the previous step's output ``g`` and draft. Those entries are speculative and lie at or past the new
``num_computed_tokens``; the next step's pass 1 overwrites them with the verified ones. The scheduler
reserves ``k - 1`` lookahead slots for them (Scheduler.num_lookahead_tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from pdcluster.engine.models.mtp import MTPHead
from pdcluster.engine.models.nemotron_mtp import NemotronMTP
from pdcluster.engine.proposers.base import ProposeBatch, Proposer
from pdcluster.engine.proposers.paged import PagedDraftRows


class MTPProposer(Proposer):
    def __init__(self, head: MTPHead | NemotronMTP, kv_cache: torch.Tensor, block_size: int):
        num_target_layers = head.target.arch.num_layers
        self.num_draft_layers = head.num_draft_layers
        if kv_cache.shape[0] < num_target_layers + self.num_draft_layers:
            raise ValueError(
                f"kv_cache has {kv_cache.shape[0]} layers but MTP needs {num_target_layers} target layers + "
                f"{self.num_draft_layers} draft layers; allocate it with KVCacheSpec.num_draft_layers="
                f"{self.num_draft_layers}"
            )
        self.head = head
        # Pass 1's hidden: EAGLE-3 reads the target's aux hidden states (Eagle3Head.target_hidden), the others the
        # target's final ones (None).
        self._target_hidden = getattr(head, "target_hidden", None)
        self.layer_index = num_target_layers  # the draft layers sit right after the target's
        self.layer_cache = head.draft_cache(kv_cache, num_target_layers)
        self.rows = PagedDraftRows(kv_cache.device, block_size, head.target.scale, "MTP draft")
        # A split model (engine/tensor_parallel/draft.py): each MTP forward goes to the other ranks first, naming
        # the rows of their own hidden states it reads (an EAGLE-3 draft: of their own aux hidden states).
        self.mirror = head.target.tp_driver

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        st = batch.states
        num_rows = len(batch.idx_mapping_np)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        rows = np.flatnonzero(batch.num_verified_np > 0)
        if rows.size == 0:
            return drafts

        # ---- pass 1: the verified positions ------------------------------------------------------
        idx = batch.idx_mapping_np[rows]
        n = batch.num_verified_np[rows].astype(np.int64)
        starts = batch.starts_np[rows].astype(np.int64)
        qsl, row_of, offset, positions, meta = self.rows.spans(st, idx, starts, n)
        next_ids = st.token_ids_np[idx[row_of], positions + 1].astype(np.int64)
        assert (next_ids >= 0).all(), "MTP input past the committed tokens"
        hidden_rows = batch.query_start_loc_np[rows][row_of] + offset
        rows_t = self.rows.t(hidden_rows)
        take = self._target_hidden
        hidden = batch.hidden_states[rows_t] if take is None else take(batch.hidden_states, rows_t)
        if self.mirror is not None:
            self.mirror.draft_forward(True, hidden_rows, next_ids, positions, meta)
        g = self.head.forward(hidden, self.rows.t(next_ids), self.rows.t(positions), self.layer_cache, meta)

        # ---- chain: k drafts per proposing row ---------------------------------------------------
        k_rows = batch.num_drafts_np[rows]
        live = np.flatnonzero(k_rows > 0)  # indices into `rows`
        if live.size == 0:
            return drafts
        g_rows = qsl[1:][live] - 1  # which rows of the last MTP forward's output g holds (for the other ranks)
        g = g[self.rows.t(g_rows)]
        pos = starts[live] + n[live] - 1  # p0: the last verified position
        tokens = self.head.draft_tokens(g)
        for r, t in zip(live, tokens.tolist()):
            drafts[rows[r]].append(t)
        for j in range(1, int(k_rows.max())):
            keep = k_rows[live] > j
            if not keep.any():
                break
            keep_t = self.rows.t(keep)
            live, pos, g, tokens = live[keep], pos[keep] + 1, g[keep_t], tokens[keep_t]
            g_rows = g_rows[keep]
            meta = self.rows.one_token_meta(st, idx[live], pos)
            if self.mirror is not None:
                self.mirror.draft_forward(False, g_rows, tokens.cpu().numpy(), pos, meta)
            g = self.head.forward(g, tokens, self.rows.t(pos), self.layer_cache, meta)
            g_rows = np.arange(len(live))
            tokens = self.head.draft_tokens(g)
            for r, t in zip(live, tokens.tolist()):
                drafts[rows[r]].append(t)
        return drafts
