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

Long prompts go to cuDNN's attention instead (torch's SDPA cuDNN backend, dense [batch, heads, len, dim]
views of the packed rows): on an H100 one layer of 16 x 2,048 took 0.67 ms there against 1.22 ms in the
FlashAttention-2 varlen op (bench/results/prefill_attention_h100.json; cuDNN's own varlen entry point took
67 ms). Dense means one length a call: a step whose requests all have the same length, a multiple of
CUDNN_LEN_MULTIPLE, is one call; others one call a request, each padded at its end to such a multiple
(padded rows come after the real ones, so causal attention keeps them out of the real rows' results). cuDNN
builds a plan for each new shape (~50 ms on the H100, once per process), so the shapes are kept few: at
most max_model_len / CUDNN_LEN_MULTIPLE lengths of one request, and batches of equal such lengths. Steps with a prompt shorter than CUDNN_MIN_LEN stay on FlashAttention (there cuDNN's
launches, padding copies and a short request's few tiles cost more than they save).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

_disabled_why: str | None = None  # set once the op refused a call: never tried again in this process
_cudnn_disabled_why: str | None = None  # the same for the cuDNN path (FlashAttention then serves)
num_calls = 0  # layer calls it served (a diagnostic: bench/gpu_check.py reports it)
num_cudnn_calls = 0  # of those, the ones cuDNN served

CUDNN_MIN_LEN = 512  # every prompt of the step at least this long, or the step stays on FlashAttention
CUDNN_LEN_MULTIPLE = 256  # per-request calls pad each prompt to a multiple of this (bounded plan count)


def usable(query: Tensor, num_kv_heads: int) -> bool:
    """Can FlashAttention take this layer's prefill (device, dtype, head shape, GPU generation)?"""
    if _disabled_why is not None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > 256 or query.shape[1] % num_kv_heads:
        return False
    return torch.cuda.get_device_capability(query.device)[0] >= 8


def flash_prefill(query: Tensor, key: Tensor, value: Tensor, query_start_loc: Tensor, max_query_len: int,
                  scale: float, query_lens_np: np.ndarray | None = None) -> Tensor | None:
    """[num_tokens, num_q_heads, head_dim] causal attention of each request's tokens over its own
    (query_start_loc: int32 [num_reqs + 1] on the device; no request has context before them), or None
    where the op refused (the caller falls back; later calls return None at once). ``query_lens_np``
    (the same lengths on the host) lets long prompts go to cuDNN."""
    global _disabled_why, num_calls
    if _disabled_why is not None:
        return None
    if query_lens_np is not None and _cudnn_disabled_why is None and len(query_lens_np) \
            and int(query_lens_np.min()) >= CUDNN_MIN_LEN:
        out = cudnn_prefill(query, key, value, query_lens_np, scale)
        if out is not None:
            num_calls += 1
            return out
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


def cudnn_prefill(query: Tensor, key: Tensor, value: Tensor, query_lens_np: np.ndarray, scale: float) -> Tensor | None:
    """The same attention through cuDNN (module doc), or None where cuDNN refused (then never tried again)."""
    global _cudnn_disabled_why, num_cudnn_calls
    num_heads, head_dim = query.shape[1], query.shape[2]
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            lens = query_lens_np.tolist()
            if min(lens) == max(lens) and lens[0] % CUDNN_LEN_MULTIPLE == 0:  # one call over views: no copies
                out = _dense_causal(query, key, value, len(lens), lens[0], scale)
                num_cudnn_calls += 1
                return out.transpose(1, 2).reshape(query.shape)
            out = torch.empty_like(query)
            start = 0
            for length in lens:
                end = start + length
                padded = -(-length // CUDNN_LEN_MULTIPLE) * CUDNN_LEN_MULTIPLE
                q, k, v = (_padded(x[start:end], padded) for x in (query, key, value))
                o = _dense_causal(q, k, v, 1, padded, scale)  # [1, heads, padded, dim]
                out[start:end] = o[0, :, :length].transpose(0, 1)
                start = end
            num_cudnn_calls += 1
            return out.view(-1, num_heads, head_dim)
    except RuntimeError as exc:  # refused (no cuDNN, an unsupported GPU or shape): FlashAttention serves
        _cudnn_disabled_why = f"{type(exc).__name__}: {exc}"[:300]
        log.warning("cuDNN prefill attention unavailable, prompts go to FlashAttention: %s", _cudnn_disabled_why)
        return None


def _padded(rows: Tensor, length: int) -> Tensor:
    """[n, heads, dim] rows followed by zeros up to ``length`` (the rows themselves when n == length)."""
    if rows.shape[0] == length:
        return rows
    out = rows.new_zeros((length, *rows.shape[1:]))
    out[: rows.shape[0]] = rows
    return out


def _dense_causal(q: Tensor, k: Tensor, v: Tensor, batch: int, length: int, scale: float) -> Tensor:
    """Causal SDPA of ``batch`` sequences of ``length`` packed rows each: [batch, q_heads, length, dim]."""
    def dense(x: Tensor) -> Tensor:
        return x.view(batch, length, x.shape[1], x.shape[2]).transpose(1, 2)

    return F.scaled_dot_product_attention(dense(q), dense(k), dense(v), is_causal=True, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def cudnn_disabled_reason() -> str | None:
    """Why this process stopped using cuDNN for prefill (None: it has not)."""
    return _cudnn_disabled_why
