"""Triton Mamba2 decode kernels (kernels/triton_mamba.py) == the torch reference
(kernels/mamba_reference.py), under the interpreter (TRITON_INTERPRET=1, set in conftest.py), and the
Mamba mixer's one-token paths routed through them by kernels/mamba_ops.py.

Inputs are laid out as the mixer passes them: x, B, C and dt are strided views into the packed
projection / conv output, states live in a slot-indexed pool and the batch's slots are scattered.
Sizes are small (the interpreter costs about a millisecond per program) but cover masked tails: conv
channels beyond one block, head_dim beyond one block, a state size that is not a power of two.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdcluster.engine.models.mamba_mixer import Mamba2Mixer
from pdcluster.engine.mamba_state import MambaMetadata, MambaStatePool
from pdcluster.engine.models.nemotron_h import HybridArch
from pdcluster.engine.models.tiny_hybrid import TINY_HYBRID_CONFIG, tiny_hybrid_state_dict
from pdcluster.kernels import mamba_ops
from pdcluster.kernels import mamba_reference as ref
from pdcluster.kernels.triton_mamba import causal_conv1d_update_triton, selective_state_update_triton

NUM_SLOTS = 6
SLOTS = torch.tensor([4, 1, 5])  # scattered; slots 0, 2, 3 must stay untouched


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _assert_untouched(pool: torch.Tensor, before: torch.Tensor) -> None:
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS.tolist()]
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("kernel", [3, 4])
@pytest.mark.parametrize("bias,activation", [(True, True), (False, False)], ids=["bias-silu", "plain"])
def test_causal_conv1d_update_triton_matches_reference(kernel, bias, activation):
    """conv_dim 300: two channel blocks of 256, the second masked; x is a view with row stride 340."""
    conv_dim, batch = 300, len(SLOTS)
    x = _randn(batch, 340, seed=0)[:, 20:320]
    pool = _randn(NUM_SLOTS, conv_dim, kernel - 1, seed=1)
    weight = _randn(conv_dim, kernel, seed=2)
    b = _randn(conv_dim, seed=3) if bias else None
    expected_pool = pool.clone()
    expected = ref.causal_conv1d_update(x, expected_pool, SLOTS, weight, b, activation)
    before = pool.clone()
    got = causal_conv1d_update_triton(x, pool, SLOTS, weight, b, activation)
    _close(got, expected)
    _close(pool, expected_pool)
    _assert_untouched(pool, before)


def _ssu_inputs(heads: int, head_dim: int, groups: int, state: int, seed: int):
    """x | B | C packed in one conv-output row, dt a slice of a wider projection row (as in the mixer).
    dt spans the clamp (softplus under DT_MIN) and softplus's linear range (over 20)."""
    batch = len(SLOTS)
    inter, gn = heads * head_dim, groups * state
    conv_out = _randn(batch, inter + 2 * gn, seed=seed)
    x = conv_out[:, :inter].view(batch, heads, head_dim)
    B = conv_out[:, inter : inter + gn].view(batch, groups, state)
    C = conv_out[:, inter + gn :].view(batch, groups, state)
    proj = _randn(batch, heads + 7, seed=seed + 1) * 3
    proj[0, 7] = 30.0
    proj[1, 7] = -30.0
    dt = proj[:, 7:]
    A = -(torch.rand(heads, generator=torch.Generator().manual_seed(seed + 2)) * 4 + 0.5)
    D = _randn(heads, seed=seed + 3)
    dt_bias = _randn(heads, seed=seed + 4) - 2
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("heads,head_dim,groups,state", [(4, 24, 2, 12), (2, 40, 1, 16), (4, 8, 4, 128)],
                         ids=["masked-state", "two-p-blocks", "state-128"])
