"""Multi-LoRA updates on CPU in one call per projection (kernels/csrc/lora_bi.c, ``pd_lora_bi``): for the step's
adapter rows, sorted by adapter, each output slice gets ``y[r, slice] += (x[r] @ a[e].T)[its columns] @ b_s[e].T``
in place, through the batch-invariant GEMM (kernels/cpu_gemm.py), so a row's result does not depend on the other
rows. The adapters' weights are stacked and packed once (``pack_lora``); an adapter with no rows is not read.

Like the other C wrappers it returns False where C does not apply (no library, another dtype or device), so
the caller falls back.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdcluster.kernels import cpu_build, cpu_gemm
from pdcluster.kernels.cpu_grouped_mm import PackedExperts, pack_experts


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


@dataclass(frozen=True)
class PackedLora:
    """Every adapter's update of one projection, packed for ``pd_lora_bi``: the slices' A matrices stacked per
    adapter (``a``: E x [rank, in]), and per output slice its B (``b[s]``: E x [width_s, rank_s]). Slice s
    reads columns ``slices[s, 0] : + slices[s, 1]`` of the low-rank product and adds into output columns
    ``slices[s, 2] : + slices[s, 3]``."""

    a: PackedExperts
    b: tuple[PackedExperts, ...]
    slices: torch.Tensor  # int64 [S, 4]
    b_ptrs: ctypes.Array  # the b[s] data pointers, for the call
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype


def pack_lora(updates: dict[int, list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]],
              num_adapters: int, out_features: int, dtype: torch.dtype) -> PackedLora | None:
    """``updates``: adapter index -> its update of each output slice, as (output offset, width, a [rank, in] or
    None, b [width, rank] scaled, or None), the same slices for every adapter. Ranks are zero-padded to each
    slice's largest; an adapter absent from ``updates`` (or from a slice) gets zeros. None where the C layout
    does not apply (another dtype)."""
    layouts = list(updates.values())
    in_features = next(a.shape[1] for slices in layouts for _, _, a, _ in slices if a is not None)
    table, col = [], 0
    for s, (offset, width, _, _) in enumerate(layouts[0]):
        rank = max((slices[s][2].shape[0] for slices in layouts if slices[s][2] is not None), default=0)
        if rank:
            table.append((s, col, rank, offset, width))
            col += rank
    a_stack = torch.zeros(num_adapters, col, in_features)
    b_stacks = [torch.zeros(num_adapters, width, rank) for _, _, rank, _, width in table]
    for e, slices in updates.items():
        for (s, start, _, _, _), b_stack in zip(table, b_stacks):
            _, _, a, b = slices[s]
            if a is not None:
                a_stack[e, start : start + a.shape[0]] = a
                b_stack[e, :, : b.shape[1]] = b
    a_packed = pack_experts(a_stack.to(dtype))
    b_packed = tuple(pack_experts(b.to(dtype)) for b in b_stacks)
    if a_packed is None or any(b is None for b in b_packed):
        return None
    slices = torch.tensor([row[1:] for row in table], dtype=torch.int64)
    ptrs = (ctypes.c_void_p * len(b_packed))(*[b.data.data_ptr() for b in b_packed])
    return PackedLora(a_packed, b_packed, slices, ptrs, out_features)


def lora_update_bi(y: torch.Tensor, x: torch.Tensor, rows: LoraRows, packed: PackedLora, isa: int = 0,
                   num_threads: int | None = None) -> bool:
    """Adds every adapter row's update to ``y`` [M, N] (in place) from ``x`` [M, K]. x, y and the weights share
    one dtype (float32 or bfloat16). False when not applicable (nothing done). Called per projection per step:
    the checks are cheap ones."""
    lib = _lib()
    dtype, a = x.dtype, packed.a
    if (lib is None or x.device.type != "cpu" or y.device.type != "cpu" or y.dtype is not dtype
            or a.dtype is not dtype or dtype not in cpu_gemm._DTYPE_CODE or x.dim() != 2 or y.dim() != 2
            or x.stride(-1) != 1 or y.stride(-1) != 1 or x.shape[1] != a.in_features
            or y.shape[1] != packed.out_features or rows.offs.shape[0] != a.num_experts + 1
            or min(x.shape[0], y.shape[0]) != rows.num_rows):
        return False
    threads = torch.get_num_threads() if num_threads is None else num_threads
    rc = lib.pd_lora_bi(cpu_gemm._DTYPE_CODE[dtype], x.data_ptr(), x.stride(0), rows.row_ids.data_ptr(),
                        rows.offs.data_ptr(), a.num_experts, a.data.data_ptr(), a.out_features, a.in_features,
                        len(packed.b), packed.slices.data_ptr(), packed.b_ptrs, y.data_ptr(), y.stride(0), isa,
                        threads)
    if rc != 0:
        raise ValueError(f"pd_lora_bi refused: isa {isa} for {dtype} (this machine's best is "
                         f"{cpu_gemm.best_isa(dtype)})")
    return True
