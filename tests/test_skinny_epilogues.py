"""The few-row matmul's epilogues (kernels/triton_skinny_epilogues.py): the residual add with the next RMSNorm, and
the rotary embedding with the KV write, run by the kernel that adds the split-K partial sums. Interpreted here
(TRITON_INTERPRET=1, conftest.py); the model-level tests run tiny-random's emulated CUDA-graph decode steps through
them; the ``gpu`` test runs the compiled kernels."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_engine
from triton_compile_helpers import compile_for_cuda
from pdcluster.engine import skinny_linear
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels import ops
from pdcluster.kernels.graph_region import in_graph_region
from pdcluster.kernels import triton_skinny_gemm as sk
from pdcluster.kernels.triton_rms_norm import rms_norm_triton
from pdcluster.kernels.triton_rotary_kv import rotary_write_kv_triton
from pdcluster.kernels.triton_skinny_epilogues import RmsNormEpilogue, RotaryKvEpilogue

_SKINNY_GEMM = sk.skinny_gemm
# Elementwise kernel unsplit and in 3 splits, dot kernel unsplit and in 3 splits.
TILES = (sk.SkinnyTiles(16, 64, 1), sk.SkinnyTiles(8, 32, 3), sk.SkinnyTiles(16, 32, 1, dot=True),
         sk.SkinnyTiles(32, 64, 3, dot=True))


def _ids(t: sk.SkinnyTiles) -> str:
    return f"{'dot' if t.dot else 'fma'}-s{t.split}"


def _cases(rows_list):
    return [(tiles, rows) for tiles in TILES for rows in rows_list if tiles.takes(rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles, rows", _cases([1, 3, 17]), ids=lambda v: _ids(v) if isinstance(v, sk.SkinnyTiles)
                         else f"r{v}")
def test_the_norm_epilogue_writes_what_the_matmul_and_the_norm_kernel_would(dtype, tiles, rows):
    """out = RMSNorm(residual + a @ w.T) and the residual updated in place: bit for bit the matmul, then the norm
    kernel with the residual (N = 96 is not a power of two: the norm's masked lanes)."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 160
    a = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    norm_w = (1 + torch.randn(n, generator=gen) / 4).to(dtype)
    residual = torch.randn(rows, n, generator=gen).to(dtype)
    expected_residual = residual.clone()
    expected = rms_norm_triton(sk.skinny_gemm(a, w, tiles), norm_w, 1e-5, residual=expected_residual)
    got = sk.skinny_gemm(a, w, tiles, epilogue=RmsNormEpilogue(norm_w, 1e-5, residual))
    assert torch.equal(residual, expected_residual) and not torch.equal(residual, expected)
    assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.parametrize("tiles", TILES[:2], ids=_ids)
def test_the_norm_epilogue_follows_the_activation_read_with_the_weight(tiles):
    """The down projection's form at 1 to 4 rows: the SiLU-and-mul as its input is read, the next norm after it."""
    gen = torch.Generator().manual_seed(3)
    gate_up = (3 * torch.randn(2, 2 * 64, generator=gen)).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    norm_w = torch.rand(48, generator=gen).to(torch.bfloat16)
    residual = torch.randn(2, 48, generator=gen).to(torch.bfloat16)
    expected_residual = residual.clone()
    expected = rms_norm_triton(sk.skinny_gemm(gate_up, w, tiles, silu_and_mul=True), norm_w, 1e-6,
                               residual=expected_residual)
    got = sk.skinny_gemm(gate_up, w, tiles, silu_and_mul=True, epilogue=RmsNormEpilogue(norm_w, 1e-6, residual))
    assert torch.equal(got, expected) and torch.equal(residual, expected_residual)


def _rotary_case(rows: int, dtype: torch.dtype, gen: torch.Generator):
    """A GQA qkv projection (4 q heads, 2 kv heads of 16: N = 128), positions, a cos/sin table, a 3-block cache
    of 4 slots and a slot mapping whose second token is batch padding."""
    num_q, num_kv, d, k = 4, 2, 16, 80
    a = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn((num_q + 2 * num_kv) * d, k, generator=gen).to(dtype)
    positions = torch.randint(0, 32, (rows,), generator=gen)
    angles = torch.rand(32, d // 2, generator=gen) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    cache = torch.zeros(2, 3, 4, num_kv, d, dtype=dtype)
    slots = torch.randperm(12, generator=gen)[:rows]
    if rows > 1:
        slots[1] = -1
    return a, w, num_q, num_kv, positions, cos_sin, cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles, rows", _cases([1, 3, 9]), ids=lambda v: _ids(v) if isinstance(v, sk.SkinnyTiles)
                         else f"r{v}")
def test_the_rotary_epilogue_writes_what_the_matmul_and_the_rotary_kv_kernel_would(dtype, tiles, rows):
    """The qkv output with q and k rotated, and K and V in the cache (a padding token's slot left alone): bit for
    bit the matmul, then the fused rotary + KV-write kernel on its q, k and v views."""
    gen = torch.Generator().manual_seed(rows)
    a, w, num_q, num_kv, positions, cos_sin, cache, slots = _rotary_case(rows, dtype, gen)
    d = cos_sin.shape[1]
    expected = sk.skinny_gemm(a, w, tiles)
    heads = expected.view(rows, -1, d)
    expected_cache = cache.clone()
    rotary_write_kv_triton(heads[:, :num_q], heads[:, num_q : num_q + num_kv], heads[:, num_q + num_kv :], positions,
                           cos_sin, expected_cache, slots)
    got = sk.skinny_gemm(a, w, tiles, epilogue=RotaryKvEpilogue(num_q, num_kv, positions, cos_sin, cache, slots))
    assert torch.equal(got, expected) and torch.equal(cache, expected_cache)
    written = (cache != 0).flatten(3).any(-1).any(0).flatten()  # [blocks * block_size] slots written
    assert sorted(written.nonzero().flatten().tolist()) == sorted(s for s in slots.tolist() if s >= 0)


def test_the_epilogues_refuse_what_they_cannot_take():
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(2, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="gated takes no epilogue"):
        sk.skinny_gemm(torch.randn(8, 64), w, TILES[2], gated=True,
                       epilogue=RmsNormEpilogue(torch.ones(16), 1e-5, torch.zeros(8, 16)))
    with pytest.raises(ValueError, match="do not fit a \\[2, 32\\] matmul output"):
        sk.skinny_gemm(a, w, TILES[0], epilogue=RmsNormEpilogue(torch.ones(31), 1e-5, torch.zeros(2, 32)))
    with pytest.raises(ValueError, match="packed-row torch.float32 residual"):
        sk.skinny_gemm(a, w, TILES[0], epilogue=RmsNormEpilogue(torch.ones(32), 1e-5, torch.zeros(32, 2).T))
    a, w, num_q, num_kv, positions, cos_sin, cache, slots = _rotary_case(2, torch.float32, gen)
    with pytest.raises(ValueError, match="is not 3 \\+ 2 x 2 heads"):
        sk.skinny_gemm(a, w, TILES[0], epilogue=RotaryKvEpilogue(3, num_kv, positions, cos_sin, cache, slots))
    with pytest.raises(ValueError, match="do not fit 2 tokens"):
        sk.skinny_gemm(a, w, TILES[0], epilogue=RotaryKvEpilogue(num_q, num_kv, positions[:1], cos_sin, cache, slots))
    assert not cache.any()  # nothing was launched


# ---- in the model: tiny-random's emulated CUDA-graph decode steps (engine/cuda_graphs.py) on CPU tensors ------------

@pytest.fixture
def cpu_skinny(monkeypatch):
    """CPU weights of at most 1,024 rows take the skinny kernel (every weight but the LM head's); the choices and the
    epilogue switch are reset after."""
    skinny_linear.reset()
    monkeypatch.setattr(skinny_linear, "takes", lambda w: w.dim() == 2 and w.shape[0] <= 1024)
    yield
    skinny_linear.reset()
    skinny_linear.set_epilogues(True)


def _decode(monkeypatch, choose, dtype: str, epilogues: bool = True) -> tuple[list, list, list[str]]:
    """tiny-random's greedy tokens and their logprobs for three prompts, its decode steps' matmuls choosing by
    ``choose``: (tokens, logprobs, each skinny_gemm call's epilogue class name or "")."""
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(6 + 5 * i)] for i in range(3)]
    monkeypatch.setattr(skinny_linear, "choose", choose)
    calls = []

    def recorded(a, *args, **kw):
        calls.append(type(kw["epilogue"]).__name__ if kw.get("epilogue") is not None else "")
        return _SKINNY_GEMM(a, *args, **kw)

    monkeypatch.setattr(sk, "skinny_gemm", recorded)
    engine = make_engine("tiny-random", max_num_seqs=4, dtype=dtype, deterministic=False, skinny_epilogues=epilogues)
    engine.runner.use_decode_graphs(emulate=True)
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0))
    assert engine.runner.graphs.num_replays > 0
    return [o.token_ids for o in outs], [o.logprobs for o in outs], calls


