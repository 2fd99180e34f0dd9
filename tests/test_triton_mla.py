"""The latent-attention kernel (kernels/triton_mla_attention.py): DeepSeek's absorbed MLA on CUDA.

Under TRITON_INTERPRET=1 (conftest) here, compiled where a GPU is (``gpu`` marker): the kernel equals the torch
reference (every head over one cached vector a token, the latents as values) for prefill chunks, decode and
verification rows, contexts over several partitions, split or merged in the program, heads fewer and more than a
tile, the published width (512 + 64); a row's bits do not depend on its batch; and the kernel compiles for sm_80
and sm_90 within their shared memory.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdcluster.kernels import ops, reference
from pdcluster.kernels import triton_mla_attention as mla
from attention_contexts import TargetContext, invariance_failures
from triton_compile_helpers import compile_for_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETED
DEVICES = [
    pytest.param("cpu", id="interpreted", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not ON_GPU, reason="needs a CUDA device and compiled Triton")]),
]
BLOCK_SIZE = 8
# Partitions of 32 positions here (two key tiles; the engine's are 128) keep the interpreter's runs short while
# contexts still span three of them.
PARTITION = 32
CONTEXT = 75
TARGET_POSITIONS = (20, 50, 74)
OTHER_CONTEXTS = (13, 40, 9, 66)


@pytest.fixture(autouse=True)
def _short_partitions(monkeypatch):
    monkeypatch.setattr(mla, "PARTITION", PARTITION)


class LatentContext(TargetContext):
    """Request 0 (the target) and the OTHER_CONTEXTS requests, their latent vectors in a one-plane paged cache;
    ``run`` hands the launch the latent's width after the call's arguments."""

    def __init__(self, num_heads: int, latent: int, rope: int, dtype: torch.dtype, device: str):
        super().__init__((CONTEXT,) + OTHER_CONTEXTS, BLOCK_SIZE, 1, num_heads, 1, latent + rope, dtype, device, seed=5)
        self.num_heads, self.latent = num_heads, latent

    def run(self, launch, rows) -> dict[int, torch.Tensor]:
        return super().run(launch, rows, self.latent)


def fixed_tiles(query, cache, tables, seq_lens, qsl, scale, latent):
    return mla.mla_attention_triton(query, cache, tables, seq_lens, qsl, scale, latent)


# Batches the target's rows meet (request 0 is the target; a decode row of request r is (r, context - 1, 1)).
SCENARIOS = [
    ("prefill chunk across a partition's end, among a decode", [(2, 39, 1), (0, 14, 40)]),
    ("verification rows among decodes", [(1, 12, 1), (0, 47, 4), (4, 65, 1)]),
    ("decode batch", [(1, 12, 1), (2, 39, 1), (0, 20, 1), (3, 8, 1), (4, 65, 1)]),
    ("last position in a batch", [(4, 65, 1), (0, 74, 1)]),
]


def latent_invariance_failures(launch, ctx: LatentContext) -> list[str]:
    """Where the target's row for a position differs bitwise from the same query as a decode step alone."""
    return invariance_failures(launch, ctx, SCENARIOS, TARGET_POSITIONS)


def assert_matches_reference(out: torch.Tensor, args, latent: int, dtype: torch.dtype) -> None:
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    expected = reference.latent_attention(*cpu_args, latent)
    assert not expected.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().float(), expected.float(), **tol)


MIXED = [(2, 39, 1), (0, 30, 20), (1, 10, 3), (4, 50, 16), (3, 8, 1)]  # decode, chunks, verification


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads, split", [(4, None), (20, False), (20, True)],
                         ids=["4heads-rule", "20heads-merged", "20heads-split"])
def test_latent_attention_matches_the_reference(device, num_heads, split):
    """Heads fewer than a tile (4 tokens a tile), and a full head block and a partial one (20); contexts over
    three partitions, merged in the program, by the second kernel, or by the launch's rule."""
    ctx = LatentContext(num_heads, 32, 16, torch.float32, device)
    args, _ = ctx.batch(MIXED)
    out = mla.launch(*args, ctx.latent, split=split)
    assert out.shape == (args[0].shape[0], num_heads, ctx.latent)
    assert_matches_reference(out, args, ctx.latent, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_latent_attention_at_the_published_width(device, dtype):
    """DeepSeek-V2 / V3's latent (512) and rotary part (64) with 16 heads, the query a strided view (the model's
    query buffer sliced), and the engine's handing of the plane as K and V (a stride-0 view) read alike."""
    ctx = LatentContext(16, 512, 64, dtype, device)
    args, _ = ctx.batch([(2, 39, 1), (0, 40, 12), (4, 65, 1)])
    padded = torch.zeros(args[0].shape[0], 16, 600, dtype=dtype, device=device)
    padded[:, :, 7:583] = args[0]
    strided = padded[:, :, 7:583]
    out = mla.mla_attention_triton(strided, *args[1:], 512)
    assert_matches_reference(out, args, 512, dtype)
    planes = ctx.cache.expand(2, *ctx.cache.shape[1:])
    assert torch.equal(mla.mla_attention_triton(strided, planes, *args[2:], 512), out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, num_heads", [(torch.float32, 4), (torch.bfloat16, 4),
                                              pytest.param(torch.float32, 16, marks=pytest.mark.slow)],
                         ids=["fp32-4heads", "bf16-4heads", "fp32-16heads"])
