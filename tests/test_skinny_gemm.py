"""The few-row matmul kernel (kernels/triton_skinny_gemm.py) and its per-shape choice against cuBLAS
(engine/skinny_linear.py). Here the kernel runs interpreted (TRITON_INTERPRET=1, conftest.py), and its GPU
build is compiled for sm_90 without a GPU; the ``gpu`` tests run it and the CUDA-graph timing for real."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import make_engine
from triton_compile_helpers import compile_for_cuda
from pdcluster.engine import skinny_linear
from pdcluster.engine.linear import Linear
from pdcluster.kernels.graph_region import graph_region
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels import triton_skinny_gemm as sk
from pdcluster.kernels.triton_silu_and_mul import silu_and_mul_triton

TILES = (sk.SkinnyTiles(16, 64, 1), sk.SkinnyTiles(8, 32, 3), sk.SkinnyTiles(32, 32, 2))
DOT_TILES = (sk.SkinnyTiles(16, 32, 1, dot=True), sk.SkinnyTiles(32, 64, 3, dot=True))


def _within_16bit(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> bool:
    # The interpreter truncates float32 -> bf16 where a GPU rounds to nearest (tests/test_kernels.py): one ulp.
    ulp = 2.0 ** -7 if dtype is torch.bfloat16 else 2.0 ** -10
    return bool(((out.float() - exact).abs() <= exact.abs() * ulp + 1e-4).all())


def _ids(t: sk.SkinnyTiles) -> str:
    return f"{'dot' if t.dot else 'fma'}-n{t.block_n}k{t.block_k}s{t.split}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 17, 40, 128])
@pytest.mark.parametrize("tiles", TILES + DOT_TILES, ids=_ids)
def test_skinny_gemm_equals_the_exact_product(dtype, rows, tiles):
    """Odd N and K (masked column band and K tail), K split in 1 to 3 runs; the dot kernel's rows padded to 16, 32,
    64 and 128."""
    if not tiles.takes(rows):
        with pytest.raises(ValueError, match="the elementwise kernel takes at most 4"):
            sk.skinny_gemm(torch.zeros(rows, 32, dtype=dtype), torch.zeros(8, 32, dtype=dtype), tiles)
        return
    gen = torch.Generator().manual_seed(rows)
    n, k = 37, 160
    a = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    exact = a.double() @ w.double().T
    out = sk.skinny_gemm(a, w, tiles)
    assert out.shape == (rows, n) and out.dtype == dtype
    if dtype is torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
    else:
        assert _within_16bit(out, exact.float(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILES[:2] + DOT_TILES[:1], ids=_ids)
def test_fused_silu_and_mul_reads_what_the_unfused_kernel_writes(dtype, tiles):
    """The activation computed as the weight streams is rounded as the SiLU-and-mul kernel rounds it: the fused
    matmul equals that kernel followed by the plain one, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    k = 96
    gate_up = (3 * torch.randn(3, 2 * k, generator=gen)).to(dtype)
    w = torch.randn(40, k, generator=gen).to(dtype)
    fused = sk.skinny_gemm(gate_up, w, tiles, silu_and_mul=True)
    assert torch.equal(fused, sk.skinny_gemm(silu_and_mul_triton(gate_up), w, tiles))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 16, 40])
@pytest.mark.parametrize("tiles", DOT_TILES, ids=_ids)
def test_the_gated_epilogue_writes_what_the_silu_kernel_would(dtype, rows, tiles):
    """The gate/up projection with its SiLU-and-mul in the epilogue (whole, and K in 3 splits summed by the split
    kernel) equals the plain matmul followed by the SiLU-and-mul kernel, bit for bit."""
    gen = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 160, generator=gen).to(dtype)
    w = torch.randn(2 * 37, 160, generator=gen).to(dtype)
    fused = sk.skinny_gemm(a, w, tiles, gated=True)
    assert fused.shape == (rows, 37) and torch.equal(fused, silu_and_mul_triton(sk.skinny_gemm(a, w, tiles)))


