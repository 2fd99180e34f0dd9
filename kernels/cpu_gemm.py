"""Batch-invariant linear on CPU (issue 24): ``y = x @ w.T`` where each output row depends only on its
own input row, bit for bit, whatever the number of rows in the call and the thread count.

The C kernel (kernels/csrc/gemm_bi.c, ``pd_gemm_bi``) gives every output element one fp32 accumulator
updated in increasing k by one fixed operation (fma for float32; for bfloat16 ``vdpbf16ps`` on pairs of
k where the CPU has avx512_bf16, else two fmas; ``tdpbf16ps`` tiles over 32 k at a time where it has AMX,
for every row count), so the row count, tile and thread only choose which
elements are computed together, never how (invariant BI, stated in that file). Why our own: on this
box oneDNN's bf16 GEMM changes rows with the batch at K=1536 (the MLP's down projection) and MKL's
float32 GEMM changes them at every shape we measured (bench/gemm_bi.py --variance).

Usage: ``packed = pack_bi(weight)`` once at load (the packed copy replaces the plain weight), then
``linear_bi(x, packed)`` per call. Like kernels/cpu_ops.py, the wrappers refuse tensors outside host
memory and return None when the library is unavailable or the inputs are outside what C handles, so
the caller falls back (and is then no longer batch-invariant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.kernels import cpu_build

STRIP = 16  # output columns per packed strip (gemm_bi.c STRIP)
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
ISA_NAMES = {1: "scalar", 2: "avx2", 3: "avx512", 4: "amx"}  # bf16 "avx512" means avx512_bf16; "amx" bf16 only


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] weight in gemm_bi.c's strip layout (float32 [S][K][16], bfloat16
    [S][K/2][16][2], S = ceil(out / 16), zero padded)."""

    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def _lib():
    lib = cpu_build.load()
    return lib if lib is not None and hasattr(lib, "pd_gemm_bi") else None


def available() -> bool:
    return _lib() is not None


def best_isa(dtype: torch.dtype) -> int | None:
    """The path pd_gemm_bi takes for ``dtype`` on this machine (see ISA_NAMES), None without the library."""
    lib = _lib()
    return None if lib is None or dtype not in _DTYPE_CODE else lib.pd_gemm_bi_isa(_DTYPE_CODE[dtype])


def pack_bi(weight: torch.Tensor) -> PackedWeight | None:
    """The strip layout of a float32 or bfloat16 CPU weight [N, K]; None for anything else."""
    if weight.dim() != 2 or weight.dtype not in _DTYPE_CODE or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    strips = -(-n // STRIP)
    if weight.dtype is torch.bfloat16:
        kx = k + (k & 1)
        padded = F.pad(weight, (0, kx - k, 0, strips * STRIP - n))
        data = padded.view(strips, STRIP, kx // 2, 2).permute(0, 2, 1, 3)
    else:
        padded = F.pad(weight, (0, 0, 0, strips * STRIP - n))
        data = padded.view(strips, STRIP, k).permute(0, 2, 1)
    return PackedWeight(data.contiguous(), n, k)


def linear_bi(x: torch.Tensor, packed: PackedWeight, out_dtype: torch.dtype | None = None, isa: int = 0,
              num_threads: int | None = None, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for the weight ``packed`` came from, batch-invariant (see the module).
    ``x`` must have the weight's dtype; the output has it too unless ``out_dtype=torch.float32``. ``bias``: float32
    [out_features], added to each fp32 accumulator before it is rounded (one rounding, as oneDNN's fused bias).
    ``isa`` forces a path (tests, benchmarks; 0 = best). None when not applicable."""
    lib = _lib()
    out_dtype = out_dtype or x.dtype
    if (lib is None or x.dtype is not packed.dtype or x.device.type != "cpu" or packed.data.device.type != "cpu"
            or x.shape[-1] != packed.in_features or out_dtype not in (x.dtype, torch.float32)):
        return None
    if bias is not None and (not hasattr(lib, "pd_gemm_bi_bias") or bias.dtype is not torch.float32
                             or bias.device.type != "cpu" or bias.shape != (packed.out_features,)
                             or not bias.is_contiguous()):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.out_features, dtype=out_dtype)
    threads = torch.get_num_threads() if num_threads is None else num_threads
    args = (_DTYPE_CODE[x.dtype], rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data.data_ptr(),
            packed.out_features, packed.in_features, out.data_ptr(), out.stride(0), int(out_dtype is torch.float32),
            isa, threads)
    rc = lib.pd_gemm_bi(*args) if bias is None else lib.pd_gemm_bi_bias(*args, bias.data_ptr())
    if rc != 0:
        raise ValueError(f"pd_gemm_bi refused isa {isa} for {x.dtype} (this machine's best is "
                         f"{lib.pd_gemm_bi_isa(_DTYPE_CODE[x.dtype])}; see cpu_gemm.ISA_NAMES)")
    return out.reshape(*x.shape[:-1], packed.out_features)
