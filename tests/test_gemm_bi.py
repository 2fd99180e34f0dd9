"""The batch-invariant linear (kernels/cpu_gemm.py, kernels/csrc/gemm_bi.c; issue 24): invariant BI,
each output row bit-for-bit independent of the other rows in the call and of the thread count; close
to F.linear; every ISA path this machine has; non-CPU tensors refused. The detector these tests use is
itself checked: it flags a kernel that splits K by the row count, and torch's own bf16 GEMM where that
is batch-variant (it is on our AMD EPYC box at K=1536)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler: the kernel library is unavailable")

DTYPES = [torch.float32, torch.bfloat16]
# (N, K): K odd and not a multiple of any block, N not a multiple of the 16-column strip or a tile
SHAPES = [(83, 37), (1000, 577)]
# 513 and 1030: two and three row blocks (gemm_bi.c's MC), split evenly; 97: one block, not a whole number of tiles
ROWS = list(range(1, 71)) + [97, 513, 1030]


def _isas(dtype: torch.dtype) -> list[int]:
    best = cpu_gemm.best_isa(dtype) if cpu_gemm.available() else 1
    return list(range(1, best + 1))


def _data(n: int, k: int, dtype: torch.dtype, rows: int = 1030, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    return w, x


def rows_that_vary(linear, x: torch.Tensor, row_counts: list[int]) -> dict[int, int]:
    """The detector: {M: how many of the first M rows differ, bitwise, from the same row computed
    alone}, for the row counts where any does."""
    alone = torch.cat([linear(x[r:r + 1]) for r in range(max(row_counts))])
    found = {}
    for m in row_counts:
        differing = int((linear(x[:m]) != alone[:m]).any(dim=1).sum())
        if differing:
            found[m] = differing
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
def test_bi_each_row_is_the_same_as_alone(dtype, n, k):
    w, x = _data(n, k, dtype)
    packed = cpu_gemm.pack_bi(w)
    for isa in _isas(dtype):
        if isa == 1 and n * k > 10_000:
            continue  # the scalar path is slow; its invariance is checked on the small shape
        for out_dtype in {dtype, torch.float32}:
            found = rows_that_vary(lambda v: cpu_gemm.linear_bi(v, packed, out_dtype=out_dtype, isa=isa), x, ROWS)
            assert found == {}, f"isa {cpu_gemm.ISA_NAMES[isa]}, out {out_dtype}: rows differ {found}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bi_the_same_on_any_thread_count(dtype):
    w, x = _data(1000, 577, dtype)
    packed = cpu_gemm.pack_bi(w)
    for m in (1, 3, 7, 64, 513):
        one = cpu_gemm.linear_bi(x[:m], packed, num_threads=1)
        for threads in (2, 3):
            assert torch.equal(cpu_gemm.linear_bi(x[:m], packed, num_threads=threads), one), (m, threads)


def test_bi_float32_is_the_same_on_every_path():
    """fp32 is one fma per k in increasing k on every path: AVX-512, AVX2 and scalar agree bitwise
    (so fp32 results do not depend on which of these machines serves them)."""
    w, x = _data(83, 37, torch.float32, rows=70)
    packed = cpu_gemm.pack_bi(w)
    results = [cpu_gemm.linear_bi(x, packed, isa=isa) for isa in _isas(torch.float32)]
    for other in results[1:]:
        assert torch.equal(other, results[0])


def test_bi_bfloat16_avx2_matches_scalar():
    if cpu_gemm.best_isa(torch.bfloat16) < 2:
        pytest.skip("no AVX2 path on this machine")
    w, x = _data(83, 37, torch.bfloat16, rows=70)
    packed = cpu_gemm.pack_bi(w)
    assert torch.equal(cpu_gemm.linear_bi(x, packed, isa=1, out_dtype=torch.float32),
                       cpu_gemm.linear_bi(x, packed, isa=2, out_dtype=torch.float32))


@pytest.mark.parametrize("n,k", SHAPES)
def test_float32_close_to_f_linear(n, k):
    w, x = _data(n, k, torch.float32, rows=70)
    packed = cpu_gemm.pack_bi(w)
    ref = F.linear(x.double(), w.double()).float()
    for isa in _isas(torch.float32):
        y = cpu_gemm.linear_bi(x, packed, isa=isa)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(cpu_gemm.linear_bi(x, packed), F.linear(x, w), rtol=1e-5,
                               atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("n,k", SHAPES)
def test_bfloat16_close_to_f_linear_and_rounded_like_torch(n, k):
    w, x = _data(n, k, torch.bfloat16, rows=70)
    packed = cpu_gemm.pack_bi(w)
    exact = F.linear(x.double(), w.double())
    for isa in _isas(torch.bfloat16):
        y32 = cpu_gemm.linear_bi(x, packed, isa=isa, out_dtype=torch.float32)
        # bf16 products are exact in fp32: only the fp32 sums round
        torch.testing.assert_close(y32.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
        y = cpu_gemm.linear_bi(x, packed, isa=isa)
        assert y.dtype is torch.bfloat16
        assert torch.equal(y, y32.to(torch.bfloat16))  # round to nearest even, as torch does
    torch.testing.assert_close(cpu_gemm.linear_bi(x, packed), F.linear(x, w), rtol=1.6e-2, atol=1e-2)


def test_leading_dims_and_strided_rows():
    w, x = _data(83, 37, torch.bfloat16, rows=12)
    packed = cpu_gemm.pack_bi(w)
    wide = torch.zeros(12, 50, dtype=torch.bfloat16)
    wide[:, :37] = x
    strided = wide[:, :37]  # rows 50 apart
    assert torch.equal(cpu_gemm.linear_bi(strided, packed), cpu_gemm.linear_bi(x, packed))
    assert torch.equal(cpu_gemm.linear_bi(x.view(3, 4, 37), packed), cpu_gemm.linear_bi(x, packed).view(3, 4, 83))
    assert cpu_gemm.linear_bi(x[:0], packed).shape == (0, 83)


AMX = cpu_gemm.available() and cpu_gemm.best_isa(torch.bfloat16) == 4


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this machine (or the kernel refused them)")
@pytest.mark.parametrize("n,k", [(100, 576), (33, 64), (1000, 576)])  # 1000 x 576: several panels
def test_amx_reads_whole_k_steps_in_place(n, k):
    """K a multiple of the tile's 32: rows are read where they lie (SHAPES' odd K goes through the zero-padded
    copy), in 16-row tiles and then one shorter tile for the last rows. Rows 64 apart from the caller's wider
    buffer, each the same as alone, on any thread count, and within fp32 rounding of the exact products."""
    w, x = _data(n, k, torch.bfloat16, rows=97)
    packed = cpu_gemm.pack_bi(w)
    wide = torch.zeros(97, k + 64, dtype=torch.bfloat16)
    wide[:, :k] = x
    strided = wide[:, :k]
    amx = lambda v: cpu_gemm.linear_bi(v, packed, isa=4, out_dtype=torch.float32)  # noqa: E731
    assert rows_that_vary(amx, strided, list(range(1, 40)) + [97]) == {}
    assert torch.equal(amx(strided), amx(x))
    assert torch.equal(cpu_gemm.linear_bi(x, packed, isa=4, num_threads=3), cpu_gemm.linear_bi(x, packed, isa=4,
                                                                                                num_threads=1))
    exact = F.linear(x.double(), w.double())
    torch.testing.assert_close(amx(x).double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


@pytest.mark.parametrize("k", [37, 576])
def test_a_nan_row_stays_in_its_row(k):
    """A row of NaN (an uninitialised padding row, say) changes no other row on any path: a tile that read
    past its row's end into the next one would carry it there (NaN times a zero-padded weight is NaN)."""
    w, x = _data(83, k, torch.bfloat16, rows=40)
    packed = cpu_gemm.pack_bi(w)
    poisoned = x.clone()
    poisoned[16] = float("nan")
    for isa in _isas(torch.bfloat16):
        clean = cpu_gemm.linear_bi(x, packed, isa=isa)
        y = cpu_gemm.linear_bi(poisoned, packed, isa=isa)
        keep = torch.arange(40) != 16
        assert torch.equal(y[keep], clean[keep]), cpu_gemm.ISA_NAMES[isa]
        assert y[16].isnan().all()


