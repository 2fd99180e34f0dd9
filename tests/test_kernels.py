"""Paged-KV kernels: Triton kernels == torch reference (under TRITON_INTERPRET=1, set in conftest.py),
the reference against itself and against plain dense attention, and the dispatch in ops.py.

Shapes are tiny on purpose: the interpreter costs about 1 ms per program instance, so every launch
here stays well under 100 programs.

Unused cache slots and the padding entries of block tables point at NaN ("poison"): the reference
reads only each request's first seq_len slots, so a kernel that reads one slot too many, or follows
a block table entry past a request's blocks, turns its output NaN and fails.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import pytest
import torch

import pdcluster.kernels as kernels_pkg
from pdcluster.kernels import cpu_ops, ops, reference
from pdcluster.kernels.triton_block_copy import gather_blocks_triton, scatter_blocks_triton
from pdcluster.kernels.triton_paged_attention import paged_attention_triton
from pdcluster.kernels.triton_write_kv import write_kv_triton
from triton_compile_helpers import compile_for_cuda

HEAD_DIM = 16
BLOCK_SIZE = 4
SCALE = HEAD_DIM**-0.5


@dataclass
class PagedBatch:
    """A varlen batch whose context already sits in a paged layer cache."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    layer_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    dense_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per request: K, V [seq_len, Hkv, D]

    def args(self) -> tuple:
        return (self.query, self.layer_cache, self.block_tables, self.seq_lens, self.query_start_loc, SCALE)


# The C kernel's bf16 attention paths (block size 16, head_dim a multiple of 32): AMX tiles, avx512_bf16 vectors,
# the generic loop. A machine without AMX skips the first; one without avx512_bf16 runs the generic loop for the second.
C_BF16_PATHS = ["amx", "avx512", "generic"]


