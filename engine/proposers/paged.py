"""The paged-cache rows a draft forward writes and reads: slots and attention metadata from the requests' block
tables, for proposers that keep draft layers in the paged KV cache (MTP heads, draft models)."""

from __future__ import annotations

import numpy as np
import torch

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.step_inputs import host_to_device


def ragged(num_tokens_np: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``num_tokens_np[r]`` tokens laid end to end: (query_start_loc [rows + 1], each token's row, each
    token's offset in its row)."""
    qsl = np.zeros(len(num_tokens_np) + 1, dtype=np.int64)
    np.cumsum(num_tokens_np, out=qsl[1:])
    row_of = np.repeat(np.arange(len(num_tokens_np)), num_tokens_np)
    return qsl, row_of, np.arange(qsl[-1]) - qsl[row_of]


class PagedDraftRows:
    """Builds a draft forward's inputs for rows of the engine's request slots (``RequestStates``)."""

    def __init__(self, device: torch.device, block_size: int, scale: float, what: str = "draft"):
        self.device = device
        self.block_size = block_size
        self.scale = scale  # the attention scale of the draft's layers
        self.what = what  # names the proposer in errors

    def slots(self, states, idx: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slots of ``positions`` of request slots ``idx``; RuntimeError where a position lies past the
        request's allocated blocks (the scheduler reserves the drafts' lookahead slots)."""
        block_col = positions // self.block_size
        short = block_col >= states.num_blocks_np[idx]
        if short.any():
            r = int(np.flatnonzero(short)[0])
            raise RuntimeError(
                f"{self.what} position {int(positions[r])} of request slot {int(idx[r])} lies past its "
                f"{int(states.num_blocks_np[idx[r]])} allocated blocks: the scheduler must reserve lookahead slots"
            )
        return states.block_table_np[idx, block_col].astype(np.int64) * self.block_size + positions % self.block_size

    def t(self, array_np: np.ndarray) -> torch.Tensor:
        """A host array on the cache's device (as is on the CPU)."""
        return host_to_device(array_np, self.device)

    def spans(self, states, idx: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray):
        """A varlen forward over rows of ``num_tokens[r]`` positions from ``starts[r]`` of request slots ``idx``:
        (query_start_loc, each token's row, its offset in the row, its position, the attention metadata)."""
        qsl, row_of, offset = ragged(num_tokens)
        positions = starts[row_of] + offset
        meta = self.meta(states, idx, self.slots(states, idx[row_of], positions), starts + num_tokens, qsl, None)
        return qsl, row_of, offset, positions, meta

    def one_token_meta(self, states, idx: np.ndarray, positions: np.ndarray) -> AttentionMetadata:
        """A chained draft step: one token per row, at ``positions`` of request slots ``idx``."""
        ones = np.arange(len(idx) + 1, dtype=np.int64)
        return self.meta(states, idx, self.slots(states, idx, positions), positions + 1, ones, 1)

    def meta(self, states, idx_rows: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
             query_start_loc: np.ndarray, uniform_q_len: int | None) -> AttentionMetadata:
        max_blocks = int(-(-int(seq_lens.max()) // self.block_size))
        return AttentionMetadata(
            slot_mapping=self.t(slots),
            block_tables=self.t(states.block_table_np[idx_rows, :max_blocks]),
            seq_lens=self.t(seq_lens.astype(np.int32)),
            query_start_loc=self.t(query_start_loc.astype(np.int32)),
            uniform_q_len=uniform_q_len,
            scale=self.scale,
        )
