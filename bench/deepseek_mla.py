"""DeepSeek's Multi-head Latent Attention served absorbed over a one-plane latent cache (engine/models/deepseek.py):
what a token costs in the KV cache (and in a KV transfer) for the published V2-Lite and V3 shapes, and engine speed
on a random-weight model of DeepSeek-V2-Lite's layer shape (2 layers: one dense, one MoE), beside transformers'
``generate`` on the same model and prompts. Prints JSON (and writes it with --out).

    python bench/deepseek_mla.py [--dtype float32] [--batches 1 8] [--device cpu|cuda] [--out bench/results/deepseek_mla.json]

On CUDA (``--device cuda --dtype bfloat16``) the engine runs the latent kernel (kernels/triton_mla_attention.py) with
decode in CUDA graphs, and transformers runs on the same GPU in the same dtype.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

# The published configs' shape fields (DeepSeek-V2-Lite, DeepSeek-V3): what the cache cost depends on.
PUBLISHED = {
    "DeepSeek-V2-Lite": dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                             moe_intermediate_size=1408, n_shared_experts=2, first_k_dense_replace=1,
                             topk_method="greedy", max_position_embeddings=163840,
                             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                           "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                                           "beta_slow": 1}),
    "DeepSeek-V3": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                        intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3, n_group=8,
                        topk_group=4, num_nextn_predict_layers=1, max_position_embeddings=163840,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}


def kv_cost() -> dict:
    """Bytes a token takes in the cache (all layers, bf16): ours, the same latents kept as K and V planes, and the
    keys and values MLA stands for (what a plain MHA cache of the same heads would hold)."""
    from pdcluster.engine.kv_cache import KVCacheSpec
    from pdcluster.engine.models.deepseek import DeepseekArch

    out = {}
    for name, cfg in PUBLISHED.items():
        a = DeepseekArch.from_config(cfg, name)
        m = a.mla
        spec = KVCacheSpec(a.num_layers, 0, 1, 16, a.num_kv_heads, a.head_dim, torch.bfloat16, num_planes=a.kv_planes)
        mha = a.num_layers * a.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
        out[name] = {"bytes_per_token": spec.bytes_per_token, "bytes_per_token_two_planes": 2 * spec.bytes_per_token,
                     "bytes_per_token_expanded_mha": mha, "expanded_over_ours": round(mha / spec.bytes_per_token, 1)}
    return out


def _build(out: Path) -> Path:
    """A random DeepSeek-V2-Lite-shaped model of two layers (16 routed experts instead of 64, vocab 32,000)."""
    import transformers

    from pdcluster.engine.models.registry import resolve_model

    cfg = dict(PUBLISHED["DeepSeek-V2-Lite"], num_hidden_layers=2, n_routed_experts=16, vocab_size=32000,
               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.pop("architectures")
    cfg["rope_scaling"] = None
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**cfg))
    model.save_pretrained(str(out))
    (out / "tokenizer.json").write_bytes((resolve_model("tiny-random", progress=False) / "tokenizer.json").read_bytes())
    return out


def engine_speed(model_dir: Path, dtype: str, batches: list[int], prompt_len: int, new_tokens: int,
                 device: str = "cpu") -> dict:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    num_kv_blocks = 512 if device == "cpu" else 16 * (max(batches) * 2 + 8)
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype=dtype, num_kv_blocks=num_kv_blocks,
                                                max_num_batched_tokens=4096, max_model_len=1024, device=device,
                                                max_num_seqs=max(max(batches), 8), enable_prefix_caching=False),
                                   progress=False)
    gen = torch.Generator().manual_seed(1)
    out = {"deterministic": engine.config.deterministic,
           "cuda_graphs": engine.runner.graphs is not None}
    engine.generate([[5] * 8], SamplingParams(max_tokens=2))  # warm
    for batch in batches:
        prompts = [torch.randint(3, 32000, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
        total_s = time.perf_counter() - t0
        decode_s = max(total_s - prefill_s, 1e-9)
        out[f"batch_{batch}"] = {"prefill_tok_s": round(batch * prompt_len / prefill_s, 1),
                                 "decode_tok_s": round(batch * new_tokens / decode_s, 1),
                                 "decode_step_ms": round(1000 * decode_s / new_tokens, 2)}
    return out


def transformers_speed(model_dir: Path, batch: int, prompt_len: int, new_tokens: int, device: str = "cpu",
                       dtype: str = "float32") -> dict:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.randint(3, 32000, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        hf.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, do_sample=False)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False)
        decode_s = time.perf_counter() - t0 - prefill_s
    return {"prefill_tok_s": round(batch * prompt_len / prefill_s, 1),
            "decode_tok_s": round(batch * new_tokens / decode_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="")
    args = p.parse_args()
    result = {"kv_cache": kv_cost(), "threads": torch.get_num_threads(), "device": args.device}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _build(Path(tmp) / "v2-lite-2layers")
        result["engine"] = {"model": "random DeepSeek-V2-Lite layer shape, 2 layers (1 dense, 1 MoE of 16 experts)",
                            "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                            **engine_speed(model_dir, args.dtype, args.batches, args.prompt_len, args.new_tokens,
                                           args.device)}
        result["transformers_generate"] = {f"batch_{b}": transformers_speed(model_dir, b, args.prompt_len,
                                                                            args.new_tokens, args.device, args.dtype)
                                           for b in args.batches}
    for b in args.batches:
        ours, theirs = result["engine"][f"batch_{b}"], result["transformers_generate"][f"batch_{b}"]
        ours["decode_over_transformers"] = round(ours["decode_tok_s"] / theirs["decode_tok_s"], 2)
        ours["prefill_over_transformers"] = round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
