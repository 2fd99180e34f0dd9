"""A step's rows packed token by token (engine/input_batch.py ``pack_rows``): decode rows take a shorter path,
``pack_decode_rows``, that must give exactly the arrays of the general ``pack_any_rows`` (values and dtypes),
and every other mix must keep taking the general one."""

from __future__ import annotations

import numpy as np
import pytest

from pdcluster.engine import input_batch
from pdcluster.engine.input_batch import StepRows, pack_any_rows, pack_decode_rows, pack_rows

BLOCK_SIZE = 16
NAMES = ("query_start_loc", "positions", "slot_mapping", "input_ids", "seq_lens", "block_tables", "logits_start",
         "logits_count", "logits_indices")


class _States:
    def __init__(self, rng: np.random.Generator, num_slots: int = 64, max_blocks: int = 40):
        self.block_table_np = rng.integers(0, 5000, size=(num_slots, max_blocks), dtype=np.int32)


def _rows(rng: np.random.Generator, q_lens: list[int], behind: list[int]) -> StepRows:
    """Rows of ``q_lens`` inputs whose last input lies ``behind`` tokens before their committed end (0: the
    row samples; > 0: a prompt chunk that does not reach its prompt's end)."""
    starts = rng.integers(0, 600, size=len(q_lens)).astype(np.int64)
    q = np.array(q_lens, dtype=np.int64)
    return StepRows(starts_np=starts, q_lens_np=q, num_tokens_np=starts + q + np.array(behind, dtype=np.int64),
                    num_output_np=np.zeros(len(q_lens), np.int64),
                    input_token_ids=[rng.integers(0, 1000, size=n).tolist() for n in q_lens],
                    draft_token_ids=[[] for _ in q_lens])


def _assert_same(got: tuple, want: tuple) -> None:
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name


@pytest.mark.parametrize("num_rows", [1, 2, 7, 128])
def test_decode_rows_pack_as_the_general_path_packs_them(num_rows):
    rng = np.random.default_rng(num_rows)
    states = _States(rng, num_slots=max(64, num_rows))
    idx_mapping = rng.permutation(len(states.block_table_np))[:num_rows].astype(np.int32)
    rows = _rows(rng, [1] * num_rows, [0] * num_rows)
    _assert_same(pack_decode_rows(rows, idx_mapping, states, BLOCK_SIZE),
                 pack_any_rows(rows, idx_mapping, states, BLOCK_SIZE))
    _assert_same(pack_rows(rows, idx_mapping, states, BLOCK_SIZE), pack_any_rows(rows, idx_mapping, states, BLOCK_SIZE))


@pytest.mark.parametrize("q_lens, behind", [
    ([1, 3, 1], [0, 0, 0]),  # a verification or prompt row among decode rows
    ([1, 1], [0, 5]),  # a one-token prompt chunk short of its prompt's end: it samples nothing
    ([4], [0]),
])
def test_other_rows_take_the_general_path(monkeypatch, q_lens, behind):
    rng = np.random.default_rng(0)
    states = _States(rng)
    idx_mapping = np.arange(len(q_lens), dtype=np.int32)
    rows = _rows(rng, q_lens, behind)
    want = pack_any_rows(rows, idx_mapping, states, BLOCK_SIZE)

    def refuse(*args):
        raise AssertionError("not decode rows")

    monkeypatch.setattr(input_batch, "pack_decode_rows", refuse)
    got = pack_rows(rows, idx_mapping, states, BLOCK_SIZE)
    _assert_same(got, want)
    assert list(got[7]) == [1 if b == 0 else 0 for b in behind]  # a logits row for each row that reaches its end
