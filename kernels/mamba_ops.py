"""The Mamba2 ops the engine calls: Triton kernels on CUDA tensors (the one-token decode steps in
kernels/triton_mamba.py, the per-request prefill conv and chunked scan in kernels/triton_mamba_conv.py
and kernels/triton_mamba_scan.py), the torch reference otherwise (CPU).

Signatures, shapes and semantics are those of the same-named functions in
:mod:`pdcluster.kernels.mamba_reference`; the functions here only pick the implementation (as
kernels/ops.py does for the attention-side ops). Triton is imported only when CUDA tensors arrive.
"""

from __future__ import annotations

from torch import Tensor

from pdcluster.kernels import mamba_reference as reference
from pdcluster.kernels.ops import _use_triton


def causal_conv1d(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                  activation: bool = True) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv over one request's tokens from its conv state: (out, new conv state)."""
    if _use_triton(x, conv_state, weight):
        from pdcluster.kernels.triton_mamba_conv import causal_conv1d_triton

        return causal_conv1d_triton(x, conv_state, weight, bias, activation)
    return reference.causal_conv1d(x, conv_state, weight, bias, activation)


def causal_conv1d_update(x: Tensor, conv_state: Tensor, state_slots: Tensor, weight: Tensor, bias: Tensor | None,
                         activation: bool = True) -> Tensor:
    """One conv step per request; ``conv_state[state_slots]`` shifts by one input in place."""
    if _use_triton(x, conv_state, state_slots, weight):
        from pdcluster.kernels.triton_mamba import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, conv_state, state_slots, weight, bias, activation)
    return reference.causal_conv1d_update(x, conv_state, state_slots, weight, bias, activation)


def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
                   dt_min: float, chunk_size: int, initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The SSM over one request's tokens in chunks from ``initial_state``: (y, final state)."""
    tensors = (x, dt, A, B, C, D, dt_bias) + ((initial_state,) if initial_state is not None else ())
    if _use_triton(*tensors):
        from pdcluster.kernels.triton_mamba_scan import ssd_chunk_scan_triton

        return ssd_chunk_scan_triton(x, dt, A, B, C, D, dt_bias, dt_min, chunk_size, initial_state)
    return reference.ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, dt_min, chunk_size, initial_state)


def selective_state_update(ssm_state: Tensor, state_slots: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                           C: Tensor, D: Tensor, dt_bias: Tensor, dt_min: float) -> Tensor:
    """One SSM step per request; ``ssm_state[state_slots]`` updated in place. Returns y (D skip in)."""
    if _use_triton(ssm_state, state_slots, x, dt, A, B, C, D, dt_bias):
        from pdcluster.kernels.triton_mamba import selective_state_update_triton

        return selective_state_update_triton(ssm_state, state_slots, x, dt, A, B, C, D, dt_bias, dt_min)
    return reference.selective_state_update(ssm_state, state_slots, x, dt, A, B, C, D, dt_bias, dt_min)