def test_latent_attention_rows_are_batch_invariant(device, dtype, num_heads):
    """A query's row has the same bits as a decode step alone, in a prefill chunk, among verification rows and
    in decode batches, and whether the partitions merge in the program or in the second kernel."""
    ctx = LatentContext(num_heads, 32, 16, dtype, device)
    assert latent_invariance_failures(fixed_tiles, ctx) == []
    alone = {pos: ctx.run(fixed_tiles, [(0, pos, 1)])[pos] for pos in TARGET_POSITIONS}
    for split in (True, False):
        def launch(*args, split=split):
            return mla.launch(*args, split=split)
        for name, rows in SCENARIOS:
            for pos, row in ctx.run(launch, rows).items():
                if pos in alone:
                    assert torch.equal(row, alone[pos]), (split, name, pos)
    args, _ = ctx.batch([(0, 74, 1)])
    assert_matches_reference(alone[74].unsqueeze(0), args, ctx.latent, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_the_latent_check_catches_a_key_tile_chosen_from_the_batch(device):
    """Mutation: a key tile that widens for calls with many query tokens changes the online-softmax merges of a
    prefill chunk's rows against the same queries decoded alone."""

    def keyed_on_batch(query, cache, tables, seq_lens, qsl, scale, latent):
        block_n = 32 if query.shape[0] > 8 else mla.KV_TILE_TOKENS
        return mla.launch(query, cache, tables, seq_lens, qsl, scale, latent, block_n)

    failures = latent_invariance_failures(keyed_on_batch, LatentContext(4, 32, 16, torch.float32, device))
    assert any(f.startswith("prefill chunk") for f in failures), failures
    assert not any(f.startswith("decode batch") for f in failures), failures  # 5 tokens: the fixed tile


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
def test_latent_tiles_are_constants_of_the_model(monkeypatch):
    """Every batch launches the same row and key tiles (the interpreter's dot cannot see a row tile that changes
    with the batch; a GPU's can): 16 rows, heads first."""
    assert [mla.heads_block_for(h) for h in (1, 4, 16, 20, 128)] == [1, 4, 16, 16, 16]
    launched = set()
    kernel = mla._mla_attention_kernel

    class Recording:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launched.add((kw["BLOCK_M"], kw["BLOCK_N"], kw["HEADS_BLOCK"], kw["NATIVE_DOT"]))
                return kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(mla, "_mla_attention_kernel", Recording())
    ctx = LatentContext(4, 32, 16, torch.float32, "cpu")
    for _, rows in SCENARIOS:
        ctx.run(fixed_tiles, rows)
    assert launched == {(16, mla.KV_TILE_TOKENS, 4, False)}


def test_ops_latent_attention_on_cpu_equals_the_reference():
    """The engine's CPU path (the C paged kernel over the plane as K and V, or the reference without a compiler)
    returns the latent dims of every head."""
    ctx = LatentContext(16, 512, 64, torch.float32, "cpu")
    args, _ = ctx.batch(MIXED)
    out = ops.latent_attention(*args, 512)
    assert out.shape == (args[0].shape[0], 16, 512)
    expected = reference.latent_attention(*args, 512)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # the C kernel sums 576 dims in its order


def test_launch_refuses_what_it_cannot_compute():
    ctx = LatentContext(4, 32, 16, torch.float32, "cpu")
    args, _ = ctx.batch([(0, 10, 1)])
    with pytest.raises(ValueError, match="rotary parts"):
        mla.launch(*args, 48)
    two_heads = torch.zeros(2, *ctx.cache.shape[1:3], 2, 48)
    with pytest.raises(ValueError, match="one cached vector"):
        mla.launch(args[0], two_heads, *args[2:], 32)


# ------------------------------------------------------------------------------------- compiled for GPUs

_AOT_COMPILE = """
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdcluster.kernels import triton_mla_attention as mla

# Shared memory an sm_80 / sm_90 block may take (A100: 163 KiB, H100: 227 KiB).
LIMITS = {80: 166912, 90: 232448}
for spec in sys.argv[1:]:  # dtype:arch:variant, variant = fixed | fixed-split | native
    dtype, arch, variant = spec.split(":")
    arch, native = int(arch), variant == "native"
    names = mla._mla_attention_kernel.arg_names
    ptrs = {"out_ptr": "*" + dtype, "query_ptr": "*" + dtype, "cache_ptr": "*" + dtype, "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
            "part_acc_ptr": "*fp32", "qk_scale_log2": "fp32"}
    constexprs = dict(stride_q_dim=1, stride_cache_dim=1, LATENT=512, ROPE=64, LATENT_PAD=512, ROPE_PAD=64,
                      HEADS_BLOCK=16, BLOCK_Q=1, BLOCK_M=16,
                      BLOCK_N=mla.NATIVE_KV_TILE_TOKENS if native else mla.KV_TILE_TOKENS,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", PARTITION_SIZE=mla.PARTITION,
                      SPLIT=variant == "fixed-split", NATIVE_DOT=native)
    signature = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in names}
    constants = {(names.index(n),): v for n, v in constexprs.items()}
    compiled = triton.compile(ASTSource(mla._mla_attention_kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    shared = compiled.metadata.shared
    assert shared <= LIMITS[arch], f"{spec}: {shared} bytes of shared memory > {LIMITS[arch]}"
    print("compiled", spec, "shared", shared)
"""


def test_latent_kernel_compiles_for_cuda_within_shared_memory(tmp_path):
    """The published shape (16 heads a tile, 512 + 64) as the engine launches it: fp32 dots (fp32 on sm_80, bf16
    split on sm_90) and bf16's native dots (the fast mode) on both."""
    specs = ["fp32:80:fixed", "bf16:90:fixed-split", "bf16:80:native", "bf16:90:native"]
    stdout = compile_for_cuda(_AOT_COMPILE, tmp_path, specs, timeout_s=600)
    assert stdout.count("compiled") == len(specs), stdout