def use_c_attention_path(path: str, monkeypatch) -> None:
    """Routes the C kernel's bf16 attention to ``path`` (one of C_BF16_PATHS) for the rest of the test."""
    if path == "amx" and not cpu_ops.attention_amx():
        pytest.skip("no AMX tiles on this CPU (or this process)")
    monkeypatch.setenv("PDCLUSTER_ATTN_AMX", "1" if path == "amx" else "0")
    if path == "generic":
        monkeypatch.setenv("PDCLUSTER_ATTN_GENERIC", "1")


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = BLOCK_SIZE,
    poison: float = float("nan"),
    seed: int = 0,
    head_dim: int = HEAD_DIM,
) -> PagedBatch:
    """Each request's blocks are drawn from a shuffled pool, so they are scattered and out of order.
    Context is written through the reference write_kv (so this also exercises slot arithmetic)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # one padding entry even for the longest request
    num_blocks = sum(blocks_per_req) + 3  # spare blocks stay poisoned
    pool = torch.randperm(num_blocks, generator=gen)
    poison_block = int(pool[-1])
    layer_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), poison, dtype=dtype)
    block_tables = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
    dense_kv = []
    next_block = 0
    for r, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_req)):
        blocks = pool[next_block : next_block + n]
        next_block += n
        block_tables[r, :n] = blocks.to(torch.int32)
        positions = torch.arange(seq_len)
        slots = blocks[positions // block_size] * block_size + positions % block_size
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        reference.write_kv(k, v, layer_cache, slots)
        dense_kv.append((k, v))
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedBatch(
        query, layer_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc, dense_kv
    )


# A mixed batch: decode (q_len 1, context over 4 scattered blocks), a prefill chunk with a prefix that
# spans two query tiles and two KV tiles, an idle request (q_len 0), and a fresh prefill (no prefix).
MIXED_Q_LENS = [1, 10, 0, 4]
MIXED_SEQ_LENS = [13, 37, 5, 4]
HEAD_CONFIGS = [
    pytest.param(4, 2, id="gqa2"),
    pytest.param(2, 2, id="mha"),
    pytest.param(6, 2, id="gqa3"),  # group not a power of two: padded rows in every tile
]


# ---------------------------------------------------------------------------------------------------
# (a) Triton kernels == torch reference, under the interpreter


@pytest.mark.parametrize(
    "src_dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_write_kv_triton_matches_reference(src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, num_blocks = 7, 2, 6
    # K and V as strided views of one fused projection output, as the model produces them.
    fused = torch.randn(num_tokens, 3, num_kv_heads, HEAD_DIM, generator=gen).to(src_dtype)
    key, value = fused[:, 1], fused[:, 2]
    # Scattered slots in several blocks, out of order.
    slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(cache_dtype)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slot_mapping)
    write_kv_triton(key, value, cache, slot_mapping)
    if src_dtype == cache_dtype:
        assert torch.equal(cache, expected)
    else:
        # The interpreter (triton 3.9) truncates fp32 -> bf16 where a GPU rounds to nearest even: allow
        # one bf16 ulp. A misplaced token is off by far more.
        torch.testing.assert_close(cache, expected, rtol=2**-7, atol=0)


def test_write_kv_triton_skips_negative_slots():
    num_kv_heads, num_blocks = 2, 3
    key = torch.randn(3, num_kv_heads, HEAD_DIM)
    value = torch.randn(3, num_kv_heads, HEAD_DIM)
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    write_kv_triton(key, value, cache, torch.tensor([5, -1, 9]))
    expected = torch.zeros_like(cache)
    reference.write_kv(key[[0, 2]], value[[0, 2]], expected, torch.tensor([5, 9]))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEAD_CONFIGS)
def test_paged_attention_triton_matches_reference_fp32(num_q_heads, num_kv_heads):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_q_heads, num_kv_heads)
    expected = reference.paged_attention(*batch.args())
    got = paged_attention_triton(*batch.args())
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_triton_matches_reference_bf16():
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, 4, 2, dtype=torch.bfloat16)
    got = paged_attention_triton(*batch.args())
    assert got.dtype == torch.bfloat16
    # Oracle: the reference on the same bf16 values upcast to fp32; the kernel accumulates in fp32 and
    # rounds once at the end, so it is within bf16 rounding of that.
    upcast = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, 4, 2, dtype=torch.bfloat16)
    upcast.query = upcast.query.float()
    upcast.layer_cache = upcast.layer_cache.float()
    expected = reference.paged_attention(*upcast.args())
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


# The fast mode's tiles differ, the strided loads are the same: the fast one in the slow pass.
@pytest.mark.parametrize("batch_invariant", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["deterministic", "fast"])
def test_paged_attention_triton_takes_a_strided_query(batch_invariant):
    """The model's q is a view of its qkv projection (rows strided past the K and V heads): the kernel
    reads it in place, with the same bits as a packed copy, and writes a packed output."""
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, 4, 2)
    qkv = torch.cat([batch.query, torch.randn(batch.query.shape[0], 4, HEAD_DIM)], dim=1)
    strided = qkv[:, :4]
    assert not strided.is_contiguous()
    args = (batch.layer_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    got = paged_attention_triton(strided, *args, batch_invariant=batch_invariant)
    assert got.is_contiguous()
    assert torch.equal(got, paged_attention_triton(strided.contiguous(), *args, batch_invariant=batch_invariant))


def test_paged_attention_triton_decode_batch():
    """Pure decode (q_len 1 everywhere), block size 8, contexts ending mid-block and on a boundary."""
    batch = make_batch([1, 1, 1], [9, 16, 30], 4, 2, block_size=8)
    expected = reference.paged_attention(*batch.args())
    torch.testing.assert_close(paged_attention_triton(*batch.args()), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_latent_shape_matches_reference():
    """DeepSeek's MLA as engine/models/deepseek.py serves it: 16 query heads over one KV head of 576 (a 512 latent
    and 64 rotated dims, not a power of two: the Triton tiles pad it), the cache's V half holding the same vectors
    as its K half. The Triton kernel (interpreted) and the C kernel equal the reference."""
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, 16, 1, head_dim=576)
    batch.layer_cache[1] = batch.layer_cache[0]
    expected = reference.paged_attention(*batch.args())
    # The engine's one-plane cache, handed to the kernels as that plane twice (a stride-0 view).
    batch.layer_cache = reference.layer_planes(batch.layer_cache[:1].clone())
    assert batch.layer_cache.stride(0) == 0
    assert not expected.isnan().any()
    torch.testing.assert_close(paged_attention_triton(*batch.args()), expected, rtol=1e-5, atol=1e-5)
    got_c = cpu_ops.paged_attention(*batch.args())
    if got_c is not None:  # None: no C compiler here. Its sums over 576 dims run in another order: 1e-4.
        torch.testing.assert_close(got_c, expected, rtol=1e-4, atol=1e-4)
    # Writing a token's K and V through the view writes its one vector.
    latent = torch.randn(3, 1, 576)
    write_kv_triton(latent, latent, batch.layer_cache, torch.tensor([0, 17, 40]))
    assert torch.equal(batch.layer_cache[0].reshape(-1, 576)[[0, 17, 40]], latent[:, 0])


@pytest.mark.parametrize("segments, block_n", [(4, 16), (16, 32)], ids=["4x16", "16x32"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEAD_CONFIGS)
def test_paged_attention_split_in_segments_matches_reference(segments, block_n, num_q_heads, num_kv_heads):
    """The fast mode's decode split: each row's key tiles in ``segments`` even runs (several tiles a
    segment for the longer contexts, empty segments for the short ones), merged in one load. Decode and
    verification rows, contexts of 1 to 150 positions over scattered blocks; rows past the batch's last
    query token (graph padding) are left as they were."""
    from pdcluster.kernels import triton_paged_attention as attention

    batch = make_batch([1, 1, 3, 1, 2], [1, 18, 70, 150, 33], num_q_heads, num_kv_heads, block_size=8)
    expected = reference.paged_attention(*batch.args())
    num_tokens = batch.query.shape[0]
    padded = torch.cat([batch.query, torch.zeros(2, *batch.query.shape[1:])])
    out = torch.full_like(padded, float("nan"))
    attention.launch(padded, batch.layer_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE,
                     out, attention.block_q_for(triton_next_pow2(num_q_heads // num_kv_heads)), block_n, split=True,
                     segments=segments)
    torch.testing.assert_close(out[:num_tokens], expected, rtol=1e-5, atol=1e-5)
    assert out[num_tokens:].isnan().all(), "padding rows were written"


def test_fast_decode_takes_the_segment_split_for_a_few_requests(monkeypatch):
    """paged_attention_triton(batch_invariant=False) on a decode batch of a few requests launches the
    segment split (and still matches the reference); prefill-sized calls do not. A decode batch with
    enough programs runs unsplit, its whole context one partition (one key loop per program), and
    matches the reference over contexts of several FAST_PARTITIONs."""
    from pdcluster.kernels import triton_paged_attention as attention

    launched = []
    real_launch = attention.launch

    def recording(*args, **kwargs):
        launched.append((kwargs.get("segments", 0), kwargs.get("split"), kwargs.get("partition")))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(attention, "launch", recording)
    batch = make_batch([1, 1], [9, 40], 4, 2, block_size=8)
    got = attention.paged_attention_triton(*batch.args(), batch_invariant=False)
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), rtol=1e-5, atol=1e-5)
    prefill = make_batch([20], [20], 4, 2, block_size=8)
    attention.paged_attention_triton(*prefill.args(), batch_invariant=False)
    assert [seg for seg, _, _ in launched] == [32, 0]  # 2 query tiles x 2 KV heads: the most segments

    launched.clear()
    monkeypatch.setattr(attention, "SPLIT_BELOW_PROGRAMS", 1)  # every launch has programs enough
    many = make_batch([1, 2, 1], [700, 257, 3], 4, 2, block_size=8)
    got = attention.paged_attention_triton(*many.args(), batch_invariant=False)
    torch.testing.assert_close(got, reference.paged_attention(*many.args()), rtol=1e-5, atol=1e-5)
    whole = attention.fast_whole_context(many.block_tables, 8)
    assert whole >= 700 and whole > attention.FAST_PARTITION
    assert launched == [(0, None, whole)]


def test_fast_decode_segments_follow_the_launch_size():
    """About FAST_DECODE_TARGET_PROGRAMS programs, a power of two in [8, 32]: TinyLlama's decode (GQA 8,
    so 2 tokens a query tile; 4 KV heads) of 1, 8 and 32 requests, the shapes timed on an H100."""
    from pdcluster.kernels.triton_paged_attention import fast_decode_segments

    def tiles(num_reqs):
        return num_reqs // 2 + num_reqs

    assert [fast_decode_segments(tiles(n), 4) for n in (1, 8, 32)] == [32, 16, 8]
    assert fast_decode_segments(tiles(60), 4) == 8  # the floor, up to where the unsplit launch takes over
    assert all(s & (s - 1) == 0 for s in (fast_decode_segments(t, h) for t in range(1, 300) for h in (1, 2, 4, 8)))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_blocks_triton_matches_reference(dtype):
    kv_cache = torch.randn(2, 2, 7, BLOCK_SIZE, 2, HEAD_DIM).to(dtype)
    block_ids = torch.tensor([5, 1, 3])
    expected = reference.gather_blocks(kv_cache, block_ids)
    assert torch.equal(gather_blocks_triton(kv_cache, block_ids), expected)
    out = torch.zeros_like(expected)
    assert gather_blocks_triton(kv_cache, block_ids, out) is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_blocks_triton_matches_reference(dtype):
    kv_cache = torch.randn(2, 2, 7, BLOCK_SIZE, 2, HEAD_DIM).to(dtype)
    buffer = torch.randn(2, 2, 3, BLOCK_SIZE, 2, HEAD_DIM).to(dtype)
    block_ids = torch.tensor([6, 0, 2])
    expected = kv_cache.clone()
    reference.scatter_blocks(buffer, expected, block_ids)
    scatter_blocks_triton(buffer, kv_cache, block_ids)
    assert torch.equal(kv_cache, expected)


def test_block_copy_triton_one_plane():
    """MLA's latent cache has one plane a layer, not K and V: gather and scatter move that plane only."""
    kv_cache = torch.randn(3, 1, 7, BLOCK_SIZE, 1, 40)
    block_ids = torch.tensor([5, 1, 3])
    expected = reference.gather_blocks(kv_cache, block_ids)
    gathered = gather_blocks_triton(kv_cache, block_ids)
    assert gathered.shape[1] == 1 and torch.equal(gathered, expected)
    expected_cache = kv_cache.clone()
    reference.scatter_blocks(gathered * 2, expected_cache, block_ids)
    scatter_blocks_triton(gathered * 2, kv_cache, block_ids)
    assert torch.equal(kv_cache, expected_cache)


