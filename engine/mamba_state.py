"""Per-request recurrent state of a hybrid model's Mamba layers, beside the paged KV cache.

Every Mamba layer keeps, per request, a conv state (the last ``conv_kernel - 1`` inputs of its causal
conv) and an SSM state. They live in preallocated tensors indexed by the runner's request slot
(``RequestStates`` index), so a slot's state belongs to exactly one live request: it is reset when a
request takes the slot (new, or resumed after preemption: recompute from token 0) and simply
overwritten by the next owner. Nothing is shared between requests, so prefix caching is off for
hybrids (a cached block has KV but no state for its boundary).

Speculative verification runs the target over ``1 + k`` positions but only the state after the last
*accepted* token may survive. Rows marked ``keep_positions`` therefore also store the state after
every position in ``spec_conv`` / ``spec_ssm`` (slot-indexed, position-major), and the runner calls
:meth:`MambaStatePool.select` with ``num_accepted - 1`` once rejection sampling has counted the
accepted tokens (S3: ``(ids != -1).sum(1)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.step_inputs import host_to_device


@dataclass(frozen=True)
class MambaStateShape:
    num_mamba_layers: int
    conv_dim: int  # channels of the causal conv (x, B and C together)
    conv_width: int  # conv_kernel - 1: inputs kept between steps
    num_heads: int
    head_dim: int
    state_size: int  # d_state

    @property
    def bytes_per_slot(self) -> int:
        """fp32 bytes of one request's state, all Mamba layers."""
        per_layer = self.conv_dim * self.conv_width + self.num_heads * self.head_dim * self.state_size
        return self.num_mamba_layers * per_layer * 4


class MambaStatePool:
    """conv[l]: float32 [num_slots, conv_dim, conv_width]; ssm[l]: float32 [num_slots, H, P, N].

    Both in float32 whatever the model dtype (as mamba_ssm_cache_dtype defaults to in NemotronH), so a
    bf16 model's recurrence does not drift by rounding its state every token."""

    def __init__(self, shape: MambaStateShape, num_slots: int, max_positions_per_step: int = 1,
                 device: str | torch.device = "cpu"):
        self.shape = shape
        self.num_slots = num_slots
        self.max_positions_per_step = max_positions_per_step
        s = shape
        self.conv = [torch.zeros(num_slots, s.conv_dim, s.conv_width, device=device) for _ in range(s.num_mamba_layers)]
        self.ssm = [torch.zeros(num_slots, s.num_heads, s.head_dim, s.state_size, device=device)
                    for _ in range(s.num_mamba_layers)]
        # Per-position states of speculative verification rows: [num_slots, positions, ...]. Only
        # allocated with speculation (max_positions_per_step > 1).
        q = max_positions_per_step
        self.spec_conv = [torch.zeros(num_slots, q, s.conv_dim, s.conv_width, device=device)
                          for _ in range(s.num_mamba_layers)] if q > 1 else []
        self.spec_ssm = [torch.zeros(num_slots, q, s.num_heads, s.head_dim, s.state_size, device=device)
                         for _ in range(s.num_mamba_layers)] if q > 1 else []

    def reset(self, slot: int) -> None:
        """A request takes ``slot``: its state starts from zero (token 0)."""
        for t in self.conv + self.ssm:
            t[slot].zero_()

    def select(self, slots: np.ndarray, position_index: np.ndarray) -> None:
        """For each verification row: keep the state after input position ``position_index`` (the last
        accepted token: ``num_accepted - 1``), dropping the states of rejected drafts."""
        if len(slots) == 0:
            return
        if position_index.min() < 0 or position_index.max() >= self.max_positions_per_step:
            raise ValueError(f"state position index out of range [0, {self.max_positions_per_step}): {position_index}")
        device = self.conv[0].device if self.conv else torch.device("cpu")
        slots_t = host_to_device(np.asarray(slots, dtype=np.int64), device)
        pos_t = host_to_device(np.asarray(position_index, dtype=np.int64), device)
        for main, spec in zip(self.conv + self.ssm, self.spec_conv + self.spec_ssm):
            main[slots_t] = spec[slots_t, pos_t]

    def state_of(self, slot: int) -> list[torch.Tensor]:
        """Copies of one request's state, layer by layer (conv then ssm); for tests and transfer."""
        return [t[slot].clone() for t in self.conv + self.ssm]


@dataclass
class MambaMetadata:
    """What the Mamba layers need of one step, per batch row (rows are packed as in attention)."""

    pool: MambaStatePool
    query_start_loc_np: np.ndarray  # int64 [num_rows + 1]: each row's tokens in the packed batch
    state_slots_np: np.ndarray  # int64 [num_rows]: pool slot of the row's request
    # Does the row continue from the slot's state (chunked prefill, decode), or start at token 0?
    has_initial_state_np: np.ndarray  # bool [num_rows]
    # Verification rows: store the state after every position in pool.spec_* (see module docstring).
    keep_positions_np: np.ndarray  # bool [num_rows]
    # The layers' row plan (models/mamba_mixer.py MambaStepPlan) when the caller built it already: a
    # CUDA graph's, over its static buffers (engine/cuda_graphs.py). None: the model builds it.
    plan: object | None = None
    # state_slots_np on the model's device (the step's pinned copy): what a CUDA graph's static slots take.
    state_slots: torch.Tensor | None = None
