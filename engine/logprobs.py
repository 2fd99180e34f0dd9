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

from dataclasses import dataclass

import torch

from pdcluster.engine.step_inputs import to_host_async
from pdcluster.wire.logprobs import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """One record per row of ``logits`` [R, V]: the log-probability and rank of ``token_ids[r]`` and
    the ``num_top[r]`` most likely tokens."""
    if not token_ids:
        return []
    index = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    pending = launch_token_logprobs(logits, index, num_top)
    if logits.is_cuda:  # the copies to the host were started non-blocking
        torch.cuda.current_stream(logits.device).synchronize()
    return pending.records(token_ids)


@dataclass
class PendingLogprobs:
    """:func:`token_logprobs`' numbers, computed on the logits' device and on their way to host memory
    (pinned, non-blocking: read them only after the copies finished, e.g. behind a CUDA event)."""

    chosen: torch.Tensor  # [R] logprob of each row's token
    ranks: torch.Tensor  # [R]
    top_values: torch.Tensor | None  # [R, k_max]
    top_ids: torch.Tensor | None
    num_top: list[int]

    def records(self, token_ids: list[int]) -> list[TokenLogprobs]:
        top_values = self.top_values.tolist() if self.top_values is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        chosen_l, ranks_l = self.chosen.tolist(), self.ranks.tolist()
        out = []
        for r, token_id in enumerate(token_ids):
            k = self.num_top[r]
            out.append(TokenLogprobs(
                token_id=int(token_id), logprob=float(chosen_l[r]), rank=int(ranks_l[r]),
                top_token_ids=top_ids[r][:k] if k else [], top_logprobs=top_values[r][:k] if k else [],
            ))
        return out


def launch_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> PendingLogprobs:
    """The numbers of :func:`token_logprobs` for ``token_ids`` (an int64 tensor on the logits' device),
    without waiting for the device: the copies to the host are started, not awaited."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.view(-1, 1))  # [R, 1]
    ranks = (logp > chosen).sum(dim=1) + 1
    k_max = max(num_top) if num_top else 0
    top_values = top_ids = None
    if k_max > 0:
        top_values, top_ids = torch.topk(logp, min(k_max, logp.shape[-1]), dim=-1)
        top_values, top_ids = to_host_async(top_values), to_host_async(top_ids)
    return PendingLogprobs(to_host_async(chosen.squeeze(1)), to_host_async(ranks), top_values, top_ids,
                           list(num_top))
