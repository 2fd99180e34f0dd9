"""Per-request runner state in preallocated numpy arrays indexed by a request slot.

The scheduler is authoritative for ``num_computed_tokens`` (invariant S1): ``num_computed_tokens_np``
is overwritten from each step's scheduler output (``refresh``) and nothing in the runner adds to it.
``num_computed_prefill_tokens_np = min(num_computed_tokens_np, prefill_len_np)`` is derived in the same
place, and ``is_prefilling`` answers per request.
"""

from __future__ import annotations

import numpy as np

from pdcluster.engine.sampling_params import SamplingParams


class RequestStates:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int):
        self.max_num_reqs = max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: list[str | None] = [None] * max_num_reqs
        self._free_indices = list(range(max_num_reqs - 1, -1, -1))
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.prefill_len_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_prefill_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)  # committed (no drafts)
        # The client's prompt: tokens before it are what penalties call "prompt", after it "output"
        # (a request resumed after preemption or recovery re-prefills its outputs too).
        self.client_prompt_len_np = np.zeros(max_num_reqs, dtype=np.int32)
        # Committed tokens; -1 past ``num_tokens_np`` so a read beyond them (e.g. at an async-inflated
        # length, S4) yields an invalid id instead of a plausible stale one.
        self.token_ids_np = np.full((max_num_reqs, max_model_len), -1, dtype=np.int32)
        self.block_table_np = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.seed_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        # Per slot, what its parameters ask of the sampler, asked of a whole batch at once (a decode step would
        # otherwise call a property per row for each): a draw rather than the argmax, logits processors
        # (penalties, bias, min_tokens, allowed/bad words), logprobs of the sampled tokens.
        self.draws_np = np.zeros(max_num_reqs, dtype=bool)
        self.has_penalties_np = np.zeros(max_num_reqs, dtype=bool)
        self.wants_logprobs_np = np.zeros(max_num_reqs, dtype=bool)
        self.pools_np = np.zeros(max_num_reqs, dtype=bool)  # an embedding: its prompt's hidden states pooled
        self.num_pooling = 0  # slots with pools_np set: a step with none looks no further (the decode hot path)
        # Bumped whenever a slot is taken: a step finished after the next one was launched (async
        # scheduling) appends its tokens only to slots still held by the same request since its launch.
        self.epoch_np = np.zeros(max_num_reqs, dtype=np.int64)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req_id: str, token_ids: list[int], params: SamplingParams, seed: int) -> int:
        if not self._free_indices:
            raise RuntimeError(f"no free request slot for {req_id!r}: max_num_reqs={self.max_num_reqs}")
        idx = self._free_indices.pop()
        self.req_id_to_index[req_id] = idx
        self.index_to_req_id[idx] = req_id
        n = len(token_ids)
        self.token_ids_np[idx, :n] = token_ids
        self.token_ids_np[idx, n:] = -1
        self.num_tokens_np[idx] = n
        self.prefill_len_np[idx] = n
        self.num_computed_tokens_np[idx] = 0
        self.num_computed_prefill_tokens_np[idx] = 0
        self.num_blocks_np[idx] = 0
        self.seed_np[idx] = seed
        self.sampling_params[idx] = params
        self.draws_np[idx] = not params.greedy
        self.has_penalties_np[idx] = params.has_penalties
        self.wants_logprobs_np[idx] = params.logprobs is not None
        self.pools_np[idx] = pools = params.pooling is not None
        self.num_pooling += pools
        self.epoch_np[idx] += 1
        return idx

    def remove_request(self, req_id: str) -> None:
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is None:
            return
        self.index_to_req_id[idx] = None
        self.sampling_params[idx] = None
        if self.pools_np[idx]:
            self.pools_np[idx] = False
            self.num_pooling -= 1
        self._free_indices.append(idx)

    def set_block_ids(self, idx: int, block_ids: list[int] | tuple[int, ...]) -> None:
        """The request's whole block table, from the scheduler. Only entries past the slot's count are
        written: while a request keeps its slot its table only grows (blocks are appended, never
        replaced: ``Request.block_table``), and a slot taken anew starts from none (``add_request``), so
        a decode step writes nothing for most rows instead of the whole table."""
        n, num_known = len(block_ids), int(self.num_blocks_np[idx])
        if n == num_known:
            return
        if n < num_known:  # a table never shrinks under a slot; if it did, take it whole
            num_known = 0
        self.block_table_np[idx, num_known:n] = block_ids[num_known:]
        self.num_blocks_np[idx] = n

    def refresh_counts(self, idx_np: np.ndarray, num_computed_tokens_np: np.ndarray) -> None:
        """Overwrite the computed counts of the slots ``idx_np`` from the scheduler (S1): never ``+=``."""
        self.num_computed_tokens_np[idx_np] = num_computed_tokens_np
        self.num_computed_prefill_tokens_np[idx_np] = np.minimum(num_computed_tokens_np, self.prefill_len_np[idx_np])

    def is_prefilling(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        """Per request: is part of its prompt still to be computed?"""
        return self.num_computed_prefill_tokens_np[idx_mapping_np] < self.prefill_len_np[idx_mapping_np]

    def append_tokens(self, idx: int, token_ids: list[int]) -> None:
        n = int(self.num_tokens_np[idx])
        self.token_ids_np[idx, n : n + len(token_ids)] = token_ids
        self.num_tokens_np[idx] = n + len(token_ids)

    def append_sampled(self, idx_np: np.ndarray, per_req: list[list[int]]) -> None:
        """``append_tokens`` for a step's sampled rows: one token each (no speculation) in one go (past a
        few rows: below, numpy's fancy indexing costs more than the loop)."""
        if len(per_req) > 4 and all(len(t) == 1 for t in per_req):
            n = self.num_tokens_np[idx_np]
            self.token_ids_np[idx_np, n] = [t[0] for t in per_req]
            self.num_tokens_np[idx_np] = n + 1
            return
        for idx, tokens in zip(idx_np.tolist(), per_req):
            self.append_tokens(idx, tokens)
