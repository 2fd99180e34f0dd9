"""A Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint's image encoder: its image processor and vision tower (with the
merger).

The tower is transformers' own module for the architecture (Qwen2VisionTransformerPretrainedModel,
Qwen2_5_VisionTransformerPretrainedModel, Qwen3VLVisionModel: patch embedding, 2-D rotary ViT blocks, Qwen2.5's
windowed attention, Qwen3's interpolated position embeddings and deepstack mergers, the 2 x 2 patch merger), built from the checkpoint's ``vision_config`` and given the checkpoint's ``visual.*`` weights; the
processor is transformers' for the checkpoint (``preprocessor_config.json``: the resize within the pixel budget,
patches flattened in merge order). An image's embeddings are the merger's rows, one per merged patch, in the order
spec.MergedPatchGrid counts them (rows of columns): what transformers' get_image_features computes. Their M-RoPE
positions are engine/multimodal/mrope.py's. Qwen3-VL's tower also gives each image's rows from some of its layers
("deepstack"), which the language model adds to its first layers' outputs at the image's rows: they travel beside the
embeddings as one row, [hidden | deepstack 0 | deepstack 1 | ...] (engine/models/llama.py splits it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdcluster.engine.checkout_path import drop_checkout_from_sys_path
from pdcluster.engine.multimodal.images import open_image
from pdcluster.engine.multimodal.llava import MAX_CROPS_A_CALL, encode_in_calls, engine_linears
from pdcluster.engine.multimodal.spec import ImageSpec
from pdcluster.engine.multimodal.tower_weights import loaded_module

# transformers 5 saves the tower under model.visual, the Hub's Qwen2-VL / Qwen2.5-VL checkpoints under visual.
_TOWER_PREFIXES = ("model.visual.", "visual.")
_TOWERS = {"Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
           "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
           "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLVisionModel"),
           "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", "Qwen3VLMoeVisionModel")}


class QwenVLImageEncoder:
    def __init__(self, spec: ImageSpec, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
                 deterministic: bool = False):
        """``spec``: the checkpoint's (ImageSpec.from_dir)."""
        drop_checkout_from_sys_path()
        import importlib

        import transformers

        model_dir = Path(model_dir)
        self.spec = spec
        self.dtype, self.device, self.deterministic = dtype, torch.device(device), deterministic
        if not (model_dir / "preprocessor_config.json").is_file():
            raise ValueError(f"{model_dir}: no preprocessor_config.json (the image processor's settings)")
        logging.getLogger("transformers.models.auto.image_processing_auto").setLevel(logging.ERROR)
        self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        module, name = _TOWERS[self.spec.architecture]
        tower_class = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
        vision_cfg = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True).vision_config
        vision_cfg._attn_implementation = "sdpa"
        tower = loaded_module(lambda: tower_class(vision_cfg), model_dir, _TOWER_PREFIXES, dtype, self.device,
                              "vision tower")
        engine_linears(tower, deterministic)
        self.tower = tower
        self.merge_size = vision_cfg.spatial_merge_size

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        """Each image's embeddings, [its placeholders, text hidden] in the model's dtype on its device; one image a
        tower call in deterministic mode (its bits whatever else a step holds), else up to MAX_CROPS_A_CALL a call
        (the tower's activations are outside the GPU's KV budget)."""
        return encode_in_calls(self._encode, images, 1 if self.deterministic else MAX_CROPS_A_CALL)

    @torch.inference_mode()
    def _encode(self, images: list[bytes], first: int) -> list[torch.Tensor]:
        pil = [open_image(data, f"image {first + i}") for i, data in enumerate(images)]
        # The spec's pixel budget (the checkpoint's, or --mm-processor-kwargs' over it): what the placeholders count.
        patches = self.spec.patches
        processed = self.processor(images=pil, return_tensors="pt",
                                   size={"shortest_edge": patches.min_pixels, "longest_edge": patches.max_pixels})
        grid_thw = processed["image_grid_thw"]
        result = self.tower(processed["pixel_values"].to(self.device, self.dtype), grid_thw=grid_thw.to(self.device))
        merged = result.pooler_output
        deepstack = getattr(result, "deepstack_features", None)
        if deepstack:  # Qwen3-VL: [embeddings | each deepstack layer's], which the language model splits
            merged = torch.cat([merged, *deepstack], dim=-1)
        out = list(merged.split((grid_thw.prod(-1) // self.merge_size ** 2).tolist()))
        for i, (image, embeds) in enumerate(zip(pil, out)):
            want = self.spec.tokens_for_size(image.width, image.height)
            if embeds.shape[0] != want:
                raise RuntimeError(f"the vision tower gave {embeds.shape[0]} tokens for image {first + i}, expected "
                                   f"{want}")
        return out

