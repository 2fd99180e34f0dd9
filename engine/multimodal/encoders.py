"""The image encoder of a checkpoint that takes images, by its layout (engine/multimodal/spec.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from pdcluster.engine.multimodal.spec import ImageSpec


def image_encoder(model_dir: str | Path, dtype: torch.dtype, device, deterministic: bool):
    """The image encoder of a checkpoint that takes images (spec.IMAGE_ARCHITECTURES)."""
    spec = ImageSpec.from_dir(model_dir)
    if spec.patches is not None:
        from pdcluster.engine.multimodal.qwen2_vl import QwenVLImageEncoder

        return QwenVLImageEncoder(model_dir, dtype, device, deterministic)
    from pdcluster.engine.multimodal.llava import LlavaImageEncoder

    return LlavaImageEncoder(model_dir, dtype, device, deterministic)