def _always(w, rows, silu_and_mul, gated=False):
    return None if gated else SKINNY  # 1 to 4 rows: the elementwise kernel, K in 3 splits


SKINNY = sk.SkinnyTiles(16, 64, 3)


# The slow pass (25 s on CI, the default suite's longest): each epilogue's bits are the kernel tests' above, the
# routing around them test_a_model_with_some_projections_on_cublas_runs_their_followers_apart's below.
@pytest.mark.slow
def test_a_model_with_its_norms_and_rotary_in_the_matmul_epilogues_gives_the_unfused_bits(tiny_dir, cpu_skinny,
                                                                                         monkeypatch):
    """tiny-random decoding through the skinny kernel with every qkv projection's rotary and KV write and every norm
    after an output or down projection in the epilogues gives the tokens and logprobs, bit for bit, of the same
    kernels with those apart (--no-skinny-epilogues); each step runs the three epilogues a layer. float32: a CPU's
    bf16 weights are prepacked for oneDNN, never the kernel's (the bf16 rounding is the kernel tests' above)."""
    # The decode steps' norms and rotary + KV writes run apart through the Triton kernels (interpreted), as on a GPU,
    # not the CPU's C kernels (which sum a row in another order).
    real_norm, real_rotary = ops.rms_norm, ops.rotary_write_kv

    def norm(x, weight, eps, residual=None):
        return (rms_norm_triton if in_graph_region() else real_norm)(x, weight, eps, residual)

    def rotary(*args):
        return rotary_write_kv_triton(*args) is None if in_graph_region() else real_rotary(*args)

    monkeypatch.setattr(ops, "rms_norm", norm)
    monkeypatch.setattr(ops, "rotary_write_kv", rotary)
    tokens, logprobs, calls = _decode(monkeypatch, _always, "float32")
    apart_tokens, apart_logprobs, apart_calls = _decode(monkeypatch, _always, "float32", epilogues=False)
    assert tokens == apart_tokens and logprobs == apart_logprobs
    assert set(apart_calls) == {""}
    # Per layer and step: qkv (rotary), o_proj (norm), down_proj (norm: the next layer's input norm or the final).
    assert calls.count("RotaryKvEpilogue") > 0 and calls.count("RmsNormEpilogue") == 2 * calls.count(
        "RotaryKvEpilogue")
    assert calls.count("") == calls.count("RotaryKvEpilogue")  # gate/up, plain