def test_block_copy_triton_multi_chunk():
    """A block of 8 * 3 * 48 = 1152 elements is copied in two chunks (1024 + a masked tail of 128)."""
    kv_cache = torch.randn(1, 2, 4, 8, 3, 48)
    block_ids = torch.tensor([2, 0])
    expected = reference.gather_blocks(kv_cache, block_ids)
    assert torch.equal(gather_blocks_triton(kv_cache, block_ids), expected)
    buffer = torch.randn(1, 2, 2, 8, 3, 48)
    expected_cache = kv_cache.clone()
    reference.scatter_blocks(buffer, expected_cache, block_ids)
    scatter_blocks_triton(buffer, kv_cache, block_ids)
    assert torch.equal(kv_cache, expected_cache)


def test_block_copy_triton_round_trip():
    """Gather from one cache, scatter into another at different ids: the blocks arrive intact."""
    src = torch.randn(2, 2, 7, BLOCK_SIZE, 2, HEAD_DIM)
    dst = torch.zeros(2, 2, 9, BLOCK_SIZE, 2, HEAD_DIM)
    src_ids, dst_ids = torch.tensor([4, 0, 6]), torch.tensor([8, 3, 1])
    scatter_blocks_triton(gather_blocks_triton(src, src_ids), dst, dst_ids)
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    untouched = [i for i in range(9) if i not in dst_ids.tolist()]
    assert not dst[:, :, untouched].any()


