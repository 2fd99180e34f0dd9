"""The name of the arithmetic a worker's kernels do, told to its peers in the KV handshake.

Two workers with the same name compute every value of a request with the same operations in the same order, so a
request split between them (prefill on one, decode on the other) gets the bits a colocated run gives; two with
different names give the same values to the dtype's precision but not always the same bits (kv_transfer's
numerics_note warns of the pair). On CPUs, bfloat16 linears and attention run on AMX tiles where the CPU and the
kernel allow them (PDCLUSTER_CPU_AMX=0 turns them off for a process), else on avx512_bf16 dot products, else on
the generic loops; float32 is the same fma chain on every ISA (kernels/csrc/gemm_bi.c).
"""

from __future__ import annotations

import torch


def describe(device: str | torch.device, dtype: torch.dtype) -> str:
    """E.g. "cpu bfloat16 amx", "cpu bfloat16 avx512_bf16", "cpu float32", "cuda bfloat16 NVIDIA H200"."""
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return f"cuda {name} {torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return f"{device.type} {name}"
    if dtype != torch.bfloat16:
        return f"cpu {name}"
    from pdcluster.kernels import cpu_gemm, cpu_ops

    if not cpu_ops.available():
        return "cpu bfloat16 torch"
    if cpu_ops.attention_amx():
        return "cpu bfloat16 amx"
    return "cpu bfloat16 avx512_bf16" if (cpu_gemm.best_isa(torch.bfloat16) or 0) >= 3 else "cpu bfloat16 generic"
