"""Triton Mamba2 prefill kernels (kernels/triton_mamba_scan.py: the chunked SSD scan;
kernels/triton_mamba_conv.py: the causal conv over a row) == the torch reference
(kernels/mamba_reference.py), under the interpreter (TRITON_INTERPRET=1, set in conftest.py); the
mixer's prefill rows routed through them by kernels/mamba_ops.py; the kernels compiled for CUDA targets
(no GPU needed); and, marked ``gpu``, both at a NemotronH-like size on a CUDA device.

Inputs are laid out as the mixer passes them: x, B and C are strided views into the packed conv output,
dt a slice of a wider projection row. Sizes are small (the interpreter costs about a millisecond per
program) but cover a one-token row, rows shorter than, equal to and not a multiple of the chunk, head_dim
and state size below the kernels' 16-wide blocks and not powers of two, 1 and 2 groups.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from pdcluster.engine.mamba_state import MambaStatePool
from pdcluster.kernels import mamba_ops
from pdcluster.kernels import mamba_reference as ref
from pdcluster.kernels.triton_mamba_conv import causal_conv1d_triton
from pdcluster.kernels.triton_mamba_scan import ssd_chunk_scan_triton
from test_triton_mamba import mixer_step, tiny_hybrid_mixer
from triton_compile_helpers import compile_for_cuda

CHUNK = 16
DT_MIN = 0.01

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

gpu = pytest.mark.gpu
needs_compiled_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device and compiled kernels (run with TRITON_INTERPRET=0)",
)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)


def _close_scan(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The scan's within-chunk decay is exp(cs_l - cs_s), a difference of cumsums (as in mamba_ssm), where
    the reference sums each segment: float32 rounding of |cs| (~45 after the dt = 25 token) shows up as
    a few 1e-5 absolute on outputs of ~100 with 80-token chunks."""
    _close(got, expected, atol=5e-5)


def _scan_case(length: int, heads: int = 4, head_dim: int = 8, groups: int = 2, state: int = 8, seed: int = 0):
    """x | B | C packed in one conv-output row, dt a slice of a wider projection row (as in the mixer).
    dt spans the clamp (softplus under DT_MIN: forced on the last token's head 1) and, on token 0 head 0,
    softplus's linear range (over 20: a decay of e^-40 or so, which sets |cumsum(dt A)| for that chunk)."""
    inter, gn = heads * head_dim, groups * state
    conv_out = _randn(length, inter + 2 * gn, seed=seed)
    proj = _randn(length, heads + 5, seed=seed + 1) * 1.5
    if length:
        proj[0, 5] = 25.0
        proj[-1, 6] = -10.0
    gen = torch.Generator().manual_seed(seed + 2)
    return dict(
        x=conv_out[:, :inter].view(length, heads, head_dim),
        dt=proj[:, 5:],
        A=-(torch.rand(heads, generator=gen) * 2 + 0.1),
        B=conv_out[:, inter : inter + gn].view(length, groups, state),
        C=conv_out[:, inter + gn :].view(length, groups, state),
        D=_randn(heads, seed=seed + 3),
        dt_bias=_randn(heads, seed=seed + 4) - 3.0,
        dt_min=DT_MIN,
    )


def _initial(case: dict, seed: int = 7) -> torch.Tensor:
    heads, head_dim = case["x"].shape[1:]
    return _randn(heads, head_dim, case["B"].shape[-1], seed=seed)


def _rows(case: dict, start: int, end: int) -> dict:
    return {k: (v[start:end] if k in ("x", "dt", "B", "C") else v) for k, v in case.items()}


# ---------------------------------------------------------------------------------------------------
# Chunked scan


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("length", [1, 7, 16, 33, 70])
def test_scan_matches_reference(length, groups):
    """Chunk 16: one token, a partial chunk, exactly one chunk, and 3 / 5 chunks with a partial last one;
    a non-zero initial state in, the final state out."""
    case = _scan_case(length, groups=groups, seed=length)
    initial = _initial(case)
    assert (torch.nn.functional.softplus(case["dt"] + case["dt_bias"]) < DT_MIN).any()  # the clamp is exercised
    y, final = ssd_chunk_scan_triton(**case, chunk_size=CHUNK, initial_state=initial)
    y_ref, final_ref = ref.ssd_chunk_scan(**case, chunk_size=CHUNK, initial_state=initial)
    _close_scan(y, y_ref)
    _close_scan(final, final_ref)
    assert torch.equal(initial, _initial(case))  # read, never written


@pytest.mark.parametrize("heads,head_dim,groups,state", [(4, 16, 2, 16), (2, 24, 1, 12)],
                         ids=["blocks-16", "masked-p-and-n"])
def test_scan_head_and_state_sizes(heads, head_dim, groups, state):
    case = _scan_case(40, heads=heads, head_dim=head_dim, groups=groups, state=state, seed=heads + state)
    y, final = ssd_chunk_scan_triton(**case, chunk_size=CHUNK, initial_state=_initial(case))
    y_ref, final_ref = ref.ssd_chunk_scan(**case, chunk_size=CHUNK, initial_state=_initial(case))
    _close_scan(y, y_ref)
    _close_scan(final, final_ref)


