"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the request's last n committed
tokens (n from ``ngram_max`` down to ``ngram_min``) and propose the tokens that followed it."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdcluster.engine.proposers.base import ProposeBatch, Proposer


def ngram_lookup(tokens: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the longest matching suffix."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n:]
        # windows[j] = tokens[j : j + n] for j + n <= length - 1: every match has a token after it,
        # and the suffix itself (j = length - n) is excluded.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        st = batch.states
        drafts: list[list[int]] = []
        for idx, k in zip(batch.idx_mapping_np, batch.num_drafts_np):
            if k <= 0:
                drafts.append([])
                continue
            tokens = st.token_ids_np[idx, : st.num_tokens_np[idx]]
            drafts.append(ngram_lookup(tokens, self.ngram_min, self.ngram_max, int(k)))
        return drafts
