"""Log-probabilities of sampled and prompt tokens: one record per position.

Computed from the model's raw distribution, ``log_softmax(logits)`` in float32, before penalties,
temperature and top-k/top-p (vLLM's default ``raw_logprobs``): the numbers describe the model, so a
client's scoring does not change with its sampling settings, and they equal a transformers forward
pass. Under speculative decoding the row for an accepted token is the target model's row at that
position, so logprobs are the same with and without a proposer.

The record (``TokenLogprobs``) is a wire record (wire/logprobs.py): it rides in the prefill worker's
FirstToken / TransferDone and in the decode worker's Tokens events unchanged.
"""

from __future__ import annotations

import torch

from pdcluster.wire.logprobs import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """One record per row of ``logits`` [R, V]: the log-probability and rank of ``token_ids[r]`` and
    the ``num_top[r]`` most likely tokens."""
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(token_ids, dtype=torch.int64, device=logp.device).unsqueeze(1)
    chosen = logp.gather(1, index)  # [R, 1]
    ranks = (logp > chosen).sum(dim=1) + 1
    k_max = max(num_top) if num_top else 0
    if k_max > 0:
        top_values, top_ids = torch.topk(logp, min(k_max, logp.shape[-1]), dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
    out = []
    for r, token_id in enumerate(token_ids):
        k = num_top[r]
        out.append(TokenLogprobs(
            token_id=int(token_id), logprob=float(chosen_l[r]), rank=int(ranks_l[r]),
            top_token_ids=top_ids[r][:k] if k else [], top_logprobs=top_values[r][:k] if k else [],
        ))
    return out