def test_refuses_what_c_does_not_handle():
    w, x = _data(83, 37, torch.bfloat16, rows=4)
    packed = cpu_gemm.pack_bi(w)
    assert cpu_gemm.linear_bi(x.float(), packed) is None  # dtype other than the weight's
    assert cpu_gemm.linear_bi(x[:, :36], packed) is None  # wrong in_features
    assert cpu_gemm.pack_bi(w.to(torch.float16)) is None
    meta_x = torch.empty(4, 37, dtype=torch.bfloat16, device="meta")
    assert cpu_gemm.linear_bi(meta_x, packed) is None  # never a device pointer into C
    assert cpu_gemm.pack_bi(w.to("meta")) is None
    meta_packed = cpu_gemm.PackedWeight(packed.data.to("meta"), 83, 37)
    assert cpu_gemm.linear_bi(x, meta_packed) is None
    with pytest.raises(ValueError, match="refused isa"):
        cpu_gemm.linear_bi(x, packed, isa=cpu_gemm.best_isa(torch.bfloat16) + 1)
    with pytest.raises(ValueError, match="refused isa"):  # AMX tiles here hold bfloat16 only
        cpu_gemm.linear_bi(x.float(), cpu_gemm.pack_bi(w.float()), isa=4)


def test_the_detector_flags_a_kernel_whose_k_split_depends_on_the_rows():
    """Mutation check: the same kernel, but with rows > 1 summing K in two halves (a split-K chosen by
    the batch size) must be caught."""
    w, x = _data(83, 577, torch.float32, rows=70)
    halves = cpu_gemm.pack_bi(w[:, :288]), cpu_gemm.pack_bi(w[:, 288:])
    whole = cpu_gemm.pack_bi(w)

    def split_k_when_batched(v):
        if v.shape[0] == 1:
            return cpu_gemm.linear_bi(v, whole)
        return cpu_gemm.linear_bi(v[:, :288].contiguous(), halves[0]) + cpu_gemm.linear_bi(v[:, 288:].contiguous(), halves[1])

    assert rows_that_vary(split_k_when_batched, x, [2, 17, 70])


