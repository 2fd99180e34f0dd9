"""Programmatic dependent launch (kernels/launch_pdl.py): the decode step's Triton kernels, built for sm_90 as a
launch with PDL builds them, wait before they write anything or read anything but a weight, and let the next kernel
start only after that wait (read off their PTX: tests/ptx_rules.py); launches ask for PDL only inside a CUDA graph's
forward, on a Hopper-or-later GPU, when the engine has it on; on a GPU a graph of PDL kernels gives the same bits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels import launch_pdl
from pdcluster.kernels.graph_region import graph_region, in_graph_region
from ptx_rules import pre_wait
from triton_compile_helpers import compile_for_cuda

# ---- the sm_90 build ---------------------------------------------------------------------------------------

_BUILD = r"""
import json, sys
from sm90_build import build as build_sm90
from pdcluster.kernels import triton_paged_attention as pa, triton_skinny_gemm as sk
from pdcluster.kernels.triton_rms_norm import _rms_norm_kernel
from pdcluster.kernels.triton_rotary_kv import _rotary_write_kv_kernel
from pdcluster.kernels.triton_silu_and_mul import _silu_and_mul_kernel
from pdcluster.kernels import triton_skinny_epilogues as ep

use_pdl = sys.argv[1] == "1"
out = {}


def build(name, fn, pointer_types, constexprs, num_warps=4, num_stages=3):
    got = build_sm90(fn, pointer_types, {**constexprs, "USE_PDL": use_pdl}, num_warps=num_warps,
                     num_stages=num_stages, launch_pdl=use_pdl)
    out[name] = {k: got[k] for k in ("ptx", "params", "pointers")}


