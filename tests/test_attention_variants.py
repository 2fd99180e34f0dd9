"""Sliding-window attention (each query sees its last ``window`` positions), Gemma 2's soft-capped scores
(softcap * tanh(s / softcap)), gpt-oss's attention sinks (one value-less logit per head) and Llama 4's chunked
attention (each query sees its own chunk of positions) in every attention kernel: the torch reference against dense attention, the C kernel (generic and avx512_bf16 paths) and the Triton
kernel (interpreted; every launch shape: fixed tiles, fast prefill, split decode) against the reference; batch
invariance of a query's bits. Models with windows, caps and sinks served past them equal transformers in
tests/test_model_families.py.

Batches come from test_kernels.make_batch: NaN in every cache slot a request must not read, so a kernel that
reads outside a request's blocks fails; windows reach back across block and key-tile boundaries.
"""

from __future__ import annotations

import torch
import pytest

from pdcluster.kernels import cpu_ops, reference
from pdcluster.kernels import triton_paged_attention as attention
from test_kernels import C_BF16_PATHS, HEAD_DIM, SCALE, make_batch, triton_next_pow2, use_c_attention_path

CASES = [
    pytest.param([1, 1, 1], [13, 4, 40], id="decode"),
    pytest.param([3, 3], [9, 30], id="verify"),
    pytest.param([10, 1, 0, 4], [37, 13, 5, 4], id="mixed"),
    pytest.param([23], [23], id="prefill-fresh"),
    pytest.param([17, 6], [70, 6], id="prefill-chunk-with-prefix"),
]
WINDOWS = [1, 3, 8, 17]


def _dense(batch, q_lens, window, softcap=0.0, sinks=None, chunk=0):
    """Plain softmax attention per query over its window, from the dense K/V the batch was made from (with
    ``sinks``: each head's sink logit one more column of the softmax, dropped before the values)."""
    out = torch.empty_like(batch.query, dtype=torch.float32)
    starts = batch.query_start_loc.tolist()
    group = batch.query.shape[1] // batch.dense_kv[0][0].shape[1]
    for r, (k, v) in enumerate(batch.dense_kv):
        seq_len = k.shape[0]
        for i in range(q_lens[r]):
            pos = seq_len - q_lens[r] + i
            lo = max(0, pos - window + 1) if window > 0 else 0
            if chunk > 0:  # Llama 4's chunked attention: the query's own chunk only
                lo = max(lo, pos // chunk * chunk)
            kk = k[lo : pos + 1].float().repeat_interleave(group, 1)  # [n, Hq, D]
            vv = v[lo : pos + 1].float().repeat_interleave(group, 1)
            q = batch.query[starts[r] + i].float()  # [Hq, D]
            scores = torch.einsum("hd,nhd->hn", q, kk) * SCALE
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                weights = torch.cat([scores, sinks.float()[:, None]], dim=-1).softmax(-1)[:, :-1]
            else:
                weights = scores.softmax(-1)
            out[starts[r] + i] = torch.einsum("hn,nhd->hd", weights, vv)
    return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("q_lens, seq_lens", CASES)
def test_reference_equals_dense(q_lens, seq_lens, window):
    batch = make_batch(q_lens, seq_lens, 4, 2)
    got = reference.paged_attention(*batch.args(), window)
    torch.testing.assert_close(got, _dense(batch, q_lens, window), rtol=1e-5, atol=1e-5)
    # A window as long as the context is plain causal attention.
    torch.testing.assert_close(reference.paged_attention(*batch.args(), max(seq_lens)),
                               reference.paged_attention(*batch.args()), rtol=0, atol=0)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("q_lens, seq_lens", CASES)
def test_c_kernel_equals_reference(q_lens, seq_lens, window, dtype):
    batch = make_batch(q_lens, seq_lens, 6, 2, dtype=dtype)
    got = cpu_ops.paged_attention(*batch.args(), window=window)
    assert got is not None and not got.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), reference.paged_attention(*batch.args(), window).float(), **tol)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")