def test_a_model_with_some_projections_on_cublas_runs_their_followers_apart(tiny_dir, cpu_skinny, monkeypatch):
    """Where cuBLAS is chosen for the output projection (here, the [hidden, hidden] shape), its norm runs as a
    kernel of its own and the qkv and down projections' epilogues still run: the library's greedy tokens (float32)."""
    expected = [o.token_ids for o in make_engine("tiny-random", max_num_seqs=4, dtype="float32").generate(
        [[5 + (7 * i + 3 * j) % 300 for j in range(6 + 5 * i)] for i in range(3)],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))]

    def choose(w, rows, silu_and_mul, gated=False):
        return None if gated or w.shape[0] == w.shape[1] else SKINNY

    tokens, _, calls = _decode(monkeypatch, choose, "float32")
    assert tokens == expected
    assert calls.count("RmsNormEpilogue") == calls.count("RotaryKvEpilogue") > 0  # the down projections' only


# ---- the GPU build, compiled for sm_90 (H100 / H200) without a GPU -------------------------------------------------

_BUILD = r"""
import json
from sm90_build import build
from pdcluster.kernels import triton_skinny_epilogues as ep
out = {}
# TinyLlama's shapes: 2,048-wide rows (8 warps, as launched), 32 query / 4 KV heads of 64; K in 4 splits.
for pdl in (False, True):
    out[f"sum_rms_norm pdl={pdl}"] = build(
        ep._sum_rms_norm_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32", "residual_ptr": "*bf16",
                                  "norm_w_ptr": "*bf16", "eps": "fp32"},
        dict(SPLIT=4, BLOCK=2048, USE_PDL=pdl), aligned=("N", "stride_om", "stride_rm"), num_warps=8, launch_pdl=pdl,
        spills=True)["spill_bytes"]
    # The rotary + KV write over a bf16 cache, and over an fp8 one (--kv-cache-dtype: the written-out conversion).
    for cache in ("bf16", "fp8e4nv"):
        out[f"sum_rotary_kv pdl={pdl} cache={cache}"] = build(
            ep._sum_rotary_kv_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32", "positions_ptr": "*i64",
                                       "cos_sin_ptr": "*fp32", "cache_ptr": "*" + cache, "slot_mapping_ptr": "*i64"},
            dict(stride_cos_sin_dim=1, stride_cache_dim=1, SPLIT=4, Q_HEADS_PAD=32, KV_HEADS_PAD=4, HALF_PAD=32,
                 USE_PDL=pdl), aligned=("N", "stride_om", "stride_cache_kv", "stride_cache_block", "stride_cache_slot"),
            launch_pdl=pdl, spills=True)["spill_bytes"]
print(json.dumps(out))
"""


