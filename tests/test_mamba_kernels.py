"""The torch reference kernels of a Mamba2 layer (kernels/mamba_reference.py): the chunked SSM scan
against the token-by-token recurrence (its definition) and against transformers' mamba2_chunk_scan;
the causal conv over a row against one-token updates; batched updates against rows alone; the dt
clamp; and the CPU dispatch in kernels/mamba_ops.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels import mamba_ops
from pdcluster.kernels import mamba_reference as ref

DT_MIN = 0.01

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


def _case(length: int, heads: int = 4, head_dim: int = 8, groups: int = 2, state: int = 6, seed: int = 0):
    """Random SSM inputs; dt_bias low enough that softplus(dt + dt_bias) < DT_MIN on some tokens (the
    clamp is exercised), decays A in [-2.1, -0.1]."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return dict(
        x=r(length, heads, head_dim), dt=r(length, heads) * 1.5, A=-(torch.rand(heads, generator=gen) * 2 + 0.1),
        B=r(length, groups, state), C=r(length, groups, state), D=r(heads), dt_bias=r(heads) - 3.0, dt_min=DT_MIN,
    )


def _initial(case: dict, seed: int = 1) -> torch.Tensor:
    heads, head_dim = case["x"].shape[1:]
    return torch.randn(heads, head_dim, case["B"].shape[-1], generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# (f) chunked scan == token-by-token recurrence


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 16, 40, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("with_initial", [False, True], ids=["zero-state", "initial-state"])
def test_chunk_scan_equals_recurrence(chunk_size, with_initial):
    """L = 40: chunk sizes that divide it (1, 5, 8, 40), that do not (16: a padded last chunk), and one
    larger than the row (64: a single padded chunk)."""
    case = _case(40)
    initial = _initial(case) if with_initial else None
    y, final = ref.ssd_chunk_scan(**case, chunk_size=chunk_size, initial_state=initial)
    y_rec, final_rec, _ = ref.ssm_recurrence(**case, initial_state=initial)
    _close(y, y_rec)
    _close(final, final_rec)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunk_scan_groups_map_heads_like_the_recurrence(groups):
    case = _case(13, heads=4, groups=groups, seed=groups)
    y, final = ref.ssd_chunk_scan(**case, chunk_size=4, initial_state=_initial(case))
    y_rec, final_rec, _ = ref.ssm_recurrence(**case, initial_state=_initial(case))
    _close(y, y_rec)
    _close(final, final_rec)


def test_chunk_scan_in_two_calls_carries_the_state():
    case = _case(29, seed=3)
    whole_y, whole_state = ref.ssd_chunk_scan(**case, chunk_size=8)
    first = {k: (v[:11] if isinstance(v, torch.Tensor) and v.shape[0] == 29 else v) for k, v in case.items()}
    rest = {k: (v[11:] if isinstance(v, torch.Tensor) and v.shape[0] == 29 else v) for k, v in case.items()}
    y1, state1 = ref.ssd_chunk_scan(**first, chunk_size=8)
    y2, state2 = ref.ssd_chunk_scan(**rest, chunk_size=8, initial_state=state1)
    _close(torch.cat([y1, y2]), whole_y)
    _close(state2, whole_state)


def test_chunk_scan_equals_transformers_mamba2_chunk_scan():
    """The math is transformers' (batched, with the same clamp): same outputs and final state."""
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    case = _case(37, seed=4)
    initial = _initial(case)
    y, final = ref.ssd_chunk_scan(**case, chunk_size=16, initial_state=initial)
    y_hf, final_hf = modeling.mamba2_chunk_scan(
        case["x"][None], case["dt"][None], case["A"], case["B"][None], case["C"][None], 16, D=case["D"],
        dt_bias=case["dt_bias"], initial_states=initial[None], dt_softplus=True, dt_limit=(DT_MIN, float("inf")),
        return_final_states=True)
    _close(y, y_hf[0])
    _close(final, final_hf[0])


def test_dt_is_clamped_below_by_dt_min():
    dt = torch.tensor([[-30.0, -5.0, -4.0, 25.0]])  # softplus: ~0, 0.0067 (both under DT_MIN), 0.018, 25
    got = ref.discretize_dt(dt, torch.zeros(4), DT_MIN)
    expected = torch.tensor([[DT_MIN, DT_MIN, F.softplus(torch.tensor(-4.0)).item(), 25.0]])
    _close(got, expected)
    case = _case(20, seed=5)
    assert (F.softplus(case["dt"] + case["dt_bias"]) < DT_MIN).any()  # the clamp matters in these cases


def test_selective_state_update_batched_equals_rows_alone():
    """Three requests in slots 4, 0, 2 of a 5-slot pool: each updated as if alone, slots 1 and 3 untouched."""
    case = _case(3, seed=6)
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(5, 4, 8, 6, generator=gen)
    slots = torch.tensor([4, 0, 2])
    before = pool.clone()
    y = ref.selective_state_update(pool, slots, case["x"], case["dt"], case["A"], case["B"], case["C"], case["D"],
                                   case["dt_bias"], DT_MIN)
    for b, slot in enumerate(slots.tolist()):
        single = before[slot : slot + 1].clone()
        y_b = ref.selective_state_update(single, torch.tensor([0]), case["x"][b : b + 1], case["dt"][b : b + 1],
                                         case["A"], case["B"][b : b + 1], case["C"][b : b + 1], case["D"],
                                         case["dt_bias"], DT_MIN)
        _close(y[b], y_b[0])
        _close(pool[slot], single[0])
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


# ---------------------------------------------------------------------------------------------------
# Causal conv


def _conv_case(length: int, channels: int = 10, kernel: int = 4, seed: int = 8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(length, channels, generator=gen), torch.randn(channels, kernel - 1, generator=gen),
            torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen))