def test_the_detector_sees_torch_bf16_gemm_vary_where_it_does():
    """torch's bf16 F.linear (oneDNN) at the MLP down projection's shape (576 x 1536): on our EPYC it
    changes rows with the batch (bench/gemm_bi.py --variance); ours on the same rows does not."""
    torch.manual_seed(0)
    w = (torch.randn(576, 1536) * 0.05).bfloat16()
    x = torch.randn(64, 1536).bfloat16()
    found = rows_that_vary(lambda v: F.linear(v, w), x, [8, 17, 64])
    packed = cpu_gemm.pack_bi(w)
    assert rows_that_vary(lambda v: cpu_gemm.linear_bi(v, packed), x, [8, 17, 64]) == {}
    if not found:
        pytest.skip("torch's bf16 GEMM happens to be batch-invariant at this shape on this machine")
    assert max(found.values()) >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES + [(50, 96)])  # 50: three whole strips and a partial one (AMX's strip pairs)
def test_bias_is_added_to_the_accumulator_before_rounding(dtype, n, k):
    """``bias``: on every ISA the output is the float32 GEMM plus the bias, rounded once (as oneDNN's fused bias), and
    each row is still the same as alone."""
    w, x = _data(n, k, dtype, rows=97)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    packed = cpu_gemm.pack_bi(w)
    for isa in _isas(dtype):
        acc = cpu_gemm.linear_bi(x, packed, out_dtype=torch.float32, isa=isa)
        for out_dtype in (None, torch.float32):
            got = cpu_gemm.linear_bi(x, packed, out_dtype=out_dtype, isa=isa, bias=bias)
            assert torch.equal(got, (acc + bias).to(got.dtype)), (isa, out_dtype)
        assert not rows_that_vary(lambda rows: cpu_gemm.linear_bi(rows, packed, isa=isa, bias=bias), x, [1, 2, 33, 97])
    with_wrong = torch.randn(n + 1)
    assert cpu_gemm.linear_bi(x, packed, bias=with_wrong) is None  # refused: the caller adds it


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("bf16_gemm", ["auto", "onednn"])
def test_linear_with_a_bias_equals_f_linear(dtype, deterministic, bf16_gemm, monkeypatch):
    """engine/linear.Linear(bias=...) on every path it picks here (the C GEMM's epilogue, oneDNN's, or added after)
    equals F.linear with the bias, for a few rows and many. ``onednn``: fast mode's bf16 weight packed for oneDNN
    (its fused bias) even on an AMX CPU, where our GEMM would take it."""
    from pdcluster.engine import linear
    from pdcluster.engine.linear import Linear

    if bf16_gemm == "onednn":
        monkeypatch.setenv("PDCLUSTER_CPU_BF16_GEMM", "onednn")
        monkeypatch.setattr(linear, "_amx_gemm", functools.cache(linear._amx_gemm.__wrapped__))
    w, x = _data(83, 37, dtype, rows=97)
    bias = torch.randn(83).to(dtype)
    lin = Linear(w, deterministic=deterministic, bias=bias)
    if bf16_gemm == "onednn" and dtype is torch.bfloat16 and not deterministic and linear._can_prepack():
        assert lin._packed is not None and lin._bias_bf16 is not None  # the path this case is for
    for rows in (1, 3, 97):
        want = F.linear(x[:rows].float(), w.float(), bias.float())
        got = lin(x[:rows])
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want).abs().max() < (2e-2 if dtype is torch.bfloat16 else 1e-4)
