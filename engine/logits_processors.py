"""What changes the logits before sampling: logit bias, min_tokens, allowed_token_ids, bad words,
repetition / frequency / presence penalties (as vLLM applies them), and the grammar of structured output
(engine/structured_output.py).

The same function serves a plain sampling step and a verification step of speculative decoding: each
row is one output position and carries the output tokens *before* that position (for a verification
row j: the committed outputs plus drafts[:j]). The rejection sampler then compares drafts against the
processed distribution, so speculation stays lossless with penalties on.

Order (vLLM v1): allowed_token_ids, bad words, logit bias and min_tokens first, then repetition (divides positive logits, multiplies
negative ones, over prompt and output tokens), frequency (minus ``f * count`` over output tokens) and
presence (minus ``p`` once a token appeared in the output). Last, a thinking budget that is spent
(engine/thinking_budget.py) leaves one token possible: the end marker's next one, whatever came before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.thinking_budget import forced_token, prompt_state


@dataclass
class RowContext:
    """One logits row: the request's parameters and the tokens that precede its output position."""

    params: SamplingParams
    prompt_token_ids: list[int]  # the client's prompt (without outputs carried by a resumed request)
    output_token_ids: list[int]  # outputs before this position, drafts of the same step included


def stop_ids_for(params: SamplingParams, eos_token_ids: set[int] | frozenset[int]) -> list[int]:
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= set(eos_token_ids)
    return sorted(ids)


def apply_penalties(logits: torch.Tensor, rows: list[RowContext], eos_token_ids: set[int]) -> torch.Tensor:
    """Processed float32 logits [R, V] (a new tensor when anything applies). A handful of batched
    [R, V] operations whatever the number of rows: per-row work is only building index lists."""
    processed = _penalised(logits, rows, eos_token_ids)
    forced = [(i, forced_token(row.prompt_token_ids, row.output_token_ids, row.params.thinking_token_budget,
                               row.params.reasoning_start_token_ids, row.params.reasoning_end_token_ids,
                               prompt_state(row.params, row.prompt_token_ids)))
              for i, row in enumerate(rows) if row.params.thinking_token_budget is not None]
    forced = [(i, t) for i, t in forced if t is not None and 0 <= t < logits.shape[1]]
    if forced:
        if processed is logits:  # nothing copied the model's logits yet
            processed = logits.float().clone()
        dev = processed.device
        at = torch.tensor([i for i, _ in forced], device=dev)
        processed[at] = float("-inf")
        processed[at, torch.tensor([t for _, t in forced], device=dev)] = 0.0
    return processed


def _penalised(logits: torch.Tensor, rows: list[RowContext], eos_token_ids: set[int]) -> torch.Tensor:
    active = [i for i, row in enumerate(rows) if row.params.has_logit_changes]
    if not active:
        return logits
    logits = logits.float().clone()
    num_rows, vocab = logits.shape
    dev = logits.device  # index lists are built on the host, used where the logits live

    def in_vocab(ids) -> list[int]:
        return [int(t) for t in ids if 0 <= int(t) < vocab]

    # Masks: every token outside allowed_token_ids, and each bad word's last token where the output so far
    # ends with the rest of it.
    allowed = [i for i in active if rows[i].params.allowed_token_ids is not None]
    if allowed:
        keep = torch.ones(num_rows, vocab, dtype=torch.bool, device=dev)
        keep[allowed] = False
        keep_rows = [i for i in allowed for _ in in_vocab(rows[i].params.allowed_token_ids)]
        keep_ids = [t for i in allowed for t in in_vocab(rows[i].params.allowed_token_ids)]
        if keep_rows:
            keep[torch.tensor(keep_rows, device=dev), torch.tensor(keep_ids, device=dev)] = True
        logits.masked_fill_(~keep, float("-inf"))
    banned_rows, banned_ids = [], []
    for i in active:
        out = rows[i].output_token_ids
        for seq in rows[i].params.bad_words_token_ids:
            prefix = len(seq) - 1
            if prefix <= len(out) and (prefix == 0 or out[len(out) - prefix:] == seq[:-1]) and 0 <= seq[-1] < vocab:
                banned_rows.append(i), banned_ids.append(seq[-1])
    if banned_rows:
        logits[torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev)] = float("-inf")

    # Additive: logit bias, and -inf on stop tokens while min_tokens is not reached.
    bias_rows, bias_ids, bias_values, stop_rows, stop_ids = [], [], [], [], []
    for i in active:
        p = rows[i].params
        for token_id, bias in p.logit_bias:
            if 0 <= int(token_id) < vocab:
                bias_rows.append(i), bias_ids.append(int(token_id)), bias_values.append(float(bias))
        if len(rows[i].output_token_ids) < p.min_tokens:
            ids = in_vocab(stop_ids_for(p, eos_token_ids))
            stop_rows += [i] * len(ids)
            stop_ids += ids
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev)),
                          torch.tensor(bias_values, device=dev),
                          accumulate=True)
    if stop_rows:
        logits[torch.tensor(stop_rows, device=dev), torch.tensor(stop_ids, device=dev)] = float("-inf")

    # Output-token counts [R, V] and the prompt's tokens, for the three penalties.
    rep = [i for i in active if rows[i].params.repetition_penalty != 1.0]
    freq = [i for i in active if rows[i].params.frequency_penalty or rows[i].params.presence_penalty]
    if not rep and not freq:
        return logits
    rep_set = set(rep)
    penalised = sorted(rep_set | set(freq))
    out_rows = [i for i in penalised for _ in in_vocab(rows[i].output_token_ids)]
    out_ids = [t for i in penalised for t in in_vocab(rows[i].output_token_ids)]
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev)
    if out_rows:
        counts.index_put_((torch.tensor(out_rows, device=dev), torch.tensor(out_ids, device=dev)),
                          torch.ones(len(out_ids), device=dev), accumulate=True)
    if rep:
        seen = counts > 0
        prompt_rows = [i for i in rep for _ in in_vocab(rows[i].prompt_token_ids)]
        prompt_ids = [t for i in rep for t in in_vocab(rows[i].prompt_token_ids)]
        if prompt_rows:
            seen[torch.tensor(prompt_rows, device=dev), torch.tensor(prompt_ids, device=dev)] = True
        penalty = torch.ones(num_rows, 1, device=dev)
        penalty[rep, 0] = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=dev)
        seen[[i for i in range(num_rows) if i not in rep_set]] = False
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if freq:
        f = torch.zeros(num_rows, 1, device=dev)
        pr = torch.zeros(num_rows, 1, device=dev)
        f[freq, 0] = torch.tensor([rows[i].params.frequency_penalty for i in freq], device=dev)
        pr[freq, 0] = torch.tensor([rows[i].params.presence_penalty for i in freq], device=dev)
        logits -= f * counts + pr * (counts > 0)
    return logits