# ---------------------------------------------------------------------------------------------------
# (b) The reference against itself and against dense attention


def naive_dense_attention(batch: PagedBatch, q_lens: list[int]) -> torch.Tensor:
    """Causal attention from each request's dense K/V, with no paging: one query token, one head at a
    time, in float64."""
    num_q_heads = batch.query.shape[1]
    num_kv_heads = batch.dense_kv[0][0].shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for r, (k, v) in enumerate(batch.dense_kv):
        seq_len = k.shape[0]
        for i in range(q_lens[r]):
            token = starts[r] + i
            position = seq_len - q_lens[r] + i
            for h in range(num_q_heads):
                keys = k[: position + 1, h // group].double()
                values = v[: position + 1, h // group].double()
                weights = torch.softmax(keys @ batch.query[token, h].double() * SCALE, dim=0)
                out[token, h] = weights @ values
    return out


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEAD_CONFIGS[:2])
def test_reference_paged_attention_equals_dense(num_q_heads, num_kv_heads):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_q_heads, num_kv_heads)
    got = reference.paged_attention(*batch.args())
    torch.testing.assert_close(got.double(), naive_dense_attention(batch, MIXED_Q_LENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len", [1, 3])
def test_reference_uniform_equals_varlen(q_len):
    # Finite poison: the uniform reference reads every slot up to the longest request's last block
    # and relies on its mask alone, so NaN in a masked slot would leak into its output.
    batch = make_batch([q_len] * 3, [q_len + 2, 11, 17], 4, 2, poison=1e4)
    varlen = reference.paged_attention(*batch.args())
    uniform = reference.paged_attention_uniform(
        batch.query, batch.layer_cache, batch.block_tables, batch.seq_lens, q_len, SCALE
    )
    torch.testing.assert_close(uniform, varlen, rtol=1e-5, atol=1e-5)


def test_reference_gather_scatter_round_trip():
    src = torch.randn(3, 2, 6, BLOCK_SIZE, 2, HEAD_DIM)
    dst = torch.zeros(3, 2, 8, BLOCK_SIZE, 2, HEAD_DIM)
    src_ids, dst_ids = torch.tensor([2, 5, 0]), torch.tensor([7, 1, 4])
    reference.scatter_blocks(reference.gather_blocks(src, src_ids), dst, dst_ids)
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])


