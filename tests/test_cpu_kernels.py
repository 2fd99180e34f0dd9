"""The C kernels (kernels/csrc/cpu_kernels.c) against the torch reference, and their build/fallback.

Attention batches come from test_kernels.make_batch: scattered blocks, NaN in every slot a request
must not read, so reading one slot too many (or a wrong block) turns the output NaN and fails here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from pdcluster.kernels import cpu_build, cpu_gemm, cpu_ops, numerics, ops, reference
from test_kernels import C_BF16_PATHS, HEAD_DIM, SCALE, make_batch, use_c_attention_path

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler: the C kernels cannot be built")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

ATTENTION_CASES = [
    pytest.param([1, 1, 1], [13, 4, 40], id="decode"),
    pytest.param([3, 3], [9, 30], id="verify-1+2"),  # speculative verification: q_len 1 + k
    pytest.param([10, 1, 0, 4], [37, 13, 5, 4], id="mixed"),  # chunk with prefix, decode, idle, fresh
    pytest.param([23], [23], id="prefill-fresh"),  # several query chunks of one request
    pytest.param([17, 6], [50, 6], id="prefill-chunk-with-prefix"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 2), (2, 2), (6, 2), (9, 3)])
@pytest.mark.parametrize("q_lens, seq_lens", ATTENTION_CASES)
def test_paged_attention_matches_reference(q_lens, seq_lens, num_q_heads, num_kv_heads, dtype):
    batch = make_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, dtype=dtype)
    expected = reference.paged_attention(*batch.args())
    got = cpu_ops.paged_attention(*batch.args())
    assert got is not None and not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("path", C_BF16_PATHS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_lens, seq_lens", ATTENTION_CASES)
def test_bf16_vector_path_matches_reference(q_lens, seq_lens, head_dim, path, monkeypatch):
    """bf16 with block size 16 and head_dim a multiple of 32 takes AMX tiles where the CPU has them, else the
    avx512_bf16 path where it has that (dot products straight from the cache, 16 keys per vector), else the
    generic loop; each path here against the reference."""
    use_c_attention_path(path, monkeypatch)
    batch = make_batch(q_lens, seq_lens, 9, 3, dtype=torch.bfloat16, block_size=16, head_dim=head_dim)
    args = (*batch.args()[:5], head_dim**-0.5)
    expected = reference.paged_attention(*args)
    got = cpu_ops.paged_attention(*args)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("path", ["amx", "avx512"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("window, chunk", [(0, 0), (11, 0), (0, 24)], ids=["causal", "window", "chunked"])
@pytest.mark.parametrize("spread", [1.0, 40.0], ids=["scores", "wide-scores"])
def test_bf16_paths_are_batch_invariant(path, num_q_heads, num_kv_heads, head_dim, window, chunk, spread,
                                        monkeypatch):
    """A query's float32 output bits (before the rounding to bf16, which would hide most differences) in a 40-token
    prefill chunk (after 21 cached tokens, beside a decode request) equal its bits as a decode step alone and as the
    last token of a 3-token verification step. The AMX path puts a kv head's queries in row groups of 16 (40 tokens
    x 3 heads: 7.5 groups; x 8: 20), so a query sits in a different tile row, or a tile of another height, in each
    call. Wide scores (40x the usual scale) put a block's weights over many binades, where their fp32 sum depends
    on its order: a query's sum must be the same tree whether its row is a vector or a lane."""
    use_c_attention_path(path, monkeypatch)
    batch = make_batch([40, 1], [61, 30], num_q_heads, num_kv_heads, dtype=torch.bfloat16, block_size=16,
                       head_dim=head_dim)
    scale = spread * head_dim**-0.5
    tables, cache = batch.block_tables, batch.layer_cache

    def attend(query, tables, seq_lens, starts):
        out = torch.empty(query.shape, dtype=torch.float32)
        cpu_ops.paged_attention(query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                torch.tensor(starts, dtype=torch.int32), scale, out=out, window=window, chunk=chunk)
        return out

    together = attend(batch.query, tables, [61, 30], [0, 40, 41])
    torch.testing.assert_close(together, reference.paged_attention(
        batch.query, cache, tables, batch.seq_lens, batch.query_start_loc, scale, window, 0.0, None, chunk).float(),
        **TOL[torch.bfloat16])
    rounded = cpu_ops.paged_attention(batch.query, cache, tables, batch.seq_lens, batch.query_start_loc, scale,
                                      window=window, chunk=chunk)
    assert torch.equal(rounded, together.bfloat16())  # the bf16 output is the float32 one, rounded
    for i in (0, 2, 15, 16, 23, 39):
        pos = 21 + i
        alone = attend(batch.query[i : i + 1], tables[:1], [pos + 1], [0, 1])
        assert torch.equal(alone[0], together[i]), i
        if i >= 2:
            verify = attend(batch.query[i - 2 : i + 1], tables[:1], [pos + 1], [0, 3])
            assert torch.equal(verify[2], together[i]), i


