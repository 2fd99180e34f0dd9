"""The multi-LoRA C kernel (kernels/csrc/lora_bi.c through kernels/cpu_lora.py): for the rows of each adapter e,
in place, each output slice s gets y[r, s] += (x[r] @ a_s[e].T) @ b_s[e].T (adapters with other ranks, or none, on
each slice, as a fused q/k/v projection has).

- it equals the torch formula (float32 within rounding; bfloat16 with the low-rank product rounded to bf16, as
  two chained linears would), rows outside the adapter rows untouched;
- a row's result is bit for bit the same alone, among other rows and adapters, and past the kernel's 256-row
  chunks, at one thread or two (what deterministic serving with adapters rests on);
- row sets it cannot take are refused before any write.
"""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import cpu_lora

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="the C kernel library is not built here")

E, K = 3, 72
# One projection's output slices (offset, width), like a fused q/k/v; widths off the 16-column strips on purpose.
SLICES = [(0, 40), (40, 24), (64, 24)]
N = 88
# Per adapter, the rank of its update of each slice (0: it leaves that slice alone); odd ranks on purpose.
RANKS = {0: [8, 8, 8], 1: [5, 0, 5], 2: [0, 12, 0]}


def _weights(dtype, seed=0):
    """({adapter: [(offset, width, a, b) per slice]} float32, the packed form)."""
    gen = torch.Generator().manual_seed(seed)
    updates = {}
    for e, ranks in RANKS.items():
        updates[e] = [(off, width, None, None) if not r else
                      (off, width, torch.randn(r, K, generator=gen).to(dtype).float(),
                       (torch.randn(width, r, generator=gen) * 0.1).to(dtype).float())
                      for (off, width), r in zip(SLICES, ranks)]
    return updates, cpu_lora.pack_lora(updates, E, N, dtype)


def _reference(y0: torch.Tensor, x: torch.Tensor, slices, dtype) -> torch.Tensor:
    """One row: each slice's low-rank product rounded to dtype, its product with b added in fp32."""
    out = y0.float().clone()
    for off, width, a, b in slices:
        if a is not None:
            out[off : off + width] += (x.float() @ a.T).to(dtype).float() @ b.T
    return out


def _rows(adapter_of_row: list[int | None]) -> cpu_lora.LoraRows:
    """LoraRows for a step whose row i has adapter ``adapter_of_row[i]`` (None: the base model)."""
    ids = [i for e in range(E) for i, a in enumerate(adapter_of_row) if a == e]
    counts = [sum(a == e for a in adapter_of_row) for e in range(E)]
    offs = torch.tensor([0] + counts).cumsum(0)
    return cpu_lora.LoraRows.of(torch.tensor(ids, dtype=torch.int64), offs, len(adapter_of_row))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_torch_formula_and_leaves_base_rows_alone(dtype):
    updates, packed = _weights(dtype)
    assert packed.slices.tolist() == [[0, 8, 0, 40], [8, 12, 40, 24], [20, 8, 64, 24]]  # each slice's largest rank
    gen = torch.Generator().manual_seed(1)
    adapters = [2, None, 0, 0, None, 1, 2, 0]
    x = torch.randn(len(adapters), K, generator=gen).to(dtype)
    y = torch.randn(len(adapters), N, generator=gen).to(dtype)
    y0 = y.clone()
    assert cpu_lora.lora_update_bi(y, x, _rows(adapters), packed)
    for r, e in enumerate(adapters):
        if e is None:
            assert torch.equal(y[r], y0[r])
            continue
        want = _reference(y0[r], x[r], updates[e], dtype)
        tol = 1e-4 if dtype is torch.float32 else 2 ** -7 * want.abs().max().item()
        assert (y[r].float() - want).abs().max().item() <= tol, (r, e)
        for (off, width, a, _) in updates[e]:  # slices it leaves alone stay as they were
            assert torch.equal(y[r, off : off + width], y0[r, off : off + width]) == (a is None), (r, e, off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    _, packed = _weights(dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    num_rows = 600  # > 2 x 256: the kernel's row chunks
    adapters = [None if i % 7 == 0 else (i * 5) % E for i in range(num_rows)]
    x = torch.randn(num_rows, K, generator=gen).to(dtype)
    y0 = torch.randn(num_rows, N, generator=gen).to(dtype)
    together = y0.clone()
    assert cpu_lora.lora_update_bi(together, x, _rows(adapters), packed, num_threads=2)
    one_thread = y0.clone()
    assert cpu_lora.lora_update_bi(one_thread, x, _rows(adapters), packed, num_threads=1)
    assert torch.equal(together, one_thread)
    for r in (1, 255, 256, 257, 599):
        alone = y0[r : r + 1].clone()
        rows = cpu_lora.LoraRows.of(torch.tensor([0]), torch.tensor([0] + [1 if e >= adapters[r] else 0
                                                                           for e in range(E)]), 1)
        assert cpu_lora.lora_update_bi(alone, x[r : r + 1], rows, packed)
        assert torch.equal(alone[0], together[r]), r


def test_bad_rows_are_refused_and_nothing_written():
    _, packed = _weights(torch.float32)
    for ids, offs, num_rows in (([0, 5], [0, 1, 2, 2], 4),   # a row id past the step's rows
                                ([0, 1], [0, 2, 1, 2], 4),   # offsets that go down
                                ([0, 1], [0, 1, 1, 3], 4),   # offsets past the row ids
                                ([0, 1], [1, 1, 2, 2], 4)):  # not from 0
        with pytest.raises(ValueError, match="LoraRows"):
            cpu_lora.LoraRows.of(torch.tensor(ids), torch.tensor(offs), num_rows)
    y = torch.zeros(4, N)
    rows = cpu_lora.LoraRows.of(torch.tensor([0, 1]), torch.tensor([0, 2, 2, 2]), 4)
    # Shapes or dtypes that do not fit: False (the caller raises), y untouched.
    assert not cpu_lora.lora_update_bi(y, torch.zeros(4, K + 1), rows, packed)
    assert not cpu_lora.lora_update_bi(y, torch.zeros(4, K, dtype=torch.bfloat16), rows, packed)
    assert not cpu_lora.lora_update_bi(y, torch.zeros(3, K), rows, packed)
    assert not cpu_lora.lora_update_bi(torch.zeros(4, N + 1), torch.zeros(4, K), rows, packed)
    assert torch.equal(y, torch.zeros(4, N))
