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

Long prompts of one length go to cuDNN's attention instead (torch's SDPA cuDNN backend, one dense
[batch, heads, len, dim] call over views of the packed rows, no copies): on an H100 one layer of 16 x 2,048
took 0.67 ms there against 1.22 ms in the FlashAttention-2 varlen op (bench/results/prefill_attention_h100.json;
cuDNN's own varlen entry point took 67-125 ms), and the 16 x 2,048 prefill step went from MFU 0.47-0.49 to
0.52-0.53. Only steps whose prompts all have one length, a multiple of CUDNN_LEN_MULTIPLE and at least
CUDNN_MIN_LEN: cuDNN builds a plan for each new shape (50-75 ms on the H100, once per process), so the
shapes are kept few. Prompts of several lengths stay on FlashAttention: one cuDNN call a request, each
padded to such a multiple, measured no faster there (16 prompts of 1,904-2,048 tokens: MFU 0.46) and paid
a plan per new length.
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

CUDNN_MIN_LEN = 512  # shorter prompts stay on FlashAttention (fewer tiles, a plan for little gain)
CUDNN_LEN_MULTIPLE = 256  # the prompts' one length is a multiple of this (a bounded number of plans)


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
    if query_lens_np is not None and _cudnn_disabled_why is None and cudnn_takes(query_lens_np):
        out = cudnn_prefill(query, key, value, len(query_lens_np), int(query_lens_np[0]), scale)
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


def cudnn_takes(query_lens_np: np.ndarray) -> bool:
    """Prompts cuDNN serves (module doc): one length, a multiple of CUDNN_LEN_MULTIPLE, >= CUDNN_MIN_LEN."""
    length = int(query_lens_np[0]) if len(query_lens_np) else 0
    return length >= CUDNN_MIN_LEN and length % CUDNN_LEN_MULTIPLE == 0 and bool((query_lens_np == length).all())


def cudnn_prefill(query: Tensor, key: Tensor, value: Tensor, num_seqs: int, length: int, scale: float) -> Tensor | None:
    """The same attention through cuDNN for ``num_seqs`` prompts of ``length`` tokens each (module doc), or
    None where cuDNN refused (then never tried again)."""
    global _cudnn_disabled_why, num_cudnn_calls
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = _dense_causal(query, key, value, num_seqs, length, scale)
    except RuntimeError as exc:  # refused (no cuDNN, an unsupported GPU or shape): FlashAttention serves
        _cudnn_disabled_why = f"{type(exc).__name__}: {exc}"[:300]
        log.warning("cuDNN prefill attention unavailable, prompts go to FlashAttention: %s", _cudnn_disabled_why)
        return None
    num_cudnn_calls += 1
    return out.transpose(1, 2).reshape(query.shape)


def _dense_causal(q: Tensor, k: Tensor, v: Tensor, batch: int, length: int, scale: float) -> Tensor:
    """Causal SDPA of ``batch`` sequences of ``length`` packed rows each: [batch, q_heads, length, dim]."""
    def dense(x: Tensor) -> Tensor:
        return x.view(batch, length, x.shape[1], x.shape[2]).transpose(1, 2)

    return F.scaled_dot_product_attention(dense(q), dense(k), dense(v), is_causal=True, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def cudnn_disabled_reason() -> str | None:
    """Why this process stopped using cuDNN for prefill (None: it has not)."""
    return _cudnn_disabled_why
