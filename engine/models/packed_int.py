"""AWQ and GPTQ checkpoints (4-bit, and 8-bit GPTQ): integer weights packed into int32 words, unpacked and
dequantized at load.

Each quantized linear ``X`` [out N, in K] is stored as (group size g along the inputs; -1: one group):
- ``X.qweight`` int32: AWQ [K, N / 8], eight 4-bit values of one input row a word, in AWQ's order (word nibble i
  holds column 8 j + (0, 2, 4, 6, 1, 3, 5, 7)[i]); GPTQ [K / p, N], p = 32 / bits values of one column a word,
  row k in nibble k % p;
- ``X.qzeros`` int32 [K / g, N / p]: the groups' zero points, packed along the columns as the weights are
  (AWQ's order for AWQ, in order for GPTQ). GPTQ's original format (``checkpoint_format`` "gptq", AutoGPTQ's) stores
  each zero minus one; "gptq_v2" stores it as it is;
- ``X.scales`` [K / g, N] (float16);
- GPTQ's ``X.g_idx`` [K]: each input row's group (act-order checkpoints permute it; else k // g).
A weight is ``W[k, n] = (q[k, n] - zero[group(k), n]) * scale[group(k), n]``; the model's linear weight is W
transposed. These are the layouts vLLM's ``awq_pack`` / ``gptq_pack`` write and its AWQ dequantize kernel reads
(tests/test_model_families.py checks words vLLM packed).

The loader keeps the packed tensors as they are (integers: a cast would ruin them) and the scales in float32,
then dequantizes each weight in float32 once all files are read and rounds once to the serving dtype. The model
holds 16-bit weights: four times a 4-bit checkpoint's bytes (no 4-bit matmuls yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) of each nibble of an AWQ word
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble of each column
_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


@dataclass(frozen=True)
class PackedInts:
    """How a checkpoint packs its weights (module docstring)."""

    method: str  # "awq" or "gptq"
    bits: int
    group_size: int  # inputs a group; -1: all of them
    zero_offset: int = 0  # GPTQ's original format stores zero - 1

    def is_side_tensor(self, name: str) -> bool:
        return name.endswith(_SUFFIXES)


def packed_ints_of(config: dict) -> PackedInts | None:
    """The packing of a config.json's AWQ / GPTQ weights when the loader serves it; None otherwise (unquantized,
    another method, or a variant not served: AWQ GEMV / without zero points, bits other than 4 (AWQ) or 4 and 8)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method, bits, group = q.get("quant_method"), q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or group > 0):
        return None
    if method == "awq" and bits == 4 and str(q.get("version", "gemm")).lower() == "gemm" and q.get("zero_point", True):
        return PackedInts("awq", 4, group)
    if method == "gptq" and bits in (4, 8) and q.get("checkpoint_format", "gptq") in ("gptq", "gptq_v2"):
        return PackedInts("gptq", bits, group, zero_offset=1 if q.get("checkpoint_format", "gptq") == "gptq" else 0)
    return None


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``words`` -> the unsigned ``bits``-bit values they hold, in order (value i of a word in bits
    [bits * i, bits * (i + 1))), spread along ``dim`` (int32)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word] (arithmetic shift, then masked)
    values = values.movedim(-1, dim + 1 if dim >= 0 else dim)
    shape = list(words.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of ``unpack``: unsigned ``bits``-bit int values, consecutive ones along ``dim`` into int32 words.
    For tests and tooling."""
    per_word = 32 // bits
    v = (values.to(torch.int64) & ((1 << bits) - 1)).movedim(dim, -1)  # -1 (GPTQ's zero 0 minus one) wraps, as stored
    v = v.reshape(*v.shape[:-1], -1, per_word)
    words = (v << torch.arange(0, 32, bits, dtype=torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def awq_columns(values: torch.Tensor) -> torch.Tensor:
    """AWQ's unpacked values (nibble order within each 8 columns) in column order."""
    return values.unflatten(-1, (-1, 8))[..., list(AWQ_REVERSE_ORDER)].flatten(-2)


def awq_nibbles(values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``awq_columns``: columns in AWQ's nibble order (what ``pack`` then packs). For tests."""
    return values.unflatten(-1, (-1, 8))[..., list(AWQ_ORDER)].flatten(-2)


def dequantize_one(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, layout: PackedInts,
                   dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """One linear weight [out N, in K] in ``dtype`` from its packed tensors (module docstring)."""
    if layout.method == "awq":
        q = awq_columns(unpack(qweight, layout.bits, dim=1))  # [K, N]
        zeros = awq_columns(unpack(qzeros, layout.bits, dim=1))
    else:
        q = unpack(qweight, layout.bits, dim=0)  # [K, N]
        zeros = unpack(qzeros, layout.bits, dim=1) + layout.zero_offset
    num_inputs, num_outputs = q.shape
    if zeros.shape[-1] != num_outputs or scales.shape[-1] != num_outputs or zeros.shape[0] != scales.shape[0]:
        raise ValueError(f"packed weight {tuple(q.shape)} (K, N) with zeros {tuple(zeros.shape)} and scales "
                         f"{tuple(scales.shape)}: they disagree")
    if g_idx is None:
        group = num_inputs if layout.group_size == -1 else layout.group_size
        g_idx = torch.arange(num_inputs, device=q.device) // group
    groups = g_idx.long()
    if int(groups.max()) >= scales.shape[0]:
        raise ValueError(f"packed weight of {num_inputs} inputs in groups of {layout.group_size}: only "
                         f"{scales.shape[0]} groups of scales")
    w = (q.float() - zeros[groups].float()) * scales.float()[groups]
    return w.t().contiguous().to(dtype)


def dequantize_packed(weights: dict[str, torch.Tensor], layout: PackedInts,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every ``X.qweight`` (with its qzeros, scales, g_idx) in ``weights`` replaced (in place) by ``X.weight`` in
    ``dtype``; ValueError naming the tensor for a part missing."""
    for name in [n for n in weights if n.endswith(".qweight")]:
        base = name[: -len(".qweight")]
        missing = [f"{base}.{part}" for part in ("qzeros", "scales") if f"{base}.{part}" not in weights]
        if missing:
            raise ValueError(f"packed weight {name} lacks {', '.join(missing)} in the checkpoint")
        g_idx = weights.pop(f"{base}.g_idx", None) if layout.method == "gptq" else None
        weights[f"{base}.weight"] = dequantize_one(weights.pop(name), weights.pop(f"{base}.qzeros"),
                                                   weights.pop(f"{base}.scales"), layout, dtype, g_idx)
    return weights
