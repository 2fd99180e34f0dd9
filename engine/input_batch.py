"""One step's model inputs, built from the scheduler's rows and the runner's per-request arrays
(engine/request_slots.py): first the exact rows (``step_rows``: async placeholder rows filled in from
the previous step's outputs, S4), then the packed batch (``prepare_inputs``): token ids, positions, the
slot mapping, block tables, attention (and Mamba) metadata, and which rows the sampler reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.async_scheduler import LaunchedTokens, PrevStepOutput, fill_ahead_rows, fill_placeholder_rows
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.batch_classifier import BatchKind, classify_batch, uniform_decode_query_len
from pdcluster.engine.cuda_graphs import DecodeGraphs
from pdcluster.engine.mamba_state import MambaMetadata, MambaStatePool
from pdcluster.engine.request_slots import RequestStates
from pdcluster.engine.scheduler_output import SchedulerOutput
from pdcluster.engine.step_inputs import StepInputs


@dataclass
class StepRows:
    """Per-row inputs of one step, exact: async placeholder rows already filled in."""

    starts_np: np.ndarray  # num_computed_tokens before the step: position of the row's first input
    q_lens_np: np.ndarray
    num_tokens_np: np.ndarray  # committed tokens before the step (drafts excluded)
    num_output_np: np.ndarray  # output tokens before the step: output position of the first one sampled
    input_token_ids: list[list[int]]
    draft_token_ids: list[list[int]]
    # Launch-ahead (engine/async_scheduler.py): rows whose input token is the previous step's sampled id,
    # still on the device, and that id's index in ``ahead_tokens_dev``.
    ahead_rows_np: np.ndarray | None = None
    ahead_src_np: np.ndarray | None = None
    ahead_tokens_dev: torch.Tensor | None = None


@dataclass
class InputBatch:
    """The packed inputs of one step, on the model's device, and where the sampler reads."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    batch_kind: BatchKind
    # Per row: first row in ``logits_indices`` and how many rows (0 = mid-prefill, nothing to sample).
    logits_start_np: np.ndarray
    logits_count_np: np.ndarray
    logits_indices: torch.Tensor
    query_start_loc_np: np.ndarray  # [num_rows + 1]: each row's tokens in the packed batch
    # Every token is a logits row (decode rows; verification rows): the hidden states need no gather.
    logits_all_tokens: bool = False


def step_rows(sched: SchedulerOutput, idx_mapping: np.ndarray, states: RequestStates,
              prev: PrevStepOutput, ahead: LaunchedTokens | None = None) -> StepRows:
    """The scheduler's rows, with ``num_computed_tokens`` from the runner's mirror (the scheduler's, S1)
    and placeholder rows (async scheduling) made exact from the previous step's outputs (S4): from
    ``prev`` once that step is finished, else (launched ahead of it) from ``ahead``, its ids on the device."""
    scheduled, columns = sched.scheduled, sched.columns()
    rows = StepRows(
        starts_np=states.num_computed_tokens_np[idx_mapping].astype(np.int64),  # the scheduler's (S1)
        q_lens_np=columns.q_lens_np.astype(np.int64),
        num_tokens_np=columns.num_tokens_np.astype(np.int64),
        num_output_np=columns.num_output_np.copy(),  # the placeholder rows' are made exact below
        input_token_ids=[s.input_token_ids for s in scheduled],
        draft_token_ids=[s.spec_token_ids for s in scheduled],
    )
    if not columns.placeholder_np.any():
        return rows
    if ahead is not None:
        rows.ahead_rows_np, rows.ahead_src_np = fill_ahead_rows(
            columns.req_ids, scheduled, ahead, rows.starts_np, rows.num_tokens_np, rows.num_output_np,
            columns.placeholder_np)
        rows.ahead_tokens_dev = ahead.tokens_dev
    else:
        fill_placeholder_rows(
            columns.req_ids, scheduled, idx_mapping, prev, states,
            rows.starts_np, rows.num_tokens_np, rows.num_output_np, rows.input_token_ids, rows.draft_token_ids,
        )
    return rows


