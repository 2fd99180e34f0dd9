"""Per-step attention metadata and the layer-level attention call into the kernels."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.mamba_state import MambaMetadata  # noqa: F401 (annotation)

from pdcluster.kernels import flash_prefill, ops, reference


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot of every input token
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor  # int32 [num_reqs]: context length including this step's tokens
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    # Set for a uniform-decode batch (every request has this many query tokens): one batched kernel
    # call instead of a per-request loop. None for prefill/mixed batches (engine/batch_classifier.py).
    uniform_q_len: int | None
    scale: float
    # Hybrid models: the Mamba layers' per-row step inputs (engine/mamba_state.py); None for Llama.
    mamba: "MambaMetadata | None" = None
    # Every request of the step starts at position 0 (prompts with no context yet, no prefix-cache hit):
    # the longest one's token count, else None. Such a step's attention needs nothing from the paged
    # cache (the fast mode hands it to FlashAttention on CUDA: kernels/flash_prefill.py).
    no_context_max_query_len: int | None = None
    # The same steps' query lengths on the host (int64 [num_reqs]): the cuDNN path takes steps whose
    # prompts have one length (kernels/flash_prefill.py); None where no_context_max_query_len is.
    no_context_query_lens_np: np.ndarray | None = None


class _Breaks(threading.local):
    recorder = None  # engine/piecewise_graphs.py's recorder of the forward this thread is running, or None


_breaks = _Breaks()


@contextlib.contextmanager
def attention_breaks(recorder) -> Iterator[None]:
    """Within it, this thread's ``attend`` calls go to ``recorder.attention(query, key, value, layer_cache,
    kwargs)`` (piecewise CUDA graphs: the forward is captured in pieces between attention calls)."""
    previous, _breaks.recorder = _breaks.recorder, recorder
    try:
        yield
    finally:
        _breaks.recorder = previous


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor,
           meta: AttentionMetadata, **kwargs) -> torch.Tensor:
    """A layer's attention (``attend_now``, with its keyword arguments), or a break between captured pieces
    where a recorder is active (``attention_breaks``)."""
    recorder = _breaks.recorder
    if recorder is not None:
        return recorder.attention(query, key, value, layer_cache, kwargs)
    return attend_now(query, key, value, layer_cache, meta, **kwargs)


def attend_now(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    batch_invariant: bool = True,
    kv_written: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """``batch_invariant`` (deterministic mode): a query's result is the same in any batch (on CUDA the
    fixed attention tiles; the CPU kernel always is). ``kv_written``: the caller already put this step's
    K and V into the cache (ops.rotary_write_kv). ``window`` > 0: sliding-window attention (each query sees
    its last ``window`` positions; the paged kernels serve it, FlashAttention's prefill path is skipped);
    ``softcap`` > 0: scores capped by softcap * tanh(s / softcap) (Gemma 2; paged kernels too); ``sinks`` (float32
    [num_q_heads]): gpt-oss's attention sinks, one value-less logit per head in each softmax (paged kernels); ``chunk``
    > 0: chunked attention, each query sees its own chunk of ``chunk`` positions (Llama 4's local layers)."""
    if not kv_written:
        ops.write_kv(key, value, layer_cache, meta.slot_mapping)
    if meta.no_context_max_query_len is not None and not batch_invariant and window <= 0 and softcap <= 0 \
            and sinks is None and chunk <= 0 and flash_prefill.usable(query, key.shape[1]):
        if layer_cache.dtype in reference.FP8_MAX:
            # The step's own K and V as the paged kernels read them back from an fp8 cache, so a prompt's bits do
            # not depend on which kernel ran it (chunked or whole, prefill worker or decode worker).
            key = reference.to_cache_dtype(key, layer_cache.dtype).to(key.dtype)
            value = reference.to_cache_dtype(value, layer_cache.dtype).to(value.dtype)
        out = flash_prefill.flash_prefill(query, key, value, meta.query_start_loc, meta.no_context_max_query_len,
                                          meta.scale, meta.no_context_query_lens_np)
        if out is not None:
            return out
    # One varlen kernel serves every batch shape (CPU and CUDA); query_start_loc is already on the device.
    return ops.paged_attention(
        query, layer_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.scale,
        batch_invariant=batch_invariant, window=window, softcap=softcap, sinks=sinks, chunk=chunk,
        uniform_q_len=meta.uniform_q_len,
    )


def attend_latent(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]
    key: torch.Tensor,  # [num_tokens, 1, latent_dim + rope_dim]: the token's cached vector [c, k_r]
    layer_cache: torch.Tensor,  # the layer's one-plane cache [1, num_blocks, block_size, 1, latent_dim + rope_dim]
    meta: AttentionMetadata,
    latent_dim: int,
    batch_invariant: bool = True,
) -> torch.Tensor:
    """Absorbed multi-head latent attention (engine/models/deepseek.py): writes each token's vector into its slot,
    then every head attends over the cached vectors with the latents as values. [num_tokens, num_heads, latent_dim]."""
    ops.write_kv(key, key, reference.layer_planes(layer_cache), meta.slot_mapping)  # both planes: the one vector
    return ops.latent_attention(query, layer_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.scale,
                                latent_dim, batch_invariant=batch_invariant)
