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
3. "disagg_bytes": bytes a disaggregated request moves from the prefill to the decode worker, drafting with the
   model's own MTP layers (--spec mtp): the target's attention KV, the MTP layers' KV (their draft layers, every
   prompt block) and the Mamba state (conv + SSM of every Mamba layer, fp32, in whole blocks after the prompt's).
   Measured over a real tcp pair (the prefill worker's bytes_sent) and split by the connector's sends
   (kv_transfer/connector/prefill.py): the full blocks layer by layer, then at post_forward the tail block again
   (the last full one when the prompt fills its blocks), the draft layers of every block and the state blocks. For
   tiny-hybrid-moe and for section 1's model with one MTP step added (attention + latent MoE, random weights
   under the published Nemotron-3 names: transformers' save_pretrained writes none).

    python bench/moe_decode.py [--threads 1] [--new-tokens 32] [--repeats 3] [--sections ...]
                               [--out bench/results/moe_decode.json]
--sections runs only those sections; the others are kept from --out's file.
"""

from __future__ import annotations

import argparse
import json
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
from pdcluster.engine.models.tiny_hybrid_moe import mtp_state_dict
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


def add_mtp_layers(model_dir: Path) -> None:
    """One MTP step (transformers' default attention + moe) under the published names, as NVIDIA's checkpoints
    carry it: config fields, and the weights in their own file (tiny_hybrid_moe's draws at this model's shape)."""
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"])
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(mtp_state_dict(config), str(model_dir / "mtp.safetensors"), metadata={"format": "pt"})


def request_bytes(engine, prompt_tokens: int) -> dict:
    """What the prefill connector sends for one prompt (module docstring), split by kind."""
    spec, bs = engine.kv_spec, engine.kv_spec.block_size
    per_layer_block = spec.bytes_per_block // spec.num_layers
    target_layers = spec.num_layers - spec.num_draft_layers
    full, blocks = prompt_tokens // bs, -(-prompt_tokens // bs)
    resent = blocks - min(full, blocks - 1)  # the tail block, or the last full block again
    return {"kv": (full + resent) * target_layers * per_layer_block,
            "mtp_kv": blocks * spec.num_draft_layers * per_layer_block,
            "state": engine.num_state_blocks * spec.bytes_per_block}


def disagg_bytes(model: str, dtype: str, prompt_lengths: tuple[int, ...]) -> dict:
    """Each prompt through a real tcp prefill/decode pair, one at a time: bytes sent against request_bytes."""
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.node.events import Tokens
    from pdcluster.prefill_node.worker import PrefillWorker

    cfg = EngineConfig(model=model, dtype=dtype, num_kv_blocks=512, max_model_len=2048, prefill_chunk_size=512,
                       spec_method="mtp", num_spec_tokens=2, mtp_checkpoint="")
    prefill, decode = PrefillWorker("p0", cfg, TransferConfig(transport="tcp")), None
    finished: set[str] = set()
    try:
        decode = DecodeWorker("d0", cfg, TransferConfig(transport="tcp"))
        decode.on_event = lambda e: isinstance(e, Tokens) and e.finished and finished.add(e.request_id)
        decode.connect_prefill(prefill.address)
        engine, rows = prefill.engine, []
        gen = torch.Generator().manual_seed(2)
        for n in prompt_lengths:
            sent_before = prefill.stats()["bytes_sent"]
            decode.submit(f"n{n}", torch.randint(3, engine.arch.vocab_size, (n,), generator=gen).tolist(),
                          SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), "p0")
            t_end = time.monotonic() + 600
            while f"n{n}" not in finished and time.monotonic() < t_end:
                time.sleep(0.01)
            time.sleep(0.2)  # the prefill worker counts its last sends when the receiver acks them
            parts = request_bytes(engine, n)
            rows.append({"prompt_tokens": n, "bytes_sent": prefill.stats()["bytes_sent"] - sent_before,
                         **{f"{k}_bytes": v for k, v in parts.items()}, "accounted_bytes": sum(parts.values())})
            print(f"disagg bytes {Path(model).name} {dtype} {n} tokens: {rows[-1]}", flush=True)
        spec = engine.kv_spec
        return {"mtp_source": engine.mtp_source.split(": ", 1)[-1], "block_size": spec.block_size, "num_layers": spec.num_layers,
                "num_draft_layers": spec.num_draft_layers, "bytes_per_block": spec.bytes_per_block,
                "num_state_blocks": engine.num_state_blocks, "state_payload_bytes": engine.state_shape.bytes_per_slot,
                "requests": rows}
    finally:
        prefill.close()
        if decode is not None:
            decode.close()


def disagg_section(model_dir: Path) -> dict:
    add_mtp_layers(model_dir)
    return {"tiny-hybrid-moe": {"float32": disagg_bytes("tiny-hybrid-moe", "float32", (100, 1000))},
            "nemotron_h_with_mtp": {dtype: disagg_bytes(str(model_dir), dtype, (100, 1000))
                                    for dtype in ("float32", "bfloat16")}}


SECTIONS = ("nemotron_h", "fused_moe_block", "disagg_bytes")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="decode timings: the fastest of this many runs")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).is_file() else {}
    result.update({"what": __doc__.split("\n\n")[0], "threads": args.threads, "torch": torch.__version__})
    for section in args.sections:
        started = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            if section != "fused_moe_block":
                make_nemotron_dir(Path(tmp))
            if section == "nemotron_h":
                result[section] = nemotron_section(args, Path(tmp))
            elif section == "fused_moe_block":
                result[section] = block_section(args)
            else:
                result[section] = disagg_section(Path(tmp))
        result[section]["load_avg_1min"] = {"start": started, "end": os.getloadavg()[0],
                                            "date": time.strftime("%Y-%m-%d")}
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
