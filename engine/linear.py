"""A weight matrix in the layout the CPU GEMM wants.

On CPU with bfloat16, oneDNN (through torch's mkldnn ops) reorders the weight into its blocked layout
on every plain ``F.linear`` call; done once at load time ("prepacking"), a decode-sized matmul runs
up to 2x faster (measured: 576x3072 at M=1 0.147 -> 0.070 ms, M=32 0.62 -> 0.54 ms, one thread) and
large-M prefill GEMMs are unchanged. float32 keeps ``F.linear`` (MKL), except for 2 to 8 rows (a
decode batch): MKL runs those as one matrix-vector pass over the weight per row, so a batch of two read
every weight twice (decode step of smollm2 fp32 here: 63 ms for one request, 100 ms for two); the C
kernel ``pd_linear_small_m`` (kernels/csrc/cpu_kernels.c) streams the weight once for all rows. On
CUDA, ``F.linear`` (cuBLAS) as is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pdcluster.kernels import cpu_ops


@functools.cache
def _can_prepack() -> bool:
    try:
        w = torch.zeros(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
        return torch.backends.mkldnn.is_available()
    except (RuntimeError, AttributeError):
        return False


_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None


class Linear:
    """``y = x @ weight.T`` with the weight stored as the backend prefers. ``keep_weight`` keeps the
    plain [out, in] tensor beside a packed copy (for weights other code also reads, e.g. the tied
    embedding); otherwise a packed weight is the only copy (no doubled memory)."""

    def __init__(self, weight: torch.Tensor, prepack: bool = True, keep_weight: bool = False):
        self.weight: torch.Tensor | None = weight
        self.out_features, self.in_features = weight.shape
        self._packed = None
        if prepack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _can_prepack():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            if not keep_weight:
                self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            if x.dtype is not torch.bfloat16:
                x = x.to(torch.bfloat16)
            return _linear_pointwise(x, self._packed, None, "none", [], "")
        if x.dtype is torch.float32 and 2 * x.shape[-1] <= x.numel() <= cpu_ops.SMALL_M * x.shape[-1]:
            out = cpu_ops.linear_small_m(x, self.weight)  # None: no C kernels here (falls through)
            if out is not None:
                return out
        return F.linear(x, self.weight)