@pytest.mark.parametrize("path", C_BF16_PATHS)
@pytest.mark.parametrize("window", [5, 16, 33])
def test_c_bf16_paths_equal_reference(window, path, monkeypatch):
    """bf16, block size 16, head_dim 64: AMX tiles and the avx512_bf16 path where the CPU has them (window masks
    within a 16-key block), the generic loop."""
    use_c_attention_path(path, monkeypatch)
    q_lens, seq_lens = [1, 9, 20], [70, 50, 20]
    batch = make_batch(q_lens, seq_lens, 9, 3, dtype=torch.bfloat16, block_size=16, head_dim=64)
    args = (*batch.args()[:5], 64**-0.5)
    got = cpu_ops.paged_attention(*args, window=window)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), reference.paged_attention(*args, window).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype,block_size,head_dim,path", [(torch.float32, 4, HEAD_DIM, "generic"),
                                                             (torch.bfloat16, 16, 64, "amx"),
                                                             (torch.bfloat16, 16, 64, "avx512")])
def test_c_kernel_is_batch_invariant(dtype, block_size, head_dim, path, monkeypatch):
    """A query's bits are the same in a prefill chunk, in a decode step, alone or beside other requests."""
    use_c_attention_path(path, monkeypatch)
    window = 11
    batch = make_batch([20, 1], [45, 30], 4, 2, dtype=dtype, block_size=block_size, head_dim=head_dim)
    args = (batch.layer_cache,)
    chunk = cpu_ops.paged_attention(batch.query, *args, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                    SCALE, window=window)
    for i in (0, 7, 19):  # query i of request 0 alone, as a decode step at its position
        one = cpu_ops.paged_attention(batch.query[i : i + 1], *args, batch.block_tables[:1],
                                      torch.tensor([45 - 20 + i + 1], dtype=torch.int32),
                                      torch.tensor([0, 1], dtype=torch.int32), SCALE, window=window)
        assert torch.equal(one[0], chunk[i])


# Every window in the deterministic mode; the fast mode's tiles at one window in the default suite, all in the slow.
@pytest.mark.parametrize("mode, window", [("deterministic", w) for w in (1, 8, 40)] + [("fast", 8)]
                         + [pytest.param("fast", w, marks=pytest.mark.slow) for w in (1, 40)])
