"""`tiny-mistral3`: a small, seeded Mistral3ForConditionalGeneration (a 2-layer Pixtral tower of 4-pixel patches,
merged 2 x 2 into 8-pixel cells, images shrunk to at most 48 pixels a side, over a 2-layer Mistral), or Pixtral-12B's
LLaVA form of it (8-pixel patches, LLaVA's projector), made by transformers, with tiny-random's tokenizer and Pixtral's [IMG], [IMG_BREAK] and [IMG_END] tokens added: for the tests
(tests/test_mistral3_images.py) and the GPU check. Its weights are drawn wide so each image moves the next token."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.engine.multimodal.tiny_llava import _seeded
from pdcluster.engine.multimodal.tiny_llava import transformers_greedy as llava_greedy

IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
CELL = 8  # pixels: a 4-pixel patch times the 2 x 2 merge
# Mistral's chat template, cut down: an image part is its [IMG] token, where it stands among the text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}[IMG]{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if message['role'] == 'user' %}[/INST]{% else %}</s>{% endif %}{% endfor %}")


def build_tiny_mistral3(out: Path, tokenizer_dir: Path, llava: bool = False) -> Path:
    """The checkpoint in ``out`` (created); ``llava``: Pixtral-12B's form instead, a LlavaForConditionalGeneration
    with a Pixtral tower of 8-pixel patches (one patch a cell, no merge) and LLaVA's projector."""
    import transformers
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.add_special_tokens(list(IMAGE_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    image_id = tok.token_to_id("[IMG]")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    text = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=image_id + 3,
                max_position_embeddings=512, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, image_size=48, patch_size=4)
    if llava:
        vision["patch_size"] = CELL
        cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_id,
                                       vision_feature_layer=-1, vision_feature_select_strategy="full",
                                       projector_hidden_act="gelu", tie_word_embeddings=False)
        _seeded(transformers.LlavaForConditionalGeneration, cfg).save_pretrained(str(out))
    else:
        cfg = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=image_id,
                                          spatial_merge_size=2, vision_feature_layer=-1, projector_hidden_act="gelu",
                                          multimodal_projector_bias=False, tie_word_embeddings=False)
        _seeded(transformers.Mistral3ForConditionalGeneration, cfg).save_pretrained(str(out))
    patch = vision["patch_size"]
    processor = dict(image_processor_type="PixtralImageProcessor", do_resize=True, size={"longest_edge": 48},
                     patch_size={"height": patch, "width": patch}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                     image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
                     do_convert_rgb=True, resample=3)
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    return out


def transformers_greedy(model_dir: Path, prompt_ids: list[int], images: list[bytes], num_new: int,
                        device: str = "cpu", model=None) -> list[int]:
    """transformers' greedy tokens for the expanded prompt with ``images`` (its processor's pixels, in cells of
    CELL pixels as PixtralProcessor asks)."""
    return llava_greedy(model_dir, prompt_ids, images, num_new, device, model,
                        {"patch_size": {"height": CELL, "width": CELL}})
