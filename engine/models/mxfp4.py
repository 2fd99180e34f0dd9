"""MXFP4 expert weights of OpenAI gpt-oss checkpoints, dequantized at load time.

gpt-oss ships its MoE expert matrices in MXFP4 (config.json ``quantization_config = {"quant_method":
"mxfp4", ...}``); everything else (attention, router, embeddings, the expert biases) is plain bf16.
Each expert matrix ``X`` (``gate_up_proj`` or ``down_proj`` of ``model.layers.{i}.mlp.experts``) is
stored as two uint8 tensors:

  * ``X_blocks`` [E, R, G, 16]: 32 FP4 (e2m1) codes per group of a row, two per byte, the LOW nibble
    first (value 2j is byte j's low nibble, value 2j+1 its high nibble). A code is sign (bit 3) and
    a magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  * ``X_scales`` [E, R, G]: one e8m0 exponent per group of 32 values; the group's scale is
    2 ** (scale - 127).

R is the matrix's output dimension and G * 32 its input dimension: gate_up_proj is [E, 2I, H/32, 16]
and down_proj [E, H, I/32, 16]. transformers (``integrations/mxfp4.py``,
``_convert_moe_packed_tensors``) dequantizes to [E, R, G*32] and then TRANSPOSES dims 1 and 2, giving
GptOssExperts' parameter layout: gate_up_proj [E, H, 2I], down_proj [E, I, H] (``x @ W``, input dim
first). That is also how the bf16 gpt-oss checkpoints (e.g. unsloth/gpt-oss-20b-BF16) store them, so
`dequantize_checkpoint` turns one MXFP4 safetensors file into what a bf16 one holds and the bf16
loader needs nothing else. Gate and up stay interleaved along 2I (gate = [..., ::2], up = [..., 1::2])
in both formats; dequantizing does not reorder them.

Dequantizing is exact: an FP4 value times a power of two is representable in float32, and in bf16 for
every scale a real checkpoint uses. We go through float32 in row chunks so a 20B model's largest
expert tensor (32 x 5760 x 2880) never needs a whole float32 copy.
"""

from __future__ import annotations

import torch

# The 16 e2m1 values in code order: codes 0-7 are +magnitude, 8-15 the same magnitudes negated.
FP4_E2M1_VALUES: tuple[float, ...] = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

VALUES_PER_GROUP = 32
BYTES_PER_GROUP = VALUES_PER_GROUP // 2
FP4_MAX = 6.0
E8M0_BIAS = 127
# e8m0 spans 2**-127 .. 2**127 (codes 0..254); code 255 is NaN in the OCP MX spec.
E8M0_MIN_EXPONENT = -127
E8M0_MAX_EXPONENT = 127

# Decision boundaries between consecutive FP4 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6): the midpoints.
_FP4_MAGNITUDE_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# Bound on the float32 values materialised per chunk (16 MiB), plus an int64 index copy of the same
# count: small next to any expert tensor, large enough that the Python loop is negligible.
_VALUES_PER_CHUNK = 1 << 22

_BLOCKS_SUFFIX = "_blocks"
_SCALES_SUFFIX = "_scales"


def _fp4_lut(device: torch.device) -> torch.Tensor:
    return torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)


def _e8m0_lut(device: torch.device) -> torch.Tensor:
    """All 256 e8m0 scales as float32, built from Python floats so each power of two is exact (no
    exp2/pow rounding): 2**-127 is a float32 subnormal, 2**127 the largest power; 255 is NaN."""
    powers = [2.0 ** (code - E8M0_BIAS) for code in range(255)] + [float("nan")]
    return torch.tensor(powers, dtype=torch.float32, device=device)


def _check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got blocks {blocks.dtype} {tuple(blocks.shape)} "
            f"and scales {scales.dtype} {tuple(scales.shape)}"
        )
    if blocks.ndim < 2 or blocks.shape[-1] != BYTES_PER_GROUP or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree: expected "
            f"blocks [..., G, {BYTES_PER_GROUP}] and scales [..., G]"
        )


