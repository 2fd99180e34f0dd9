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
- ``longrope`` (Phi-3.5, Phi-4-mini; Phi-3's older ``su``): per-dimension divisors of the frequencies, a short
  list for sequences within the original context and a long one past it, and cos / sin scaled by
  sqrt(1 + ln(factor) / ln(original context)).
All are static: one table for every position, so KV written at any step stays valid. ``dynamic`` NTK, whose
frequencies follow the current sequence length, is refused. transformers switches longrope's table when a
sequence grows past the original context (and Phi-3's generate then recomputes the whole cache); a paged cache
cannot follow a switch, so an engine picks one table for every request from its max_model_len, as vLLM does:
the short one when max_model_len fits the original context (transformers' answers for every request), else
the long one (transformers' answers for prompts past the original context) -- ``for_context``.

Partial rotary (Phi-4-mini: 0.75 of each head; GLM-4: half, in interleaved pairs (2j, 2j + 1)) rotates the first
``rotary_dim`` dimensions of q and k in pairs (j, j + rotary_dim / 2) and passes the rest through. The kernels
rotate pairs (j, j + head_dim / 2) of the whole head, so the loader permutes each q and k head's dimensions
(``partial_rotary_order``: the rotated pairs and the passed-through dimensions each split across the two halves)
and the table gives the passed-through pairs cos 1 and sin 0. q . k is the same under one permutation of both, and
V is not permuted.

A config says which variant in one of two forms: ``rope_scaling`` {"type" or "rope_type", ...} beside
``rope_theta`` (transformers 4), or ``rope_parameters`` {"rope_type", "rope_theta", ...} (transformers 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")


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
    short_factor: tuple[float, ...] = ()  # longrope: a divisor per frequency, within the original context
    long_factor: tuple[float, ...] = ()  # longrope: ... and past it
    use_long: bool = False  # longrope: the table this engine serves every request with (``for_context``)


def rope_from_config(cfg: dict, where: str, phi3: bool = False,
                     partial_ok: bool = False) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from a Hugging Face config dict, scaling None for default RoPE; ValueError naming the field
    for what is not served. ``phi3``: a Phi-3 family config, which may ask for ``longrope`` (Phi3Config reads its
    legacy ``su`` and ``yarn`` as longrope) and partial rotary (``partial_rotary_factor``); ``partial_ok``: another
    architecture served with partial rotary (GLM-4)."""
    params, legacy = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise ValueError(f"{where}: rope_scaling / rope_parameters must be an object")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: rope_parameters per layer type ({sorted(params)}) are not supported")
    params = {**legacy, **params}
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if phi3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    partial = partial_rotary_factor(cfg)
    if partial != 1.0 and not (phi3 or partial_ok):
        raise ValueError(f"{where}: partial_rotary_factor {partial!r} is not supported (only 1.0; partial rotary "
                         "is served for Phi3ForCausalLM, Glm4ForCausalLM and Glm4MoeForCausalLM)")
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if rope_type == "longrope" and not phi3:
        raise ValueError(f"{where}: {field} rope type 'longrope' is served for Phi3ForCausalLM only")
    if rope_type not in SUPPORTED:
        why = {"dynamic": "its frequencies follow the sequence length, so cached KV would go stale"}
        raise ValueError(f"{where}: {field} rope type {rope_type!r} is not supported "
                         f"({why.get(rope_type, 'unknown')}; supported: {', '.join(SUPPORTED)})")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_positions)
    factor = params.get("factor")
    if rope_type in ("linear", "llama3") and factor is None:
        raise ValueError(f"{where}: {field} rope type {rope_type!r} needs a 'factor'")
    if rope_type in ("yarn", "longrope") and factor is None:
        factor = max_positions / original  # transformers' rule when a yarn / longrope config gives no factor
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                raise ValueError(f"{where}: {field} rope type 'llama3' needs {key!r}")
        # Equal factors are served (Llama 4 Scout's 1.0 / 1.0: no ramp, a step at the original context).
        if float(params["high_freq_factor"]) < float(params["low_freq_factor"]):
            raise ValueError(f"{where}: {field} rope type 'llama3' needs high_freq_factor >= low_freq_factor")
    factors = {}
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            value = params.get(key)
            if not isinstance(value, list) or not value or not all(isinstance(x, (int, float)) for x in value):
                raise ValueError(f"{where}: {field} rope type 'longrope' needs {key!r}, a list of numbers")
            factors[key] = tuple(float(x) for x in value)
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
        **factors,
    )


def partial_rotary_factor(cfg: dict, default: float = 1.0) -> float:
    """The fraction of each head that RoPE rotates (``rope_parameters`` or the config's top level; ``default`` when
    neither says: 1.0, all, except for GLM-4, whose config class assumes 0.5)."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return default if partial is None else float(partial)


def rotary_dim_of(cfg: dict, head_dim: int, scaling: RopeScaling | None, where: str, default: float = 1.0) -> int:
    """How many of a head's dimensions RoPE rotates (transformers: int(head_dim * partial_rotary_factor)); a
    ValueError when the kernels cannot serve it, or when longrope's factor lists do not fit it."""
    partial = partial_rotary_factor(cfg, default)
    rotary_dim = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise ValueError(f"{where}: partial_rotary_factor {partial!r} of head_dim {head_dim} gives {rotary_dim} "
                         "rotated dimensions: it needs an even count in (0, head_dim] that leaves an even rest")
    if scaling is not None and scaling.rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(getattr(scaling, key)) != rotary_dim // 2:
                raise ValueError(f"{where}: longrope {key} has {len(getattr(scaling, key))} entries; the "
                                 f"{rotary_dim} rotated dimensions need {rotary_dim // 2}")
    return rotary_dim


def for_context(scaling: RopeScaling | None, max_model_len: int) -> RopeScaling | None:
    """The variant an engine of this max_model_len serves: longrope's long table when a sequence may run past the
    original context, else its short one (vLLM's rule); other variants as they are."""
    if scaling is None or scaling.rope_type != "longrope":
        return scaling
    return replace(scaling, use_long=max_model_len > scaling.original_max_position_embeddings)


def partial_rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """int64 [head_dim]: which of a checkpoint's head dimensions each position of the kernels' layout holds. The
    kernels pair position j with j + head_dim / 2: the first half holds the rotated pairs' first members, then half
    of the passed-through dimensions; the second half their partners, then the other passed-through half. A rotated
    pair is (j, j + rotary_dim / 2), or with ``interleaved`` (GLM-4) (2j, 2j + 1)."""
    half_rot, half_pass = rotary_dim // 2, (head_dim - rotary_dim) // 2
    firsts, partners = ((range(0, rotary_dim, 2), range(1, rotary_dim, 2)) if interleaved
                        else (range(half_rot), range(half_rot, rotary_dim)))
    first = [*firsts, *range(rotary_dim, rotary_dim + half_pass)]
    second = [*partners, *range(rotary_dim + half_pass, head_dim)]
    return torch.tensor(first + second, dtype=torch.int64)


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
    if s.rope_type == "longrope":
        return _longrope(head_dim, theta, s)
    raise ValueError(f"rope type {s.rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    if s.high_freq_factor == s.low_freq_factor:  # no ramp between the bands (transformers' 0 / 0 would be NaN there)
        return scaled
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


def _longrope(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    ext_factors = torch.tensor(s.long_factor if s.use_long else s.short_factor, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * theta**exponents), float(attention_factor)