@pytest.mark.parametrize("path", ["amx", "avx512"])
def test_bf16_path_sums_a_score_in_its_own_order(path, monkeypatch):
    """Which path ran, told by a score whose fp32 sum depends on its order: q . k = 2^30 (dims 0) + 1 (dim 2)
    - 2^30 (dim 32). AMX adds dim pairs in order, 16 a tile step, so 2^30 + 1 rounds to 2^30 and the score is
    0; avx512_bf16 puts pairs 0 and 16 in one lane (they cancel) and pair 1 in another: the score is 1. Every
    other score is 0, so the output is V's mean, or weights with e on that key. (Both are valid fp32 sums: the
    point is that a process takes one path for every call.)"""
    use_c_attention_path(path, monkeypatch)
    head_dim = 64
    cache = torch.zeros(2, 2, 16, 1, head_dim)
    cache[1] = torch.randn(2, 16, 1, head_dim, generator=torch.Generator().manual_seed(0))
    key = cache[0, 1, 5, 0]
    key[0], key[2], key[32] = 2.0**15, 1.0, -(2.0**15)
    query = torch.zeros(1, 1, head_dim)
    query[0, 0, 0], query[0, 0, 2], query[0, 0, 32] = 2.0**15, 1.0, 2.0**15
    cache, query = cache.bfloat16(), query.bfloat16()
    out = cpu_ops.paged_attention(query, cache, torch.tensor([[1]], dtype=torch.int32),
                                  torch.tensor([16], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)
    values = cache[1, 1, :, 0].float()
    weights = torch.ones(16)
    if path == "avx512" and (cpu_gemm.best_isa(torch.bfloat16) or 0) >= 3:  # the CPU has avx512_bf16
        weights[5] = torch.e
    expected = (weights.bfloat16().float()[:, None] * values).sum(0) / weights.bfloat16().float().sum()
    torch.testing.assert_close(out[0, 0].float(), expected, rtol=0, atol=4e-3)


@pytest.mark.parametrize("q_lens, seq_lens", [([1, 1], [40, 23]), ([7, 20], [30, 20])])
def test_paged_attention_with_scores_far_below_the_max(q_lens, seq_lens):
    """Scores more than 87 below the running max take exp_nonpos's underflow select (0): a large
    scale spreads the scores over thousands, so most keys underflow and a few dominate, and blocks
    whose max is far below an earlier one rescale the accumulator by exp(-large) = 0."""
    batch = make_batch(q_lens, seq_lens, 6, 3)
    args = (*batch.args()[:5], 40.0)
    expected = reference.paged_attention(*args)
    got = cpu_ops.paged_attention(*args)
    assert not got.isnan().any()
    # Scores of ~1e3 carry ~1e-4 of summation-order error into exp: looser than TOL (the code before
    # the branch-free exp differed from the reference by the same 3e-5).
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_paged_attention_block_sizes(block_size):
    batch = make_batch([1, 7, 20], [9, 30, 20], 6, 3, block_size=block_size)
    torch.testing.assert_close(cpu_ops.paged_attention(*batch.args()), reference.paged_attention(*batch.args()),
                               **TOL[torch.float32])


def test_paged_attention_reads_a_strided_query_and_threads_agree():
    """The model passes q as a view of the qkv matmul's output (token stride > heads * head_dim);
    one thread and two give the same numbers (work items never share outputs)."""
    batch = make_batch([3, 1, 12], [10, 21, 12], 4, 2)
    qkv = torch.randn(batch.query.shape[0], 8, HEAD_DIM)
    qkv[:, :4] = batch.query
    strided = qkv[:, :4]
    assert not strided.is_contiguous()
    args = (batch.layer_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    expected = reference.paged_attention(batch.query, *args)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_attention(strided, *args)
        torch.set_num_threads(2)
        two = cpu_ops.paged_attention(strided, *args)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype) if with_residual else None
    ref_residual = residual.clone() if with_residual else None
    expected = reference.rms_norm(x.clone(), weight, 1e-5, ref_residual)
    got = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    if with_residual:  # the skip connection is updated in place to residual + x
        assert torch.equal(residual, ref_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference_on_strided_heads(dtype):
    gen = torch.Generator().manual_seed(2)
    head_dim, max_pos = 64, 300
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
    qkv = torch.randn(11, 15, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (11,), generator=gen)
    expected = qkv.clone()
    reference.rotary(expected[:, :12], positions, cos_sin)
    got = qkv.clone()
    assert cpu_ops.rotary(got[:, :12], positions, cos_sin)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    assert torch.equal(got[:, 12:], qkv[:, 12:])  # the v heads are not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    x = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends: no overflow, no NaN
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("n, k", [(1536, 576), (577, 1536), (7, 13), (1, 8)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_linear_small_m_matches_f_linear_and_is_batch_invariant(n, k, rows):
    """Up to 8 rows of float32 x against an nn.Linear weight: equal to F.linear within fp32 rounding
    (odd N, K not a multiple of 8: the pair and lane tails), and each row's result is bit-identical
    whatever the other rows are (a request's logits do not depend on its batch)."""
    g = torch.Generator().manual_seed(n + k + rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    got = cpu_ops.linear_small_m(x, w)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    for r in range(rows):
        assert torch.equal(cpu_ops.linear_small_m(x[r:r + 1], w)[0], got[r])
    strided = torch.randn(rows, 2 * k, generator=g)[:, :k]  # a row stride other than k
    torch.testing.assert_close(cpu_ops.linear_small_m(strided, w), torch.nn.functional.linear(strided, w),
                               rtol=1e-4, atol=1e-4)


def test_linear_routes_decode_batches_to_the_small_m_kernel(monkeypatch):
    """engine.linear.Linear sends 2-8 float32 rows (leading dims flattened) to the C kernel and the rest
    (one row: MKL's matrix-vector path is as fast; prefill-sized batches: MKL's GEMM) to F.linear."""
    from pdcluster.engine.linear import Linear

    calls = []
    real = cpu_ops.linear_small_m
    monkeypatch.setattr(cpu_ops, "linear_small_m", lambda x, w: calls.append(x.shape) or real(x, w))
    lin = Linear(torch.randn(64, 32))
    for shape in [(1, 32), (2, 32), (2, 4, 32), (8, 32), (9, 32), (128, 32)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=1e-4, atol=1e-4)
    assert calls == [(2, 32), (2, 4, 32), (8, 32)]
    assert cpu_ops.linear_small_m(torch.randn(9, 32), lin.weight) is None
    assert cpu_ops.linear_small_m(torch.randn(2, 32, dtype=torch.float64), lin.weight.double()) is None


def test_lm_head_float32_packing_serves_decode_batches_and_leaves_big_inputs_to_mkl(monkeypatch):
    """pack_float32 (the LM head): up to PACKED_F32_MAX_ROWS float32 rows go through the oneDNN copy,
    more (prompt logprobs) through F.linear on the plain weight, kept beside it; results agree."""
    from pdcluster.engine import linear as linear_mod

    if not linear_mod._can_prepack(torch.float32):
        pytest.skip("this torch has no oneDNN linear")
    packed_calls = []
    real = linear_mod._linear_pointwise
    monkeypatch.setattr(linear_mod, "_linear_pointwise", lambda x, *a: packed_calls.append(x.shape) or real(x, *a))
    w = torch.randn(300, 48, generator=torch.Generator().manual_seed(5))
    lin = linear_mod.Linear(w, keep_weight=True, pack_float32=True)
    assert lin.weight is w and lin._packed_f32 is not None
    limit = linear_mod.PACKED_F32_MAX_ROWS
    for rows in (1, 8, 32, limit, limit + 1, 200):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    assert packed_calls == [(1, 48), (8, 48), (32, 48), (limit, 48)]
    big = torch.randn(200, 48)
    assert torch.equal(lin(big), torch.nn.functional.linear(big, w))  # MKL on the plain weight
    assert linear_mod.Linear(w)._packed_f32 is None  # only where asked (the layers keep MKL)


def test_ops_route_cpu_tensors_to_the_c_kernels(monkeypatch):
    batch = make_batch([1, 4], [6, 9], 4, 2)
    called = []
    for name in ("paged_attention", "rms_norm", "rotary", "silu_and_mul", "write_kv"):
        monkeypatch.setattr(reference, name, lambda *a, _n=name, **k: called.append(_n))
    ops.write_kv(batch.query[:2, :2], batch.query[:2, 2:], batch.layer_cache, torch.tensor([0, 1]))
    ops.paged_attention(*batch.args())
    ops.paged_attention_uniform(batch.query[:2], batch.layer_cache, batch.block_tables, batch.seq_lens, 1, SCALE)
    ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-5)
    ops.rotary(torch.randn(3, 2, 8), torch.arange(3), torch.randn(3, 8))
    ops.silu_and_mul(torch.randn(3, 8))
    assert called == []


def test_without_a_compiler_the_engine_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    cpu_build.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_build.load() is None
        assert "no C compiler" in caplog.text
        batch = make_batch([1, 4], [6, 9], 4, 2)
        assert cpu_ops.paged_attention(*batch.args()) is None
        torch.testing.assert_close(ops.paged_attention(*batch.args()), reference.paged_attention(*batch.args()))
    finally:
        cpu_build.load.cache_clear()


def test_a_failing_build_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_compiler", lambda: "false")  # exits 1: a compiler that fails
    cpu_build.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_build.load() is None
        assert "falling back" in caplog.text
        assert not list(tmp_path.rglob("*.so"))  # no half-written library left to load later
    finally:
        cpu_build.load.cache_clear()


def test_the_build_is_cached_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    cpu_build.load.cache_clear()
    try:
        assert cpu_build.load() is not None
        built = list(tmp_path.rglob("cpu_kernels-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_build.load.cache_clear()
        assert cpu_build.load() is not None
        assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
    finally:
        cpu_build.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_from_strided_views(dtype):
    """K and V arrive as views of the qkv output; a negative slot (padding) writes nothing."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, 4 + 2 * 2, 16, generator=gen).to(dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 17, 0, -1, 9, 22, 5])
    expected = torch.full((2, 6, 4, 2, 16), 7.0, dtype=dtype)
    got = expected.clone()
    keep = slots >= 0
    reference.write_kv(key[keep], value[keep], expected, slots[keep])
    assert cpu_ops.write_kv(key, value, got, slots)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_first_index_on_ties(dtype):
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[1, 2999] = 50.0  # the maximum in the last (partial) chunk
    x[2, 10] = x[2, 2048] = 60.0  # a tie across chunks: the first index wins
    x[3, :] = -1.0  # all equal
    x[4, 1500] = float("-inf")
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))
    assert cpu_ops.argmax_rows(x)[2] == 10 and cpu_ops.argmax_rows(x)[3] == 0


def test_c_kernels_refuse_tensors_outside_host_memory():
    """A GPU engine once handed the C write_kv a CPU key and a CUDA cache and it wrote through the device
    pointer (segfault). Every wrapper now refuses when any tensor it would pass to C is not on the CPU
    ("meta" stands in for CUDA here: no storage, so a dereference would crash this process)."""
    meta = torch.device("meta")
    key = torch.randn(3, 2, HEAD_DIM)
    cache = torch.zeros(2, 4, 16, 2, HEAD_DIM)
    slots = torch.tensor([0, 1, 2])
    assert cpu_ops.write_kv(key, key, cache.to(meta), slots) is False
    assert cpu_ops.write_kv(key, key, cache, slots.to(meta)) is False
    assert cpu_ops.write_kv(key, key, cache, slots) is True  # all on the CPU: the kernel runs
    batch = make_batch([1, 1], [5, 9], 4, 2)
    query, layer_cache, block_tables, seq_lens, query_start_loc, scale = batch.args()
    assert cpu_ops.paged_attention(query, layer_cache, block_tables.to(meta), seq_lens, query_start_loc, scale) is None
    assert cpu_ops.paged_attention(query, layer_cache, block_tables, seq_lens.to(meta), query_start_loc, scale) is None
    assert cpu_ops.paged_attention(query, layer_cache.to(meta), block_tables, seq_lens, query_start_loc, scale) is None
    x, w = torch.randn(4, 64), torch.ones(64)
    assert cpu_ops.rms_norm(x, w.to(meta), 1e-6) is None
    assert cpu_ops.rms_norm(x, w, 1e-6, out=torch.empty(4, 64, device=meta)) is None
    heads = torch.randn(3, 2, HEAD_DIM)
    cos_sin = torch.randn(32, HEAD_DIM)
    assert cpu_ops.rotary(heads, torch.tensor([0, 1, 2]).to(meta), cos_sin) is False
    assert cpu_ops.rotary(heads, torch.tensor([0, 1, 2]), cos_sin.to(meta)) is False
    assert cpu_ops.silu_and_mul(torch.randn(3, 8, device=meta)) is None
    assert cpu_ops.argmax_rows(torch.randn(3, 8, device=meta)) is None
    assert cpu_ops.linear_small_m(torch.randn(2, 64), torch.randn(32, 64, device=meta)) is None


def test_cpu_amx_off_keeps_a_process_off_tiles():
    """PDCLUSTER_CPU_AMX=0 (a fleet of AMX and older CPUs that must compute the same bits) takes both the linear
    and attention off AMX tiles for the whole process; without it an AMX CPU uses them for both."""
    code = ("import torch; from pdcluster.kernels import cpu_gemm, cpu_ops, numerics; "
            "print(int(cpu_ops.attention_amx()), cpu_gemm.best_isa(torch.bfloat16), "
            "numerics.describe('cpu', torch.bfloat16).replace(' ', '_'))")
    env = {**os.environ, "PDCLUSTER_CPU_AMX": "0"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    isa = min(cpu_gemm.best_isa(torch.bfloat16) or 0, 3)
    assert off.stdout.split() == ["0", str(isa), "cpu_bfloat16_avx512_bf16" if isa == 3 else "cpu_bfloat16_generic"]
    # The name a worker tells its KV peers (kernels/numerics.py) follows the path this process takes.
    assert numerics.describe("cpu", torch.float32) == "cpu float32"
    if cpu_ops.attention_amx():
        assert cpu_gemm.best_isa(torch.bfloat16) == 4
        assert numerics.describe("cpu", torch.bfloat16) == "cpu bfloat16 amx"