@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_causal_conv1d_equals_one_token_updates(kernel, length):
    """A row shorter than the kernel included: the new state then mixes old state and new inputs."""
    x, state, weight, bias = _conv_case(length, kernel=kernel)
    out, new_state = ref.causal_conv1d(x, state, weight, bias)
    pool = state[None].clone()
    steps = [ref.causal_conv1d_update(x[t : t + 1], pool, torch.tensor([0]), weight, bias)[0] for t in range(length)]
    _close(out, torch.stack(steps))
    _close(new_state, pool[0])
    assert torch.equal(new_state, torch.cat([state, x.t()], dim=1)[:, -(kernel - 1):])


def test_causal_conv1d_from_zero_state_equals_transformers_conv():
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, state, weight, bias = _conv_case(9)
    out, _ = ref.causal_conv1d(x, torch.zeros_like(state), weight, bias)
    expected = modeling.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")[0].t()
    _close(out, expected)
    raw, _ = ref.causal_conv1d(x, torch.zeros_like(state), weight, None, activation=False)
    _close(raw, modeling.causal_conv1d_fn(x.t()[None], weight, None)[0].t())


# ---------------------------------------------------------------------------------------------------
# Dispatch


def test_ops_use_the_reference_on_cpu(monkeypatch):
    """CPU tensors never reach the Triton module (it would need a GPU, or the interpreter)."""
    import sys

    monkeypatch.delitem(sys.modules, "pdcluster.kernels.triton_mamba", raising=False)
    case = _case(1, seed=9)
    pool = torch.zeros(2, 4, 8, 6)
    y = mamba_ops.selective_state_update(pool, torch.tensor([1]), case["x"], case["dt"], case["A"], case["B"],
                                         case["C"], case["D"], case["dt_bias"], DT_MIN)
    expected_pool = torch.zeros(2, 4, 8, 6)
    _close(y, ref.selective_state_update(expected_pool, torch.tensor([1]), case["x"], case["dt"], case["A"], case["B"],
                                         case["C"], case["D"], case["dt_bias"], DT_MIN))
    x, state, weight, bias = _conv_case(1)
    conv_pool = state[None].clone()
    mamba_ops.causal_conv1d_update(x, conv_pool, torch.tensor([0]), weight, bias)
    assert "pdcluster.kernels.triton_mamba" not in sys.modules
