"""Torch reference implementations of the paged-KV kernels.

These run on CPU (the engine's path on our machines) and are the oracle the Triton kernels in this
folder are tested against under ``TRITON_INTERPRET=1``.

KV cache layout (one tensor for the whole model, written down once here):

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

``kv_cache[layer]`` is a layer's view ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; index 0
is K, index 1 is V. A token's slot is ``block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The largest finite value of each fp8 format a KV cache may hold (--kv-cache-dtype fp8, fp8_e5m2).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: cast, and for fp8 first clamped to the format's finite range, so a value past
    it saturates (as vLLM's CUDA conversion and our kernels do) instead of becoming NaN or inf. Per-tensor scale
    1.0, vLLM's default without calibrated scales."""
    limit = FP8_MAX.get(dtype)
    if limit is None:
        return x.to(dtype)
    return x.float().clamp(-limit, limit).to(dtype)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place); a slot of -1 (a padded row of a CUDA
    graph's batch, vLLM's PAD_SLOT_ID) writes nothing, as in the C and Triton kernels."""
    _, num_blocks, block_size, num_kv_heads, head_dim = layer_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    key, value = to_cache_dtype(key, layer_cache.dtype), to_cache_dtype(value, layer_cache.dtype)
    cache = layer_cache
    if layer_cache.dtype in FP8_MAX:  # torch has no index_copy_ / index_put_ for fp8: the same bytes through uint8
        cache, key, value = cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    if cache.stride(1) == block_size * cache.stride(2):
        flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, slot_mapping, key)
        flat[1].index_copy_(0, slot_mapping, value)
    else:  # a packed draft layer (engine/kv_cache.py): its blocks lie further apart than its slots
        index = (slot_mapping // block_size, slot_mapping % block_size)
        cache[0].index_put_(index, key)
        cache[1].index_put_(index, value)


def gather_context(
    layer_cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``context_len`` tokens, contiguous: [context_len, Hkv, D]."""
    block_size = layer_cache.shape[2]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    k = layer_cache[0].index_select(0, blocks).flatten(0, 1)[:context_len]
    v = layer_cache[1].index_select(0, blocks).flatten(0, 1)[:context_len]
    if layer_cache.dtype in FP8_MAX:  # widened here (exactly: every fp8 value is a bfloat16 and a float16 value)
        k, v = k.float(), v.float()
    return k, v


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], requests packed back to back
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor,  # int32 [num_reqs]: context length including this step's tokens
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]: cumulative query lengths
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # float32 [num_q_heads]: one extra logit per head (gpt-oss), no value
    chunk: int = 0,  # > 0: chunked attention (Llama 4's local layers)
) -> torch.Tensor:
    """Causal attention of each request's new query tokens over its paged context.

    Query token ``i`` of request ``r`` (with ``q_len`` new tokens) sits at position
    ``seq_lens[r] - q_len + i`` and attends to context positions ``0 ..= that position``; with a sliding
    ``window`` > 0, to its last ``window`` positions (``that position - window + 1 ..= that position``); with
    ``softcap`` > 0 each scaled score s is softcap * tanh(s / softcap) (Gemma 2); with ``sinks`` (gpt-oss's attention
    sinks) head h's softmax has one more logit, ``sinks[h]``, whose value is zero: it takes part of the weight
    (``exp(sinks[h])`` in the denominator) and adds nothing to the output; with ``chunk`` > 0 a query sees only the
    keys of its own chunk of ``chunk`` positions (``that position // chunk * chunk ..= that position``). This one
    function serves prefill (q_len = chunk), decode (q_len = 1) and speculative verification
    (q_len = 1 + k). The K/V of the new tokens must already be written into the cache.
    """
    num_q_heads = query.shape[1]
    num_kv_heads = layer_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, context_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k, v = gather_context(layer_cache, block_tables[r], context_len)
        q = query[q_start:q_end].transpose(0, 1)  # [Hq, q_len, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(context_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos  # [q_len, L]
        if window > 0:
            mask &= k_pos > q_pos - window
        if chunk > 0:
            mask &= k_pos >= q_pos // chunk * chunk
        if softcap > 0 or sinks is not None:
            scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:  # the sink's column joins the softmax, then is dropped (transformers' order)
                sink_col = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
                probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            o = torch.matmul(probs, v.float()).to(q.dtype)
        else:
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def layer_planes(layer_cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as the attention kernels take it, [2, num_blocks, block_size, num_kv_heads, head_dim]: a
    one-plane cache (MLA: engine/kv_cache.py) as its plane twice, a view (stride 0), so writing K and V writes the
    one vector."""
    return layer_cache if layer_cache.shape[0] == 2 else layer_cache.expand(2, *layer_cache.shape[1:])


def latent_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]: [W_k^T q_nope, q_rope] per head
    layer_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, latent_dim + rope_dim] (or K and V planes over it)
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """Absorbed multi-head latent attention (DeepSeek's MLA): :func:`paged_attention` of every head over one
    cached vector a token, [c, k_r], whose first ``latent_dim`` dims (the latent c) are also the values.
    Returns [num_tokens, num_heads, latent_dim]."""
    out = paged_attention(query, layer_planes(layer_cache), block_tables, seq_lens, query_start_loc, scale)
    return out[:, :, :latent_dim]


def paged_attention_uniform(
    query: torch.Tensor,  # [num_reqs * q_len, num_q_heads, head_dim]
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    q_len: int,
    scale: float,
) -> torch.Tensor:
    """Batched form of :func:`paged_attention` for a uniform-decode batch (every request has the same
    ``q_len``, e.g. ``1 + num_spec_steps``): one gather and one SDPA call for the whole batch."""
    num_reqs = seq_lens.shape[0]
    _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
    num_q_heads = query.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    k = layer_cache[0][table].view(num_reqs, num_blocks * block_size, num_kv_heads, head_dim)
    v = layer_cache[1][table].view(num_reqs, num_blocks * block_size, num_kv_heads, head_dim)
    q = query.view(num_reqs, q_len, num_q_heads, head_dim).transpose(1, 2)  # [B, Hq, q, D]
    k = k.transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    v = v.transpose(1, 2).to(q.dtype)
    key_pos = torch.arange(num_blocks * block_size, device=query.device).view(1, 1, -1)
    q_pos = (seq_lens.long().view(-1, 1) - q_len + torch.arange(q_len, device=query.device).view(1, -1)).unsqueeze(-1)
    mask = (key_pos <= q_pos).unsqueeze(1)  # [B, 1, q, L]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(num_reqs * q_len, num_q_heads, head_dim)


def gather_blocks(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # int64 [n]
    out: torch.Tensor | None = None,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
) -> torch.Tensor:
    """Copy the listed blocks (all layers, K and V) into one contiguous buffer, in list order."""
    gathered = kv_cache.index_select(2, block_ids)
    if out is None:
        return gathered
    out.copy_(gathered)
    return out


def scatter_blocks(
    buffer: torch.Tensor,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # int64 [n]: destination block of each buffer entry
) -> None:
    """Inverse of :func:`gather_blocks`: write buffer entry ``i`` into block ``block_ids[i]``."""
    if kv_cache.dtype in FP8_MAX:  # torch has no index_copy_ for fp8: the same bytes through uint8 views
        kv_cache.view(torch.uint8).index_copy_(2, block_ids, buffer.to(kv_cache.dtype).view(torch.uint8))
        return
    kv_cache.index_copy_(2, block_ids, buffer.to(kv_cache.dtype))


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # updated in place to residual + x
) -> torch.Tensor:
    """HF LlamaRMSNorm (normalise in fp32, cast back, then scale); with ``residual``, first
    ``residual += x`` in the model dtype (the decoder's skip connection) and normalise that."""
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    positions: torch.Tensor,  # int64 [num_tokens]
    cos_sin: torch.Tensor,  # float32 [max_positions, head_dim]: cos of each frequency, then sin
) -> None:
    """Rotary embedding in HF's rotate_half convention, in place."""
    half = x.shape[-1] // 2
    cs = cos_sin[positions].unsqueeze(1)  # [T, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x.copy_(out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
