"""Tensor-level wrappers over the C kernels (kernels/csrc/cpu_kernels.c): shape and dtype checks
here, raw pointers and strides to C. Same signatures as kernels/reference.py; ops.py picks one.

Each wrapper returns False (nothing done) when the library is unavailable or the inputs are outside
what the C code handles (activations other than float32/bfloat16, caches other than those or fp8, non-contiguous
head dim), so the caller
falls back to the reference. Every tensor whose pointer reaches C must be in host memory: one CUDA (or
any non-CPU) tensor among them and the wrapper refuses, where C would write through a device pointer.
"""

from __future__ import annotations

import torch

from pdcluster.kernels import cpu_build

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
# A KV cache may also hold fp8 (--kv-cache-dtype fp8): widened on load, converted (saturating) on store.
_CACHE_DTYPE_CODE = {**_DTYPE_CODE, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def available() -> bool:
    return cpu_build.load() is not None


def attention_amx() -> bool:
    """Whether bf16 paged attention runs on AMX tiles in this process (kernels/csrc/attention_amx.h): a CPU with
    AMX-BF16 whose kernel grants the tile state, and PDCLUSTER_CPU_AMX not 0."""
    lib = cpu_build.load()
    return lib is not None and bool(lib.pd_attention_amx())


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _code(*tensors: torch.Tensor) -> int | None:
    """The C dtype code of same-dtype CPU tensors, else None (the caller falls back)."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype is not dtype or t.device.type != "cpu":
            return None
    return _DTYPE_CODE.get(dtype)


def _threads() -> int:
    return torch.get_num_threads()


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (head dim contiguous)
    value: torch.Tensor,
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
) -> bool:
    lib = cpu_build.load()
    src_code, cache_code = _DTYPE_CODE.get(key.dtype), _CACHE_DTYPE_CODE.get(layer_cache.dtype)
    if (lib is None or not _on_cpu(key, value, layer_cache, slot_mapping) or value.dtype != key.dtype
            or src_code is None or cache_code is None or (cache_code < 2 and key.dtype != layer_cache.dtype)
            or key.stride() != value.stride() or key.stride(-1) != 1 or layer_cache.stride(-1) != 1
            or slot_mapping.dtype != torch.int64):
        return False
    slot_mapping = slot_mapping.contiguous()
    # The plane's own strides: a packed draft layer's blocks lie further apart than its slots (kv_cache.py).
    block_stride, slot_stride, head_stride = layer_cache.stride()[1:4]
    rc = lib.pd_write_kv(key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), layer_cache[0].data_ptr(),
                         layer_cache[1].data_ptr(), slot_mapping.data_ptr(), key.shape[0], key.shape[1], key.shape[2],
                         key.element_size(), src_code, cache_code, _threads(), layer_cache.shape[2], block_stride,
                         slot_stride, head_stride)
    return rc == 0


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    scale: float,
    out: torch.Tensor | None = None,  # float32 or bfloat16 (default: the query's dtype); a float32 out of a bf16
    # query holds the kernel's float32 results unrounded (tests read a query's exact bits there)
    window: int = 0,  # > 0: each query sees its last ``window`` positions (sliding-window attention)
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # float32 [num_q_heads]: attention sinks (gpt-oss; reference.paged_attention)
    chunk: int = 0,  # > 0: chunked attention, each query sees its chunk's keys (Llama 4's local layers)
) -> torch.Tensor | None:
    lib = cpu_build.load()
    code = _code(query)
    cache_code = code if layer_cache.dtype is query.dtype else _CACHE_DTYPE_CODE.get(layer_cache.dtype)
    if cache_code is not None and cache_code < 2 and cache_code != code:
        cache_code = None  # 16- and 32-bit caches are read in the query's dtype only
    if (lib is None or code is None or cache_code is None or query.stride(-1) != 1 or layer_cache.stride(-1) != 1
            or not _on_cpu(layer_cache, block_tables, seq_lens, query_start_loc, out, sinks)):
        return None
    if sinks is not None:
        sinks = sinks.float().contiguous()
        assert sinks.shape == (query.shape[1],), f"sinks {tuple(sinks.shape)} for {query.shape[1]} query heads"
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    if out is None:
        out = torch.empty_like(query)
    out_code = _DTYPE_CODE.get(out.dtype)
    if out_code is None or out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"paged_attention: out must be float32 or bfloat16 of the query's shape {tuple(query.shape)}"
                         f" with unit last stride, not {out.dtype} {tuple(out.shape)}")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    _, _, block_size, num_kv_heads, _ = layer_cache.shape
    k, v = layer_cache[0], layer_cache[1]
    rc = lib.pd_paged_attention(
        code, cache_code, query.data_ptr(), query.stride(0), query.stride(1),
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(),
        seq_lens.shape[0], num_q_heads, num_kv_heads, head_dim, block_size, scale, window, chunk, softcap,
        None if sinks is None else sinks.data_ptr(), out.data_ptr(), out_code, out.stride(0), out.stride(1),
        _threads(),
    )
    if rc != 0:
        raise ValueError(f"pd_paged_attention: unsupported shape (code {rc}): heads {num_q_heads}/{num_kv_heads}, "
                         f"head_dim {head_dim}, block_size {block_size}")
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden], updated in place to residual + x
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    lib = cpu_build.load()
    tensors = (x, weight) if residual is None else (x, weight, residual)
    code = _code(*tensors)
    if lib is None or code is None or not all(t.is_contiguous() for t in tensors) or not _on_cpu(out):
        return None
    if out is None:
        out = torch.empty_like(x)
    num_tokens = x.numel() // x.shape[-1]
    rc = lib.pd_rms_norm(code, x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                         out.data_ptr(), num_tokens, x.shape[-1], eps, _threads())
    if rc != 0:
        raise ValueError(f"pd_rms_norm: hidden size {x.shape[-1]} is over the kernel's limit")
    return out


def rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    positions: torch.Tensor,  # int64 [num_tokens]
    cos_sin: torch.Tensor,  # float32 [max_positions, head_dim]: cos | sin halves
) -> bool:
    lib = cpu_build.load()
    code = _code(x)
    if (lib is None or code is None or x.stride(-1) != 1 or positions.dtype != torch.int64
            or not _on_cpu(positions, cos_sin)):
        return False
    positions = positions.contiguous()
    rc = lib.pd_rotary(code, x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], x.shape[1], x.shape[2],
                       positions.data_ptr(), cos_sin.data_ptr(), _threads())
    if rc != 0:
        raise ValueError(f"pd_rotary: head_dim {x.shape[2]} unsupported")
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:  # [num_tokens, 2 * d] -> [num_tokens, d]
    lib = cpu_build.load()
    code = _code(x)
    if lib is None or code is None or not x.is_contiguous():
        return None
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)
    lib.pd_silu_and_mul(code, x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], d, _threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:  # [num_rows, n] -> int64 [num_rows]
    """torch.argmax(x, -1) (first index of the maximum; rows without NaN) without widening bf16."""
    lib = cpu_build.load()
    code = _code(x)
    if lib is None or code is None or x.dim() != 2 or x.stride(-1) != 1:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.pd_argmax_rows(code, x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), _threads())
    return out


SMALL_M = 8  # pd_linear_small_m handles up to this many rows


def linear_small_m(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` for float32 ``x`` of at most SMALL_M rows (leading dims flattened):
    one pass over the weight for all rows (MKL makes one per row). None when not applicable."""
    if (x.dtype is not torch.float32 or weight.dtype is not torch.float32 or not _on_cpu(x, weight)
            or not weight.is_contiguous() or x.shape[-1] != weight.shape[1]):
        return None
    rows = x.reshape(-1, x.shape[-1])
    lib = cpu_build.load()
    if lib is None or rows.shape[0] == 0 or rows.shape[0] > SMALL_M:
        return None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n, k = weight.shape
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    lib.pd_linear_small_m(rows.data_ptr(), rows.stride(0), rows.shape[0], weight.data_ptr(), n, k,
                          out.data_ptr(), out.stride(0), _threads())
    return out.reshape(*x.shape[:-1], n)
