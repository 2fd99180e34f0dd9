"""Batch-invariant grouped linear on CPU for a fused MoE (issue 26): rows sorted by expert, each row times its
expert's weight, ``y[r] = x[r] @ w[e].T`` for the rows ``offs[e]:offs[e + 1]`` of expert e.

The C kernel (kernels/csrc/grouped_gemm_bi.c, ``pd_grouped_gemm_bi``) runs every (expert, strip range) through
the batch-invariant GEMM of kernels/csrc/gemm_bi.c, so a row's result is bit for bit ``linear_bi(row, w[e])``
(kernels/cpu_gemm.py): it does not depend on how many rows its expert got, nor on the thread count. Experts
with no rows are not read.

Usage: ``packed = pack_experts(weight)`` once at load ([E, N, K] float32 or bfloat16; the packed copy replaces
the plain one), then ``grouped_linear_bi(rows, packed, offs)`` per call. Like kernels/cpu_gemm.py the wrappers
return None where C does not apply (no library, another dtype or device), so the caller falls back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.kernels import cpu_build, cpu_gemm


@dataclass(frozen=True)
class PackedExperts:
    """E weights [out_features, in_features], each in gemm_bi.c's strip layout, stacked: ``data[e]`` is
    expert e's ``cpu_gemm.PackedWeight.data``."""

    data: torch.Tensor
    num_experts: int
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def expert(self, e: int) -> cpu_gemm.PackedWeight:
        """Expert e alone, as the plain batch-invariant GEMM takes it (tests compare the two)."""
        return cpu_gemm.PackedWeight(self.data[e], self.out_features, self.in_features)


def _lib():
    lib = cpu_build.load()
    return lib if lib is not None and hasattr(lib, "pd_grouped_gemm_bi") and hasattr(lib, "pd_gemm_bi") else None


def available() -> bool:
    return _lib() is not None


def pack_experts(weight: torch.Tensor) -> PackedExperts | None:
    """The C layout of a float32 or bfloat16 CPU expert stack [E, N, K]; None for anything else."""
    if weight.dim() != 3 or weight.shape[0] < 1:
        return None
    packed = [cpu_gemm.pack_bi(w) for w in weight]
    if packed[0] is None:
        return None
    return PackedExperts(torch.stack([p.data for p in packed]), weight.shape[0], weight.shape[1], weight.shape[2])


def grouped_linear_bi(rows: torch.Tensor, packed: PackedExperts, offs: torch.Tensor,
                      out_dtype: torch.dtype | None = None, isa: int = 0,
                      num_threads: int | None = None) -> torch.Tensor | None:
    """[M, N]: row r times the weight of the expert whose range of ``offs`` (int64 [E + 1], non-decreasing;
    rows outside ``offs[0]:offs[E]`` are left unwritten) holds it. ``rows`` [M, K] in the weights' dtype; the
    output has it too unless ``out_dtype=torch.float32``. ``isa`` forces a path (see cpu_gemm.ISA_NAMES;
    0 = best). None when not applicable."""
    lib = _lib()
    out_dtype = out_dtype or rows.dtype
    if (lib is None or rows.dtype is not packed.dtype or rows.device.type != "cpu" or rows.dim() != 2
            or rows.shape[1] != packed.in_features or out_dtype not in (rows.dtype, torch.float32)
            or offs.shape != (packed.num_experts + 1,)):
        return None
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    offs = offs.to(torch.int64).contiguous()
    if int(offs[-1]) > rows.shape[0]:
        raise ValueError(f"grouped_linear_bi: offs end at row {int(offs[-1])}, past the {rows.shape[0]} rows given")
    out = torch.empty(rows.shape[0], packed.out_features, dtype=out_dtype)
    threads = torch.get_num_threads() if num_threads is None else num_threads
    code = cpu_gemm._DTYPE_CODE[rows.dtype]
    rc = lib.pd_grouped_gemm_bi(code, rows.data_ptr(), rows.stride(0), offs.data_ptr(), packed.num_experts,
                                packed.data.data_ptr(), packed.out_features, packed.in_features, out.data_ptr(),
                                out.stride(0), int(out_dtype is torch.float32), isa, threads)
    if rc != 0:
        raise ValueError(f"pd_grouped_gemm_bi refused: isa {isa} for {rows.dtype} (this machine's best is "
                         f"{cpu_gemm.best_isa(rows.dtype)}; see cpu_gemm.ISA_NAMES), or offs not non-decreasing "
                         f"within 0..{rows.shape[0]}")
    return out
