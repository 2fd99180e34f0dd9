"""The CUDA side of deterministic mode (issue 24): the Triton kernels the engine runs on a GPU give each row
a result that depends on that row alone, bit for bit.

- kernels/triton_matmul_bi.py (every projection and the LM head in deterministic mode on CUDA): equals
  torch within tolerance, and row r computed alone == row r among M = 1, 3, 17, 64 and 100 rows, or at
  another place in its tile;
- kernels/triton_paged_attention.py: a query's output is the same as a decode step alone, in a decode
  batch, as a row of a prefill chunk (alone or among other requests) and as a verification row.

Each invariance check is a helper that returns what differs; a mutation test runs it on a variant that
chooses a tile from the batch (the matmul's BLOCK_K from M, the attention's key tile from the number of
query tokens) and asserts it finds differences: the checks can fail. The mutations run in float32, where
every change of summation order shows; a bf16 output rounds most of them away (measured: a K-chunking
change of an fp32 accumulator moved 0 to 1 of about 4,000 bf16 outputs). A row tile whose height follows
the batch is invisible to the interpreter (numpy's dot gives a row the same bits in any tile height; a
GPU's dot instruction and row reductions follow the tile shape), so two tests record the launch
parameters and assert one configuration for every batch: the attention tiles used before issue 24 (64
rows for prefill batches, 16 for decode) fail that one, as does a BLOCK_M keyed on M.

Devices: "interpreted" runs under TRITON_INTERPRET=1 (set in conftest.py) on CPU tensors; "gpu" runs the
same tests compiled on CUDA (marker ``gpu``; bench/gpu_check.py runs them on a lent GPU). The
interpreter widens bf16 operands of the matmul's dot to fp32 (its bf16 dot is wrong, see the kernel's
docstring), so the native bf16 dot is checked by the gpu tests and compiled ahead of time below.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels import reference, triton_matmul_bi
from pdcluster.kernels import triton_paged_attention as attention
from pdcluster.kernels.triton_matmul_bi import matmul_bi, tiles_for
from attention_contexts import TargetContext, invariance_failures
from triton_compile_helpers import compile_for_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETED
DEVICES = [
    pytest.param("cpu", id="interpreted", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not ON_GPU, reason="needs a CUDA device and compiled Triton")]),
]
BF16_ULP = 2**-7


def _randn(*shape: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


# ---------------------------------------------------------------------------------------------- matmul

N, K = 48, 200  # two column tiles, four K steps with a tail (BLOCK_K 64) or seven (fp32's 32)
NUM_ROWS = 100  # two row tiles


def matmul_invariance_failures(matmul, x: torch.Tensor, w: torch.Tensor) -> list[str]:
    """Where rows computed in some batch differ bitwise from the same rows in ``matmul(x, w)``: prefixes
    of M = 1, 3, 17, 64 rows, a window that puts rows at other places in their tile, single rows."""
    full = matmul(x, w)
    failures = []
    for m in (1, 3, 17, 64):
        if not torch.equal(matmul(x[:m], w), full[:m]):
            failures.append(f"first {m} rows")
    if not torch.equal(matmul(x[5:69], w), full[5:69]):
        failures.append("rows 5..68")
    for r in (0, 37, 63, x.shape[0] - 1):
        if not torch.equal(matmul(x[r : r + 1], w), full[r : r + 1]):
            failures.append(f"row {r} alone")
    return failures


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_matmul_bi_matches_torch(device, dtype):
    x = _randn(2, 5, K, dtype=dtype, seed=0, device=device)  # leading dims are kept
    w = _randn(N, K, dtype=dtype, seed=1, device=device)
    got = matmul_bi(x, w)
    assert got.shape == (2, 5, N) and got.dtype == dtype
    expected = F.linear(x.double(), w.double())  # the exact sum, to compare both roundings against
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    else:
        # One rounding of the fp32 sum to 16 bits (the interpreter truncates: up to one ulp).
        ulp = BF16_ULP if dtype == torch.bfloat16 else 2**-10
        torch.testing.assert_close(got.double(), expected, rtol=ulp, atol=1e-4)
    strided = torch.cat([x, x], dim=-1)[..., :K]  # rows with a stride larger than K
    assert torch.equal(matmul_bi(strided, w), got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matmul_bi_rows_are_batch_invariant(device, dtype):
    x = _randn(NUM_ROWS, K, dtype=dtype, seed=2, device=device)
    w = _randn(N, K, dtype=dtype, seed=3, device=device)
    assert matmul_invariance_failures(matmul_bi, x, w) == []


@pytest.mark.parametrize("device", DEVICES)
def test_the_matmul_check_catches_split_k_chosen_from_m(device):
    """Mutation: split-K keyed on the number of rows (a library GEMM's habit for a few rows and a long
    K): two half-K partial products summed round differently from one accumulation."""
    x = _randn(NUM_ROWS, K, dtype=torch.float32, seed=2, device=device)
    w = _randn(N, K, dtype=torch.float32, seed=3, device=device)
    half = K // 2

    def split_k_for_few_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 8:
            return matmul_bi(x, w)
        return matmul_bi(x[:, :half].contiguous(), w[:, :half].contiguous()) + \
            matmul_bi(x[:, half:].contiguous(), w[:, half:].contiguous())

    failures = matmul_invariance_failures(split_k_for_few_rows, x, w)
    assert "row 0 alone" in failures and "first 1 rows" in failures, failures


@pytest.mark.parametrize("device", DEVICES[:1])
def test_the_matmul_check_catches_block_k_chosen_from_m(device):
    """Mutation: BLOCK_K keyed on the number of rows changes every row's K chunking under the
    interpreter (its dot sums a whole K block at once). Not on a GPU: there the tensor cores sum 8
    (fp32) or 16 (bf16) K elements per instruction into the same accumulator, in order, so 16- and
    32-wide K blocks give the same bits (seen on an H100); split-K above is the GPU's real hazard."""
    x = _randn(NUM_ROWS, K, dtype=torch.float32, seed=2, device=device)
    w = _randn(N, K, dtype=torch.float32, seed=3, device=device)
    tiles = tiles_for(N, K, torch.float32)

    def keyed_on_m(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return matmul_bi(x, w, replace(tiles, block_k=16 if x.shape[0] > 8 else 32))

    failures = matmul_invariance_failures(keyed_on_m, x, w)
    assert "row 0 alone" in failures and "first 1 rows" in failures, failures


def test_matmul_tiles_come_from_the_weight_shape():
    """The widest column tile that still leaves ~132 column tiles for a one-row-tile step; K and dtype
    set BLOCK_K. (tiles_for takes no row count: nothing can key on M.)"""
    assert tiles_for(49152, 576, torch.bfloat16).block_n == 128  # an LM head
    assert tiles_for(11264, 2048, torch.bfloat16).block_n == 64  # a fused gate/up projection
    assert tiles_for(2048, 5632, torch.bfloat16).block_n == 32  # a down projection
    assert tiles_for(2048, 2048, torch.bfloat16).block_k == 64
    assert tiles_for(2048, 2048, torch.float32).block_k == 32
    assert tiles_for(64, 24, torch.bfloat16).block_k == 32  # short K: one masked step
    assert len({tiles_for(2048, 2048, torch.bfloat16).block_m, tiles_for(64, 24, torch.float32).block_m}) == 1


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
def test_matmul_launches_one_configuration_for_every_m(monkeypatch):
    """The compile-time parameters of every launch are the same for 1 to 100 rows. The interpreter cannot
    see a BLOCK_M or warp count that changes with M (numpy's dot gives a row the same bits in any tile
    height; a GPU's dot instruction follows the tile shape): this is the check that does."""
    launched = set()
    real_kernel = triton_matmul_bi._matmul_bi_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.add(tuple(sorted(kwargs.items())))
                return real_kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_matmul_bi, "_matmul_bi_kernel", Recording())
    w = _randn(N, K, dtype=torch.bfloat16, seed=3)
    for m in (1, 3, 17, 64, 100):
        matmul_bi(_randn(m, K, dtype=torch.bfloat16, seed=m), w)
    assert len(launched) == 1, launched


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device and compiled Triton")
def test_the_mtp_and_gated_norms_reduce_each_row_alone_on_cuda():
    """The MTP head's norms (engine/models/llama.py rms_norm) and the Mamba gated norm's per-group RMS
    (engine/models/mamba_mixer.py) run the per-row Triton RMSNorm on CUDA, not torch's mean (whose
    reduction may split a row by the batch's shape): a row's bits do not depend on the rows beside it,
    and the values match torch's."""
    from pdcluster.engine.models.llama import rms_norm
    from pdcluster.kernels import ops

    x = _randn(300, 576, dtype=torch.bfloat16, seed=8, device="cuda")
    w = _randn(576, dtype=torch.bfloat16, seed=9, device="cuda")
    full = rms_norm(x, w, 1e-5)
    for m in (1, 2, 7, 64, 257):
        assert torch.equal(rms_norm(x[:m], w, 1e-5), full[:m]), m
    x32 = x.float()
    ref = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    torch.testing.assert_close(full.float(), ref.float(), rtol=2 * BF16_ULP, atol=1e-2)
    groups = _randn(300 * 8, 128, dtype=torch.float32, seed=10, device="cuda")  # (token, group) rows
    unit = torch.ones(128, device="cuda")
    normed = ops.rms_norm(groups, unit, 1e-5)
    assert torch.equal(ops.rms_norm(groups[:8], unit, 1e-5), normed[:8])
    torch.testing.assert_close(normed, groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device and compiled Triton")
def test_linear_on_cuda_runs_the_batch_invariant_matmul_in_deterministic_mode():
    """engine/linear.py: deterministic mode on CUDA is matmul_bi (bitwise), the fast mode F.linear; a
    model-sized projection is row-invariant at decode and prefill batch sizes."""
    from pdcluster.engine.linear import Linear

    w = _randn(2560, 2048, dtype=torch.bfloat16, seed=4, device="cuda")
    x = _randn(300, 2048, dtype=torch.bfloat16, seed=5, device="cuda")
    det, fast = Linear(w, deterministic=True), Linear(w)
    assert det.deterministic and not fast.deterministic
    full = det(x)
    assert torch.equal(full, matmul_bi(x, w))
    assert torch.equal(fast(x), F.linear(x, w))
    torch.testing.assert_close(full.float(), fast(x).float(), rtol=2 * BF16_ULP, atol=1e-2)
    for m in (1, 2, 7, 32, 64, 65, 128, 257):
        assert torch.equal(det(x[:m]), full[:m]), m
    assert torch.equal(det(x[100:101]), full[100:101])
    assert torch.equal(det(x.float()), full)  # another input dtype is cast to the weight's first


def test_deterministic_mode_holds_on_cuda_where_triton_is(monkeypatch, caplog):
    """On a CUDA device deterministic mode runs these kernels when asked (flag or environment), and is
    not the default there; without triton an ask is an error. Needs no GPU: the choice is made from the
    config before anything touches the device."""
    from pdcluster.engine.config import DETERMINISTIC_ENV, EngineConfig
    from pdcluster.engine.linear import DeterministicUnavailable
    from pdcluster.engine.loaded_model import _resolve_deterministic
    from pdcluster.kernels import ops

    monkeypatch.delenv(DETERMINISTIC_ENV, raising=False)
    # On CUDA it is asked for (flag or environment), not the default (its cost there: loaded_model.py).
    assert _resolve_deterministic(EngineConfig(device="cuda")) is False
    assert _resolve_deterministic(EngineConfig(device="cpu")) is True
    assert _resolve_deterministic(EngineConfig(device="cuda:1", deterministic=True)) is True
    assert _resolve_deterministic(EngineConfig(device="cuda", deterministic=False)) is False
    monkeypatch.setenv(DETERMINISTIC_ENV, "1")
    assert _resolve_deterministic(EngineConfig(device="cuda")) is True
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    with pytest.raises(DeterministicUnavailable, match="--no-deterministic"):
        _resolve_deterministic(EngineConfig(device="cuda"))  # the environment's ask
    monkeypatch.delenv(DETERMINISTIC_ENV)
    with pytest.raises(DeterministicUnavailable, match="--no-deterministic"):
        _resolve_deterministic(EngineConfig(device="cuda", deterministic=True))


# ------------------------------------------------------------------------------------------- attention

HEAD_DIM = 16
BLOCK_SIZE = 4
CONTEXT = 45  # two key tiles of KV_TILE_TOKENS (32)
TARGET_POSITIONS = (30, 44)  # in the first and in the second key tile
OTHER_CONTEXTS = (13, 37, 9, 21, 17, 40)


class PagedContext(TargetContext):
    """Request 0 (the target) and the OTHER_CONTEXTS requests, their K/V in a paged cache with scattered
    blocks; the target's query vector for each position is fixed, the others' are drawn per call."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, dtype: torch.dtype, device: str):
        super().__init__((CONTEXT,) + OTHER_CONTEXTS, BLOCK_SIZE, 2, num_q_heads, num_kv_heads, HEAD_DIM, dtype, device,
                         seed=7)


def _fixed_tiles(query, cache, tables, seq_lens, qsl, scale):
    return attention.paged_attention_triton(query, cache, tables, seq_lens, qsl, scale)


# Batches the target's query rows meet: (name, rows). Request 0 is the target; the others bring their
# own query tokens (a decode row is (r, context - 1, 1) for request r of context length OTHER_CONTEXTS[r-1]).
SCENARIOS = [
    ("prefill, whole prompt alone", [(0, 0, CONTEXT)]),
    ("prefill chunk among a decode and a chunk", [(2, 36, 1), (0, 25, 20), (3, 0, 9)]),
    ("verification rows among decodes", [(1, 12, 1), (0, 41, 4), (4, 20, 1)]),
    ("decode batch", [(1, 12, 1), (2, 36, 1), (0, 44, 1), (5, 16, 1), (6, 39, 1)]),
    ("decode at 30 in a batch", [(0, 30, 1), (3, 8, 1)]),
]


def attention_invariance_failures(launch, ctx: PagedContext) -> list[str]:
    """Where the target's row for a position differs bitwise from the same query as a decode step alone."""
    return invariance_failures(launch, ctx, SCENARIOS, TARGET_POSITIONS)


def assert_decode_row_is_attention(out: torch.Tensor, ctx: PagedContext, dtype: torch.dtype) -> None:
    """``out``, the target's row at position 44 as a decode step, matches the torch reference."""
    expected = reference.paged_attention(ctx.target_q[44:45], ctx.cache.cpu(), ctx.tables[:1].cpu(),
                                         torch.tensor([45], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                                         HEAD_DIM**-0.5)[0]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().float(), expected.float(), **tol)


HEADS = [pytest.param(4, 2, id="gqa2"), pytest.param(6, 2, id="gqa3")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
def test_attention_query_is_the_same_in_prefill_verification_and_decode(device, dtype, num_q_heads, num_kv_heads):
    ctx = PagedContext(num_q_heads, num_kv_heads, dtype, device)
    assert attention_invariance_failures(_fixed_tiles, ctx) == []
    # ... and it is attention: the decode rows match the reference.
    out = ctx.run(_fixed_tiles, [(0, 44, 1)])[44]
    assert_decode_row_is_attention(out, ctx, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_the_attention_check_catches_a_key_tile_chosen_from_the_query_count(device):
    """Mutation: a key tile that shrinks when a call has many query tokens (a split of the context that
    depends on the batch) changes the online-softmax merges of prefill rows against decode rows."""

    def keyed_on_batch(query, cache, tables, seq_lens, qsl, scale):
        block_n = 16 if query.shape[0] > 8 else attention.KV_TILE_TOKENS
        block_q = attention.block_q_for(2)
        return attention.launch(query, cache, tables, seq_lens, qsl, scale, torch.empty_like(query), block_q, block_n)

    failures = attention_invariance_failures(keyed_on_batch, PagedContext(4, 2, torch.float32, device))
    assert any(f.startswith("prefill, whole prompt alone") for f in failures), failures
    assert not any(f.startswith("decode batch") for f in failures), failures  # 5 tokens: the fixed tile


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])  # the same launch logic in either dtype: one in the default suite
def test_attention_split_and_merged_in_kernel_give_the_same_rows(device, dtype, monkeypatch):
    """The context's fixed partitions merged by a second kernel (flash-decoding, chosen for launches with
    few programs) or inside the program give every row the same bits: partitions of 32 positions (two
    for CONTEXT), each scenario launched split, unsplit and by the production rule, against the
    decode step alone split."""
    monkeypatch.setattr(attention, "PARTITION", attention.KV_TILE_TOKENS)

    def fixed(split):
        def run(query, cache, tables, seq_lens, qsl, scale):
            block_q = attention.block_q_for(triton_next_pow2(query.shape[1] // cache.shape[3]))
            return attention.launch(query, cache, tables, seq_lens, qsl, scale, torch.empty_like(query), block_q,
                                    attention.KV_TILE_TOKENS, split=split)
        return run

    ctx = PagedContext(6, 2, dtype, device)
    alone = {pos: ctx.run(fixed(True), [(0, pos, 1)])[pos] for pos in TARGET_POSITIONS}
    for split in (True, False, None):
        for name, rows in SCENARIOS:
            for pos, row in ctx.run(fixed(split), rows).items():
                if pos in alone:
                    assert torch.equal(row, alone[pos]), (split, name, pos)
    # ... and the split path is attention (a second partition's keys are counted).
    out = alone[44]
    assert_decode_row_is_attention(out, ctx, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16],
                         ids=["fp32", "bf16"])  # the fast mode serves bf16 on GPUs: that one in the default suite
def test_fast_mode_attention_matches_the_reference(device, dtype):
    """batch_invariant=False (the fast mode): 128-row query tiles for prefill-sized calls, 64-key tiles,
    native 16-bit dots on a GPU; every scenario's target rows match the reference."""
    ctx = PagedContext(4, 2, dtype, device)

    def fast(query, cache, tables, seq_lens, qsl, scale):
        return attention.paged_attention_triton(query, cache, tables, seq_lens, qsl, scale, batch_invariant=False)

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for _, rows in SCENARIOS:
        for pos, row in ctx.run(fast, rows).items():
            expected = reference.paged_attention(
                ctx.target_q[pos : pos + 1], ctx.cache.cpu(), ctx.tables[:1].cpu(),
                torch.tensor([pos + 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), HEAD_DIM**-0.5)[0]
            torch.testing.assert_close(row.cpu().float(), expected.float(), **tol)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
def test_attention_tiles_are_constants_of_the_model(monkeypatch):
    """Every batch of SCENARIOS launches with the same tiles. The interpreter cannot see a row tile that
    changes with the batch (numpy's dot gives a row the same bits in a 16- or a 64-row tile; a GPU's dot
    instruction and row reductions follow the tile shape): this is the check that does. The tiles chosen
    before issue 24 (64 rows for batches of prefill chunks, 16 for decode) fail it."""
    assert [attention.block_q_for(g) for g in (1, 2, 4, 8, 16, 32)] == [16, 8, 4, 2, 1, 1]
    assert attention.KV_TILE_TOKENS == 32
    launched = set()
    real_launch = attention.launch

    def recording(*args, **kwargs):
        launched.add(args[-2:])  # (block_q, block_n)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(attention, "launch", recording)
    ctx = PagedContext(4, 2, torch.float32, "cpu")
    for _, rows in SCENARIOS:
        ctx.run(_fixed_tiles, rows)
    assert launched == {(attention.block_q_for(2), attention.KV_TILE_TOKENS)}


# ------------------------------------------------------------------------------------- compiled for GPUs
# The interpreter skips Triton's compiler (and runs the widened matmul): compile the GPU variants for an
# sm_80 (mma) and an sm_90 (wgmma) target, as a launch would, without a GPU. Subprocess: not interpreted.

_AOT_COMPILE = """
import inspect
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdcluster.kernels.triton_matmul_bi import _matmul_bi_kernel, tiles_for
from pdcluster.kernels.triton_paged_attention import _paged_attention_kernel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build(fn, pointer_types, constexprs, arch):
    # A constexpr the build leaves out takes its default, as a launch would (else it would be compiled as a
    # runtime int and its branches, e.g. HAS_SINKS's loads, compiled in).
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    constants = {(names.index(n),): v for n, v in constexprs.items()}
    triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", arch, 32))


for spec in sys.argv[1:]:  # kernel:dtype:arch[:N]
    kernel, dtype, arch, *n = spec.split(":")
    if kernel == "matmul":
        t = tiles_for(int(n[0]) if n else 2048, 2048, DTYPES[dtype])
        build(_matmul_bi_kernel, {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "out_ptr": "*" + dtype},
              dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, WIDEN=False,
                   DOT_PRECISION="ieee" if dtype == "fp32" else "tf32"), int(arch))
    else:
        build(_paged_attention_kernel,
              {"out_ptr": "*" + dtype, "query_ptr": "*" + dtype, "cache_ptr": "*" + dtype, "block_tables_ptr": "*i32",
               "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "qk_scale_log2": "fp32",
               "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32"},
              dict(stride_q_dim=1, stride_cache_dim=1, GROUP=4, GROUP_PAD=4, BLOCK_Q=attention_block_q,
                   BLOCK_M=16, BLOCK_N=32, HEAD_DIM_PAD=128, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                   PARTITION_SIZE=128, SPLIT=kernel == "attention-split", NATIVE_DOT=False),
              int(arch))
    print("compiled", spec)
""".replace("attention_block_q", str(attention.block_q_for(4)))


def _compile_for_cuda(tmp_path, specs: list[str]) -> None:
    stdout = compile_for_cuda(_AOT_COMPILE, tmp_path, specs, timeout_s=600)
    assert stdout.count("compiled") == len(specs), stdout


def test_the_native_bf16_matmul_compiles_for_cuda(tmp_path):
    """The variant a GPU runs (native bf16 dot: mma on sm_80, wgmma on sm_90) and fp32's IEEE dot."""
    _compile_for_cuda(tmp_path, ["matmul:bf16:80", "matmul:bf16:90", "matmul:fp32:80"])


@pytest.mark.slow
def test_every_deterministic_kernel_variant_compiles_for_cuda(tmp_path):
    specs = [f"matmul:{dtype}:{arch}:{n}" for arch in (80, 90) for dtype in ("bf16", "fp16", "fp32")
             for n in (2048, 11264, 49152)]
    _compile_for_cuda(tmp_path, specs + [f"{k}:{dtype}:{arch}" for arch in (80, 90) for dtype in ("bf16", "fp32")
                                 for k in ("attention", "attention-split")])
