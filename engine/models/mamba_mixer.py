"""A Mamba2 mixer (NemotronH's "M" layer) over a packed varlen batch with per-request state.

Rows are requests with their tokens concatenated (``MambaMetadata.query_start_loc_np``); each row's
conv and SSM state live in ``MambaStatePool`` at the row's slot (engine/mamba_state.py). The layer:

    in_proj -> z (gate) | xBC | dt
    xBC -> causal depthwise conv (continuing from the slot's conv state) -> SiLU -> x | B | C
    SSM (kernels/mamba_reference.py: dt softplus + dt_bias, clamped below by the config's time_step_limit) -> y
    gated RMSNorm: group-wise norm of y * silu(z), times its weight -> out_proj

Three kinds of row, each written back to its slot once the row is done:
  * prefill rows (q_len > 1): causal conv and chunked SSM scan per row, from the slot's state when
    ``has_initial_state`` (chunked prefill) else from zeros;
  * decode rows (q_len == 1): one batched conv update and one batched SSM update for all of them;
  * verification rows (``keep_positions``, q_len <= 1 + k): token by token, batched across rows by
    position; after position j the state is also copied into ``pool.spec_conv/spec_ssm[l][slot, j]``
    so the runner can keep the state after the last accepted token (MambaStatePool.select).
Which rows take which path is worked out once per step (:class:`MambaStepPlan`, built by the model's
forward) and shared by every Mamba layer.

On CUDA the one-token steps are Triton kernels that update the pool in place (kernels/triton_mamba.py);
everything else is torch (kernels/mamba_reference.py), per prefill row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pdcluster.engine.linear import Linear
from pdcluster.engine.mamba_state import MambaMetadata
from pdcluster.engine.step_inputs import host_to_device
from pdcluster.kernels import mamba_ops, mamba_reference, ops


class Mamba2Mixer:
    """One Mamba layer's weights (plain tensors) and its forward over a packed batch.

    ``mamba_index`` is the layer's ordinal among the Mamba layers: its state is
    ``pool.conv[mamba_index]`` / ``pool.ssm[mamba_index]``."""

    def __init__(self, arch, w: Callable[[str], torch.Tensor], w_opt: Callable[[str], torch.Tensor | None],
                 mamba_index: int, deterministic: bool = False):
        self.mamba_index = mamba_index
        self.num_heads = arch.mamba_num_heads
        self.head_dim = arch.mamba_head_dim
        self.n_groups = arch.n_groups
        self.state_size = arch.ssm_state_size
        self.intermediate = arch.mamba_intermediate_size
        self.conv_dim = arch.mamba_conv_dim
        self.chunk_size = arch.chunk_size
        self.dt_min = arch.dt_min
        self.eps = arch.rms_norm_eps
        self.in_proj = Linear(w("in_proj.weight"), deterministic=deterministic)
        self.in_proj_bias = w_opt("in_proj.bias")
        # The small per-channel/per-head parameters stay float32 (the SSM runs in float32).
        self.conv_weight = w("conv1d.weight").float().reshape(self.conv_dim, -1).contiguous()  # [conv_dim, kernel]
        bias = w_opt("conv1d.bias")
        self.conv_bias = bias.float().contiguous() if bias is not None else None
        self.dt_bias = w("dt_bias").float().contiguous()
        self.A = -torch.exp(w("A_log").float()).contiguous()
        self.D = w("D").float().contiguous()
        self.norm_weight = w("norm.weight").float()
        self._unit_weight: torch.Tensor | None = None  # the gated norm's per-group RMSNorm on CUDA
        self.out_proj = Linear(w("out_proj.weight"), deterministic=deterministic)
        self.out_proj_bias = w_opt("out_proj.bias")
        expected = self.intermediate + self.conv_dim + self.num_heads
        if self.in_proj.out_features != expected:
            raise ValueError(f"Mamba layer {mamba_index}: in_proj has {self.in_proj.out_features} outputs, the config "
                             f"implies {expected} (intermediate {self.intermediate} + conv_dim {self.conv_dim} + "
                             f"heads {self.num_heads})")

    def __call__(self, x: torch.Tensor, meta: MambaMetadata | None,
                 plan: "MambaStepPlan | None" = None) -> torch.Tensor:
        """The layer's output for the packed batch ``x`` [num_tokens, hidden]; the rows' states in
        ``meta.pool`` are advanced in place. ``plan`` (built once per step by the model) saves redoing
        the row bookkeeping in every Mamba layer."""
        if meta is None:
            raise ValueError("a hybrid model's forward needs AttentionMetadata.mamba (MambaMetadata) for its "
                             "Mamba layers")
        if plan is None:
            plan = MambaStepPlan.build(meta, x.device)
        num_tokens = x.shape[0]
        proj = self.in_proj(x)
        if self.in_proj_bias is not None:
            proj = proj + self.in_proj_bias
        z = proj[:, : self.intermediate]
        xbc = proj[:, self.intermediate : self.intermediate + self.conv_dim]
        dt = proj[:, self.intermediate + self.conv_dim :]
        y = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)

        pool, layer = meta.pool, self.mamba_index
        conv_state, ssm_state = pool.conv[layer], pool.ssm[layer]
        if plan.fresh_slots is not None:  # rows starting at token 0 continue from zeros
            conv_state.index_fill_(0, plan.fresh_slots, 0.0)
            ssm_state.index_fill_(0, plan.fresh_slots, 0.0)
        for start, end, slot in plan.prefill_rows:
            self._prefill_row(start, end, slot, xbc, dt, y, conv_state, ssm_state)
        for tokens, slots, kept_slots, j in plan.positions:
            self._recurrent_position(tokens, slots, kept_slots, j, xbc, dt, y, pool)
        return self._gated_norm_out(y.view(num_tokens, self.intermediate), z, x.dtype)

    # ---- the paths -------------------------------------------------------------------------------
    def _split_conv_out(self, conv_out: torch.Tensor):
        gn = self.n_groups * self.state_size
        xs = conv_out[:, : self.intermediate].view(-1, self.num_heads, self.head_dim)
        B = conv_out[:, self.intermediate : self.intermediate + gn].view(-1, self.n_groups, self.state_size)
        C = conv_out[:, self.intermediate + gn :].view(-1, self.n_groups, self.state_size)
        return xs, B, C

    def _prefill_row(self, start: int, end: int, slot: int, xbc, dt, y, conv_state, ssm_state) -> None:
        conv_out, new_conv = mamba_ops.causal_conv1d(xbc[start:end], conv_state[slot], self.conv_weight,
                                                     self.conv_bias, activation=True)
        xs, B, C = self._split_conv_out(conv_out)
        y_row, final = mamba_ops.ssd_chunk_scan(xs, dt[start:end], self.A, B, C, self.D, self.dt_bias, self.dt_min,
                                                self.chunk_size, initial_state=ssm_state[slot])
        y[start:end] = y_row
        conv_state[slot] = new_conv
        ssm_state[slot] = final

    def _recurrent_position(self, tokens, slots, kept_slots, j: int, xbc, dt, y, pool) -> None:
        """Position j of the decode / verification rows, all rows at once."""
        layer = self.mamba_index
        conv_out = mamba_ops.causal_conv1d_update(xbc.index_select(0, tokens), pool.conv[layer], slots,
                                                  self.conv_weight, self.conv_bias, activation=True)
        xs, B, C = self._split_conv_out(conv_out)
        y[tokens] = mamba_ops.selective_state_update(pool.ssm[layer], slots, xs, dt.index_select(0, tokens),
                                                     self.A, B, C, self.D, self.dt_bias, self.dt_min)
        if kept_slots is not None:
            pool.spec_conv[layer][kept_slots, j] = pool.conv[layer][kept_slots]
            pool.spec_ssm[layer][kept_slots, j] = pool.ssm[layer][kept_slots]

    def _gated_norm_out(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj(weight * groupnorm(y * silu(z))), the norm over groups of intermediate / n_groups
        channels, in float32 (transformers' NemotronHRMSNormGated on the float32 scan output)."""
        num_tokens = y.shape[0]
        gated = (y * mamba_reference.silu(z.float())).view(num_tokens, self.n_groups, -1)
        if gated.is_cuda:
            # torch's mean may split one row's sum by the batch's shape on a GPU; the Triton RMSNorm
            # reduces each (token, group) row alone, with the same fp32 op order (a unit weight is exact).
            group_size = gated.shape[-1]
            if self._unit_weight is None or self._unit_weight.device != gated.device:
                self._unit_weight = torch.ones(group_size, dtype=torch.float32, device=gated.device)
            gated = ops.rms_norm(gated.reshape(-1, group_size), self._unit_weight, self.eps)
        else:
            gated = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.out_proj((self.norm_weight * gated.view(num_tokens, -1)).to(dtype))
        if self.out_proj_bias is not None:
            out = out + self.out_proj_bias
        return out