# ---------------------------------------------------------------------------------------------------
# Dispatch (ops.py)


def _run_all_ops(batch: PagedBatch, uniform_batch: PagedBatch, q_len: int) -> dict[str, torch.Tensor]:
    """Every op in ops.py once, on copies, returning what each produced."""
    results = {}
    gen = torch.Generator().manual_seed(4)  # both routes must see the same inputs
    key = torch.randn(3, batch.layer_cache.shape[3], HEAD_DIM, generator=gen)
    cache = batch.layer_cache.clone()
    ops.write_kv(key, key + 1, cache, torch.tensor([3, 17, 8]))
    results["write_kv"] = cache
    results["paged_attention"] = ops.paged_attention(*batch.args())
    results["paged_attention_uniform"] = ops.paged_attention_uniform(
        uniform_batch.query,
        uniform_batch.layer_cache,
        uniform_batch.block_tables,
        uniform_batch.seq_lens,
        q_len,
        SCALE,
    )
    kv_cache = torch.stack([batch.layer_cache, batch.layer_cache * 2])
    block_ids = torch.tensor([3, 0])
    results["gather_blocks"] = ops.gather_blocks(kv_cache, block_ids)
    scattered = kv_cache.clone()
    ops.scatter_blocks(results["gather_blocks"] + 1, scattered, torch.tensor([1, 2]))
    results["scatter_blocks"] = scattered
    return results


