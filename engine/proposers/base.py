"""What a draft proposer sees after verification, and the null proposer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.request_slots import RequestStates


@dataclass
class ProposeBatch:
    """One row per scheduled request, in batch order. ``states.token_ids_np`` already holds this step's
    verified tokens (``num_tokens_np`` counts them): proposers read committed tokens only, never drafts."""

    idx_mapping_np: np.ndarray  # request slot of each row
    starts_np: np.ndarray  # exact num_computed_tokens before this step (position of the row's first input)
    query_start_loc_np: np.ndarray  # [num_rows + 1]: the row's tokens in ``hidden_states``
    # Inputs whose KV is final after this step: a mid-prefill chunk's length, or the committed inputs
    # plus the accepted drafts of a row that sampled. Positions starts .. starts + num_verified - 1.
    num_verified_np: np.ndarray
    num_drafts_np: np.ndarray  # drafts wanted per row (0: mid-prefill, or no room left)
    hidden_states: torch.Tensor  # the target's final hidden states [num_tokens, H]
    states: RequestStates


class Proposer:
    """No speculation: proposes nothing."""

    #: Draft-model layers this proposer keeps in the paged KV cache (after the target's layers).
    num_draft_layers = 0

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        return [[] for _ in range(len(batch.idx_mapping_np))]
