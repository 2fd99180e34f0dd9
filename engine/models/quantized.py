"""Checkpoints whose linear weights are stored quantized with scales (FP8, INT8), dequantized at load.

Three layouts, each weight ``X.weight`` beside its scale, as the checkpoint's config.json says:
- block-wise FP8 (``quant_method: "fp8"`` with ``weight_block_size``, e.g. [128, 128]: DeepSeek-V3 / R1's own
  release, Qwen3-*-FP8, GLM-4.5-FP8; transformers' FineGrainedFP8): ``X.weight`` [out, in] float8_e4m3fn and
  ``X.weight_scale_inv`` [ceil(out / 128), ceil(in / 128)], one scale a block (edge blocks cut short);
- per-tensor FP8 (``quant_method: "fp8"`` without a block size: AutoFP8's and vLLM's own FP8 checkpoints):
  ``X.weight_scale``, one number;
- compressed-tensors (``quant_method: "compressed-tensors"``, ``format`` float-quantized / int-quantized /
  naive-quantized, 8-bit weights: RedHatAI's *-FP8-dynamic, *-quantized.w8a8 and the like): ``X.weight_scale`` of
  one number (strategy tensor), one a row ([out, 1], channel), one a group of columns ([out, in / group]) or one a
  block (strategy block, its ``block_structure``), and an ``X.weight_zero_point`` of the same shape where the
  weights are asymmetric.
A weight is ``(X.weight - zero_point) * scale``. Weights kept in 16 bits (embeddings, norms, routers, the LM head)
have no scale. Activation and KV-cache scales (``input_scale``, ``k_scale``, ``v_scale``) are dropped: the engine
computes in 16 bits.

The loader reads every weight into the serving dtype (e4m3 and int8 values are exact in bf16 and fp32), keeps the
scales and zero points in float32, and once all files are read (a weight and its scale may sit in different shards)
computes each weight in float32 and rounds once: ``dequantize_weights``. The model then holds 16-bit weights, twice an
8-bit checkpoint's bytes; 8-bit matmuls are not served. 4-bit packed formats (pack-quantized, AWQ, GPTQ) and other
methods are refused (architectures.py) by ``scaled_weights_of`` returning None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DROPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".input_zero_point")
# compressed-tensors formats whose weights are plain 8-bit values beside their scales.
_COMPRESSED_TENSORS_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class ScaledWeights:
    """How a checkpoint's quantized weights are laid out (module docstring)."""

    scale_suffix: str  # "X.weight" + this names its scale
    block_size: tuple[int, int] | None = None  # block-wise FP8's; None: a scale a tensor, a row or a column group

    def is_side_tensor(self, name: str) -> bool:
        """A scale or zero point (kept float32), or an activation / KV scale (dropped)."""
        return name.endswith((self.scale_suffix, "_zero_point")) or name.endswith(_DROPPED_SUFFIXES)


def scaled_weights_of(config: dict) -> ScaledWeights | None:
    """The layout of a config.json's quantized weights when the loader dequantizes them; None for an unquantized
    checkpoint and for quantized ones it does not (architectures.py refuses those)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    if q.get("quant_method") == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            return ScaledWeights("_scale")
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            return ScaledWeights("_scale_inv", (block[0], block[1]))
        return None
    if q.get("quant_method") == "compressed-tensors" and q.get("format") in _COMPRESSED_TENSORS_FORMATS:
        groups = q.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
        if not weights or any(w.get("num_bits") != 8 for w in weights):
            return None
        if all(w.get("strategy") in ("tensor", "channel", "group") for w in weights):
            return ScaledWeights("_scale")
        blocks = {tuple(w.get("block_structure") or ()) for w in weights}
        if all(w.get("strategy") == "block" for w in weights) and len(blocks) == 1:  # FP8_BLOCK: one size
            (block,) = blocks
            if len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
                return ScaledWeights("_scale", (block[0], block[1]))
    return None


def _expand(scale: torch.Tensor, shape: torch.Size, block_size: tuple[int, int] | None) -> torch.Tensor:
    """A weight's scales (or zero points) broadcast to the weight's shape [..., out, in], float32."""
    rows, cols = shape[-2:]
    scale = scale.float()
    if block_size is not None:
        b0, b1 = block_size
        want = (*shape[:-2], -(-rows // b0), -(-cols // b1))
        if tuple(scale.shape) != want:
            raise ValueError(f"block scale of shape {tuple(scale.shape)} for a weight of shape {tuple(shape)} in "
                             f"blocks of {b0} x {b1}: expected {want}")
        return scale.repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() == 1:
        scale = scale[:, None]
    if scale.shape[-2] == rows and cols % scale.shape[-1] == 0:  # a row's (channel) or a column group's
        return scale.repeat_interleave(cols // scale.shape[-1], dim=-1)
    raise ValueError(f"scale of shape {tuple(scale.shape)} does not fit a weight of shape {tuple(shape)}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block_size: tuple[int, int] | None = None,
               zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """``(weight - zero_point) * scale`` in float32, rounded once to ``dtype`` (module docstring)."""
    w = weight.float()
    if zero_point is not None:
        w = w - _expand(zero_point, weight.shape, block_size)
    return (w * _expand(scale, weight.shape, block_size)).to(dtype)


def dequantize_weights(weights: dict[str, torch.Tensor], layout: ScaledWeights,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight with a scale in ``weights`` replaced (in place) by its value in ``dtype``; the scales, zero
    points and activation / KV scales removed. ValueError naming the tensor for a scale without its weight."""
    for name in [n for n in weights if n.endswith(_DROPPED_SUFFIXES)]:
        del weights[name]
    for scale_name in [n for n in weights if n.endswith(layout.scale_suffix)]:
        name = scale_name[: -len(layout.scale_suffix)]
        if name not in weights:
            raise ValueError(f"quantization scale {scale_name} has no weight {name} in the checkpoint")
        zero_point = weights.pop(name + "_zero_point", None)
        weights[name] = dequantize(weights[name], weights.pop(scale_name), dtype, layout.block_size, zero_point)
    return weights


def quantize_fp8_block(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) of a [..., out, in] weight, each block scaled so its largest
    magnitude is e4m3's largest (448), as DeepSeek's and Qwen's FP8 releases are made. For tests and tooling."""
    rows, cols = weight.shape[-2:]
    b0, b1 = block_size
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % b1, 0, -rows % b0))
    blocks = padded.unflatten(-2, (-1, b0)).unflatten(-1, (-1, b1))  # [..., R, b0, C, b1]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R, C]
    scale_inv = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    return (weight.float() / _expand(scale_inv, weight.shape, block_size)).to(torch.float8_e4m3fn), scale_inv


def quantize_int8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale [out, 1]) of a [out, in] weight, symmetric per row (compressed-tensors' W8
    channel strategy). For tests and tooling."""
    scale = weight.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(weight.float() / scale).clamp(-127, 127).to(torch.int8), scale
