"""`pdcluster generate`: generate offline with one engine in this process (no cluster, no server)."""

from __future__ import annotations

import argparse
import json
import os

from pdcluster.cluster.engine_args import add_engine_args, engine_config_from_args
from pdcluster.engine.multimodal.spec import chat_content
from pdcluster.engine.sampling_params import SamplingParams


def add_generate_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="generate offline with one engine (no cluster)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--lora", default=None, metavar="NAME",
                     help="generate with this adapter of --lora-modules (default: the base model)")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image file for a model that takes images (LLaVA; repeatable): they fill the prompts' "
                          "image tokens (<image>) in order; with --chat, one prompt's images, placed before its text")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    gen.set_defaults(func=generate_main)
    return gen


def generate_main(args: argparse.Namespace) -> int:
    # What was typed is checked before torch is imported (2-3 s): a mistyped flag is answered at once.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.sampling_seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
        lora_name=args.lora,
    )
    if args.image and args.chat and len(args.prompt) > 1:
        raise SystemExit("pdcluster generate: error: with --chat, --image goes with one --prompt")
    for path in args.image:
        if not os.path.isfile(path):
            raise SystemExit(f"pdcluster generate: error: --image {path}: no such file")
    config = engine_config_from_args(args)
    from pdcluster.engine.llm_engine import LLMEngine  # torch: when generating, not at `pdcluster --help`

    from pdcluster.engine.gc_heap import freeze_startup_objects

    engine = LLMEngine.from_config(config)
    freeze_startup_objects()  # one engine for the process's life (engine/gc_heap.py)
    prompts = args.prompt
    spec = _image_spec(engine) if args.image else None
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": _chat_content(engine, spec, p,
                                                                                                    args.image)}])
                   for p in prompts]
    if args.image:
        prompts = _with_images(engine, spec, prompts, args.image)
    try:
        outputs = engine.generate(prompts, params)  # validates every prompt before the first step
    finally:
        if engine.offload is not None:  # the disk tier's writer finishes its queue (--kv-offload-*)
            engine.offload.close()
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "num_draft_tokens": out.num_draft_tokens,
                "num_accepted_tokens": out.num_accepted_tokens,
            }), flush=True)
        else:
            print(f"{prompt!r} -> {out.text!r}", flush=True)
    return 0


def _image_spec(engine):
    """The model's image spec; a model that takes no images ends the command in one line."""
    encoder = engine.model.image_encoder
    if encoder is None:
        raise SystemExit(f"pdcluster generate: error: --image: this model ({engine.model.architecture_name}) takes "
                         "no images")
    return encoder.spec


def _chat_content(engine, spec, text: str, images: list[str]):
    """A chat message's content with ``images`` before the text, as the model's chat template reads them."""
    if not images:
        return text
    parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return chat_content(parts, engine.tokenizer.chat_template, engine.tokenizer.id_to_token(spec.image_token_id))


def _with_images(engine, spec, prompts: list[str], images: list[str]) -> list:
    """Each prompt as vLLM's dict with the images its image tokens take, in order."""
    out, left = [], list(images)
    for prompt in prompts:
        n = engine.tokenizer.encode(prompt).count(spec.image_token_id)
        out.append({"prompt": prompt, "multi_modal_data": {"image": left[:n]}})
        left = left[n:]
    if left:
        raise SystemExit(f"pdcluster generate: error: {len(images)} --image files for {len(images) - len(left)} image "
                         f"tokens in the prompts: put one {engine.tokenizer.id_to_token(spec.image_token_id)} where "
                         "each image goes")
    return out
