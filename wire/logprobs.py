"""The log-probability record of one token position (engine/logprobs.py computes them).

A typed wire record (records.py): it rides in the prefill worker's FirstToken / TransferDone and in the
decode worker's Tokens events unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.wire.records import Record


@dataclass(frozen=True)
class TokenLogprobs(Record):
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token at this position
    top_token_ids: list[int] = field(default_factory=list)  # most likely first; len = the k asked for
    top_logprobs: list[float] = field(default_factory=list)