def test_the_gated_epilogue_refuses_what_it_cannot_take():
    a = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="gated takes a dot tiling"):
        sk.skinny_gemm(a, torch.zeros(16, 64), TILES[0], gated=True)
    with pytest.raises(ValueError, match="even-rowed"):
        sk.skinny_gemm(a, torch.zeros(15, 64), DOT_TILES[0], gated=True)
    assert not sk.SkinnyTiles(64, 128, 1, 4, 4, dot=True).takes(128, gated=True)  # two weight tiles a stage


def test_skinny_gemm_writes_into_a_strided_output_row():
    a, w = torch.randn(2, 64), torch.randn(24, 64)
    out = torch.full((2, 40), 7.0)[:, 8:32]
    sk.skinny_gemm(a, w, TILES[0], out=out)
    torch.testing.assert_close(out, a @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed-row"):
        sk.skinny_gemm(a, w, TILES[0], out=torch.empty(2, 24).T.contiguous().T)


@pytest.mark.parametrize("a_shape, w_shape, silu, match", [
    ((129, 64), (8, 64), False, "1 to 128 rows"),
    ((0, 64), (8, 64), False, "1 to 128 rows"),
    ((2, 64), (8, 32), False, "does not fit"),
    ((2, 64), (8, 64), True, r"silu_and_mul: a is \[M, 2K\]"),
    ((2, 4, 16), (8, 64), False, "2-d"),
])
def test_skinny_gemm_refuses_what_it_cannot_take(a_shape, w_shape, silu, match):
    with pytest.raises(ValueError, match=match):
        sk.skinny_gemm(torch.zeros(a_shape), torch.zeros(w_shape), TILES[0], silu_and_mul=silu)
    with pytest.raises(ValueError, match="unit stride"):
        sk.skinny_gemm(torch.zeros(64, 2).T, torch.zeros(8, 64), TILES[0])
    with pytest.raises(ValueError, match="float32, weight torch.bfloat16"):
        sk.skinny_gemm(torch.zeros(2, 64), torch.zeros(8, 64, dtype=torch.bfloat16), TILES[0])


# ---- the choice against cuBLAS (engine/skinny_linear.py), on CPU tensors through the interpreter ----------------

@pytest.fixture
def cpu_skinny(monkeypatch):
    """Let CPU float32 weights of at most 1,024 rows take the kernel (the LM head's 49,152 would be slow
    interpreted), and forget every choice before and after."""
    skinny_linear.reset()
    monkeypatch.setattr(skinny_linear, "takes", lambda w: w.dim() == 2 and w.shape[0] <= 1024)
    skinny_linear.set_enabled(True)
    yield
    skinny_linear.reset()
    skinny_linear.set_enabled(True)


def _timer_by_tiles(times: dict):
    """A stand-in for the CUDA-graph timer: cuBLAS's time under None, each candidate's under its tiles."""
    def timer(fn, weights):
        tiles = fn.__defaults__[0] if fn.__defaults__ else None
        return times.get(tiles, 1e9 if tiles is not None else times[None])
    return timer


def test_tuning_takes_the_fastest_candidate_only_past_the_margin(cpu_skinny, monkeypatch):
    monkeypatch.setattr(sk, "CANDIDATE_TILES", TILES)
    w = torch.randn(48, 64)
    skinny_linear.register(w)
    # 10 against cuBLAS's 10.2: inside the margin, cuBLAS stays.
    assert skinny_linear._tune(w, 1, False, timer=_timer_by_tiles({None: 10.2, TILES[0]: 10.0})) is None
    # Two candidates past the margin: the faster wins.
    picked = skinny_linear._tune(w, 2, False, timer=_timer_by_tiles({None: 10.0, TILES[0]: 9.0, TILES[2]: 6.0}))
    assert picked == TILES[2]
    record = skinny_linear.choices()[-1]
    assert record["rows"] == 2 and record["cublas_us"] == 10.0 and record["chosen_us"] == 6.0
    assert record["chosen"]["block_n"] == 32 and len(record["candidates"]) == len(TILES)


def test_tuning_times_only_the_kernels_that_take_the_rows(cpu_skinny, monkeypatch):
    monkeypatch.setattr(sk, "CANDIDATE_TILES", TILES + DOT_TILES)
    w = torch.randn(48, 64)
    times = {None: 10.0, TILES[0]: 1.0, DOT_TILES[1]: 5.0}
    assert skinny_linear._tune(w, 8, False, timer=_timer_by_tiles(times)) == DOT_TILES[1]
    assert [c["dot"] for c in skinny_linear.choices()[-1]["candidates"]] == [True, True]
    assert skinny_linear._tune(w, 4, False, timer=_timer_by_tiles(times)) == TILES[0]


def test_a_candidate_that_disagrees_with_cublas_or_raises_is_never_chosen(cpu_skinny, monkeypatch):
    monkeypatch.setattr(sk, "CANDIDATE_TILES", TILES)
    real = sk.skinny_gemm

    def broken(a, w, tiles, silu_and_mul=False, out=None, gated=False):
        if tiles == TILES[1]:
            return real(a, w, tiles, silu_and_mul) + 1.0  # a miscompiled kernel
        if tiles == TILES[2]:
            raise RuntimeError("out of resources")  # a configuration this GPU cannot build
        return real(a, w, tiles, silu_and_mul)

    monkeypatch.setattr(sk, "skinny_gemm", broken)
    w = torch.randn(48, 64)
    times = {None: 10.0, TILES[0]: 8.0, TILES[1]: 1.0, TILES[2]: 1.0}
    assert skinny_linear._tune(w, 1, True, timer=_timer_by_tiles(times)) == TILES[0]
    entries = skinny_linear.choices()[-1]["candidates"]
    assert entries[1].get("wrong") and "us" not in entries[1]
    assert "out of resources" in entries[2]["error"]


def test_tuning_that_fails_leaves_cublas(cpu_skinny):
    def timer(fn, weights):
        raise RuntimeError("capture failed")

    assert skinny_linear._tune(torch.randn(48, 64), 1, False, timer=timer) is None
    assert "capture failed" in skinny_linear.choices()[-1]["error"]


def test_linear_runs_the_chosen_kernel_and_cublas_elsewhere(cpu_skinny, monkeypatch):
    # Seeded: unseeded, its inputs followed whatever the worker ran before, and one draw in CI put one of 320 epilogue
    # outputs 1.7e-5 from the reference (the interpreted Triton sum's order against torch's, at the 1e-5 bound).
    torch.manual_seed(0)
    calls = []

    def tune(weight, rows, silu_and_mul, gated=False):  # the measurement behind skinny_linear.choose
        calls.append((rows, "gated" if gated else silu_and_mul))
        return DOT_TILES[0] if gated and rows == 8 else TILES[0] if rows <= 2 and not gated else None

    monkeypatch.setattr(skinny_linear, "_tune", tune)
    ran = []
    real = sk.skinny_gemm
    monkeypatch.setattr(sk, "skinny_gemm", lambda *a, **kw: ran.append(a[0].shape[0]) or real(*a, **kw))
    w = torch.randn(40, 64)
    lin = Linear(w, prepack=False)
    x = torch.randn(1, 64)
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert ran == [] and calls == []  # eager (outside a CUDA graph's forward): cuBLAS, nothing measured
    with graph_region():
        for rows in (1, 2, 3, 20, 30, 129, 1, 2):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert ran == [1, 2, 1, 2]  # 3 and 20-30 rows: cuBLAS chosen; 129: over MAX_ROWS
        # measured once a row count, then kept; 20 and 30 rows at the 32 the dot kernel pads them to
        assert calls == [(1, False), (2, False), (3, False), (32, False)]
        gate_up = torch.randn(2, 128)
        torch.testing.assert_close(lin.after_silu_and_mul(gate_up),
                                   F.linear(F.silu(gate_up[:, :64]) * gate_up[:, 64:], w), rtol=1e-5, atol=1e-5)
        assert calls[-1] == (2, True) and ran[-1] == 2
        # the gate/up projection with its activation in the epilogue: asked above 4 rows only, None where cuBLAS
        gate_up_lin = Linear(torch.randn(80, 64), prepack=False)
        x8 = torch.randn(8, 64)
        torch.testing.assert_close(gate_up_lin.silu_and_mul_after(x8), silu_and_mul_triton(F.linear(x8, gate_up_lin.weight)),
                                   rtol=1e-5, atol=1e-5)
        assert calls[-1] == (8, "gated") and ran[-1] == 8
        assert gate_up_lin.silu_and_mul_after(torch.randn(32, 64)) is None and calls[-1] == (32, "gated")
        assert gate_up_lin.silu_and_mul_after(torch.randn(4, 64)) is None and calls[-1] == (32, "gated")
    lin(torch.randn(1, 64))
    assert len(ran) == 6  # out of the region again: cuBLAS


def test_the_flag_reaches_the_engine_and_turns_the_choice_off(tiny_dir, cpu_skinny, monkeypatch):
    """generate and serve take --no-skinny-gemm; the engine built from it measures nothing (cuBLAS everywhere)."""
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.engine_args import engine_config_from_args

    for command in (["generate", "--prompt", "x"], ["serve"]):
        parse = lambda *a: engine_config_from_args(build_parser().parse_args([*command, *a]))  # noqa: E731
        assert parse().skinny_gemm is True
        assert parse("--no-skinny-gemm").skinny_gemm is False
    monkeypatch.setattr(skinny_linear, "_tune", lambda *a, **kw: pytest.fail("measured"))
    engine = make_engine("tiny-random", max_num_seqs=4, dtype="float32", deterministic=False, skinny_gemm=False)
    engine.runner.use_decode_graphs(emulate=True)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert engine.runner.graphs.num_replays > 0


def test_disabled_or_too_many_rows_never_measures(cpu_skinny, monkeypatch):
    monkeypatch.setattr(skinny_linear, "_tune", lambda *a, **kw: pytest.fail("measured"))
    w = torch.randn(40, 64)
    assert skinny_linear.choose(w, 129, False) is None
    skinny_linear.set_enabled(False)
    assert skinny_linear.choose(w, 1, False) is None


def _graphed_tokens(monkeypatch, prompts, params, cfg, choose) -> tuple[list, list, list]:
    """tiny-random's greedy tokens with every matmul on the library (expected), then with the few-row matmuls of its
    emulated CUDA-graph decode steps (engine/cuda_graphs.py) choosing by ``choose`` (every weight but the LM head's:
    over 1,024 rows): (expected, got, the skinny_gemm calls as (rows, keyword arguments))."""
    monkeypatch.setattr(skinny_linear, "takes", lambda w: False)
    expected = [o.token_ids for o in make_engine("tiny-random", **cfg).generate(prompts, params)]
    monkeypatch.setattr(skinny_linear, "takes", lambda w: w.dim() == 2 and w.shape[0] <= 1024)
    monkeypatch.setattr(skinny_linear, "choose", choose)
    ran = []
    real = sk.skinny_gemm
    monkeypatch.setattr(sk, "skinny_gemm", lambda a, *args, **kw: ran.append((a.shape[0], kw)) or real(a, *args, **kw))
    engine = make_engine("tiny-random", **cfg)
    engine.runner.use_decode_graphs(emulate=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.runner.graphs.num_replays > 0
    return expected, got, ran


# The two model tests in the slow pass (8-9 s each on CI): the kernel's products and the fused activation are the
# kernel tests' above; the engine's way to the kernel test_linear_runs_the_chosen_kernel_and_cublas_elsewhere's.
@pytest.mark.slow
def test_a_model_with_the_kernel_in_its_graphed_matmuls_gives_the_cublas_tokens(tiny_dir, cpu_skinny, monkeypatch):
    """tiny-random (float32) with its decode steps through emulated CUDA graphs: every matmul of those steps but the
    LM head's through the kernel, the MLP's SiLU-and-mul fused into its down projection, gives the library matmuls'
    greedy tokens; the prefill steps (eager) never ask."""
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(6 + 5 * i)] for i in range(3)]
    asked = []
    expected, got, ran = _graphed_tokens(
        monkeypatch, prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        dict(max_num_seqs=4, dtype="float32", deterministic=False),
        lambda w, rows, act, gated=False: asked.append((rows, act)) or (TILES[0] if rows <= 4 else DOT_TILES[0]))
    assert got == expected
    fused = [kw.get("silu_and_mul", False) for _, kw in ran]
    assert {rows for rows, _ in asked} <= {1, 2, 4} and True in fused and False in fused  # decode buckets only