def pack_rows(rows: StepRows, idx_mapping: np.ndarray, states: RequestStates, block_size: int) -> tuple:
    """The rows packed token by token: (query_start_loc, positions, slot_mapping, input_ids, seq_lens,
    block_tables, logits_start, logits_count, logits_indices), as numpy arrays."""
    q_lens, starts = rows.q_lens_np, rows.starts_np
    if len(q_lens) and (q_lens == 1).all() and (starts + 1 == rows.num_tokens_np).all():
        return pack_decode_rows(rows, idx_mapping, states, block_size)
    return pack_any_rows(rows, idx_mapping, states, block_size)


def pack_decode_rows(rows: StepRows, idx_mapping: np.ndarray, states: RequestStates, block_size: int) -> tuple:
    """``pack_any_rows`` for decode rows (most steps): one input a row, its last committed token, and one logits
    row each. The same arrays in ~40% of the numpy calls, ~12-15 us less of every step's fixed host time."""
    starts = rows.starts_np
    num_rows = len(starts)
    arange = np.arange(num_rows + 1, dtype=np.int64)
    table = states.block_table_np
    slot_mapping = table[idx_mapping, starts // block_size].astype(np.int64) * block_size + starts % block_size
    input_ids = np.fromiter(itertools.chain.from_iterable(rows.input_token_ids), dtype=np.int64, count=num_rows)
    seq_lens = (starts + 1).astype(np.int32)
    block_tables = table[idx_mapping, : -(-int(seq_lens.max()) // block_size)]
    return (arange, starts.copy(), slot_mapping, input_ids, seq_lens, block_tables,
            arange[:-1].astype(np.int32), np.ones(num_rows, dtype=np.int32), arange[:-1].copy())


def pack_any_rows(rows: StepRows, idx_mapping: np.ndarray, states: RequestStates, block_size: int) -> tuple:
    """``pack_rows`` for any mix of prompt chunks, decode and verification rows."""
    q_lens, starts, num_tokens = rows.q_lens_np, rows.starts_np, rows.num_tokens_np
    num_rows = len(q_lens)
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    # positions: for each request, start .. start + q_len
    req_of_token = np.repeat(np.arange(num_rows), q_lens)
    positions = starts[req_of_token] + (np.arange(query_start_loc[-1]) - query_start_loc[req_of_token])
    block_of_token = states.block_table_np[idx_mapping[req_of_token], positions // block_size]
    slot_mapping = block_of_token.astype(np.int64) * block_size + positions % block_size
    input_ids = np.fromiter(itertools.chain.from_iterable(rows.input_token_ids), dtype=np.int64,
                            count=int(query_start_loc[-1]))
    seq_lens = (starts + q_lens).astype(np.int32)
    max_blocks = int(-(-seq_lens.max() // block_size))
    block_tables = states.block_table_np[idx_mapping, :max_blocks]

    # Rows to sample: the last committed token and every draft after it, for requests whose
    # committed tokens are all computed after this step.
    reaches_end = starts + q_lens >= num_tokens
    logits_count = np.where(reaches_end, starts + q_lens - num_tokens + 1, 0).astype(np.int32)
    logits_start = np.zeros(num_rows, dtype=np.int32)
    np.cumsum(logits_count[:-1], out=logits_start[1:])
    first_row = query_start_loc[1:] - logits_count
    # Row i's entries are first_row[i] .. + logits_count[i], packed from logits_start[i] on.
    logits_indices = np.repeat(first_row - logits_start, logits_count) + np.arange(int(logits_count.sum()))
    return (query_start_loc, positions, slot_mapping, input_ids, seq_lens, block_tables,
            logits_start, logits_count, logits_indices)


def prepare_inputs(rows: StepRows, idx_mapping: np.ndarray, states: RequestStates, inputs: StepInputs,
                   block_size: int, num_spec_steps: int, scale: float, mamba_pool: MambaStatePool | None,
                   graphs: DecodeGraphs | None = None, rope_positions=None) -> InputBatch:
    """Pack ``rows`` (requests at slots ``idx_mapping``) into one batch; ``inputs`` moves the host arrays to
    the device, ``scale`` is the attention scale, ``mamba_pool`` the hybrid's state pool (None if none).
    ``graphs``: the CUDA graphs the runner would replay a uniform decode batch of this step through; such a
    batch's per-token inputs then go straight into their static buffers (``DecodeGraphs.stage``).
    ``rope_positions(positions, query_start_loc, idx_mapping)``: the tokens' rotary positions where they are not
    their sequence positions (M-RoPE: engine/multimodal/mrope.py); KV slots stay by sequence position."""
    q_lens, starts = rows.q_lens_np, rows.starts_np
    (query_start_loc, positions, slot_mapping, input_ids, seq_lens, block_tables,
     logits_start, logits_count, logits_indices) = pack_rows(rows, idx_mapping, states, block_size)
    kind = classify_batch(q_lens, num_spec_steps)
    if rope_positions is not None:
        positions = rope_positions(positions, query_start_loc, idx_mapping)
    # Every array of the step to the device in one copy (engine/step_inputs.py).
    host = {"slot_mapping": slot_mapping, "block_tables": block_tables, "seq_lens": seq_lens,
            "query_start_loc": query_start_loc.astype(np.int32), "input_ids": input_ids,
            "positions": positions.astype(np.int64), "logits_indices": logits_indices.astype(np.int64)}
    if mamba_pool is not None:
        host["state_slots"] = idx_mapping.astype(np.int64)
    ahead = rows.ahead_rows_np is not None and len(rows.ahead_rows_np) > 0
    if ahead:
        host["ahead_dst"] = query_start_loc[rows.ahead_rows_np]
        host["ahead_src"] = rows.ahead_src_np.astype(np.int64)
    inputs.begin_step()
    staged = None
    # A hybrid's row starting from token 0 needs zeroed state: such a batch runs eager (engine/cuda_graphs.py).
    if graphs is not None and kind == BatchKind.UNIFORM_DECODE and (mamba_pool is None or starts.all()):
        staged = graphs.stage(inputs, host)
    if staged is not None:
        dev = inputs.put_many({name: host[name] for name in ("block_tables", "query_start_loc", "logits_indices")})
        dev.update(staged)
    else:
        dev = inputs.put_many(host)
    no_context = len(q_lens) > 0 and not starts.any()  # every request starts at position 0
    meta = AttentionMetadata(
        slot_mapping=dev["slot_mapping"],
        block_tables=dev["block_tables"],
        seq_lens=dev["seq_lens"],
        query_start_loc=dev["query_start_loc"],
        uniform_q_len=uniform_decode_query_len(num_spec_steps) if kind == BatchKind.UNIFORM_DECODE else None,
        scale=scale,
        no_context_max_query_len=int(q_lens.max()) if no_context else None,
        no_context_query_lens_np=q_lens if no_context else None,
    )
    if mamba_pool is not None:
        meta.mamba = MambaMetadata(
            pool=mamba_pool,
            query_start_loc_np=query_start_loc,
            state_slots_np=idx_mapping.astype(np.int64),
            has_initial_state_np=starts > 0,
            # Verification rows keep the state after every position; sample_tokens keeps the one
            # after the last accepted token.
            keep_positions_np=np.array([len(d) > 0 for d in rows.draft_token_ids], dtype=bool),
            state_slots=dev["state_slots"],
        )
    input_ids_dev = dev["input_ids"]
    if ahead:
        # The previous step's sampled ids, gathered on the device: no wait for that step to finish.
        input_ids_dev[dev["ahead_dst"]] = rows.ahead_tokens_dev[dev["ahead_src"]]
    return InputBatch(
        input_ids=input_ids_dev,
        positions=dev["positions"],
        attn_metadata=meta,
        batch_kind=kind,
        logits_start_np=logits_start,
        logits_count_np=logits_count,
        logits_indices=dev["logits_indices"],
        query_start_loc_np=query_start_loc,
        logits_all_tokens=logits_indices.shape[0] == input_ids.shape[0],
    )