@pytest.fixture
def dispatch_batches():
    batch = make_batch([1, 5], [6, 9], 4, 2, poison=0.0)
    uniform_batch = make_batch([2, 2], [3, 10], 4, 2, poison=0.0)
    return batch, uniform_batch


def test_ops_uses_reference_on_cpu_without_c_kernels(monkeypatch, dispatch_batches):
    """With the C kernels off (no compiler), CPU tensors take the torch reference; with them on,
    tests/test_cpu_kernels.py checks that they are routed there instead."""
    from pdcluster.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "load", lambda: None)
    called = []
    for name in ("write_kv", "paged_attention", "paged_attention_uniform", "gather_blocks", "scatter_blocks"):
        real = getattr(reference, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(reference, name, spy)
    _run_all_ops(*dispatch_batches, q_len=2)
    assert sorted(called) == sorted(
        ["write_kv", "paged_attention", "paged_attention_uniform", "gather_blocks", "scatter_blocks"]
    )


def test_ops_triton_route_matches_reference_route(monkeypatch, dispatch_batches):
    """Force the CUDA branch (whose kernels the interpreter can run on CPU tensors): every op,
    including paged_attention_uniform's query_start_loc construction, matches the reference branch."""
    expected = _run_all_ops(*dispatch_batches, q_len=2)
    monkeypatch.setattr(ops, "_use_triton", lambda *tensors: True)
    for name in ("write_kv", "paged_attention", "paged_attention_uniform", "gather_blocks", "scatter_blocks"):
        monkeypatch.setattr(reference, name, None)  # the reference route must not be reached
    got = _run_all_ops(*dispatch_batches, q_len=2)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_ops_imports_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail, find_spec None
    monkeypatch.delitem(sys.modules, "pdcluster.kernels.ops")
    monkeypatch.setattr(kernels_pkg, "ops", ops)  # restored at teardown after the re-import rebinds it
    fresh_ops = importlib.import_module("pdcluster.kernels.ops")
    assert fresh_ops is not ops
    assert not fresh_ops.triton_available()
    cache = torch.zeros(2, 2, BLOCK_SIZE, 1, HEAD_DIM)
    fresh_ops.write_kv(torch.ones(1, 1, HEAD_DIM), torch.ones(1, 1, HEAD_DIM), cache, torch.tensor([5]))
    assert cache[:, 1, 1].eq(1).all()


# ---------------------------------------------------------------------------------------------------
# GPU build: the interpreter runs kernels as Python and skips Triton's compiler, which is stricter
# (types of loop-carried values, constexpr use, dot shapes). Compile every kernel ahead of time for
# an sm_80 target, as a GPU launch would; no GPU needed. Subprocess: this one must not interpret.

_AOT_COMPILE = """
import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdcluster.kernels.triton_block_copy import _copy_blocks_kernel
from pdcluster.kernels.triton_paged_attention import (_merge_partitions_kernel, _merge_segments_kernel,
                                                       _paged_attention_kernel)
from pdcluster.kernels.triton_rms_norm import _rms_norm_kernel
from pdcluster.kernels.triton_rotary import _rotary_kernel
from pdcluster.kernels.triton_rotary_kv import _rotary_write_kv_kernel
from pdcluster.kernels.triton_silu_and_mul import _silu_and_mul_kernel
from pdcluster.kernels.triton_write_kv import _write_kv_kernel


def build(fn, pointer_types, constexprs):
    # A constexpr the build leaves out takes its default, as a launch would (else it would be compiled as a
    # runtime int and its branches, e.g. HAS_SINKS's loads, compiled in).
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    constants = {(names.index(n),): v for n, v in constexprs.items()}
    triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 80, 32))


for dtype, precision, split in (("fp32", "ieee", False), ("bf16", "tf32", False), ("bf16", "tf32", True)):
    build(
        _paged_attention_kernel,
        {"out_ptr": "*" + dtype, "query_ptr": "*" + dtype, "cache_ptr": "*" + dtype,
         "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
         "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sinks_ptr": "*fp32",
         "qk_scale_log2": "fp32", "softcap": "fp32"},
        # num_reqs == 1 and unit strides: Triton specializes such ints into constants at launch.
        dict(num_reqs=1, stride_q_dim=1, stride_cache_dim=1, GROUP=4, GROUP_PAD=4, BLOCK_Q=4,
             BLOCK_M=16, BLOCK_N=32, HEAD_DIM_PAD=128, DOT_PRECISION=precision, PARTITION_SIZE=128,
             SPLIT=split, NATIVE_DOT=False, SOFTCAP=dtype == "bf16",  # Gemma 2's soft-capped scores too
             HAS_SINKS=dtype == "fp32"),  # gpt-oss's attention sinks, folded in this kernel when unsplit
    )
build(_paged_attention_kernel,
      {"out_ptr": "*bf16", "query_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
       "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
       "part_acc_ptr": "*fp32", "qk_scale_log2": "fp32"},
      dict(stride_q_dim=1, stride_cache_dim=1, GROUP=8, GROUP_PAD=8, BLOCK_Q=16, BLOCK_M=128, BLOCK_N=64,
           HEAD_DIM_PAD=64, DOT_PRECISION="tf32", PARTITION_SIZE=256, SPLIT=False, NATIVE_DOT=True,
           HAS_SINKS=False))  # fast prefill
build(_paged_attention_kernel,
      {"out_ptr": "*bf16", "query_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
       "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
       "part_acc_ptr": "*fp32", "qk_scale_log2": "fp32"},
      dict(stride_q_dim=1, stride_cache_dim=1, GROUP=8, GROUP_PAD=8, BLOCK_Q=2, BLOCK_M=16, BLOCK_N=32,
           HEAD_DIM_PAD=64, DOT_PRECISION="tf32", PARTITION_SIZE=256, SPLIT=True, NATIVE_DOT=True,
           NUM_SEGMENTS=16, HAS_SINKS=True))  # fast decode, split in segments (gpt-oss's sinks: in the merge)
build(_paged_attention_kernel,
      {"out_ptr": "*bf16", "query_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
       "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
       "part_acc_ptr": "*fp32", "qk_scale_log2": "fp32"},
      dict(stride_q_dim=1, stride_cache_dim=1, GROUP=8, GROUP_PAD=8, BLOCK_Q=2, BLOCK_M=16, BLOCK_N=64,
           HEAD_DIM_PAD=64, DOT_PRECISION="tf32", PARTITION_SIZE=4096, SPLIT=False,
           NATIVE_DOT=True, HAS_SINKS=False))  # fast decode of many requests: the whole context one partition
for sinks in (False, True):  # the merges fold gpt-oss's sinks when the paged kernel split
    build(_merge_segments_kernel, {"out_ptr": "*bf16", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32",
          "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sinks_ptr": "*fp32"},
          dict(stride_out_dim=1, NUM_SEGMENTS=16, HEAD_DIM_PAD=64, HAS_SINKS=sinks))
    build(_merge_partitions_kernel, {"out_ptr": "*bf16", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
          "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sinks_ptr": "*fp32"},
          dict(stride_out_dim=1, HEADS_PAD=32, HEAD_DIM_PAD=64, PARTITION_SIZE=128, HAS_SINKS=sinks))
build(_write_kv_kernel, {"key_ptr": "*fp32", "value_ptr": "*fp32", "cache_ptr": "*bf16",
      "slot_mapping_ptr": "*i64"}, dict(HEADS_PAD=8, HEAD_DIM_PAD=128))
build(_copy_blocks_kernel, {"src_ptr": "*bf16", "dst_ptr": "*bf16", "block_ids_ptr": "*i64"},
      dict(INDEX_SRC=True, CHUNK=1024, NUM_PLANES=1))  # MLA's one-plane cache
for dtype in ("fp32", "bf16"):
    for has_residual in (False, True):
        build(_rms_norm_kernel, {"out_ptr": "*" + dtype, "x_ptr": "*" + dtype, "residual_ptr": "*" + dtype,
              "weight_ptr": "*" + dtype, "eps": "fp32"}, dict(HAS_RESIDUAL=has_residual, BLOCK=1024))
    build(_rotary_kernel, {"x_ptr": "*" + dtype, "positions_ptr": "*i64", "cos_sin_ptr": "*fp32"},
          dict(stride_x_dim=1, stride_cos_sin_dim=1, HEADS_PAD=16, HALF_PAD=64))
    build(_silu_and_mul_kernel, {"out_ptr": "*" + dtype, "x_ptr": "*" + dtype}, dict(BLOCK=1024))
    build(_rotary_write_kv_kernel, {"q_ptr": "*" + dtype, "k_ptr": "*" + dtype, "v_ptr": "*" + dtype,
          "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "cache_ptr": "*" + dtype, "slot_mapping_ptr": "*i64"},
          dict(stride_q_dim=1, stride_k_dim=1, stride_v_dim=1, stride_cos_sin_dim=1, stride_cache_dim=1,
               Q_HEADS_PAD=32, KV_HEADS_PAD=4, HALF_PAD=32))
print("compiled")
"""


def test_kernels_compile_for_cuda(tmp_path):
    assert "compiled" in compile_for_cuda(_AOT_COMPILE, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device and compiled Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_and_triton_attention_on_cuda_equal_the_cpu_reference(dtype):
    """The torch reference runs on CUDA tensors (its masks are built on the query's device), and the
    compiled Triton kernel (what ops picks for CUDA tensors) agrees with it, prefill, decode and
    verification rows together."""
    batch = make_batch([10, 1, 3, 0], [37, 13, 9, 4], 8, 2, dtype=dtype)
    expected = reference.paged_attention(*batch.args())
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in batch.args()]
    on_cuda = reference.paged_attention(*cuda_args)
    assert on_cuda.is_cuda
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(on_cuda.cpu().float(), expected.float(), **tol)
    torch.testing.assert_close(ops.paged_attention(*cuda_args).cpu().float(), expected.float(), **tol)


@pytest.mark.parametrize("route", ["c", "reference", "triton"])
def test_a_packed_draft_layer_is_written_and_read_in_place(route):
    """engine/kv_cache.py packed_layer_views: a draft layer whose KV of a token is a quarter of the target's is a
    view of a target-shaped cache layer, its blocks at the target's block stride and offset by its place (no plane
    contiguous). The KV write and paged attention (the C kernel, the torch reference, Triton under the interpreter)
    take it in place: the attention equals that over a contiguous cache of the same KV, and the write touches the
    layer's own part of each block only."""
    from pdcluster.engine.kv_cache import packed_layer_views

    if route == "c" and not cpu_ops.available():
        pytest.skip("the C kernels are not built here")
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, 4, 2)
    num_blocks, per_slot = batch.layer_cache.shape[1], 4
    slot = torch.full((1, 2, num_blocks, BLOCK_SIZE, 2 * per_slot, HEAD_DIM), 0.5)
    views = packed_layer_views(slot, per_slot, per_slot, 2, HEAD_DIM)
    layer = views[2]
    assert layer.shape == batch.layer_cache.shape and not layer[0].is_contiguous()
    for r, (k, v) in enumerate(batch.dense_kv):
        positions = torch.arange(k.shape[0])
        blocks = batch.block_tables[r, positions // BLOCK_SIZE].long()
        slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        if route == "c":
            assert cpu_ops.write_kv(k, v, layer, slots)
        elif route == "reference":
            reference.write_kv(k, v, layer, slots)
        else:
            write_kv_triton(k, v, layer, slots)
        offsets = positions % BLOCK_SIZE
        assert torch.equal(layer[0][blocks, offsets], k) and torch.equal(layer[1][blocks, offsets], v)
    for i in (0, 1, 3):  # the slot's other layers: untouched
        assert bool((views[i] == 0.5).all())
    args = (batch.query, layer, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    expected = reference.paged_attention(*batch.args())
    got = {"c": lambda: cpu_ops.paged_attention(*args), "reference": lambda: reference.paged_attention(*args),
           "triton": lambda: paged_attention_triton(*args)}[route]()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