@dataclass
class MambaStepPlan:
    """How one step's rows go through the Mamba layers, worked out once per step (the same for every
    layer): which slots start from zero, the prefill rows, and for each position j of the decode and
    verification rows the packed token indices, their slots and the slots whose state after j is kept."""

    fresh_slots: torch.Tensor | None
    prefill_rows: list[tuple[int, int, int]]  # (start, end, slot)
    positions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]]  # (tokens, slots, kept, j)

    @classmethod
    def build(cls, meta: MambaMetadata, device: torch.device | str, recurrent_prefill: bool = False) -> "MambaStepPlan":
        """``recurrent_prefill`` (deterministic mode, issue 24): prompt rows too go token by token through
        the one-token conv and SSM updates, so a request's state (and every output) after a prompt
        chunk is bitwise the state after the same tokens as one-token steps, whatever the chunking,
        the batch or a re-prefill after recovery. The chunked SSD scan sums in another order."""
        qsl = meta.query_start_loc_np
        q_lens = np.diff(qsl)
        slots_np = np.asarray(meta.state_slots_np, dtype=np.int64)
        has_initial = np.asarray(meta.has_initial_state_np, dtype=bool)
        keep = np.asarray(meta.keep_positions_np, dtype=bool)
        assert len(q_lens) == len(slots_np) == len(has_initial) == len(keep), "MambaMetadata rows disagree"
        assert len(np.unique(slots_np)) == len(slots_np), f"a state slot appears twice in one step: {slots_np}"

        def tensor(a: np.ndarray) -> torch.Tensor:
            return host_to_device(np.asarray(a, dtype=np.int64), device)

        fresh = slots_np[~has_initial]
        recurrent = ((q_lens == 1) | keep | recurrent_prefill) & (q_lens > 0)
        prefill_rows = [(int(qsl[r]), int(qsl[r + 1]), int(slots_np[r]))
                        for r in np.nonzero(~recurrent & (q_lens > 0))[0]]
        rows = np.nonzero(recurrent)[0]
        positions = []
        if len(rows):
            row_lens = q_lens[rows]
            max_len = int(row_lens.max())
            kept_len = int(row_lens[keep[rows]].max()) if keep[rows].any() else 0
            if kept_len > meta.pool.max_positions_per_step:
                raise ValueError(f"a verification row has {kept_len} positions but the Mamba state pool keeps "
                                 f"{meta.pool.max_positions_per_step} (MambaStatePool max_positions_per_step)")
            for j in range(max_len):
                active = rows[row_lens > j]
                kept = active[keep[active]]
                positions.append((tensor(qsl[active] + j), tensor(slots_np[active]),
                                  tensor(slots_np[kept]) if len(kept) else None, j))
        return cls(tensor(fresh) if len(fresh) else None, prefill_rows, positions)