def _dequantize_rows_into(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """blocks [N, G, 16] + scales [N, G] -> out [N, G*32] (any strides, any float dtype), a chunk of
    rows at a time so only one chunk ever exists in float32."""
    rows, groups = scales.shape
    fp4_lut, e8m0_lut = _fp4_lut(blocks.device), _e8m0_lut(blocks.device)
    rows_per_chunk = max(1, _VALUES_PER_CHUNK // (groups * VALUES_PER_GROUP))
    for row0 in range(0, rows, rows_per_chunk):
        row1 = min(row0 + rows_per_chunk, rows)
        packed = blocks[row0:row1]
        # Low nibble first: stacking (low, high) on a new last dim puts them at values 2j, 2j+1.
        codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [n, G, 16, 2]
        # int64 indices: indexing with a uint8 tensor would be taken as a boolean mask.
        values = fp4_lut[codes.long()].reshape(row1 - row0, groups, VALUES_PER_GROUP)
        del codes
        values *= e8m0_lut[scales[row0:row1].long()].unsqueeze(-1)  # exact: times a power of two
        out[row0:row1].copy_(values.reshape(row1 - row0, groups * VALUES_PER_GROUP))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 + e8m0 scales [..., G] uint8 -> values [..., G*32] in `dtype`,
    in the stored (row-major, output-dim-first) layout: no transpose here."""
    _check_packed(blocks, scales)
    *leading, groups, _ = blocks.shape
    out = torch.empty(*leading, groups * VALUES_PER_GROUP, dtype=dtype, device=blocks.device)
    _dequantize_rows_into(
        blocks.reshape(-1, groups, BYTES_PER_GROUP),
        scales.reshape(-1, groups),
        out.view(-1, groups * VALUES_PER_GROUP),
    )
    return out


def _dequantize_experts_transposed(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, R, G, 16] + [E, R, G] -> [E, G*32, R] contiguous: transformers' GptOssExperts layout.
    Each chunk is written straight into the transposed result, so no untransposed copy exists."""
    experts, out_features, groups, _ = blocks.shape
    out = torch.empty(experts, groups * VALUES_PER_GROUP, out_features, dtype=dtype, device=blocks.device)
    for expert in range(experts):
        _dequantize_rows_into(blocks[expert], scales[expert], out[expert].T)
    return out


def dequantize_checkpoint(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors -> the same with every ``X_blocks`` / ``X_scales`` pair replaced
    by ``X`` dequantized to `dtype` in GptOssExperts' layout (gate_up_proj [E, H, 2I], down_proj
    [E, I, H]), i.e. what a bf16 gpt-oss checkpoint stores. Other tensors pass through unchanged.
    Pops from `tensors` as it goes (pass a fresh dict) so each packed pair is freed once converted."""
    result: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        if name not in tensors:  # already consumed as the partner of an earlier name
            continue
        if name.endswith(_BLOCKS_SUFFIX):
            base = name[: -len(_BLOCKS_SUFFIX)]
        elif name.endswith(_SCALES_SUFFIX):
            base = name[: -len(_SCALES_SUFFIX)]
        else:
            result[name] = tensors.pop(name)
            continue
        blocks_name, scales_name = base + _BLOCKS_SUFFIX, base + _SCALES_SUFFIX
        missing = scales_name if name == blocks_name else blocks_name
        if missing not in tensors:
            raise ValueError(f"MXFP4 tensor {name} has no partner {missing} in the same file")
        blocks, scales = tensors.pop(blocks_name), tensors.pop(scales_name)
        _check_packed(blocks, scales)
        if blocks.ndim != 4:
            raise ValueError(
                f"MXFP4 tensor {blocks_name} has shape {tuple(blocks.shape)}; only MoE expert tensors "
                f"[E, R, G, {BYTES_PER_GROUP}] are supported"
            )
        result[base] = _dequantize_experts_transposed(blocks, scales, dtype)
        del blocks, scales
    return result


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8),
    the inverse of `dequantize_mxfp4` (same layout, no transpose). For tests and tooling.

    Each group of 32 gets the smallest power of two 2**e with max|w| <= 6 * 2**e (e clamped to e8m0's
    range; an all-zero group gets e = 0), and each value is rounded to the nearest FP4 value, ties to
    the even code as IEEE rounding does. Values already FP4 times one power of two per group round-trip
    exactly (signed zeros included)."""
    if weight.shape[-1] % VALUES_PER_GROUP != 0:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of 32, got shape {tuple(weight.shape)}")
    values = weight.to(torch.float32)
    if not torch.isfinite(values).all():
        raise ValueError(f"cannot quantize a tensor of shape {tuple(weight.shape)} holding inf or NaN to MXFP4")
    *leading, features = values.shape
    groups = features // VALUES_PER_GROUP
    values = values.reshape(*leading, groups, VALUES_PER_GROUP)
    e8m0_lut = _e8m0_lut(values.device)

    group_amax = values.abs().amax(dim=-1)
    # ceil(log2(amax / 6)) by float math, then nudged by exact power-of-two comparisons, so rounding in
    # the log can never leave amax above 6 * 2**e or pick a needlessly large e.
    exponent = torch.ceil(torch.log2(group_amax / FP4_MAX)).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    exponent = exponent.clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT).long()

    def power_of_two(exp: torch.Tensor) -> torch.Tensor:
        return e8m0_lut[(exp + E8M0_BIAS).clamp(0, 254)]

    exponent += ((group_amax > FP4_MAX * power_of_two(exponent)) & (exponent < E8M0_MAX_EXPONENT)).long()
    exponent -= ((group_amax <= FP4_MAX * power_of_two(exponent - 1)) & (exponent > E8M0_MIN_EXPONENT)).long()
    exponent = torch.where(group_amax == 0, torch.zeros_like(exponent), exponent)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)

    scaled = values / e8m0_lut[scales.long()].unsqueeze(-1)  # exact: divided by a power of two
    midpoints = torch.tensor(_FP4_MAGNITUDE_MIDPOINTS, dtype=torch.float32, device=values.device)
    magnitude = scaled.abs()
    # Off a midpoint both searches agree; on one they straddle it and the even code wins.
    below = torch.bucketize(magnitude, midpoints, right=False)
    above = torch.bucketize(magnitude, midpoints, right=True)
    magnitude_code = torch.where(below % 2 == 0, below, above)
    codes = (magnitude_code + 8 * torch.signbit(scaled).long()).to(torch.uint8)

    codes = codes.reshape(*leading, groups, BYTES_PER_GROUP, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)  # low nibble first
    return blocks.contiguous(), scales


def is_mxfp4(config: dict) -> bool:
    """True when a config.json dict says its weights are MXFP4 (quantization_config.quant_method)."""
    quantization = config.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"