@pytest.mark.slow
def test_a_model_with_the_activation_in_the_gate_up_epilogue_gives_the_cublas_tokens(tiny_dir, cpu_skinny,
                                                                                    monkeypatch):
    """A decode bucket of 8 rows takes the gate/up projection with the SiLU-and-mul in its epilogue, and the down
    projection plain: the library's greedy tokens."""
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(4 + 3 * i)] for i in range(6)]
    expected, got, ran = _graphed_tokens(
        monkeypatch, prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        dict(max_num_seqs=8, dtype="float32", deterministic=False),
        lambda w, rows, act, gated=False: (DOT_TILES[1] if gated else DOT_TILES[0]) if rows > 4
        else (None if gated else TILES[0]))
    assert got == expected
    calls = {(rows, kw.get("gated", False)) for rows, kw in ran}
    assert (8, True) in calls and (8, False) in calls  # gate/up with its activation, then the down projection plain


# ---- the GPU build, compiled for sm_90 (H100 / H200) without a GPU -------------------------------------------

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sm90_build import build
from pdcluster.kernels import triton_skinny_gemm as sk
pointers = {"out_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*bf16"}
# A 2,048-wide model's N, K and strides are multiples of 16 (sm90_build.py: what a launch specialises).
aligned = ("N", "K", "stride_am", "stride_wn", "stride_om")
out = []
for spec in json.loads(sys.argv[1]):
    tiles = sk.CANDIDATE_TILES[spec["tiles"]]
    if tiles.dot:
        c = dict(BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PARTIAL=spec["partial"], NATIVE_DOT=True, USE_PDL=False,
                 ROWS=sk.dot_rows_for(spec["rows"]), GATED=spec.get("gated", False))
        fn = sk._skinny_dot_kernel
    else:
        c = dict(ROWS_PAD=sk.rows_pad_for(spec["rows"]), BLOCK_N=tiles.block_n,
                 BLOCK_K=sk.block_k_for(tiles, spec["rows"]), PARTIAL=spec["partial"], SILU_AND_MUL=spec["silu"],
                 USE_PDL=False)
        fn = sk._skinny_gemm_kernel
    got = build(fn, dict(pointers, out_ptr="*fp32" if spec["partial"] else "*bf16"), c, aligned=aligned,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages, spills=True)
    out.append({**spec, "spill_bytes": got["spill_bytes"], "shared_bytes": got["shared_bytes"]})