def test_triton_equals_reference(mode, window):
    q_lens, seq_lens = [1, 10, 0, 4, 1], [13, 170, 5, 4, 300]
    batch = make_batch(q_lens, seq_lens, 4, 2)
    got = attention.paged_attention_triton(*batch.args(), batch_invariant=mode == "deterministic", window=window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, reference.paged_attention(*batch.args(), window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split,segments", [(True, 0), (True, 4), (False, 0)], ids=["partitions", "segments", "one"])
def test_triton_launch_shapes_equal_reference(split, segments):
    """Each launch shape (partitions merged by a second kernel, segments, merged in the program) with windows
    that start partitions and key tiles past the first."""
    _launch_shapes_equal_reference(split, segments, [dict(window=window) for window in (5, 64, 130)])


def _launch_shapes_equal_reference(split: bool, segments: int, variants: list[dict]) -> None:
    """One launch shape of the Triton kernel against the reference for each of ``variants`` (the attention's
    window / softcap / sinks / chunk keywords), on requests whose contexts span several partitions."""
    batch = make_batch([1, 3, 1], [150, 300, 40], 6, 2, block_size=8)
    for variant in variants:
        out = torch.full_like(batch.query, float("nan"))
        attention.launch(*batch.args(), out, attention.block_q_for(triton_next_pow2(3)), 16, split=split,
                         segments=segments, **variant)
        torch.testing.assert_close(out, reference.paged_attention(*batch.args(), **variant), rtol=1e-5, atol=1e-5)


def test_triton_deterministic_is_batch_invariant():
    window = 37
    batch = make_batch([20, 1], [200, 30], 4, 2, block_size=8)
    chunk = attention.paged_attention_triton(*batch.args(), window=window)
    for i in (0, 19):
        one = attention.paged_attention_triton(batch.query[i : i + 1], batch.layer_cache, batch.block_tables[:1],
                                               torch.tensor([200 - 20 + i + 1], dtype=torch.int32),
                                               torch.tensor([0, 1], dtype=torch.int32), SCALE, window=window)
        assert torch.equal(one[0], chunk[i])


# ---- soft-capped scores (Gemma 2) -------------------------------------------------------------------------

CAP = 1.5  # below the scores' spread (|s| up to ~4 here), so the cap changes the weights


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("q_lens, seq_lens", CASES)
def test_softcap_reference_equals_dense(q_lens, seq_lens, window):
    batch = make_batch(q_lens, seq_lens, 4, 2)
    got = reference.paged_attention(*batch.args(), window, CAP)
    torch.testing.assert_close(got, _dense(batch, q_lens, window, CAP), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, reference.paged_attention(*batch.args(), window), atol=1e-3)  # the cap bites


@pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype,block_size,head_dim", [(torch.float32, 4, HEAD_DIM), (torch.bfloat16, 16, 64)])
@pytest.mark.parametrize("window", [0, 8])
def test_softcap_c_kernel_equals_reference(dtype, block_size, head_dim, window):
    """bf16 at block 16 / head_dim 64 would take the avx512_bf16 path: soft-capped layers take the generic one."""
    batch = make_batch([1, 10, 4], [40, 37, 4], 6, 2, dtype=dtype, block_size=block_size, head_dim=head_dim)
    got = cpu_ops.paged_attention(*batch.args(), window=window, softcap=CAP)
    expected = reference.paged_attention(*batch.args(), window, CAP)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


# The cap is one line both modes share; the fast mode's tiles (12 s interpreted) in the slow pass.
@pytest.mark.parametrize("mode", ["deterministic", pytest.param("fast", marks=pytest.mark.slow)])
def test_softcap_triton_equals_reference(mode):
    batch = make_batch([1, 10, 0, 4, 1], [13, 170, 5, 4, 300], 4, 2)
    for window in (0, 40):
        got = attention.paged_attention_triton(*batch.args(), batch_invariant=mode == "deterministic", window=window,
                                               softcap=CAP)
        torch.testing.assert_close(got, reference.paged_attention(*batch.args(), window, CAP), rtol=1e-5, atol=1e-5)


# ---- attention sinks (gpt-oss) ------------------------------------------------------------------------------


def _sinks(num_q_heads: int) -> torch.Tensor:
    """Sink logits at the scores' scale, one far above them (that head's rows are mostly sink: the fold's
    new-max branch) and one far below (a no-op head)."""
    sinks = 2.0 * torch.randn(num_q_heads, generator=torch.Generator().manual_seed(7))
    sinks[0], sinks[-1] = 9.0, -30.0
    return sinks


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("q_lens, seq_lens", CASES)
def test_sinks_reference_equals_dense(q_lens, seq_lens, window):
    batch = make_batch(q_lens, seq_lens, 4, 2)
    sinks = _sinks(4)
    got = reference.paged_attention(*batch.args(), window, 0.0, sinks)
    torch.testing.assert_close(got, _dense(batch, q_lens, window, sinks=sinks), rtol=1e-5, atol=1e-5)
    plain = reference.paged_attention(*batch.args(), window)
    assert not torch.allclose(got[:, 0], plain[:, 0], atol=1e-3)  # the sinks bite
    torch.testing.assert_close(got[:, -1], plain[:, -1], rtol=1e-5, atol=1e-6)  # a sink of -30 weighs nothing


@pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype,block_size,head_dim", [(torch.float32, 4, HEAD_DIM), (torch.bfloat16, 16, 64)])
@pytest.mark.parametrize("window", [0, 8])
def test_sinks_c_kernel_equals_reference_and_is_batch_invariant(dtype, block_size, head_dim, window):
    """bf16 at block 16 / head_dim 64 would take the avx512_bf16 path: layers with sinks take the generic one.
    A query's bits are the same in a prefill chunk and as a decode step alone (the sink folds in per row)."""
    batch = make_batch([1, 10, 4], [40, 37, 4], 6, 2, dtype=dtype, block_size=block_size, head_dim=head_dim)
    sinks = _sinks(6)
    got = cpu_ops.paged_attention(*batch.args(), window=window, sinks=sinks)
    expected = reference.paged_attention(*batch.args(), window, 0.0, sinks)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    for i in (0, 6):  # token i of request 1 (10 new tokens over 27 cached) alone, as a decode step
        one = cpu_ops.paged_attention(batch.query[1 + i : 2 + i], batch.layer_cache, batch.block_tables[1:2],
                                      torch.tensor([37 - 10 + i + 1], dtype=torch.int32),
                                      torch.tensor([0, 1], dtype=torch.int32), batch.args()[5], window=window,
                                      sinks=sinks)
        assert torch.equal(one[0], got[1 + i])


@pytest.mark.parametrize("split,segments", [(True, 0), (True, 4), (False, 0)], ids=["partitions", "segments", "one"])
def test_sinks_triton_launch_shapes_equal_reference(split, segments):
    """The sink folds in wherever a row's state ends: in the program (one), in the partition merge, in the
    segment merge; with a window and without."""
    _launch_shapes_equal_reference(split, segments, [dict(window=window, sinks=_sinks(6)) for window in (0, 64)])


def test_sinks_triton_deterministic_equals_reference_and_is_batch_invariant():
    batch = make_batch([1, 10, 0, 4, 1], [13, 170, 5, 4, 300], 4, 2)
    sinks = _sinks(4)
    got = attention.paged_attention_triton(*batch.args(), sinks=sinks)
    torch.testing.assert_close(got, reference.paged_attention(*batch.args(), 0, 0.0, sinks), rtol=1e-5, atol=1e-5)
    for i in (0, 9):  # token i of request 1 alone, as a decode step at its position
        one = attention.paged_attention_triton(batch.query[1 + i : 2 + i], batch.layer_cache, batch.block_tables[1:2],
                                               torch.tensor([170 - 10 + i + 1], dtype=torch.int32),
                                               torch.tensor([0, 1], dtype=torch.int32), SCALE, sinks=sinks)
        assert torch.equal(one[0], got[1 + i])


# ---- chunked attention (Llama 4's local layers) -----------------------------------------------------------------

CHUNKS = [4, 16, 40]  # inside a block, a block's size, across blocks and key tiles


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("q_lens, seq_lens", CASES)
def test_chunked_reference_equals_dense(q_lens, seq_lens, chunk):
    batch = make_batch(q_lens, seq_lens, 4, 2)
    got = reference.paged_attention(*batch.args(), 0, 0.0, None, chunk)
    torch.testing.assert_close(got, _dense(batch, q_lens, 0, chunk=chunk), rtol=1e-5, atol=1e-5)
    # A chunk as long as the context is plain causal attention; a window and a chunk: the later start wins.
    torch.testing.assert_close(reference.paged_attention(*batch.args(), 0, 0.0, None, max(seq_lens)),
                               reference.paged_attention(*batch.args()), rtol=0, atol=0)
    torch.testing.assert_close(reference.paged_attention(*batch.args(), 7, 0.0, None, chunk),
                               _dense(batch, q_lens, 7, chunk=chunk), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype,block_size,head_dim,path", [(torch.float32, 4, HEAD_DIM, "generic"),
                                                             (torch.bfloat16, 16, 64, "amx"),
                                                             (torch.bfloat16, 16, 64, "avx512")])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_c_kernel_equals_reference_and_is_batch_invariant(dtype, block_size, head_dim, chunk, path,
                                                                  monkeypatch):
    """bf16 at block 16 / head_dim 64: AMX tiles and the avx512_bf16 path where the CPU has them."""
    use_c_attention_path(path, monkeypatch)
    batch = make_batch([1, 10, 4], [40, 37, 4], 6, 2, dtype=dtype, block_size=block_size, head_dim=head_dim)
    got = cpu_ops.paged_attention(*batch.args(), chunk=chunk)
    expected = reference.paged_attention(*batch.args(), 0, 0.0, None, chunk)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    for i in (0, 6):  # token i of request 1 (10 new tokens over 27 cached) alone, as a decode step
        one = cpu_ops.paged_attention(batch.query[1 + i : 2 + i], batch.layer_cache, batch.block_tables[1:2],
                                      torch.tensor([37 - 10 + i + 1], dtype=torch.int32),
                                      torch.tensor([0, 1], dtype=torch.int32), batch.args()[5], chunk=chunk)
        assert torch.equal(one[0], got[1 + i])


@pytest.mark.parametrize("split,segments", [(True, 0), (True, 4), (False, 0)], ids=["partitions", "segments", "one"])
def test_chunked_triton_launch_shapes_equal_reference(split, segments):
    """Chunks that start partitions and key tiles past the first (tiles before a chunk are skipped)."""
    _launch_shapes_equal_reference(split, segments, [dict(chunk=chunk) for chunk in (16, 100, 256)])


def test_chunked_triton_deterministic_equals_reference_and_is_batch_invariant():
    batch = make_batch([1, 10, 0, 4, 1], [13, 170, 5, 4, 300], 4, 2)
    got = attention.paged_attention_triton(*batch.args(), chunk=64)
    torch.testing.assert_close(got, reference.paged_attention(*batch.args(), 0, 0.0, None, 64), rtol=1e-5, atol=1e-5)
    for i in (0, 9):  # token i of request 1 alone, as a decode step at its position
        one = attention.paged_attention_triton(batch.query[1 + i : 2 + i], batch.layer_cache, batch.block_tables[1:2],
                                               torch.tensor([170 - 10 + i + 1], dtype=torch.int32),
                                               torch.tensor([0, 1], dtype=torch.int32), SCALE, chunk=64)
        assert torch.equal(one[0], got[1 + i])
