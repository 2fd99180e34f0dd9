"""Elementwise Triton kernels (RMSNorm with the fused residual add, rotary embedding, SiLU-and-mul)
== torch reference, under the interpreter (TRITON_INTERPRET=1, set in conftest.py), and their
dispatch in ops.py.

Shapes are tiny: one program per token row, and the interpreter costs about 1 ms per program.

bf16 tolerances: the interpreter (triton 3.9) truncates fp32 -> bf16 where a GPU (and torch) rounds
to nearest even, so each rounding step of a kernel may land one bf16 ulp (<= 2**-7 relative) away
from the reference's. A kernel that gets anything else wrong (a missing weight, a swapped half, a
wrong stride) is off by far more.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import cpu_ops, ops, reference
from pdcluster.kernels.triton_rms_norm import rms_norm_triton
from pdcluster.kernels.triton_rotary import rotary_triton
from pdcluster.kernels.triton_silu_and_mul import silu_and_mul_triton

EPS = 1e-6
NUM_TOKENS = 5
HIDDEN = 64
BF16_ULP = 2**-7  # relative size of one bf16 ulp, at most

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _assert_close(got: torch.Tensor, expected: torch.Tensor, roundings: int = 1) -> None:
    """fp32: up to reordering of the fp32 math; bf16: one ulp per rounding step (module doc)."""
    assert got.dtype == expected.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=roundings * BF16_ULP, atol=0)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------------------------------------------
# RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_triton_matches_reference(dtype):
    x = _randn(NUM_TOKENS, HIDDEN, dtype=dtype, seed=0) * 3
    weight = _randn(HIDDEN, dtype=dtype, seed=1)
    expected = reference.rms_norm(x.clone(), weight, EPS)
    x_before = x.clone()
    got = rms_norm_triton(x, weight, EPS)
    assert torch.equal(x, x_before)  # no residual: the input is left alone
    # Two rounding steps (the normalised row to the dtype, then the product with the weight), the first
    # one's ulp carried through the second: 3 ulps.
    _assert_close(got, expected, roundings=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_triton_fused_residual(dtype):
    x = _randn(NUM_TOKENS, HIDDEN, dtype=dtype, seed=2)
    weight = _randn(HIDDEN, dtype=dtype, seed=3)
    residual = _randn(NUM_TOKENS, HIDDEN, dtype=dtype, seed=4) * 2
    expected_residual = residual.clone()
    expected = reference.rms_norm(x, weight, EPS, expected_residual)
    got = rms_norm_triton(x, weight, EPS, residual)
    # The residual now holds residual + x (in place), and the output is the norm of that sum.
    _assert_close(residual, expected_residual)
    _assert_close(got, expected, roundings=4)  # plus the residual sum's rounding


def test_rms_norm_triton_strided_rows_and_odd_hidden():
    """Rows that are views into a wider buffer (row stride 56 > hidden 40; 40 is not a power of two,
    so the tail lanes are masked), residual included, and an fp32 weight on an fp32 row."""
    hidden = 40
    x = _randn(3, 56, dtype=torch.float32, seed=5)[:, 8:48]
    residual_buffer = _randn(3, 56, dtype=torch.float32, seed=6)
    residual = residual_buffer[:, :hidden]
    untouched = residual_buffer[:, hidden:].clone()
    weight = _randn(hidden, dtype=torch.float32, seed=7)
    expected_residual = residual.clone()
    expected = reference.rms_norm(x, weight, EPS, expected_residual)
    got = rms_norm_triton(x, weight, EPS, residual)
    _assert_close(got, expected)
    _assert_close(residual, expected_residual)
    assert torch.equal(residual_buffer[:, hidden:], untouched)


# ---------------------------------------------------------------------------------------------------
# Rotary


def _rotary_case(dtype: torch.dtype):
    """q of a fused projection: [T, 6 heads, 16] of which the first 4 are rotated, as a view whose token
    stride (96) is larger than its heads * head_dim (64). Random cos/sin (not a real RoPE table) so a
    swapped half or a misread position cannot cancel out."""
    head_dim = 16
    buffer = _randn(NUM_TOKENS, 6, head_dim, dtype=dtype, seed=8)
    positions = torch.tensor([3, 0, 17, 9, 3])  # out of order, one repeated
    cos_sin = _randn(20, head_dim, dtype=torch.float32, seed=9)
    return buffer, positions, cos_sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_triton_matches_reference_on_strided_view(dtype):
    buffer, positions, cos_sin = _rotary_case(dtype)
    expected = buffer.clone()
    reference.rotary(expected[:, :4], positions, cos_sin)
    unrotated_heads = buffer[:, 4:].clone()
    view = buffer[:, :4]
    assert view.stride(0) > view.shape[1] * view.shape[2]
    assert rotary_triton(view, positions, cos_sin) is None
    _assert_close(buffer, expected)  # the rotated heads match; heads 4 and 5 stayed as they were
    assert torch.equal(buffer[:, 4:], unrotated_heads)


def test_rotary_triton_int32_positions_and_heads_not_power_of_two():
    buffer, positions, cos_sin = _rotary_case(torch.float32)
    expected = buffer.clone()
    reference.rotary(expected[:, 1:4], positions, cos_sin)
    rotary_triton(buffer[:, 1:4], positions.to(torch.int32), cos_sin)
    _assert_close(buffer, expected)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["cache-fp32", "cache-bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 2), (6, 2), (3, 1)], ids=["gqa2", "gqa3", "mqa3"])
def test_fused_rotary_and_kv_write_equals_the_two_kernels(dtype, cache_dtype, num_q_heads, num_kv_heads):
    """The fused kernel (kernels/triton_rotary_kv.py) on q, k, v views of one qkv row: q and k rotated in
    place and K, V in the cache bit for bit as rotary_triton then write_kv_triton leave them; a negative
    slot (padding) is rotated but not written; v is not touched."""
    from pdcluster.kernels.triton_rotary_kv import rotary_write_kv_triton
    from pdcluster.kernels.triton_write_kv import write_kv_triton

    head_dim, num_heads = 16, num_q_heads + 2 * num_kv_heads
    qkv = _randn(NUM_TOKENS, num_heads, head_dim, dtype=dtype, seed=21)
    positions = torch.tensor([3, 0, 17, 9, 3])
    cos_sin = _randn(20, head_dim, dtype=torch.float32, seed=22)
    slots = torch.tensor([5, -1, 0, 11, 6])
    cache = torch.full((2, 4, 4, num_kv_heads, head_dim), 7.0, dtype=cache_dtype)

    def views(t):
        return t[:, :num_q_heads], t[:, num_q_heads : num_q_heads + num_kv_heads], t[:, num_q_heads + num_kv_heads :]

    want_qkv, want_cache = qkv.clone(), cache.clone()
    q, k, v = views(want_qkv)
    rotary_triton(want_qkv[:, : num_q_heads + num_kv_heads], positions, cos_sin)
    write_kv_triton(k, v, want_cache, slots)
    rotary_write_kv_triton(*views(qkv), positions, cos_sin, cache, slots)
    assert torch.equal(qkv, want_qkv) and torch.equal(cache, want_cache)
    assert cache[:, 0, 1].eq(7.0).all(), "slot 1 is no token's: untouched (the padding token's slot is -1)"


# ---------------------------------------------------------------------------------------------------
# SiLU and mul


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_triton_matches_reference(dtype):
    x = _randn(NUM_TOKENS, 2 * HIDDEN, dtype=dtype, seed=10) * 3
    got = silu_and_mul_triton(x)
    assert got.shape == (NUM_TOKENS, HIDDEN)
    # Two rounding steps (silu(gate) to the dtype, then the product with up): 3 ulps, as for RMSNorm.
    _assert_close(got, reference.silu_and_mul(x), roundings=3)


def test_silu_and_mul_triton_multi_chunk_strided_rows():
    """d = 1100: one full chunk of 1024 columns and a masked tail; rows are views (stride 2208)."""
    d = 1100
    x = _randn(2, 2 * d + 8, dtype=torch.float32, seed=11)[:, : 2 * d]
    _assert_close(silu_and_mul_triton(x), reference.silu_and_mul(x))


# ---------------------------------------------------------------------------------------------------
# Dispatch (ops.py)


def _run_elementwise_ops() -> dict[str, torch.Tensor]:
    """The three elementwise ops once, on fresh copies of fixed inputs, returning what each produced."""
    x = _randn(NUM_TOKENS, HIDDEN, dtype=torch.float32, seed=12)
    weight = _randn(HIDDEN, dtype=torch.float32, seed=13)
    residual = _randn(NUM_TOKENS, HIDDEN, dtype=torch.float32, seed=14)
    results = {"rms_norm": ops.rms_norm(x, weight, EPS)}
    results["rms_norm_residual"] = ops.rms_norm(x, weight, EPS, residual=residual)
    results["residual"] = residual
    buffer, positions, cos_sin = _rotary_case(torch.float32)
    ops.rotary(buffer[:, :4], positions, cos_sin)
    results["rotary"] = buffer
    results["silu_and_mul"] = ops.silu_and_mul(_randn(NUM_TOKENS, 2 * HIDDEN, dtype=torch.float32, seed=15))
    return results


def test_ops_elementwise_triton_route_matches_reference_route(monkeypatch):
    """Force the CUDA branch (whose kernels the interpreter runs on CPU tensors): the Triton kernels
    are reached before the C kernels and the reference, and give the same results."""
    expected = _run_elementwise_ops()
    monkeypatch.setattr(ops, "_use_triton", lambda *tensors: True)
    for name in ("rms_norm", "rotary", "silu_and_mul"):
        monkeypatch.setattr(reference, name, None)  # neither fallback may be reached
        monkeypatch.setattr(cpu_ops, name, None)
    got = _run_elementwise_ops()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_llama_layers_on_the_triton_route_fuse_rotary_and_kv_write(monkeypatch):
    """The decoder layer's CUDA branch, forced on CPU tensors (the interpreter runs every kernel): one fused
    rotary + KV-write launch a layer, and the same greedy tokens as the CPU route."""
    from conftest import make_engine
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.kernels import triton_rotary_kv

    engine = make_engine("tiny-random", dtype="float32", num_kv_blocks=32, max_model_len=128)
    prompts = [[5, 17, 300, 42, 7, 99, 1000], [8, 8, 31]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(prompts, params)]
    calls = []
    real = triton_rotary_kv.rotary_write_kv_triton
    monkeypatch.setattr(triton_rotary_kv, "rotary_write_kv_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ops, "_use_triton", lambda *tensors: True)
    monkeypatch.setattr(reference, "rotary", None)  # the separate rotary must not run
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert len(calls) >= engine.arch.num_layers * 4, "every layer of every step took the fused kernel"