s = dict(out_ptr="*bf16", part_ptr="*fp32", M="i32", N="i32", stride_om="i32", SPLIT="constexpr", BLOCK="constexpr",
         USE_PDL="constexpr", GATED="constexpr")
for gated in (False, True):
    triton.compile(ASTSource(sk._sum_splits_kernel, s, constexprs=dict(SPLIT=4, BLOCK=1024, USE_PDL=False, GATED=gated)),
                   target=GPUTarget("cuda", 90, 32))
print(json.dumps(out))
"""


def _compile_for_sm90(specs: list[dict], tmp_path) -> list[dict]:
    return json.loads(compile_for_cuda(_COMPILE, tmp_path, [json.dumps(specs)], timeout_s=600).strip().splitlines()[-1])


def test_the_gpu_build_compiles_for_sm90_without_spilling(tmp_path):
    """A few of each kernel's tiles, plain and fused, whole and split; the dot kernel's weight really goes
    through shared memory (the software pipeline it is there for) within an H100's 227 KiB."""
    dot = [i for i, t in enumerate(sk.CANDIDATE_TILES) if t.dot]
    specs = [dict(tiles=0, rows=1, silu=False, partial=False), dict(tiles=1, rows=1, silu=True, partial=True),
             dict(tiles=2, rows=4, silu=True, partial=True), dict(tiles=dot[0], rows=16, silu=False, partial=False),
             dict(tiles=dot[2], rows=16, silu=False, partial=True), dict(tiles=dot[0], rows=64, silu=False,
                                                                         partial=False),
             dict(tiles=dot[-2], rows=128, silu=False, partial=True),
             dict(tiles=dot[0], rows=32, silu=False, partial=False, gated=True),
             dict(tiles=dot[-1], rows=128, silu=False, partial=True, gated=True),
             dict(tiles=dot[-1], rows=64, silu=False, partial=True)]
    for got in _compile_for_sm90(specs, tmp_path):
        _assert_built_as_meant(got)


