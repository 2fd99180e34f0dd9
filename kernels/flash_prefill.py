"""Causal attention of prompts with no context yet, by torch's FlashAttention-2 varlen kernel (CUDA).

A prefill step whose requests all start at position 0 attends only over its own new tokens: no KV from
the paged cache is needed, so the step's q, k and v go straight to FlashAttention (the same kernel
``torch.nn.attention.varlen.varlen_attn`` wraps; called through its aten op, whose signature has held
since torch 2.5, where the wrapper's changed between 2.10 and 2.12). On an H100 our Triton kernel ran
such a step (16 x 2,048 tokens, 32 query / 4 KV heads of 64, bf16) at ~150 TFLOP/s, 27% of the step.

Fast mode only: FlashAttention's reduction order follows its tiles, which depend on the batch, and it
takes 16-bit inputs only. Grouped-query attention needs no copies: the kernel maps query heads to KV
heads itself. Anything it refuses (an older GPU, a torch without the op) is reported once and the
engine stays on the Triton kernel.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_disabled_why: str | None = None  # set once the op refused a call: never tried again in this process
num_calls = 0  # layer calls it served (a diagnostic: bench/gpu_check.py reports it)


def usable(query: Tensor, num_kv_heads: int) -> bool:
    """Can FlashAttention take this layer's prefill (device, dtype, head shape, GPU generation)?"""
    if _disabled_why is not None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > 256 or query.shape[1] % num_kv_heads:
        return False
    return torch.cuda.get_device_capability(query.device)[0] >= 8


def flash_prefill(query: Tensor, key: Tensor, value: Tensor, query_start_loc: Tensor, max_query_len: int,
                  scale: float) -> Tensor | None:
    """[num_tokens, num_q_heads, head_dim] causal attention of each request's tokens over its own
    (query_start_loc: int32 [num_reqs + 1] on the device; no request has context before them), or None
    where the op refused (the caller falls back; later calls return None at once)."""
    global _disabled_why, num_calls
    if _disabled_why is not None:
        return None
    try:
        out = torch.ops.aten._flash_attention_forward(
            query, key, value, query_start_loc, query_start_loc, max_query_len, max_query_len, 0.0, True, False,
            scale=scale)[0]
    except (RuntimeError, TypeError, AttributeError) as exc:  # refused before launching: stay on Triton
        _disabled_why = f"{type(exc).__name__}: {exc}"[:300]
        log.warning("FlashAttention prefill unavailable, prompts attend with the Triton kernel: %s", _disabled_why)
        return None
    num_calls += 1
    return out


def disabled_reason() -> str | None:
    """Why this process stopped using FlashAttention for prefill (None: it has not)."""
    return _disabled_why