@pytest.mark.parametrize("chunk_size", [5, 80], ids=["chunk5", "chunk80-two-row-blocks"])
def test_scan_other_chunk_sizes(chunk_size):
    """A chunk under the 16-wide block (masked within it), and one over the kernels' 64-row block (two
    row blocks per chunk and the column loop over both)."""
    case = _scan_case(70, groups=2, seed=chunk_size)
    y, final = ssd_chunk_scan_triton(**case, chunk_size=chunk_size, initial_state=_initial(case))
    y_ref, final_ref = ref.ssd_chunk_scan(**case, chunk_size=chunk_size, initial_state=_initial(case))
    _close_scan(y, y_ref)
    _close_scan(final, final_ref)


def test_scan_from_zero_state_equals_the_recurrence():
    case = _scan_case(33, seed=5)
    y, final = ssd_chunk_scan_triton(**case, chunk_size=CHUNK)
    y_rec, final_rec, _ = ref.ssm_recurrence(**case)
    _close_scan(y, y_rec)
    _close_scan(final, final_rec)


def test_scan_in_two_pieces_carries_the_state():
    """A prompt scanned as 23 + 47 tokens (a split inside a chunk), the first piece's final state the
    second's initial state, equals the prompt scanned at once."""
    case = _scan_case(70, seed=11)
    initial = _initial(case)
    whole_y, whole_state = ssd_chunk_scan_triton(**case, chunk_size=CHUNK, initial_state=initial)
    y1, state1 = ssd_chunk_scan_triton(**_rows(case, 0, 23), chunk_size=CHUNK, initial_state=initial)
    y2, state2 = ssd_chunk_scan_triton(**_rows(case, 23, 70), chunk_size=CHUNK, initial_state=state1)
    _close_scan(torch.cat([y1, y2]), whole_y)
    _close_scan(state2, whole_state)


def test_scan_empty_row_returns_the_initial_state():
    case = _scan_case(0)
    y, final = ssd_chunk_scan_triton(**case, chunk_size=CHUNK, initial_state=_initial(case))
    assert y.shape == (0, 4, 8)
    assert torch.equal(final, _initial(case))


# ---------------------------------------------------------------------------------------------------
# Causal conv over a row


def _conv_case(length: int, kernel: int, seed: int = 0):
    """conv_dim 140: two channel blocks of 128, the second masked; x a view with row stride 200."""
    conv_dim = 140
    x = _randn(length, 200, seed=seed)[:, 30:170]
    return x, _randn(conv_dim, kernel - 1, seed=seed + 1), _randn(conv_dim, kernel, seed=seed + 2), \
        _randn(conv_dim, seed=seed + 3)


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("length", [1, 2, 7, 40])
def test_conv_matches_reference(length, kernel):
    """Rows shorter than the state (the new state mixes old state and x), and longer than one 32-token block."""
    x, state, weight, bias = _conv_case(length, kernel, seed=length + kernel)
    before = state.clone()
    for b, activation in ((bias, True), (None, False)):
        out, new_state = causal_conv1d_triton(x, state, weight, b, activation)
        out_ref, new_state_ref = ref.causal_conv1d(x, state, weight, b, activation)
        _close(out, out_ref)
        assert torch.equal(new_state, new_state_ref)  # copies of inputs, exactly
    assert torch.equal(state, before)


def test_conv_in_two_pieces_carries_the_state():
    x, state, weight, bias = _conv_case(40, 4, seed=3)
    whole, whole_state = causal_conv1d_triton(x, state, weight, bias)
    out1, state1 = causal_conv1d_triton(x[:2], state, weight, bias)
    out2, state2 = causal_conv1d_triton(x[2:], state1, weight, bias)
    _close(torch.cat([out1, out2]), whole)
    assert torch.equal(state2, whole_state)


# ---------------------------------------------------------------------------------------------------
# The mixer's prefill rows through the Triton kernels (dispatch in mamba_ops.py)


def _run_mixer_prefills():
    """Two fresh rows (33 and 7 tokens) in one step, then the first continued by 20 tokens."""
    arch, mixer = tiny_hybrid_mixer()
    pool = MambaStatePool(arch.mamba_state_shape(), 4, max_positions_per_step=1)
    outputs = [mixer_step(arch, mixer, pool, [(3, 33, False, False), (1, 7, False, False)], seed=30),
               mixer_step(arch, mixer, pool, [(3, 20, True, False)], seed=31)]
    return outputs, pool


def test_mixer_prefill_through_triton_matches_reference(monkeypatch):
    expected, expected_pool = _run_mixer_prefills()
    monkeypatch.setattr(mamba_ops, "_use_triton", lambda *tensors: True)
    for name in ("causal_conv1d", "ssd_chunk_scan"):
        monkeypatch.setattr(ref, name, None)  # the reference prefill kernels may not be reached
    got, pool = _run_mixer_prefills()
    for g, e in zip(got, expected):
        _close(g, e)
    for g, e in zip(pool.conv + pool.ssm, expected_pool.conv + expected_pool.ssm):
        _close(g, e)