def _assert_built_as_meant(got: dict) -> None:
    assert got["spill_bytes"] in (0, None), got
    tiles = sk.CANDIDATE_TILES[got["tiles"]]
    if tiles.dot:  # at least num_stages - 1 weight and operand tiles in flight, within what takes() allowed
        weight_rows = tiles.block_n * (2 if got.get("gated") else 1)
        stage_bytes = (weight_rows + sk.dot_rows_for(got["rows"])) * tiles.block_k * 2
        assert (tiles.num_stages - 1) * stage_bytes <= got["shared_bytes"] <= 227 * 1024, got


@pytest.mark.slow
def test_every_candidate_compiles_for_sm90_without_spilling(tmp_path):
    specs = [dict(tiles=i, rows=r, silu=s, partial=p) for i, t in enumerate(sk.CANDIDATE_TILES)
             for r in ((16, 32, 64, 128) if t.dot else (1, 2, 4)) if t.takes(r)
             for s in ((False,) if t.dot else (False, True))
             for p in ((False, True) if t.split > 1 else (False,))]
    specs += [dict(tiles=i, rows=r, silu=False, partial=t.split > 1, gated=True) for i, t in enumerate(sk.CANDIDATE_TILES)
              for r in (16, 32, 64, 128) if t.takes(r, gated=True)]
    for got in _compile_for_sm90(specs, tmp_path):
        _assert_built_as_meant(got)


