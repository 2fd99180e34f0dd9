"""vLLM's ``--limit-mm-per-prompt``: how many items of each modality one prompt may hold. This engine serves images
only; 0 images turns them off (a LLaVA then serves text alone and its vision tower is not loaded)."""

from __future__ import annotations

import functools
import json

# vLLM's default is higher (999); every image is fetched, decoded and encoded before the prompt starts, and a
# LLaVA-1.5 image is 576 placeholders: 16 fill a 9k context.
DEFAULT_MAX_IMAGES_PER_PROMPT = 16
# Modalities a vLLM deployment's flag may name: given as 0 they are accepted (nothing to turn off here).
OTHER_MODALITIES = ("video", "audio", "vision_chunk")


@functools.lru_cache(maxsize=8)  # read for every request of a model that takes images: the JSON parsed once
def max_images_per_prompt(limit_mm_per_prompt: str) -> int:
    """The images one prompt may hold under ``limit_mm_per_prompt`` (vLLM's JSON: ``{"image": 4}``, or
    ``{"image": {"count": 4, "width": 512, "height": 512}}`` whose size hints only shape vLLM's profiling run);
    "" is the default. A ValueError names what is wrong."""
    if not limit_mm_per_prompt.strip():
        return DEFAULT_MAX_IMAGES_PER_PROMPT
    try:
        limits = json.loads(limit_mm_per_prompt)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): want e.g. '{{\"image\": 4}}'") from None
    if not isinstance(limits, dict):
        raise ValueError(f"want a JSON object of modality: count, e.g. '{{\"image\": 4}}', got {limit_mm_per_prompt!r}")
    out = DEFAULT_MAX_IMAGES_PER_PROMPT
    for modality, value in limits.items():
        count = value.get("count") if isinstance(value, dict) else value
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{modality!r}: the count must be a non-negative integer, got {value!r}")
        if modality == "image":
            out = count
        elif modality in OTHER_MODALITIES:
            if count:
                raise ValueError(f"{modality!r}: this engine serves images only (give {modality} 0 or leave it out)")
        else:
            raise ValueError(f"{modality!r} is no modality (image, {', '.join(OTHER_MODALITIES)})")
    return out


@functools.lru_cache(maxsize=8)
def image_processor_kwargs(mm_processor_kwargs: str) -> dict:
    """vLLM's ``--mm-processor-kwargs`` JSON object (``{"max_pixels": 1003520}``) as a dict ("" is none; the same
    object for the same text: not to be changed). Which keys a model's processor takes is its spec's to say
    (spec.ImageSpec.from_dir); a ValueError names what is wrong here."""
    if not mm_processor_kwargs.strip():
        return {}
    try:
        kwargs = json.loads(mm_processor_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): want e.g. '{{\"max_pixels\": 1003520}}'") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"want a JSON object of setting: value, e.g. '{{\"max_pixels\": 1003520}}', got "
                         f"{mm_processor_kwargs!r}")
    return kwargs