def test_the_epilogue_kernels_compile_for_sm90_without_spilling(tmp_path):
    got = json.loads(compile_for_cuda(_BUILD, tmp_path).strip().splitlines()[-1])
    assert len(got) == 6 and all(spill in (0, None) for spill in got.values()), got


# ---- on a GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_epilogues_give_the_unfused_kernels_results():
    """The 1.1B Llama's shapes in bf16 with every candidate tiling that takes the rows: the rotary epilogue bit for
    bit; the norm epilogue within one bf16 unit of the norm kernel (its row sum may be ordered otherwise: the
    module doc), and the residual bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda")
    w_o = (torch.randn(2048, 2048, **dev, generator=gen) * 0.02).to(torch.bfloat16)
    w_qkv = (torch.randn(2560, 2048, **dev, generator=gen) * 0.02).to(torch.bfloat16)
    norm_w = (1 + torch.randn(2048, **dev, generator=gen) / 4).to(torch.bfloat16)
    angles = torch.rand(4096, 32, **dev, generator=gen) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    differing = 0
    for rows in (1, 4, 16, 128):
        a = torch.randn(rows, 2048, **dev, generator=gen).to(torch.bfloat16)
        residual = torch.randn(rows, 2048, **dev, generator=gen).to(torch.bfloat16)
        positions = torch.randint(0, 4096, (rows,), **dev, generator=gen)
        slots = torch.randperm(64 * 16, **dev, generator=gen)[:rows]
        for tiles in (t for t in sk.CANDIDATE_TILES if t.takes(rows)):
            expected_residual, got_residual = residual.clone(), residual.clone()
            expected = rms_norm_triton(sk.skinny_gemm(a, w_o, tiles), norm_w, 1e-5, residual=expected_residual)
            got = sk.skinny_gemm(a, w_o, tiles, epilogue=RmsNormEpilogue(norm_w, 1e-5, got_residual))
            assert torch.equal(got_residual, expected_residual), (rows, tiles)
            ulp = expected.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
            assert ((got.float() - expected.float()).abs() <= ulp).all(), (rows, tiles)
            differing += int((got != expected).sum())
            cache, expected_cache = (torch.zeros(2, 64, 16, 4, 64, dtype=torch.bfloat16, **dev) for _ in range(2))
            qkv = sk.skinny_gemm(a, w_qkv, tiles)
            heads = qkv.view(rows, 40, 64)
            rotary_write_kv_triton(heads[:, :32], heads[:, 32:36], heads[:, 36:], positions, cos_sin, expected_cache,
                                   slots)
            got = sk.skinny_gemm(a, w_qkv, tiles, epilogue=RotaryKvEpilogue(32, 4, positions, cos_sin, cache, slots))
            assert torch.equal(got, qkv) and torch.equal(cache, expected_cache), (rows, tiles)
    print(f"norm epilogue: {differing} elements one unit off the norm kernel")
