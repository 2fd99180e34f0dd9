"""A loaded text model's image side: its tower (and a Qwen2-VL's M-RoPE), put on it where an engine loads a model
(engine/loaded_model.py) and where a weight update loads the new checkpoint beside it (engine/weight_update.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.multimodal.spec import ImageSpec


def attach_image_encoder(model, spec: ImageSpec, model_dir: Path, config: EngineConfig, dtype: torch.dtype,
                         deterministic: bool) -> None:
    """The image tower of ``model_dir`` on its loaded text model (and a Qwen2-VL's M-RoPE: the image rows' scratch
    rows of the rotary tables); also what a weight update loads beside the served one (engine/weight_update.py)."""
    from pdcluster.engine.multimodal.encoders import image_encoder

    if spec.patches is not None:
        install_mrope(model, spec, model_dir, config)
    model.image_encoder = image_encoder(spec, model_dir, dtype, config.device, deterministic,
                                        getattr(model, "embed_tokens", None))


def install_mrope(model, spec, model_dir: Path, config: EngineConfig) -> None:
    """A Qwen2-VL's M-RoPE (engine/multimodal/mrope.py) on the loaded model, before any graph is captured."""
    from pdcluster.engine.multimodal.mrope import MRope, mrope_sections

    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    sections, interleaved = mrope_sections(cfg, model.arch.head_dim, str(model_dir / "config.json"))
    model.mrope = MRope(spec, model.rope, sections, config.max_num_batched_tokens, interleaved)
