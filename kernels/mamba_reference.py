"""Torch reference kernels of a Mamba2 layer: the causal depthwise conv and the SSM (state space
model) scan, each with the recurrent state carried between steps.

They run on CPU (the engine's path there) and are the oracle the Triton kernels in
``kernels/triton_mamba.py`` are tested against. Everything is computed in float32 whatever the input
dtype, and states are float32 (engine/mamba_state.py).

Shapes (one layer):

    conv state:  [conv_dim, width]          width = conv_kernel - 1: the last inputs seen
    conv weight: [conv_dim, conv_kernel]    (nn.Conv1d's [conv_dim, 1, kernel] squeezed)
    ssm state:   [num_heads, head_dim, state_size]
    x:           [num_tokens, num_heads, head_dim]
    dt:          [num_tokens, num_heads]    raw, before dt_bias and softplus
    B, C:        [num_tokens, n_groups, state_size]   head h reads group h // (num_heads // n_groups)

The SSM, per head h and token t (A = -exp(A_log) < 0, so the state decays):

    dt_t = max(softplus(dt_t + dt_bias), dt_min)
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t (outer) B_t        [head_dim, state_size]
    y_t  = S_t @ C_t + D * x_t

``dt_min`` is the lower end of the model config's ``time_step_limit`` (0 by default: no clamp, as mamba_ssm's and
vLLM's Mamba2). transformers' chunked (prefill) path clamps there; its one-token path does not clamp; here every
path clamps, so a prompt computed in chunks, token by token or at once gives the same state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


# Batch invariance (issue 24): torch's CPU elementwise kernels run the vectorised (Sleef) op on whole
# vectors and the scalar libm op on the tail of the tensor, and for silu, sigmoid, softplus and log1p the
# two disagree in the last bit (measured: ~5% of elements), so an element's value depended on where its
# row landed in the batch. exp, log, +, *, / agree on both paths: the two below use only those.


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))`` (float32 in, float32 out): the same bits for an
    element wherever it sits in the tensor (see above)."""
    return x / (1.0 + torch.exp(-x))


def softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x))`` (x itself above 20, as F.softplus), computed in float64 and rounded to float32:
    no log1p (batch-variant), and float64 keeps the precision log1p would (within 2.3e-7 of F.softplus)."""
    x64 = x.double()
    return torch.where(x64 > 20.0, x64, torch.log(1.0 + torch.exp(x64))).float()


def discretize_dt(dt: Tensor, dt_bias: Tensor, dt_min: float) -> Tensor:
    """``max(softplus(dt + dt_bias), dt_min)`` in float32 (same shape as ``dt``, [..., num_heads])."""
    return softplus(dt.float() + dt_bias.float()).clamp(min=dt_min)


# ---------------------------------------------------------------------------------------------------
# Causal depthwise conv


def causal_conv1d(
    x: Tensor,  # [num_tokens, conv_dim]
    conv_state: Tensor,  # [conv_dim, width]: the inputs before x (zeros at token 0)
    weight: Tensor,  # [conv_dim, width + 1]
    bias: Tensor | None,  # [conv_dim]
    activation: bool = True,
) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv over one request's tokens, continuing from ``conv_state``.

    Returns (out [num_tokens, conv_dim] float32, SiLU applied if ``activation``; the new conv state
    [conv_dim, width] float32: the last ``width`` inputs of state + x)."""
    num_tokens, conv_dim = x.shape
    width = conv_state.shape[-1]
    assert weight.shape == (conv_dim, width + 1), (weight.shape, conv_dim, width)
    padded = torch.cat([conv_state.float(), x.float().t()], dim=1)  # [conv_dim, width + num_tokens]
    out = F.conv1d(padded[None], weight.float()[:, None, :], bias.float() if bias is not None else None,
                   groups=conv_dim)[0]  # [conv_dim, num_tokens]
    out = out.t()
    if activation:
        out = silu(out)
    return out, padded[:, num_tokens:].clone()


