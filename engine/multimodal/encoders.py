"""The image encoder of a checkpoint that takes images, by its layout (engine/multimodal/spec.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from pdcluster.engine.multimodal.spec import ImageSpec


def image_encoder(spec: ImageSpec, model_dir: str | Path, dtype: torch.dtype, device, deterministic: bool,
                  text_embeddings: torch.Tensor | None = None):
    """The image encoder of a checkpoint that takes images (``spec``: its ImageSpec.from_dir); ``text_embeddings``:
    the language model's token table (Mistral 3's break / end rows)."""
    if spec.frame is not None:
        from pdcluster.engine.multimodal.gemma3 import Gemma3ImageEncoder

        return Gemma3ImageEncoder(spec, model_dir, dtype, device, deterministic)
    if spec.pixtral is not None:
        from pdcluster.engine.multimodal.pixtral import PixtralImageEncoder

        return PixtralImageEncoder(spec, model_dir, dtype, device, deterministic, text_embeddings)
    if spec.patches is not None:
        from pdcluster.engine.multimodal.qwen2_vl import QwenVLImageEncoder

        return QwenVLImageEncoder(spec, model_dir, dtype, device, deterministic)
    from pdcluster.engine.multimodal.llava import LlavaImageEncoder

    return LlavaImageEncoder(model_dir, dtype, device, deterministic)
