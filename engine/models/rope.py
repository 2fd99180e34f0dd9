"""Rotary position embeddings: the frequency table of each RoPE variant a checkpoint's config can ask for.

The variants are the ones the popular checkpoints ship with, computed as transformers computes them (its
``modeling_rope_utils``), so a float32 run gives transformers' tokens:
- ``default``: inv_freq = theta ** (-2i / head_dim);
- ``linear`` (position interpolation): inv_freq / factor;
- ``llama3`` (Llama 3.1, 3.2, 3.3): low frequencies divided by factor, high ones kept, a smooth ramp between,
  by wavelength against the pre-training context (``original_max_position_embeddings``);
- ``yarn`` (Qwen2.5 / Qwen3 long context, DeepSeek-style configs): a ramp between interpolated and
  extrapolated frequencies over the dimensions given by beta_fast / beta_slow, and cos / sin scaled by an
  attention factor (0.1 ln(factor) + 1 unless the config sets it).
All are static: one table for every position, so KV written at any step stays valid (which ``dynamic``
NTK, whose frequencies follow the current sequence length, and ``longrope``, which switches tables past the
original context, do not give a paged cache; both are refused, as is partial rotary).

A config says which variant in one of two forms: ``rope_scaling`` {"type" or "rope_type", ...} beside
``rope_theta`` (transformers 4), or ``rope_parameters`` {"rope_type", "rope_theta", ...} (transformers 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE variant's parameters, as read from config.json (hashable: it is part of ModelArch)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # llama3 / yarn: the pre-training context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None = derived from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the correction range to whole dimensions


def rope_from_config(cfg: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from a Hugging Face config dict, scaling None for default RoPE; ValueError naming the field
    for what is not served."""
    params, legacy = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise ValueError(f"{where}: rope_scaling / rope_parameters must be an object")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: rope_parameters per layer type ({sorted(params)}) are not supported")
    params = {**legacy, **params}
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor {partial!r} is not supported (only 1.0)")
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if rope_type not in SUPPORTED:
        why = {"dynamic": "its frequencies follow the sequence length, so cached KV would go stale",
               "longrope": "it switches tables past the original context, so cached KV would go stale"}
        raise ValueError(f"{where}: {field} rope type {rope_type!r} is not supported "
                         f"({why.get(rope_type, 'unknown')}; supported: {', '.join(SUPPORTED)})")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_positions)
    factor = params.get("factor")
    if rope_type in ("linear", "llama3") and factor is None:
        raise ValueError(f"{where}: {field} rope type {rope_type!r} needs a 'factor'")
    if rope_type == "yarn" and factor is None:
        factor = max_positions / original  # transformers' rule when a yarn config gives no factor
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                raise ValueError(f"{where}: {field} rope type 'llama3' needs {key!r}")
        if float(params["high_freq_factor"]) <= float(params["low_freq_factor"]):
            raise ValueError(f"{where}: {field} rope type 'llama3' needs high_freq_factor > low_freq_factor")
    opt = lambda key, default: default if params.get(key) is None else float(params[key])  # noqa: E731
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        original_max_position_embeddings=original,
        low_freq_factor=opt("low_freq_factor", 1.0),
        high_freq_factor=opt("high_freq_factor", 4.0),
        beta_fast=opt("beta_fast", 32.0) or 32.0,
        beta_slow=opt("beta_slow", 1.0) or 1.0,
        attention_factor=opt("attention_factor", None),
        mscale=opt("mscale", None),
        mscale_all_dim=opt("mscale_all_dim", None),
        truncate=bool(params.get("truncate", True)),
    )


def inv_freq_and_scale(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """float32 [head_dim // 2] inverse frequencies, and the factor cos / sin are multiplied by."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    s = scaling or RopeScaling()
    if s.rope_type == "default":
        return inv_freq, 1.0
    if s.rope_type == "linear":
        return inv_freq / s.factor, 1.0
    if s.rope_type == "llama3":
        return _llama3(inv_freq, s), 1.0
    if s.rope_type == "yarn":
        return _yarn(head_dim, theta, s)
    raise ValueError(f"rope type {s.rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(s.factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength turns num_rotations times over the original context.
        return (dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1: the dimension keeps its trained frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)
