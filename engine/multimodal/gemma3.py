"""A Gemma 3 checkpoint's image encoder (Gemma3ForConditionalGeneration: Gemma 3 4B, 12B, 27B; MedGemma): SigLIP's
tower and Gemma 3's projector.

Every image is resized to the tower's square (896 pixels) by transformers' Gemma3ImageProcessor for the checkpoint
(pan and scan refused at load: spec.ImageSpec._gemma3); the tower (transformers' SiglipVisionModel, its last hidden
state after the post-layernorm) gives a patch grid (64 x 64), which the projector (transformers'
Gemma3MultiModalProjector: average pooling to ``mm_tokens_per_image`` cells, Gemma's RMSNorm, one matmul) makes the
image's soft-token rows. They replace the soft tokens' embeddings after the language model's embedding scale (as
transformers merges them: engine/models/gemma.py), and attend to each other both ways
(engine/multimodal/bidirectional.py).
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

# The Hub's Gemma 3 checkpoints name the tower "vision_tower.vision_model.*"; transformers 5 saves "vision_tower.*".
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3ImageEncoder:
    def __init__(self, spec: ImageSpec, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
                 deterministic: bool):
        drop_checkout_from_sys_path()
        import transformers
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        model_dir = Path(model_dir)
        self.spec = spec
        self.dtype, self.device, self.deterministic = dtype, torch.device(device), deterministic
        logging.getLogger("transformers.models.auto.image_processing_auto").setLevel(logging.ERROR)
        self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        cfg = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        cfg.vision_config._attn_implementation = "sdpa"
        # SiglipVisionModel's own names carry no "vision_model." (transformers 5); its pooling head is not read.
        cfg.vision_config.vision_use_head = False
        self.tower = loaded_module(lambda: transformers.SiglipVisionModel(cfg.vision_config), model_dir,
                                   _TOWER_PREFIXES, dtype, self.device, "vision tower")
        self.projector = loaded_module(lambda: Gemma3MultiModalProjector(cfg), model_dir, _PROJECTOR_PREFIXES, dtype,
                                       self.device, "projector")
        engine_linears(self.tower, deterministic)

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        """Each image's soft-token rows, [mm_tokens_per_image, text hidden] in the model's dtype on its device; one
        image a tower call in deterministic mode, else up to MAX_CROPS_A_CALL a call."""
        return encode_in_calls(self._encode, images, 1 if self.deterministic else MAX_CROPS_A_CALL)

    @torch.inference_mode()
    def _encode(self, images: list[bytes], first: int) -> list[torch.Tensor]:
        pil = [open_image(data, f"image {first + i}") for i, data in enumerate(images)]
        pixels = self.processor(images=pil, return_tensors="pt", do_pan_and_scan=False)["pixel_values"].to(self.device, self.dtype)
        rows = self.projector(self.tower(pixel_values=pixels).last_hidden_state)
        if rows.shape[1] != self.spec.tokens_per_image:
            raise RuntimeError(f"the projector gave {rows.shape[1]} rows an image, expected "
                               f"{self.spec.tokens_per_image}")
        return list(rows)