def test_prefill_ops_use_the_reference_on_cpu(monkeypatch):
    """CPU tensors never reach the Triton modules (they would need a GPU, or the interpreter)."""
    for module in ("pdcluster.kernels.triton_mamba_scan", "pdcluster.kernels.triton_mamba_conv"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    case = _scan_case(7)
    y, final = mamba_ops.ssd_chunk_scan(**case, chunk_size=CHUNK, initial_state=_initial(case))
    y_ref, final_ref = ref.ssd_chunk_scan(**case, chunk_size=CHUNK, initial_state=_initial(case))
    assert torch.equal(y, y_ref) and torch.equal(final, final_ref)
    x, state, weight, bias = _conv_case(7, 4)
    out, _ = mamba_ops.causal_conv1d(x, state, weight, bias)
    assert torch.equal(out, ref.causal_conv1d(x, state, weight, bias)[0])
    assert "pdcluster.kernels.triton_mamba_scan" not in sys.modules
    assert "pdcluster.kernels.triton_mamba_conv" not in sys.modules


# ---------------------------------------------------------------------------------------------------
# GPU build: the interpreter skips Triton's compiler, which is stricter (loop-carried types, dot shapes).
# Compile the kernels ahead of time for sm_90 (H100 / H200) as a launch would; no GPU needed. Subprocess:
# this one must not interpret (as in test_kernels.py).

_AOT_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdcluster.kernels.triton_mamba_conv import _causal_conv1d_kernel
from pdcluster.kernels.triton_mamba_scan import _chunk_scan_kernel, _chunk_state_passing_kernel, _dt_cumsum_kernel


def build(fn, constexprs, arch):
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else "*fp32" if n.endswith("_ptr")
                 else "fp32" if n == "dt_min" else "i32" for n in names}
    constants = {(names.index(n),): v for n, v in constexprs.items()}
    triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", arch, 32))


for arch in (90,):  # H100 / H200
    build(_dt_cumsum_kernel, dict(BLOCK_CS=128), arch)
    for has_init in (False, True):
        build(_chunk_state_passing_kernel, dict(HAS_INIT=has_init, BLOCK_K=64, BLOCK_P=32, BLOCK_N=128), arch)
    build(_chunk_scan_kernel, dict(BLOCK_M=64, BLOCK_P=64, BLOCK_N=128), arch)
    build(_chunk_scan_kernel, dict(BLOCK_M=16, BLOCK_P=16, BLOCK_N=16), arch)
    build(_causal_conv1d_kernel, dict(WIDTH=3, HAS_BIAS=True, SILU=True, BLOCK_T=32, BLOCK_C=128, BLOCK_W=4), arch)
print("compiled")
"""


@pytest.mark.slow  # ~25 s of compiling; the one-token kernels' compile is test_kernels.py's, in the default suite
def test_prefill_kernels_compile_for_cuda(tmp_path):
    assert "compiled" in compile_for_cuda(_AOT_COMPILE, tmp_path)


# ---------------------------------------------------------------------------------------------------
# On a CUDA device, compiled (TRITON_INTERPRET=0): a NemotronH-like size against the reference on the CPU
# (float32 there: no TF32 in the oracle).


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.cpu() - expected).abs().max() / expected.abs().max()).item()


@gpu
@needs_compiled_cuda
def test_scan_on_cuda_at_nemotron_size():
    """2,048 tokens (chunk 128 divides it) and 2,000 (a partial last chunk); 64 heads x 64, state 128,
    8 groups."""
    for length in (2048, 2000):
        case = _scan_case(length, heads=64, head_dim=64, groups=8, state=128, seed=length)
        initial = _initial(case)
        y_ref, final_ref = ref.ssd_chunk_scan(**case, chunk_size=128, initial_state=initial)
        on_gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
        y, final = ssd_chunk_scan_triton(**on_gpu, chunk_size=128, initial_state=initial.cuda())
        assert y.is_cuda and final.is_cuda
        # The interpreter gave 3e-6 (y) and 5e-7 (state) relative to the largest value (|y| ~ 550) at 2,000.
        assert _rel_err(y, y_ref) < 2e-5, _rel_err(y, y_ref)
        assert _rel_err(final, final_ref) < 2e-5, _rel_err(final, final_ref)


@gpu
@needs_compiled_cuda
def test_conv_on_cuda_at_nemotron_size():
    conv_dim, length = 64 * 64 + 2 * 8 * 128, 2048
    x = _randn(length, conv_dim + 100, seed=1)[:, 50 : 50 + conv_dim]
    state, weight, bias = _randn(conv_dim, 3, seed=2), _randn(conv_dim, 4, seed=3), _randn(conv_dim, seed=4)
    out_ref, state_ref = ref.causal_conv1d(x, state, weight, bias)
    out, new_state = causal_conv1d_triton(x.cuda(), state.cuda(), weight.cuda(), bias.cuda())
    torch.testing.assert_close(out.cpu(), out_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_state.cpu(), state_ref)