def causal_conv1d_update(
    x: Tensor,  # [batch, conv_dim]: one new token per request
    conv_state: Tensor,  # [num_slots, conv_dim, width] float32, updated in place at state_slots
    state_slots: Tensor,  # int64 [batch], distinct
    weight: Tensor,  # [conv_dim, width + 1]
    bias: Tensor | None,
    activation: bool = True,
) -> Tensor:
    """One conv step for a batch of requests, each with its state at ``conv_state[state_slots[b]]``;
    the states shift by one input (in place). Returns out [batch, conv_dim] float32."""
    state = conv_state.index_select(0, state_slots)  # [batch, conv_dim, width]
    window = torch.cat([state, x.float()[:, :, None]], dim=2)  # [batch, conv_dim, width + 1]
    out = (window * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation:
        out = silu(out)
    conv_state.index_copy_(0, state_slots, window[:, :, 1:].to(conv_state.dtype))
    return out


# ---------------------------------------------------------------------------------------------------
# SSM


def selective_state_update(
    ssm_state: Tensor,  # [num_slots, num_heads, head_dim, state_size] float32, updated in place
    state_slots: Tensor,  # int64 [batch], distinct
    x: Tensor,  # [batch, num_heads, head_dim]
    dt: Tensor,  # [batch, num_heads]
    A: Tensor,  # [num_heads] float32 (negative)
    B: Tensor,  # [batch, n_groups, state_size]
    C: Tensor,  # [batch, n_groups, state_size]
    D: Tensor,  # [num_heads]
    dt_bias: Tensor,  # [num_heads]
    dt_min: float,
) -> Tensor:
    """One SSM step for a batch of requests (module docstring's recurrence). Returns y [batch,
    num_heads, head_dim] float32, D skip included."""
    num_heads = x.shape[1]
    heads_per_group = num_heads // B.shape[1]
    dt = discretize_dt(dt, dt_bias, dt_min)  # [batch, H]
    decay = torch.exp(dt * A.float())  # [batch, H]
    Bh = B.float().repeat_interleave(heads_per_group, dim=1)  # [batch, H, N]
    Ch = C.float().repeat_interleave(heads_per_group, dim=1)
    xf = x.float()
    state = ssm_state.index_select(0, state_slots)  # [batch, H, P, N]
    state = state * decay[:, :, None, None] + (dt[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    ssm_state.index_copy_(0, state_slots, state)
    # An elementwise product summed over the contiguous last dim: per row the same sum whatever the
    # batch (a batched matmul, as einsum lowers to, need not be).
    return (state * Ch[:, :, None, :]).sum(-1) + D.float()[:, None] * xf


def _segment_sum(a: Tensor) -> Tensor:
    """[..., T] -> [..., T, T] with out[..., i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal (so exp() of it is the causal decay matrix). Summed with masked cumsums rather than
    differences of one cumsum, which would cancel catastrophically."""
    T = a.shape[-1]
    a = a[..., None].expand(*a.shape, T)  # [..., i, j] = a[i]
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    out = torch.cumsum(a.masked_fill(~below, 0), dim=-2)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~causal, float("-inf"))


def ssd_chunk_scan(
    x: Tensor,  # [L, num_heads, head_dim]
    dt: Tensor,  # [L, num_heads]
    A: Tensor,  # [num_heads] (negative)
    B: Tensor,  # [L, n_groups, state_size]
    C: Tensor,  # [L, n_groups, state_size]
    D: Tensor,  # [num_heads]
    dt_bias: Tensor,  # [num_heads]
    dt_min: float,
    chunk_size: int,
    initial_state: Tensor | None = None,  # [num_heads, head_dim, state_size]
) -> tuple[Tensor, Tensor]:
    """The SSM over one request's L tokens in chunks (Mamba2's state space duality), continuing from
    ``initial_state`` (zeros if None). Returns (y [L, H, P] float32 with the D skip, the state after
    the last token [H, P, N] float32) — the same as L steps of :func:`selective_state_update`.

    Within a chunk the SSM is a masked matmul (quadratic in chunk_size, parallel); between chunks
    only the state at chunk boundaries is carried (linear in the number of chunks). The math is that
    of transformers' ``mamba2_chunk_scan``; the boundary recurrence is a loop over chunks here."""
    L, H, P = x.shape
    N = B.shape[-1]
    heads_per_group = H // B.shape[1]
    dt = discretize_dt(dt, dt_bias, dt_min)  # [L, H]
    xf = x.float()
    pad = (-L) % chunk_size
    nc = (L + pad) // chunk_size

    def chunked(t: Tensor) -> Tensor:  # pad the token dim with zeros, then [nc, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.view(nc, chunk_size, *t.shape[1:])

    # Padded tokens have dt * A = 0 (no decay) and dt * x = 0 (no input): they leave the state alone.
    x_dt = chunked(xf * dt[..., None])  # [nc, l, H, P]
    A_dt = chunked(A.float() * dt).permute(2, 0, 1)  # [H, nc, l]
    Bc = chunked(B.float().repeat_interleave(heads_per_group, dim=1))  # [nc, l, H, N]
    Cc = chunked(C.float().repeat_interleave(heads_per_group, dim=1))
    A_cumsum = torch.cumsum(A_dt, dim=-1)  # [H, nc, l]: decay from the chunk start to l (log)

    # 1. Within each chunk: y_l += sum_{s <= l} (C_l . B_s) exp(A_s+1 + ... + A_l) x_s dt_s.
    decay_within = torch.exp(_segment_sum(A_dt))  # [H, nc, l, s]
    scores = torch.einsum("clhn,cshn->clsh", Cc, Bc) * decay_within.permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", scores, x_dt)

    # 2. Each chunk's own contribution to the state at its end.
    decay_to_end = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # [H, nc, l]
    chunk_states = torch.einsum("clhn,clhp->chpn", Bc * decay_to_end.permute(1, 2, 0)[..., None], x_dt)

    # 3. The state at every chunk boundary: S_{c+1} = exp(sum A_dt over chunk c) S_c + chunk_states[c].
    chunk_decay = torch.exp(A_cumsum[..., -1])  # [H, nc]
    state = (initial_state.float() if initial_state is not None
             else torch.zeros(H, P, N, dtype=torch.float32, device=x.device))
    start_states = []
    for c in range(nc):
        start_states.append(state)
        state = state * chunk_decay[:, c, None, None] + chunk_states[c]
    starts = torch.stack(start_states)  # [nc, H, P, N]

    # 4. What the state at each chunk's start contributes to its tokens: C_l S_start decayed to l.
    y = y + torch.einsum("clhn,chpn->clhp", Cc, starts) * torch.exp(A_cumsum).permute(1, 2, 0)[..., None]
    y = y.reshape(nc * chunk_size, H, P)[:L] + D.float()[:, None] * xf
    return y, state


def ssm_recurrence(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor, dt_min: float,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The SSM token by token (the definition; for tests). Same arguments as :func:`ssd_chunk_scan`
    without the chunk size; returns (y [L, H, P], final state, the state after every token [L, H, P, N])."""
    L, H, P = x.shape
    N = B.shape[-1]
    pool = (initial_state.float().clone() if initial_state is not None
            else torch.zeros(H, P, N, dtype=torch.float32, device=x.device))[None]
    slot = torch.zeros(1, dtype=torch.int64, device=x.device)
    ys, states = [], []
    for t in range(L):
        ys.append(selective_state_update(pool, slot, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1],
                                         D, dt_bias, dt_min)[0])
        states.append(pool[0].clone())
    return torch.stack(ys), pool[0], torch.stack(states)
