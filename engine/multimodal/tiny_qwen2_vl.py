"""`tiny-qwen2-vl`: a small, seeded Qwen2VLForConditionalGeneration (a 2-layer vision tower of 4-pixel patches merged
2 x 2, so an image is one placeholder per 8 x 8 pixels within a 1,600-pixel budget, over a 2-layer Qwen2 with M-RoPE
sections [2, 3, 3]), or its Qwen2.5-VL twin (RMSNorm and SwiGLU blocks, windowed attention in its first layer), or
a Qwen3-VL (Qwen3 text, interleaved M-RoPE, learned position embeddings and deepstack rows from both tower layers), or
its Qwen3-VL-MoE twin (Qwen3-MoE text, its experts stored fused), made by transformers, with tiny-random's tokenizer and Qwen2-VL's vision tokens added: for the tests
(tests/test_qwen2_vl.py) and the GPU check. Its weights are drawn wide so each image moves the next token."""

from __future__ import annotations

import inspect
import io
import json
from pathlib import Path

from pdcluster.engine.multimodal.tiny_llava import _seeded

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# Qwen2-VL's chat template, cut down: an image part is its vision tokens, then the text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_PIXELS = 1600
MIN_PIXELS = 256


VERSIONS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")


def build_tiny_qwen2_vl(out: Path, tokenizer_dir: Path, version: str = "qwen2-vl") -> Path:
    """The checkpoint in ``out`` (created); ``version``: one of VERSIONS."""
    import transformers
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.add_special_tokens(list(VISION_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    start_id, image_id, end_id = (tok.token_to_id(t) for t in VISION_TOKENS)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                           "eos_token": "<|im_end|>"}))
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=image_id + 3, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    common = dict(image_token_id=image_id, video_token_id=image_id + 2, vision_start_token_id=start_id,
                  vision_end_token_id=end_id, tie_word_embeddings=False)
    if version in ("qwen3-vl", "qwen3-vl-moe"):  # Qwen3 text (q/k norms), interleaved M-RoPE, deepstack from both
        text.update(head_dim=16, rope_parameters={**text["rope_parameters"], "mrope_interleaved": True})  # layers
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1])
        if version == "qwen3-vl-moe":  # Qwen3-MoE text: 8 experts of width 48, top 2, in both layers
            text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
            cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **common)
            model = _seeded(transformers.Qwen3VLMoeForConditionalGeneration, cfg)
        else:
            cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **common)
            model = _seeded(transformers.Qwen3VLForConditionalGeneration, cfg)
    elif version == "qwen2.5-vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        model = _seeded(transformers.Qwen2_5_VLForConditionalGeneration, cfg)
    elif version == "qwen2-vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        model = _seeded(transformers.Qwen2VLForConditionalGeneration, cfg)
    else:
        raise ValueError(f"version must be one of {', '.join(VERSIONS)}, got {version!r}")
    model.save_pretrained(str(out))
    if version == "qwen3-vl-moe":
        hub_expert_layout(out)
    processor = dict(image_processor_type="Qwen2VLImageProcessor", do_resize=True, do_rescale=True,
                     rescale_factor=1 / 255, do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
                     image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True, resample=3,
                     min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=4, temporal_patch_size=2, merge_size=2)
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    return out


def hub_expert_layout(model_dir: Path) -> None:
    """The fused experts rewritten as the Hub's Qwen3-VL-MoE checkpoints keep them, gate_up_proj [E, H, 2I] and
    down_proj [E, I, H] (transformers 5 saves its own [E, 2I, H] / [E, H, I], and transposes the Hub's at load)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    save_file({k: (v.transpose(1, 2).contiguous() if k.endswith(fused) else v) for k, v in weights.items()}, str(path),
              metadata={"format": "pt"})


def transformers_greedy(model_dir: Path, prompt_ids: list[int], images: list[bytes], num_new: int,
                        device: str = "cpu", model=None, processor_kwargs: dict | None = None) -> list[int]:
    """transformers' greedy tokens for the expanded prompt with ``images`` (its processor's pixels and grids, the
    processor called with ``processor_kwargs``; its own M-RoPE positions from them)."""
    import torch
    import transformers
    from PIL import Image

    if model is None:
        model = transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
        model = model.to(device).eval()
    kwargs = {}
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
        processed = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt",
                              **(processor_kwargs or {}))
        kwargs = {k: processed[k].to(device) for k in ("pixel_values", "image_grid_thw")}
    ids = torch.tensor([prompt_ids], device=device)
    # Which tokens are an image's (transformers' processor returns it; 5.2x computes M-RoPE positions from it, older
    # versions from the vision tokens).
    if images and "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                             min_new_tokens=num_new, do_sample=False, **kwargs)
    return out[0, len(prompt_ids):].tolist()
