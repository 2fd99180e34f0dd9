"""A Mistral 3 checkpoint's image encoder (Mistral Small 3.1 / 3.2, Magistral, Ministral 3): Pixtral's tower and
Mistral 3's projector; and Pixtral-12B's in LLaVA's form (LlavaForConditionalGeneration with a Pixtral tower: LLaVA's
projector, one patch a cell).

The tower (PixtralVisionModel: a patch convolution, 2-D rotary ViT blocks over each image at its own size) and the
projector (Mistral3MultiModalProjector: RMSNorm, the learned 2 x 2 patch merger, linear, activation, linear) are
transformers' modules built from the checkpoint's config and given its weights; the processor is transformers' for
the checkpoint, asked for cells of a patch times the merge (as PixtralProcessor asks). An image's placeholders are its
rows of cells, each row closed by a break token and the last by an end token (spec.PixtralGrid): the encoder gives
every row of that run, the image's features at its image tokens and the language model's own embeddings of the break
and end tokens at theirs, so the run is one block of rows like any other image's (engine/multimodal/step.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdcluster.engine.checkout_path import drop_checkout_from_sys_path
from pdcluster.engine.multimodal.images import open_image
from pdcluster.engine.multimodal.llava import MAX_CROPS_A_CALL, encode_in_calls, engine_linears
from pdcluster.engine.multimodal.spec import MISTRAL3, ImageSpec
from pdcluster.engine.multimodal.tower_weights import loaded_module

_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class PixtralImageEncoder:
    def __init__(self, spec: ImageSpec, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
                 deterministic: bool, text_embeddings: torch.Tensor):
        """``spec``: the checkpoint's (ImageSpec.from_dir: it reads the tokenizer's added tokens, once);
        ``text_embeddings``: the language model's token table (the break and end tokens' rows come from it)."""
        drop_checkout_from_sys_path()
        import transformers
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector
        from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

        model_dir = Path(model_dir)
        self.spec = spec
        self.dtype, self.device, self.deterministic = dtype, torch.device(device), deterministic
        logging.getLogger("transformers.models.auto.image_processing_auto").setLevel(logging.ERROR)
        self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        cfg = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        cfg.vision_config._attn_implementation = "sdpa"
        self.feature_layer = cfg.vision_feature_layer
        self.tower = loaded_module(lambda: PixtralVisionModel(cfg.vision_config), model_dir, _TOWER_PREFIXES, dtype,
                                   self.device, "vision tower")
        # Mistral 3's projector merges 2 x 2 patches by the images' sizes; Pixtral-12B's (LLaVA's) maps each patch.
        self.merges = self.spec.architecture == MISTRAL3
        projector = Mistral3MultiModalProjector if self.merges else LlavaMultiModalProjector
        self.projector = loaded_module(lambda: projector(cfg), model_dir, _PROJECTOR_PREFIXES, dtype, self.device,
                                       "projector")
        engine_linears(self.tower, deterministic)
        engine_linears(self.projector, deterministic)
        grid = self.spec.pixtral
        self.cell = grid.cell
        ids = torch.tensor([grid.break_token_id, grid.end_token_id], device=text_embeddings.device)
        self.break_row, self.end_row = text_embeddings[ids].to(self.device, dtype)

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        """Each image's run of placeholder rows, [rows x (columns + 1), text hidden] in the model's dtype on its
        device; one image a tower call in deterministic mode, else up to MAX_CROPS_A_CALL a call."""
        return encode_in_calls(self._encode, images, 1 if self.deterministic else MAX_CROPS_A_CALL)

    @torch.inference_mode()
    def _encode(self, images: list[bytes], first: int) -> list[torch.Tensor]:
        pil = [open_image(data, f"image {first + i}") for i, data in enumerate(images)]
        processed = self.processor(images=pil, patch_size={"height": self.cell, "width": self.cell},
                                   return_tensors="pt")
        image_sizes = processed["image_sizes"]
        states = self.tower(processed["pixel_values"].to(self.device, self.dtype), image_sizes=image_sizes,
                            output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        features = torch.cat([states[i] for i in layers], dim=-1).squeeze(0)
        merged = self.projector(features, image_sizes) if self.merges else self.projector(features)
        cells = [(int(h) // self.cell, int(w) // self.cell) for h, w in image_sizes.tolist()]
        out = []
        for i, ((rows, cols), rows_of_image) in enumerate(zip(cells, merged.split([r * c for r, c in cells]))):
            grid = rows_of_image.view(rows, cols, -1)
            breaks = self.break_row.expand(rows, 1, -1).clone()
            breaks[-1, 0] = self.end_row
            run = torch.cat([grid, breaks], dim=1).reshape(rows * (cols + 1), -1)
            want = self.spec.tokens_for_size(pil[i].width, pil[i].height)
            if run.shape[0] != want:
                raise RuntimeError(f"the vision tower gave {run.shape[0]} rows for image {first + i}, expected {want}")
            out.append(run)
        return out
