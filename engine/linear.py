"""A weight matrix in the layout the CPU GEMM wants.

On CPU with bfloat16, oneDNN (through torch's mkldnn ops) reorders the weight into its blocked layout
on every plain ``F.linear`` call; done once at load time ("prepacking"), a decode-sized matmul runs
up to 2x faster (measured: 576x3072 at M=1 0.147 -> 0.070 ms, M=32 0.62 -> 0.54 ms, one thread) and
large-M prefill GEMMs are unchanged. float32 keeps ``F.linear`` (MKL), except for 2 to 8 rows (a
decode batch): MKL runs those as one matrix-vector pass over the weight per row, so a batch of two read
every weight twice (decode step of smollm2 fp32 here: 63 ms for one request, 100 ms for two); the C
kernel ``pd_linear_small_m`` (kernels/csrc/cpu_kernels.c) streams the weight once for all rows. On
CUDA, ``F.linear`` (cuBLAS) as is.

``pack_float32`` (the LM head): a float32 weight also gets a oneDNN copy packed for 32 rows, used for
up to PACKED_F32_MAX_ROWS rows (a decode batch's last hidden states); bigger inputs (prompt logprobs)
keep MKL, which is faster there. Measured on this box, one thread, smollm2's 576 x 49152 head: M=1
7.6 -> 6.4 ms, M=8 19.7 (16.8 with the small-M kernel) -> 11.1 ms, M=32 37.1 -> 28.6 ms; M=512 MKL
393 ms against 420 ms packed. The cost is a second copy of that one matrix (113 MB for smollm2).

On a CPU with AMX (Sapphire Rapids and later) a bf16 weight goes to the batch-invariant C GEMM below in
fast mode as well (``_amx_gemm``): its tile kernel is the faster one there.

``deterministic=True`` (issue 24, EngineConfig.deterministic): a bf16 or float32 CPU weight is packed for
the batch-invariant C GEMM (kernels/cpu_gemm.py, kernels/csrc/gemm_bi.c) and every call goes there, so
each output row is bit for bit a function of its own input row, whatever the number of rows (oneDNN's
bf16 GEMM varies with M at K=1536 here; MKL's fp32 GEMM and the small-M kernel switch with M). Without
the C library that mode is refused (DeterministicUnavailable), never silently dropped. On CUDA that mode
runs every call through the fixed-tile Triton matmul (kernels/triton_matmul_bi.py: no split-K, tiles from
the weight's shape only) on the plain weight; the fast mode keeps ``F.linear`` (cuBLAS, whose kernel and
split-K choice follow the number of rows), except that inside a CUDA graph's forward up to 128 rows of a
16-bit weight may run a weight-streaming Triton kernel where it measured faster on the GPU at hand (engine/skinny_linear.py; the MLP's
down projection then takes the SiLU-and-mul in the same kernel: ``after_silu_and_mul``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pdcluster.engine import skinny_linear
from pdcluster.kernels import cpu_gemm, cpu_ops, ops
from pdcluster.kernels.graph_region import in_graph_region


PACKED_F32_ROWS_HINT = 32  # the batch size oneDNN lays the float32 copy out for
PACKED_F32_MAX_ROWS = 64  # above this MKL on the plain weight is faster (see the module docstring)


@functools.cache
def _can_prepack(dtype: torch.dtype = torch.bfloat16) -> bool:
    try:
        w = torch.zeros(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=dtype), packed, None, "none", [], "")
        return torch.backends.mkldnn.is_available()
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def _amx_gemm() -> bool:
    """Whether fast mode's bf16 CPU linear is ours too: on an AMX CPU our tile kernel beat oneDNN's prepacked
    bf16 GEMM 2-4x at decode's 1-64 rows and came within 0.9-1.05x of it at 512-2,048 (bench/results/
    gemm_bi_amx_s71.json), so one path serves both modes there. PDCLUSTER_CPU_BF16_GEMM=onednn keeps oneDNN."""
    if os.environ.get("PDCLUSTER_CPU_BF16_GEMM", "").lower() == "onednn":
        return False
    return cpu_gemm.available() and cpu_gemm.best_isa(torch.bfloat16) == 4


_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None


class DeterministicUnavailable(RuntimeError):
    """Deterministic mode was asked for where the batch-invariant GEMM cannot run."""


def check_deterministic_available(device_type: str = "cpu") -> None:
    """Raise DeterministicUnavailable (one line saying why and what to do) unless the batch-invariant
    GEMM for ``device_type`` can run here: the C library on the CPU, Triton on CUDA."""
    if device_type == "cuda":
        if not ops.triton_available():
            raise DeterministicUnavailable("deterministic mode on CUDA needs triton (the batch-invariant "
                                           "matmul), which is not installed; pip install triton or run with "
                                           "--no-deterministic")
        return
    if cpu_gemm.available():
        return
    from pdcluster.kernels import cpu_build

    if os.environ.get("PDCLUSTER_CPU_KERNELS", "1") == "0":
        why = "PDCLUSTER_CPU_KERNELS=0 turns the C kernels off"
    elif cpu_build._compiler() is None:
        why = "no C compiler was found (set CC or install gcc: apt-get install gcc)"
    else:
        why = "building kernels/csrc/gemm_bi.c failed (see the warning logged above)"
    raise DeterministicUnavailable(f"deterministic mode needs the batch-invariant C GEMM, but {why}; "
                                   "fix that or run with --no-deterministic")


class Linear:
    """``y = x @ weight.T`` with the weight stored as the backend prefers. ``keep_weight`` keeps the
    plain [out, in] tensor beside a packed copy (for weights other code also reads, e.g. the tied
    embedding); otherwise a packed weight is the only copy (no doubled memory)."""

    def __init__(self, weight: torch.Tensor, prepack: bool = True, keep_weight: bool = False,
                 pack_float32: bool = False, deterministic: bool = False, bias: torch.Tensor | None = None):
        """``bias`` [out_features]: ``y = x @ weight.T + bias``, in the GEMM's epilogue where its kernel has one (the
        C GEMM and oneDNN: added to the fp32 accumulator, rounded once), else added after."""
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self._bias_f32 = bias.float().contiguous() if bias is not None and weight.device.type == "cpu" else None
        self.out_features, self.in_features = weight.shape
        self._packed = None
        self._packed_f32 = None  # beside the plain weight: up to PACKED_F32_MAX_ROWS rows
        self._packed_bi = None  # deterministic: the batch-invariant GEMM's layout (the only path then)
        self._cuda_bi = None  # deterministic on CUDA: kernels/triton_matmul_bi.matmul_bi on the plain weight
        # Fast mode on CUDA, 16-bit: few-row calls in a CUDA graph may take the skinny kernel (engine/skinny_linear.py).
        self._skinny = False
        on_cpu = prepack and weight.device.type == "cpu"
        if deterministic and weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32):
            check_deterministic_available()
            self._packed_bi = cpu_gemm.pack_bi(weight)
            if not keep_weight:
                self.weight = None
        elif deterministic and weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
            check_deterministic_available("cuda")
            from pdcluster.kernels.triton_matmul_bi import matmul_bi  # triton only where CUDA is

            self._cuda_bi = matmul_bi
        elif on_cpu and weight.dtype == torch.bfloat16 and _amx_gemm():
            self._packed_bi = cpu_gemm.pack_bi(weight)  # faster than oneDNN here, and batch-invariant for free
            if not keep_weight:
                self.weight = None
        elif on_cpu and weight.dtype == torch.bfloat16 and _can_prepack():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            if not keep_weight:
                self.weight = None
        elif on_cpu and pack_float32 and weight.dtype == torch.float32 and _can_prepack(torch.float32):
            self._packed_f32 = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_F32_ROWS_HINT)
        elif skinny_linear.takes(weight):
            skinny_linear.register(weight)
            self._skinny = True
        # oneDNN's fused bias takes the weight's dtype: converted once here, not on every call.
        self._bias_bf16 = bias.to(torch.bfloat16) if bias is not None and self._packed is not None else None

    @property
    def deterministic(self) -> bool:
        return self._packed_bi is not None or self._cuda_bi is not None

    def _skinny_tiles(self, x: torch.Tensor, silu_and_mul: bool, gated: bool = False):
        """The skinny kernel's tiles for ``x`` (None: cuBLAS; skinny_linear.choose measures once a shape and row
        count, and keeps the answer). Only inside a CUDA graph's forward (kernels/graph_region.py)."""
        if not self._skinny or self.bias is not None or not in_graph_region() or x.dim() != 2 or x.shape[0] == 0 \
                or x.shape[0] > skinny_linear.MAX_ROWS or x.stride(-1) != 1 or x.dtype is not self.weight.dtype:
            return None
        return skinny_linear.choose(self.weight, x.shape[0], silu_and_mul, gated)

    def silu_and_mul_after(self, x: torch.Tensor) -> torch.Tensor | None:
        """``ops.silu_and_mul(self(x))`` for the fused gate/up projection, in one kernel (the activation in the matmul's
        epilogue) where the skinny dot kernel was chosen for this many rows; None where it was not (the caller runs
        the matmul and the activation apart, or fuses the activation into the down projection). Above
        skinny_linear.FMA_MAX_ROWS rows only: below, the down projection's elementwise kernel takes the activation
        as it reads its input."""
        if x.shape[0] <= skinny_linear.FMA_MAX_ROWS:
            return None
        tiles = self._skinny_tiles(x, False, gated=True)
        if tiles is None:
            return None
        from pdcluster.kernels.triton_skinny_gemm import skinny_gemm

        return skinny_gemm(x, self.weight, tiles, gated=True)

    def then_rms_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor,
                      silu_and_mul: bool = False) -> torch.Tensor | None:
        """``ops.rms_norm(self(x), norm_weight, eps, residual=residual)`` (``silu_and_mul``: of
        ``self.after_silu_and_mul(x)``) with the residual add and the norm in the skinny kernel's epilogue, where that
        kernel was chosen for this many rows; None where it was not, having done nothing (the caller runs them apart).
        """
        if norm_weight.dtype is not x.dtype or residual.dtype is not x.dtype or residual.dim() != 2 \
                or residual.stride(1) != 1:
            return None
        from pdcluster.kernels.triton_skinny_epilogues import RmsNormEpilogue

        return self._with_epilogue(x, silu_and_mul, lambda: RmsNormEpilogue(norm_weight, eps, residual))

    def then_rotary_write_kv(self, x: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                             cos_sin: torch.Tensor, layer_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """The qkv projection's output [M, (num_q_heads + 2 num_kv_heads) * head_dim] with q and k rotated and K and
        V written into the cache (``ops.rotary_write_kv`` on its views), those in the skinny kernel's epilogue where
        that kernel was chosen for this many rows; None where it was not, having done nothing."""
        from pdcluster.kernels.triton_skinny_epilogues import RotaryKvEpilogue

        return self._with_epilogue(x, False, lambda: RotaryKvEpilogue(num_q_heads, num_kv_heads, positions, cos_sin,
                                                                     layer_cache, slot_mapping))

    def _with_epilogue(self, x: torch.Tensor, silu_and_mul: bool, epilogue) -> torch.Tensor | None:
        """The skinny kernel with ``epilogue()`` (built only then) where that kernel and its epilogues are on and it was
        chosen for this many rows; None, having done nothing, where not: the gate both ``then_*`` share."""
        tiles = self._skinny_tiles(x, silu_and_mul) if self._skinny and skinny_linear.epilogues() else None
        if tiles is None:
            return None
        from pdcluster.kernels.triton_skinny_gemm import skinny_gemm

        return skinny_gemm(x, self.weight, tiles, silu_and_mul=silu_and_mul, epilogue=epilogue())

    def after_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``self(silu(x[:, :d]) * x[:, d:])`` for the fused gate/up projection's output ``x``: one kernel where
        the skinny kernel was chosen for this many rows (the activation computed as the weight streams)."""
        tiles = self._skinny_tiles(x, True)
        if tiles is not None:
            from pdcluster.kernels.triton_skinny_gemm import skinny_gemm

            return skinny_gemm(x, self.weight, tiles, silu_and_mul=True)
        return self(ops.silu_and_mul(x))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self._matmul(x)
        if self._packed_bi is not None:  # the bias in the C GEMM's epilogue
            return cpu_gemm.linear_bi(x if x.dtype is self._packed_bi.dtype else x.to(self._packed_bi.dtype),
                                      self._packed_bi, bias=self._bias_f32)
        if self._packed is not None:  # in oneDNN's
            return _linear_pointwise(x if x.dtype is torch.bfloat16 else x.to(torch.bfloat16), self._packed,
                                     self._bias_bf16, "none", [], "")
        # Paths with no epilogue of their own (the skinny and batch-invariant Triton GEMMs, the packed fp32 and
        # small-M kernels _matmul picks) add the bias after; the rest is F.linear's.
        if self._skinny or self._cuda_bi is not None or (x.dtype is torch.float32 and (
                self._packed_f32 is not None or 2 * x.shape[-1] <= x.numel() <= cpu_ops.SMALL_M * x.shape[-1])):
            return self._matmul(x).add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._skinny:
            tiles = self._skinny_tiles(x, False)
            if tiles is not None:
                from pdcluster.kernels.triton_skinny_gemm import skinny_gemm

                return skinny_gemm(x, self.weight, tiles)
            return F.linear(x, self.weight)
        if self._cuda_bi is not None:
            return self._cuda_bi(x if x.dtype is self.weight.dtype else x.to(self.weight.dtype), self.weight)
        if self._packed_bi is not None:
            if x.dtype is not self._packed_bi.dtype:
                x = x.to(self._packed_bi.dtype)
            return cpu_gemm.linear_bi(x, self._packed_bi)
        if self._packed is not None:
            if x.dtype is not torch.bfloat16:
                x = x.to(torch.bfloat16)
            return _linear_pointwise(x, self._packed, None, "none", [], "")
        if (self._packed_f32 is not None and x.dtype is torch.float32 and x.is_contiguous()
                and x.numel() <= PACKED_F32_MAX_ROWS * x.shape[-1]):
            return _linear_pointwise(x, self._packed_f32, None, "none", [], "")
        if x.dtype is torch.float32 and 2 * x.shape[-1] <= x.numel() <= cpu_ops.SMALL_M * x.shape[-1]:
            out = cpu_ops.linear_small_m(x, self.weight)  # None: no C kernels here (falls through)
            if out is not None:
                return out
        return F.linear(x, self.weight)
