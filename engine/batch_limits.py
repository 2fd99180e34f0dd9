"""A step's token budget (``max_num_batched_tokens``) and the cap on running requests (``max_num_seqs``) when the
config leaves them 0: chosen for the device the engine runs on, as vLLM's serving defaults are.

vLLM's ``vllm serve`` (arg_utils ``get_batch_defaults``) takes 8,192 tokens and 1,024 sequences on an H100/H200
(70 GiB or more and not an A100, where a larger budget measured slower), 16,384 and 1,024 from 160 GiB (B200), and
2,048 and 256 on other GPUs, and 2,048 and 128 on a CPU. Our old cap of 64 everywhere left most of an H200's decode
batch unused, and on a CPU too 128 measured better at saturation: 256 queued SmolLM2 prompts (256 tokens in, 64 out,
bf16, a 2-core AMX Xeon) gave 642 and 659 output tok/s at 128 against 598-617 and 577-580 at 64 in two runs; 256 gave
637 and 611, the 1 GiB pool no longer holding every running request (bench/results/cpu_max_num_seqs_amx_s79.json).

Hybrids (Mamba layers) keep 64 on every device: each running request holds a recurrent-state slot of the
``MambaStatePool``, which is allocated beside the KV pool rather than from its budget, so the cap is what bounds that
memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.engine.kv_budget import GIB


@dataclass(frozen=True)
class BatchLimits:
    max_num_batched_tokens: int
    max_num_seqs: int


CPU_LIMITS = BatchLimits(max_num_batched_tokens=2048, max_num_seqs=128)
HYBRID_MAX_NUM_SEQS = 64


def device_batch_limits(device_type: str, total_memory_bytes: int = 0, device_name: str = "") -> BatchLimits:
    """The defaults for a device: ``device_type`` "cpu" or "cuda"; for a GPU its total memory and name."""
    if device_type != "cuda":
        return CPU_LIMITS
    if total_memory_bytes >= 160 * GIB:
        return BatchLimits(16384, 1024)
    if total_memory_bytes >= 70 * GIB and "a100" not in device_name.lower():
        return BatchLimits(8192, 1024)
    return BatchLimits(2048, 256)


def cuda_batch_limits(device: str) -> BatchLimits:
    """device_batch_limits for the CUDA device ``device`` ("cuda" or "cuda:N"), read from torch."""
    props = torch.cuda.get_device_properties(torch.device(device))
    return device_batch_limits("cuda", props.total_memory, props.name)