def test_a_dot_tiling_takes_the_rows_its_pipeline_fits():
    wide = sk.SkinnyTiles(32, 256, 1, 4, 4, dot=True)  # 4 stages of (32 + rows) x 256 16-bit tiles
    assert wide.takes(1) and wide.takes(32) and not wide.takes(64) and not wide.takes(129)
    assert not sk.SkinnyTiles(128, 64, 2, 8, 4, dot=True, min_rows=32).takes(16)
    for rows in (1, 4, 16, 32, 64, 128):  # every row count up to MAX_ROWS has candidates to time
        assert any(t.takes(rows) for t in sk.CANDIDATE_TILES if t.dot), rows
    with pytest.raises(ValueError, match="shared memory"):
        sk.skinny_gemm(torch.zeros(128, 64), torch.zeros(8, 64), wide)


def test_the_choice_is_measured_at_the_padded_row_count():
    assert [skinny_linear.measured_rows(r) for r in (1, 3, 4, 5, 8, 9, 16, 17, 48, 64, 65, 128)] == \
        [1, 3, 4, 8, 8, 16, 16, 32, 64, 64, 128, 128]


# ---- on a GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n, k, silu", [(2048, 2048, False), (2560, 2048, False), (2048, 5632, True),
                                        (11264, 2048, False)])
def test_gpu_every_candidate_agrees_with_cublas(n, k, silu):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 8, 16, 32, 48, 128):
        a = torch.randn(rows, 2 * k if silu else k, device="cuda", generator=gen).to(torch.bfloat16)
        ref = F.linear(silu_and_mul_triton(a) if silu else a, w).float()
        for tiles in (t for t in sk.CANDIDATE_TILES if t.takes(rows)):
            out = sk.skinny_gemm(a, w, tiles, silu_and_mul=silu).float()
            assert skinny_linear._agrees(out, ref), (rows, tiles, (out - ref).abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tuning_times_in_cuda_graphs_and_records_the_choice():
    skinny_linear.reset()
    w = (torch.randn(2048, 2048, device="cuda") * 0.02).to(torch.bfloat16)
    others = [w.clone() for _ in range(7)]
    for x in [w, *others]:
        skinny_linear.register(x)
    skinny_linear.choose(w, 1, False)
    record = skinny_linear.choices()[-1]
    assert record["cublas_us"] > 0 and "error" not in record
    assert all(("us" in c and c["us"] > 0) for c in record["candidates"]), record
    lin = Linear(w)
    x = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    assert skinny_linear._agrees(lin(x).float(), F.linear(x, w).float())
    skinny_linear.reset()
