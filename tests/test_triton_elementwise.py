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
