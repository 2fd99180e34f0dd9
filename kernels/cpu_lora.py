"""Multi-LoRA updates on CPU in one call per projection (kernels/csrc/lora_bi.c, ``pd_lora_bi``): for the step's
adapter rows, sorted by adapter, ``y[r] += (x[r] @ a[e].T) @ b[e].T`` in place, through the batch-invariant GEMM
(kernels/cpu_gemm.py), so a row's result does not depend on the other rows. The adapters' weights are stacked
and packed once (kernels/cpu_grouped_mm.py ``pack_experts``); an adapter with no rows is not read.

Like the other C wrappers it returns False where C does not apply (no library, another dtype or device), so
the caller falls back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.kernels import cpu_build, cpu_gemm
from pdcluster.kernels.cpu_grouped_mm import PackedExperts


def _lib():
    lib = cpu_build.load()
    return lib if lib is not None and hasattr(lib, "pd_lora_bi") and hasattr(lib, "pd_gemm_bi") else None


def available() -> bool:
    return _lib() is not None


@dataclass(frozen=True)
class LoraRows:
    """A step's adapter rows, checked once for every projection's call: adapter e's rows are
    ``row_ids[offs[e]:offs[e + 1]]`` of the step's ``num_rows``."""

    row_ids: torch.Tensor  # int64, contiguous
    offs: torch.Tensor  # int64 [num_adapters + 1], from 0, non-decreasing, ending at len(row_ids)
    num_rows: int

    @classmethod
    def of(cls, row_ids: torch.Tensor, offs: torch.Tensor, num_rows: int) -> "LoraRows":
        row_ids, offs = row_ids.to(torch.int64).contiguous(), offs.to(torch.int64).contiguous()
        if (offs.dim() != 1 or int(offs[0]) != 0 or bool((offs[1:] < offs[:-1]).any())
                or int(offs[-1]) != row_ids.numel()
                or (row_ids.numel() and not 0 <= int(row_ids.min()) <= int(row_ids.max()) < num_rows)):
            raise ValueError(f"LoraRows: offs must rise from 0 to the {row_ids.numel()} row ids, each row id within "
                             f"0..{num_rows - 1}; got offs {offs.tolist()}")
        return cls(row_ids, offs, num_rows)


def lora_update_bi(y: torch.Tensor, x: torch.Tensor, rows: LoraRows, a: PackedExperts, b: PackedExperts,
                   isa: int = 0, num_threads: int | None = None) -> bool:
    """Adds every adapter row's update to ``y`` [M, N] (in place) from ``x`` [M, K], ``a`` E x [rank, K] and ``b``
    E x [N, rank] packed, E = len(rows.offs) - 1. x, y and the weights share one dtype (float32 or bfloat16).
    False when not applicable (nothing done). Called per projection per step: the checks are cheap ones."""
    lib = _lib()
    dtype = x.dtype
    if (lib is None or x.device.type != "cpu" or y.device.type != "cpu" or y.dtype is not dtype
            or a.dtype is not dtype or b.dtype is not dtype or dtype not in cpu_gemm._DTYPE_CODE or x.dim() != 2
            or y.dim() != 2 or x.stride(-1) != 1 or y.stride(-1) != 1 or x.shape[1] != a.in_features
            or y.shape[1] != b.out_features or a.out_features != b.in_features or a.num_experts != b.num_experts
            or rows.offs.shape[0] != a.num_experts + 1 or min(x.shape[0], y.shape[0]) != rows.num_rows):
        return False
    threads = torch.get_num_threads() if num_threads is None else num_threads
    rc = lib.pd_lora_bi(cpu_gemm._DTYPE_CODE[dtype], x.data_ptr(), x.stride(0), rows.row_ids.data_ptr(),
                        rows.offs.data_ptr(), a.num_experts, a.data.data_ptr(), a.out_features, b.data.data_ptr(),
                        b.out_features, a.in_features, y.data_ptr(), y.stride(0), isa, threads)
    if rc != 0:
        raise ValueError(f"pd_lora_bi refused: isa {isa} for {dtype} (this machine's best is "
                         f"{cpu_gemm.best_isa(dtype)})")
    return True
