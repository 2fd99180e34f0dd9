"""`tiny-gemma3`: a small, seeded Gemma3ForConditionalGeneration (a 2-layer SigLIP tower of 32-pixel images in 4-pixel
patches, pooled 2 x 2 to 16 soft tokens, over a 2-layer Gemma 3: one sliding layer whose window, 12, is shorter than an
image, one full layer), made by transformers, with tiny-random's tokenizer and Gemma's <start_of_image>,
<end_of_image> and <image_soft_token> added, and runs of 1 to 8 newlines as one token each (Gemma's tokenizer has them:
the frame around an image merges with the prompt's newlines as it does there): for the tests (tests/test_gemma3_images.py) and the GPU check. Its weights
are drawn wide so each image moves the next token.

transformers' oracle is its model given ``token_type_ids`` 1 at the soft tokens, as Gemma3Processor makes them: what
makes an image's tokens attend to each other both ways."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.engine.multimodal.tiny_llava import _seeded

IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
NUM_SOFT_TOKENS = 16
SLIDING_WINDOW = 12
# Gemma 3's chat template, cut down (tiny-random's tokenizer has no <start_of_turn>): an image part is its
# <start_of_image>, where it stands among the text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}model\n{% endif %}")


def build_tiny_gemma3(out: Path, tokenizer_dir: Path) -> Path:
    """The checkpoint in ``out`` (created)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.add_special_tokens(list(IMAGE_TOKENS))
    tok.add_tokens([AddedToken("\n" * k, normalized=False) for k in range(1, 9)])
    tok.save(str(out / "tokenizer.json"))
    boi, eoi, soft = (tok.token_to_id(t) for t in IMAGE_TOKENS)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "extra_special_tokens": {"boi_token": IMAGE_TOKENS[0], "eoi_token": IMAGE_TOKENS[1],
                                 "image_token": IMAGE_TOKENS[2]}}))
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=tok.get_vocab_size(), max_position_embeddings=512,
                sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=16, rms_norm_eps=1e-6)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=32, patch_size=4, vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=NUM_SOFT_TOKENS,
                                    boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft)
    model = _seeded(transformers.Gemma3ForConditionalGeneration, cfg)
    with torch.no_grad():  # the embedding is scaled by sqrt(hidden): drawn that much smaller, so the tied LM head
        model.get_input_embeddings().weight.div_(text["hidden_size"] ** 0.5)  # does not just echo the last token
    model.save_pretrained(str(out))
    processor = dict(image_processor_type="Gemma3ImageProcessor", do_resize=True, size={"height": 32, "width": 32},
                     do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5],
                     image_std=[0.5, 0.5, 0.5], do_convert_rgb=True, resample=2, do_pan_and_scan=False)
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                           "image_seq_length": NUM_SOFT_TOKENS}))
    return out


def transformers_greedy(model_dir: Path, prompt_ids: list[int], images: list[bytes], num_new: int,
                        device: str = "cpu", model=None, both_ways: bool = True) -> list[int]:
    """transformers' greedy tokens for the expanded prompt with ``images`` (its processor's pixels); ``both_ways``
    False: without token_type_ids (every token causal, what a server that drops the image mask computes)."""
    import io

    import torch
    from PIL import Image

    import transformers

    if model is None:
        model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
        model = model.to(device).eval()
    kwargs = {}
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        kwargs["pixel_values"] = processor(images=pil, return_tensors="pt")["pixel_values"].to(device)
    soft = model.config.image_token_index
    seq = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_new):
            ids = torch.tensor([seq], device=device)
            types = {"token_type_ids": (ids == soft).long()} if both_ways and images else {}
            seq.append(int(model(input_ids=ids, **kwargs, **types).logits[0, -1].argmax()))
    return seq[len(prompt_ids):]