for residual in (False, True):
    build(f"rms_norm residual={residual}", _rms_norm_kernel,
          {"out_ptr": "*bf16", "x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "eps": "fp32"},
          dict(HAS_RESIDUAL=residual, BLOCK=2048), num_warps=8)
build("rotary_write_kv", _rotary_write_kv_kernel,
      {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
       "cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
      dict(stride_q_dim=1, stride_k_dim=1, stride_v_dim=1, stride_cos_sin_dim=1, stride_cache_dim=1,
           Q_HEADS_PAD=32, KV_HEADS_PAD=4, HALF_PAD=32))
build("silu_and_mul", _silu_and_mul_kernel, {"out_ptr": "*bf16", "x_ptr": "*bf16"}, dict(BLOCK=1024))
attention = {"out_ptr": "*bf16", "query_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
             "part_acc_ptr": "*fp32", "sinks_ptr": "*fp32", "qk_scale_log2": "fp32", "softcap": "fp32"}
build("paged_attention segments", pa._paged_attention_kernel, attention,
      dict(stride_q_dim=1, stride_cache_dim=1, GROUP=8, GROUP_PAD=8, BLOCK_Q=2, BLOCK_M=16, BLOCK_N=32,
           HEAD_DIM_PAD=64, DOT_PRECISION="tf32", PARTITION_SIZE=256, SPLIT=True, NATIVE_DOT=True, NUM_SEGMENTS=32))
build("paged_attention whole", pa._paged_attention_kernel, attention,
      dict(stride_q_dim=1, stride_cache_dim=1, GROUP=8, GROUP_PAD=8, BLOCK_Q=2, BLOCK_M=16, BLOCK_N=64,
           HEAD_DIM_PAD=64, DOT_PRECISION="tf32", PARTITION_SIZE=4096, SPLIT=False, NATIVE_DOT=True))
merge = {"out_ptr": "*bf16", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32",
         "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sinks_ptr": "*fp32"}
build("merge_segments", pa._merge_segments_kernel, merge, dict(stride_out_dim=1, NUM_SEGMENTS=32, HEAD_DIM_PAD=64))
build("merge_partitions", pa._merge_partitions_kernel, merge,
      dict(stride_out_dim=1, HEADS_PAD=32, HEAD_DIM_PAD=64, PARTITION_SIZE=128))
gemm = {"out_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*bf16"}
for silu in (False, True):
    build(f"skinny_gemm silu={silu}", sk._skinny_gemm_kernel, {**gemm, "out_ptr": "*fp32"},
          dict(ROWS_PAD=1, BLOCK_N=16, BLOCK_K=512, PARTIAL=True, SILU_AND_MUL=silu))
build("skinny_dot", sk._skinny_dot_kernel, gemm, dict(BLOCK_N=64, BLOCK_K=128, PARTIAL=False, NATIVE_DOT=True),
      num_stages=4)
build("skinny_dot gated", sk._skinny_dot_kernel, gemm, dict(BLOCK_N=64, BLOCK_K=64, PARTIAL=False, NATIVE_DOT=True,
                                                             ROWS=64, GATED=True), num_stages=4)
build("sum_splits", sk._sum_splits_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32"}, dict(SPLIT=4, BLOCK=1024))
build("sum_rms_norm", ep._sum_rms_norm_kernel,
      {"out_ptr": "*bf16", "part_ptr": "*fp32", "residual_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32"},
      dict(SPLIT=2, BLOCK=2048), num_warps=8)
build("sum_rotary_kv", ep._sum_rotary_kv_kernel,
      {"out_ptr": "*bf16", "part_ptr": "*fp32", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "cache_ptr": "*bf16",
       "slot_mapping_ptr": "*i64"},
      dict(stride_cos_sin_dim=1, stride_cache_dim=1, SPLIT=2, Q_HEADS_PAD=32, KV_HEADS_PAD=4, HALF_PAD=32))
print(json.dumps(out))
"""

# What each kernel may read before its wait: model weights, which no kernel of a forward writes.
_WEIGHTS = {"rms_norm": {"weight_ptr"}, "skinny_gemm": {"w_ptr"}, "skinny_dot": {"w_ptr"},
            "sum_rms_norm": {"norm_w_ptr"}}


def _pointers_read(build: dict, report) -> set[str]:
    """The memory a kernel reads before its wait, by argument: the pointers its read addresses derive from (integer
    arguments only offset them; a parameter past the arguments, Triton's scratch pointers, counts as read)."""
    params = build["params"]
    return {params[i] if i < len(params) else f"param {i}" for i in report.read_params
            if i >= len(params) or params[i] in build["pointers"]}


@pytest.fixture(scope="module")
def pdl_builds(tmp_path_factory) -> dict:
    return json.loads(compile_for_cuda(_BUILD, tmp_path_factory.mktemp("pdl"), ["1"]).strip().splitlines()[-1])


def test_every_pdl_kernel_waits_before_it_writes_or_reads_anything_but_weights(pdl_builds):
    assert len(pdl_builds) == 15
    for name, build in pdl_builds.items():
        report = pre_wait(build["ptx"])
        assert not report.problems and not report.writes, (name, report)
        read = _pointers_read(build, report)
        assert read <= _WEIGHTS.get(name.split()[0], set()), (name, read)
        assert "griddepcontrol.launch_dependents" in build["ptx"], name


def test_the_weight_loads_do_come_before_the_wait(pdl_builds):
    """The point of the early weight loads: with PDL they overlap the previous kernel."""
    for name, build in pdl_builds.items():
        allowed = _WEIGHTS.get(name.split()[0])
        if allowed:
            assert _pointers_read(build, pre_wait(build["ptx"])) == allowed, name


def test_without_pdl_the_kernels_have_no_wait(tmp_path):
    builds = json.loads(compile_for_cuda(_BUILD, tmp_path, ["0"]).strip().splitlines()[-1])
    assert all("griddepcontrol" not in b["ptx"] for b in builds.values())


_RULE_BREAKERS = r"""
import triton
import triton.language as tl
from pdcluster.kernels.triton_pdl import wait_then_release


@triton.jit
def early(out_ptr, x_ptr, w_ptr, USE_PDL: tl.constexpr):
    i = tl.arange(0, 128)
    w = tl.load(w_ptr + i)
    x = tl.load(x_ptr + tl.load(w_ptr + 128 + i).to(tl.int32))  # x read before the wait, at an address from w
    wait_then_release(USE_PDL)
    tl.store(out_ptr + i, x + w)


@triton.jit
def early_store(out_ptr, w_ptr, USE_PDL: tl.constexpr):
    i = tl.arange(0, 128)
    tl.store(out_ptr + i, tl.load(w_ptr + i))
    wait_then_release(USE_PDL)


@triton.jit
def branchy(out_ptr, n, USE_PDL: tl.constexpr):
    if n > 3:
        wait_then_release(USE_PDL)
    tl.store(out_ptr + tl.arange(0, 128), 1.0)
"""

_BUILD_RULE_BREAKERS = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
import rule_breakers as rb

out = {}
for name, sig in (("early", {"out_ptr": "*fp32", "x_ptr": "*fp32", "w_ptr": "*fp32"}),
                  ("early_store", {"out_ptr": "*fp32", "w_ptr": "*fp32"}),
                  ("branchy", {"out_ptr": "*fp32", "n": "i32"})):
    k = triton.compile(ASTSource(getattr(rb, name), {**sig, "USE_PDL": "constexpr"}, constexprs={(len(sig),): True}),
                       target=GPUTarget("cuda", 90, 32))
    out[name] = k.asm["ptx"]
print(json.dumps(out))
"""


def test_the_ptx_reading_catches_what_breaks_the_rule(tmp_path):
    """The check above can fail: an activation read before the wait (through an address loaded from a weight), a store
    before it, and a wait only some programs reach."""
    (tmp_path / "rule_breakers.py").write_text(_RULE_BREAKERS)
    ptx = json.loads(compile_for_cuda(_BUILD_RULE_BREAKERS, tmp_path, [str(tmp_path)]).strip().splitlines()[-1])
    assert pre_wait(ptx["early"]).read_params == {1, 2}  # x_ptr and w_ptr
    assert pre_wait(ptx["early_store"]).writes
    assert pre_wait(ptx["branchy"]).problems


# ---- when a launch asks for it -----------------------------------------------------------------------------


class _FakeCuda:
    device = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 and compiled Triton, as launch_pdl sees them."""
    monkeypatch.setattr(launch_pdl, "_INTERPRETED", False)
    monkeypatch.setitem(launch_pdl._capability, 0, (9, 0))
    launch_pdl.set_enabled(True)
    yield
    launch_pdl.set_enabled(True)


def test_pdl_only_inside_a_graph_region_on_hopper_when_enabled(hopper, monkeypatch):
    t = _FakeCuda()
    assert launch_pdl.options(t) == {}  # outside a graph's forward
    with graph_region():
        assert launch_pdl.options(t) == {"USE_PDL": True, "launch_pdl": True}
        with graph_region():
            assert launch_pdl.wanted(t)
        assert launch_pdl.wanted(t)  # nested regions unwind to the outer one
        assert not launch_pdl.wanted(torch.empty(1))  # a CPU tensor
        launch_pdl.set_enabled(False)
        assert launch_pdl.options(t) == {}
        launch_pdl.set_enabled(True)
        monkeypatch.setitem(launch_pdl._capability, 0, (8, 0))  # an A100: no PDL
        assert launch_pdl.options(t) == {}
        monkeypatch.setitem(launch_pdl._capability, 0, (9, 0))
        monkeypatch.setattr(launch_pdl, "_INTERPRETED", True)
        assert launch_pdl.options(t) == {}
    assert not in_graph_region()


def test_the_engine_flag_and_the_graphs_region(tiny_dir, monkeypatch):
    """generate and serve take --no-pdl, which reaches the runner's setting; the emulated decode graphs run their
    forward inside the PDL region, eager steps outside it."""
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.engine_args import engine_config_from_args

    for command in (["generate", "--prompt", "x"], ["serve"]):
        parse = lambda *a: engine_config_from_args(build_parser().parse_args([*command, *a]))  # noqa: E731
        assert parse().pdl is True
        assert parse("--no-pdl").pdl is False
    cfg = dict(max_num_seqs=4, dtype="float32", deterministic=False)
    make_engine("tiny-random", pdl=False, **cfg)
    assert launch_pdl.enabled() is False
    engine = make_engine("tiny-random", **cfg)
    assert launch_pdl.enabled() is True
    seen = []
    forward = engine.runner.model.forward

    def spy(*args, **kwargs):
        seen.append(in_graph_region())
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", spy)
    engine.runner.use_decode_graphs(emulate=True)
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert engine.runner.graphs.num_replays > 0
    assert True in seen and False in seen  # graph steps inside, the prefill outside


def test_a_capture_that_fails_with_pdl_is_retried_with_plain_launches(tiny_dir, monkeypatch, caplog):
    """A driver that cannot capture a PDL launch costs PDL, not the graph: the bucket is captured again with plain
    launches (PDL then off), and replays."""
    from pdcluster.engine.attention import AttentionMetadata
    from pdcluster.engine.cuda_graphs import DecodeGraphs

    engine = make_engine("tiny-random", max_num_seqs=4, num_kv_blocks=64)
    runner = engine.runner
    monkeypatch.setattr(launch_pdl, "supported", lambda device: True)
    launch_pdl.set_enabled(True)
    calls = []

    def forward(ids, pos, meta):
        calls.append(launch_pdl.enabled())
        if launch_pdl.enabled():
            raise RuntimeError("operation not supported when stream is capturing")
        return torch.zeros(ids.shape[0], 8)

    graphs = DecodeGraphs(forward, runner.device, 4, 1, 4, runner.model.scale, emulate=True)
    meta = AttentionMetadata(slot_mapping=torch.tensor([5]), block_tables=torch.tensor([[0]], dtype=torch.int32),
                             seq_lens=torch.tensor([6], dtype=torch.int32),
                             query_start_loc=torch.arange(2, dtype=torch.int32), uniform_q_len=1,
                             scale=runner.model.scale)
    try:
        with caplog.at_level("WARNING"):
            assert graphs.run(torch.tensor([7]), torch.tensor([5]), meta) is not None
        assert calls[:2] == [True, False] and not launch_pdl.enabled() and not graphs._failed
        assert "with programmatic dependent launch" in caplog.text and graphs.num_replays == 1
    finally:
        launch_pdl.set_enabled(True)


# ---- on a GPU ----------------------------------------------------------------------------------------------

_ON_HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper-or-later GPU and compiled Triton")


@pytest.mark.gpu
@_ON_HOPPER
def test_a_graph_of_pdl_kernels_gives_the_same_bits():
    """A layer's chain of our kernels (norm, few-row matmuls with split-K sums, SiLU, norm again), captured in a CUDA
    graph with and without PDL, replayed on fresh inputs: the same bits each time, and the same as eager."""
    from pdcluster.kernels import triton_skinny_gemm as sk
    from pdcluster.kernels.triton_rms_norm import rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    w_norm = torch.rand(2048, device=dev, dtype=dt, generator=g) + 0.5
    w_up = torch.randn(11264, 2048, device=dev, dtype=dt, generator=g) * 0.02
    w_down = torch.randn(2048, 5632, device=dev, dtype=dt, generator=g) * 0.02
    x = torch.empty(2, 2048, device=dev, dtype=dt)
    residual = torch.empty_like(x)
    split = next(t for t in sk.CANDIDATE_TILES if not t.dot and t.split > 1)
    dot = next(t for t in sk.CANDIDATE_TILES if t.dot)

    def layer():
        h = rms_norm_triton(x, w_norm, 1e-5, residual)
        up = sk.skinny_gemm(h, w_up, dot)
        down = sk.skinny_gemm(up, w_down, split, silu_and_mul=True)
        return rms_norm_triton(down, w_norm, 1e-5, residual)

    def fill(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device=dev, dtype=dt, generator=gen))
        residual.copy_(torch.randn(x.shape, device=dev, dtype=dt, generator=gen))

    results = {}
    for use in (False, True):
        launch_pdl.set_enabled(use)
        with graph_region():
            fill(0)
            layer()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer()
        runs = []
        for seed in range(1, 6):
            fill(seed)
            graph.replay()
            runs.append((out.clone(), residual.clone()))
        results[use] = runs
    launch_pdl.set_enabled(True)
    eager = []
    for seed in range(1, 6):
        fill(seed)
        eager.append((layer().clone(), residual.clone()))
    for (a, ra), (b, rb), (c, rc) in zip(results[False], results[True], eager):
        assert torch.equal(a, b) and torch.equal(ra, rb) and torch.equal(a, c) and torch.equal(ra, rc)
