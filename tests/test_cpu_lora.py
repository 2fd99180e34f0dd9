"""The multi-LoRA C kernel (kernels/csrc/lora_bi.c through kernels/cpu_lora.py): y[r] += (x[r] @ a[e].T) @ b[e].T
for the rows of each adapter e, in place.

- it equals the torch formula (float32 within rounding; bfloat16 with the low-rank product rounded to bf16, as
  two chained linears would), rows outside the adapter rows untouched;
- a row's result is bit for bit the same alone, among other rows and adapters, and past the kernel's 256-row
  chunks, at one thread or two (what deterministic serving with adapters rests on);
- row sets it cannot take are refused before any write.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import cpu_grouped_mm, cpu_lora

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="the C kernel library is not built here")

E, RANK, K, N = 3, 24, 72, 88  # ranks and widths off the 16-column strips on purpose


def _weights(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(E, RANK, K, generator=gen).to(dtype)
    b = (torch.randn(E, N, RANK, generator=gen) * 0.1).to(dtype)
    return a, b, cpu_grouped_mm.pack_experts(a), cpu_grouped_mm.pack_experts(b)


def _rows(adapter_of_row: list[int | None]) -> cpu_lora.LoraRows:
    """LoraRows for a step whose row i has adapter ``adapter_of_row[i]`` (None: the base model)."""
    ids = [i for e in range(E) for i, a in enumerate(adapter_of_row) if a == e]
    counts = [sum(a == e for a in adapter_of_row) for e in range(E)]
    offs = torch.tensor([0] + counts).cumsum(0)
    return cpu_lora.LoraRows.of(torch.tensor(ids, dtype=torch.int64), offs, len(adapter_of_row))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_torch_formula_and_leaves_base_rows_alone(dtype):
    a, b, a_packed, b_packed = _weights(dtype)
    gen = torch.Generator().manual_seed(1)
    adapters = [2, None, 0, 0, None, 1, 2, 0]
    x = torch.randn(len(adapters), K, generator=gen).to(dtype)
    y = torch.randn(len(adapters), N, generator=gen).to(dtype)
    y0 = y.clone()
    assert cpu_lora.lora_update_bi(y, x, _rows(adapters), a_packed, b_packed)
    for r, e in enumerate(adapters):
        if e is None:
            assert torch.equal(y[r], y0[r])
            continue
        low = (x[r].float() @ a[e].float().T).to(dtype).float()
        want = y0[r].float() + low @ b[e].float().T
        tol = 1e-4 if dtype is torch.float32 else 2 ** -7 * want.abs().max().item()
        assert (y[r].float() - want).abs().max().item() <= tol, (r, e)
        assert not torch.equal(y[r], y0[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    _, _, a_packed, b_packed = _weights(dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    num_rows = 600  # > 2 x 256: the kernel's row chunks
    adapters = [None if i % 7 == 0 else (i * 5) % E for i in range(num_rows)]
    x = torch.randn(num_rows, K, generator=gen).to(dtype)
    y0 = torch.randn(num_rows, N, generator=gen).to(dtype)
    together = y0.clone()
    assert cpu_lora.lora_update_bi(together, x, _rows(adapters), a_packed, b_packed, num_threads=2)
    one_thread = y0.clone()
    assert cpu_lora.lora_update_bi(one_thread, x, _rows(adapters), a_packed, b_packed, num_threads=1)
    assert torch.equal(together, one_thread)
    for r in (1, 255, 256, 257, 599):
        alone = y0[r : r + 1].clone()
        rows = cpu_lora.LoraRows.of(torch.tensor([0]), torch.tensor([0] + [1 if e >= adapters[r] else 0
                                                                           for e in range(E)]), 1)
        assert cpu_lora.lora_update_bi(alone, x[r : r + 1], rows, a_packed, b_packed)
        assert torch.equal(alone[0], together[r]), r


def test_bad_rows_are_refused_and_nothing_written():
    _, _, a_packed, b_packed = _weights(torch.float32)
    for ids, offs, num_rows in (([0, 5], [0, 1, 2, 2], 4),   # a row id past the step's rows
                                ([0, 1], [0, 2, 1, 2], 4),   # offsets that go down
                                ([0, 1], [0, 1, 1, 3], 4),   # offsets past the row ids
                                ([0, 1], [1, 1, 2, 2], 4)):  # not from 0
        with pytest.raises(ValueError, match="LoraRows"):
            cpu_lora.LoraRows.of(torch.tensor(ids), torch.tensor(offs), num_rows)
    y = torch.zeros(4, N)
    rows = cpu_lora.LoraRows.of(torch.tensor([0, 1]), torch.tensor([0, 2, 2, 2]), 4)
    # Shapes or dtypes that do not fit: False (the caller raises), y untouched.
    assert not cpu_lora.lora_update_bi(y, torch.zeros(4, K + 1), rows, a_packed, b_packed)
    assert not cpu_lora.lora_update_bi(y, torch.zeros(4, K, dtype=torch.bfloat16), rows, a_packed, b_packed)
    assert not cpu_lora.lora_update_bi(y, torch.zeros(3, K), rows, a_packed, b_packed)
    assert torch.equal(y, torch.zeros(4, N))
