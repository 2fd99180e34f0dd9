"""`tiny-llava`: a small, seeded LlavaForConditionalGeneration (a 2-layer CLIP tower of 32-pixel images in 8-pixel
patches, 16 image tokens, over a 2-layer Llama with tiny-random's tokenizer and an ``<image>`` token added), or its
LLaVA-NeXT twin (the same tower over 32-pixel tiles: an image's count of tokens by its size), made by transformers,
for the tests (tests/test_multimodal.py) and the GPU check (bench/gpu_check.py). Needs transformers and Pillow. Its
weights are drawn wider than transformers' std 0.02 so each image moves the next token (flat logits
would let a tie decide). The tower's tensors are named as the llava-hf checkpoints on the Hub name them
(``vision_tower.vision_model.*``; transformers >= 5.2x writes them without ``vision_model.``, and reads both).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

NUM_IMAGE_TOKENS = 16
# LLaVA's chat template as llava-hf ships it: the content's parts, the image token where an image part is.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if message['role'] != 'user' %}</s>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def png(seed: int, width: int, height: int) -> bytes:
    """A seeded noise image, PNG-encoded."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def hub_tower_names(model_dir: Path) -> None:
    """The checkpoint's tower tensors renamed as the llava-hf checkpoints on the Hub have them
    (``vision_tower.vision_model.*``), not as transformers >= 5.2x saves them (``vision_tower.*``)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    renamed = {("vision_tower.vision_model." + k.removeprefix("vision_tower.")
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in weights.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


def tokenizer_with_image_token(src_dir: Path, out: Path) -> int:
    """``src_dir``'s tokenizer.json with an ``<image>`` special token added, written to ``out``; the token's id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src_dir / "tokenizer.json"))
    tok.add_special_tokens(["<image>"])
    tok.save(str(out / "tokenizer.json"))
    return tok.token_to_id("<image>")


# tiny-llava-next's tiles: 32-pixel tiles (4 x 4 patches), an image resized onto one of these (height, width).
NEXT_GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]


def build_tiny_llava(out: Path, tokenizer_dir: Path, next_: bool = False) -> Path:
    """The checkpoint in ``out`` (created), its tokenizer ``tokenizer_dir``'s tokenizer.json with ``<image>`` added;
    ``next_``: a LlavaNextForConditionalGeneration (LLaVA-NeXT's tiles, NEXT_GRID_PINPOINTS)."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    image_id = tokenizer_with_image_token(tokenizer_dir, out)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                           "eos_token": "<|im_end|>"}))
    text = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=image_id + 1, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
    if next_:
        cfg = transformers.LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=image_id,
                                           vision_feature_layer=-2, image_grid_pinpoints=NEXT_GRID_PINPOINTS,
                                           image_seq_length=NUM_IMAGE_TOKENS, tie_word_embeddings=False)
        model = _seeded(transformers.LlavaNextForConditionalGeneration, cfg)
    else:
        cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_id,
                                       vision_feature_layer=-2, image_seq_length=NUM_IMAGE_TOKENS,
                                       tie_word_embeddings=False)
        model = _seeded(transformers.LlavaForConditionalGeneration, cfg)
    model.save_pretrained(str(out))
    hub_tower_names(out)
    processor = dict(do_resize=True, size={"shortest_edge": 32}, do_center_crop=True,
                     crop_size={"height": 32, "width": 32}, do_rescale=True, rescale_factor=1 / 255,
                     do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
                     image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True, resample=3,
                     image_processor_type="CLIPImageProcessor")
    if next_:
        processor.update(image_processor_type="LlavaNextImageProcessor", image_grid_pinpoints=NEXT_GRID_PINPOINTS,
                         do_pad=True)
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    return out


def _seeded(model_class, cfg):
    import torch

    torch.manual_seed(0)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 if "embed" in name else 1.5 / p.shape[1] ** 0.5)
            elif "image_newline" in name:
                p.normal_(0, 0.5)
    return model


def transformers_greedy(model_dir: Path, prompt_ids: list[int], images: list[bytes], num_new: int,
                        device: str = "cpu", model=None, processor_kwargs: dict | None = None) -> list[int]:
    """transformers' greedy tokens for the expanded prompt with ``images`` (its own processor for the pixels, called
    with ``processor_kwargs``)."""
    import torch
    import transformers
    from PIL import Image

    if model is None:
        model_class = transformers.AutoModelForImageTextToText
        model = model_class.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    kwargs = {}
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        processed = processor(images=pil, return_tensors="pt", **(processor_kwargs or {}))
        kwargs = {k: processed[k].to(device) for k in ("pixel_values", "image_sizes") if k in processed}
    seq = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_new):
            ids = torch.tensor([seq], device=device)
            seq.append(int(model(input_ids=ids, **kwargs).logits[0, -1].argmax()))
    return seq[len(prompt_ids):]