def test_selective_state_update_triton_matches_reference(heads, head_dim, groups, state):
    dt_min = 0.001
    x, dt, A, B, C, D, dt_bias = _ssu_inputs(heads, head_dim, groups, state, seed=heads + head_dim)
    assert (torch.nn.functional.softplus(dt + dt_bias) < dt_min).any()  # the clamp is exercised
    pool = _randn(NUM_SLOTS, heads, head_dim, state, seed=9)
    expected_pool = pool.clone()
    expected = ref.selective_state_update(expected_pool, SLOTS, x, dt, A, B, C, D, dt_bias, dt_min)
    before = pool.clone()
    got = selective_state_update_triton(pool, SLOTS, x, dt, A, B, C, D, dt_bias, dt_min)
    _close(got, expected)
    _close(pool, expected_pool)
    _assert_untouched(pool, before)


# ---------------------------------------------------------------------------------------------------
# The mixer's one-token paths through the Triton kernels (dispatch in mamba_ops.py)


def tiny_hybrid_mixer() -> tuple[HybridArch, Mamba2Mixer]:
    """tiny-hybrid's first Mamba mixer (with the built-in's weights) and its arch (vocabulary cut to 64).
    test_triton_mamba_scan.py runs its prefill rows."""
    config = dict(TINY_HYBRID_CONFIG, vocab_size=64, bos_token_id=1, eos_token_id=2)
    arch = HybridArch.from_config(config)
    weights = {k.replace("backbone.layers.0.mixer.", ""): v for k, v in tiny_hybrid_state_dict(config).items()
               if k.startswith("backbone.layers.0.mixer.")}
    mixer = Mamba2Mixer(arch, weights.pop, lambda name: weights.pop(name, None), mamba_index=0)
    return arch, mixer


def mixer_step(arch: HybridArch, mixer: Mamba2Mixer, pool: MambaStatePool, rows: list[tuple[int, int, bool, bool]],
               seed: int) -> torch.Tensor:
    """One mixer call on random hidden states; a row is (slot, q_len, has_initial_state, keep_positions)."""
    qsl = np.concatenate([[0], np.cumsum([r[1] for r in rows])]).astype(np.int64)
    meta = MambaMetadata(pool, qsl, np.array([r[0] for r in rows], dtype=np.int64),
                         np.array([r[2] for r in rows]), np.array([r[3] for r in rows]))
    return mixer(_randn(int(qsl[-1]), arch.hidden_size, seed=seed), meta)


def _run_mixer_steps(arch, mixer) -> tuple[list[torch.Tensor], MambaStatePool]:
    """Prefill three requests, then one step with a decode row, a verification row (3 positions) and a
    fresh one-token row."""
    pool = MambaStatePool(arch.mamba_state_shape(), NUM_SLOTS, max_positions_per_step=3)

    def step(rows: list[tuple[int, int, bool, bool]], seed: int) -> torch.Tensor:
        return mixer_step(arch, mixer, pool, rows, seed)

    outputs = [step([(4, 7, False, False), (1, 5, False, False)], seed=20)]
    outputs.append(step([(4, 1, True, False), (1, 3, True, True), (5, 1, False, False)], seed=21))
    outputs.append(step([(4, 1, True, False), (1, 1, True, False)], seed=22))
    return outputs, pool


def test_mixer_decode_paths_through_triton_match_reference(monkeypatch):
    arch, mixer = tiny_hybrid_mixer()
    expected, expected_pool = _run_mixer_steps(arch, mixer)
    monkeypatch.setattr(mamba_ops, "_use_triton", lambda *tensors: True)
    for name in ("causal_conv1d_update", "selective_state_update"):
        monkeypatch.setattr(ref, name, None)  # the reference one-token kernels may not be reached
    got, pool = _run_mixer_steps(arch, mixer)
    for g, e in zip(got, expected):
        _close(g, e)
    for g, e in zip(pool.conv + pool.ssm + pool.spec_conv + pool.spec_ssm,
                    expected_pool.conv + expected_pool.ssm + expected_pool.spec_conv + expected_pool.spec_ssm):
        _close(g, e)
