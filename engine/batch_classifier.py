"""Classifies a step's batch as uniform decode or prefill/mixed from its per-request query lengths.

A uniform-decode batch has every request at exactly ``1 + num_spec_steps`` query tokens (one verified
token plus the drafts); it takes the batched attention path. Anything else is prefill/mixed. Because
only query lengths are looked at, a prefill batch whose prompts are ``1 + num_spec_steps`` tokens long
would be taken for decode; warmup therefore uses ``2 + num_spec_steps`` (invariant S0, engine/warmup.py).
"""

from __future__ import annotations

import enum

import numpy as np


class BatchKind(enum.Enum):
    UNIFORM_DECODE = "uniform_decode"
    PREFILL_OR_MIXED = "prefill_or_mixed"


def uniform_decode_query_len(num_spec_steps: int) -> int:
    return 1 + num_spec_steps


def classify_batch(num_scheduled_tokens_np: np.ndarray, num_spec_steps: int) -> BatchKind:
    q = uniform_decode_query_len(num_spec_steps)
    if len(num_scheduled_tokens_np) > 0 and bool((num_scheduled_tokens_np == q).all()):
        return BatchKind.UNIFORM_DECODE
    return BatchKind.PREFILL_OR_MIXED
