"""MoE decode on CPU (issue 26): prints JSON and writes it to --out (default bench/results/moe_decode.json).

1. "nemotron_h": decode tok/s of a NemotronH model with latent MoE layers, our LLMEngine against transformers
   (``generate``, greedy, its default grouped_mm experts) on the same prompts, one request at a time (and ours also
   with all prompts in one batch). The model is made by transformers with random weights at a realistic-ish width:
   pattern "MEM*EMEM*E" (4 Mamba2, 4 MoE, 2 attention), hidden 1024, 64 routed experts of width 512 in a 512-dim
   latent space, top 6, shared expert 1024 wide; vocab 32000 (~240M parameters, ~82M read per decoded token).
   Decode tok/s = (N - 1) / (time for N new tokens - time for 1), so the prompt's prefill is left out; each
   time the fastest of --repeats runs.
   Correctness beside it: ``agrees_with_full_forward``, the fraction of our greedy tokens that are the argmax of
   transformers' logits in one full forward over prompt + our tokens (1.0 = our output is transformers' greedy;
   the tests' oracle), and ``agrees_with_generate``, the fraction equal to transformers' generate() output (its
   cached Mamba step skips the dt clamp, tests/test_hybrid_random_dir.py, so near-ties may drift).
2. "fused_moe_block": one Qwen3-MoE-shaped block (128 experts, top 8, hidden 1024, width 384), our grouped
   matmul (the C kernel, batch-invariant) against ``torch._grouped_mm``, at 1 / 8 / 64 tokens.

    python bench/moe_decode.py [--threads 1] [--new-tokens 32] [--repeats 3] [--out bench/results/moe_decode.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.moe import MoeArch, SparseMoe
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)

NEMOTRON = dict(vocab_size=32000, hidden_size=1024, hybrid_override_pattern="MEM*EMEM*E", num_attention_heads=8,
                num_key_value_heads=2, head_dim=128, mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128,
                n_groups=8, chunk_size=128, intermediate_size=2048, n_routed_experts=64, num_experts_per_tok=6,
                moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024, moe_latent_size=512,
                routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2)


def make_nemotron_dir(out: Path) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**NEMOTRON))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # logits O(10) and routing that depends on the token (transformers' init is near-flat)
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")) or "norm" in name:
                continue
            gain = 8.0 if name == "lm_head.weight" else 1.5  # logits std ~10, as the tests' models
            std = 0.5 if "embeddings" in name else gain / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    (out / "tokenizer.json").write_bytes((resolve_model("tiny-random", progress=False) / "tokenizer.json").read_bytes())


def decode_tok_s(run, new_tokens: int, repeats: int, num_seqs: int = 1) -> tuple[float, list]:
    """(decode tok/s, tokens) from ``run(max_new_tokens) -> tokens`` timed at N and at 1 new token, each the
    fastest of ``repeats`` runs (on a shared box, the run least disturbed by other jobs)."""
    run(2)  # warm-up
    full, first = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        tokens = run(new_tokens)
        full.append(time.perf_counter() - t)
        t = time.perf_counter()
        run(1)
        first.append(time.perf_counter() - t)
    return num_seqs * (new_tokens - 1) / (min(full) - min(first)), tokens


def nemotron_section(args, model_dir: Path) -> dict:
    import transformers

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (17, 40, 64, 90)]
    out = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype=dtype, max_model_len=512,
                                                    num_kv_blocks=128, block_size=16, max_num_seqs=8),
                                       progress=False)
        hf = transformers.NemotronHForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()

        def ours(n: int, ps: list) -> list:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            return [o.token_ids for o in engine.generate(ps, params)]

        def theirs(n: int, p: list) -> list:
            with torch.inference_mode():
                ids = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return ids[0, len(p):].tolist()

        rows = {"ours": [], "transformers": []}
        agree = {"agrees_with_full_forward": [], "agrees_with_generate": []}
        for p in prompts:
            ours_rate, ours_tokens = decode_tok_s(lambda n, p=p: ours(n, [p])[0], args.new_tokens, args.repeats)
            hf_rate, hf_tokens = decode_tok_s(lambda n, p=p: theirs(n, p), args.new_tokens, args.repeats)
            rows["ours"].append(ours_rate)
            rows["transformers"].append(hf_rate)
            with torch.inference_mode():
                logits = hf(torch.tensor([p + ours_tokens])).logits[0, len(p) - 1 : -1]
            for key, ref in (("agrees_with_full_forward", logits.argmax(-1).tolist()),
                             ("agrees_with_generate", hf_tokens)):
                agree[key].append(sum(a == b for a, b in zip(ours_tokens, ref)) / len(ours_tokens))
        batched, _ = decode_tok_s(lambda n: ours(n, prompts), args.new_tokens, args.repeats, num_seqs=len(prompts))
        med = {k: statistics.median(v) for k, v in rows.items()}
        out[dtype] = {"decode_tok_s_batch1_median": med, "decode_tok_s_batch1_per_prompt": rows,
                      "speedup_batch1": med["ours"] / med["transformers"],
                      f"ours_decode_tok_s_batch{len(prompts)}": batched,
                      **agree, "deterministic_mode": engine.deterministic}
        print(f"nemotron_h {dtype}: ours {med['ours']:.1f} tok/s, transformers {med['transformers']:.1f} tok/s "
              f"(batch 1 medians), ours batch {len(prompts)} {batched:.1f} tok/s", flush=True)
        del engine, hf
    return {"config": NEMOTRON, "prompt_lengths": [len(p) for p in prompts], "new_tokens": args.new_tokens,
            "repeats": args.repeats, "runs": out}


def block_section(args) -> dict:
    E, H, I, K = 128, 1024, 384, 8
    arch = MoeArch(num_experts=E, top_k=K, intermediate_size=I, norm_topk_prob=True, sparse_layers=(True,))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        router = torch.randn(E, H, generator=gen).to(dtype)
        gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dtype)
        down = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dtype)
        ways = {"c_grouped_gemm_bi": SparseMoe(arch, router, gate_up, down),
                "torch_grouped_mm": SparseMoe(arch, router, gate_up, down, backend="torch")}
        for tokens in (1, 8, 64):
            x = torch.randn(tokens, H, generator=gen).to(dtype)
            times = {name: [] for name in ways}
            with torch.inference_mode():
                outs = {name: moe(x) for name, moe in ways.items()}
                for _ in range(args.reps):
                    for name, moe in ways.items():
                        t = time.perf_counter()
                        moe(x)
                        times[name].append(time.perf_counter() - t)
            diff = (outs["c_grouped_gemm_bi"].float() - outs["torch_grouped_mm"].float()).abs().max().item()
            ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            out[f"{str(dtype)[6:]}_batch{tokens}"] = {"median_ms": ms, "max_abs_diff": diff}
            row = ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items())
            print(f"block {str(dtype)[6:]:8s} batch {tokens:2d}: {row}", flush=True)
    return {"shape": {"experts": E, "top_k": K, "hidden": H, "width": I}, "reps": args.reps, "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="decode timings: the fastest of this many runs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"what": __doc__.split("\n\n")[0], "threads": args.threads, "torch": torch.__version__,
              "load_avg_1min_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        make_nemotron_dir(Path(tmp))
        result["nemotron_h"] = nemotron_section(args, Path(tmp))
    result["fused_moe_block"] = block_section(args)
    result["load_avg_1min_at_end"] = os.getloadavg()[0]
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
