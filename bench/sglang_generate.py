"""What SGLang's native POST /generate costs against /v1/completions on the same server (cluster/api/sglang_generate.py
serves it over the completions path, then lays the answer out SGLang's way).

One in-process server (LocalRouter + the real uvicorn app, SmolLM2 by default) answers the same greedy requests through
both routes, alternating A B A B: --rounds sequential requests of --max-tokens tokens each (token ids in, with
logprobs: what an RL rollout worker sends), and --rounds bursts of --concurrency requests at once. Each request's
tokens through /generate are checked equal to /v1/completions'. Prints JSON (and writes it with --out).

    python bench/sglang_generate.py [--model smollm2] [--dtype auto] [--rounds 10] [--max-tokens 32]
                                    [--concurrency 16] [--out F.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # test_api.serving: the app on a real uvicorn in a thread
from json_report import emit_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto", help="auto: what `serve` runs (bf16 where the CPU has avx512_bf16/AMX)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import httpx

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from pdcluster.engine.config import EngineConfig
    from test_api import serving

    config = EngineConfig(model=args.model, num_kv_blocks=1024, max_model_len=2048,
                          enable_prefix_caching=False, dtype=args.dtype)
    router = LocalRouter(config, request_timeout_s=300)
    engine_dtype = router.worker.engine.dtype_name
    prompts = [router.tokenizer.encode(f"Question {i}: explain in detail why the sky looks blue at noon.")
               for i in range(max(args.concurrency, 1))]

    def completions(client, ids):
        r = client.post("/v1/completions", json={"model": args.model, "prompt": ids, "max_tokens": args.max_tokens,
                                                 "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                 "return_token_ids": True})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    def generate(client, ids):
        r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["output_ids"]

    routes = {"completions": completions, "generate": generate}
    times: dict[str, dict[str, list[float]]] = {name: {"sequential_s": [], "burst_s": []} for name in routes}
    try:
        with serving(build_app(router, args.model)) as base_url, httpx.Client(base_url=base_url, timeout=300) as client:
            tokens = {name: fn(client, prompts[0]) for name, fn in routes.items()}  # warm-up, and the check
            assert tokens["generate"] == tokens["completions"], "/generate and /v1/completions gave other tokens"
            with ThreadPoolExecutor(args.concurrency) as pool:
                for _ in range(args.rounds):
                    for name, fn in routes.items():  # A B alternation: drift hits both alike
                        t0 = time.perf_counter()
                        fn(client, prompts[0])
                        times[name]["sequential_s"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        outs = list(pool.map(lambda ids, fn=fn: fn(client, ids), prompts[:args.concurrency]))
                        times[name]["burst_s"].append(time.perf_counter() - t0)
                        assert all(len(o) == args.max_tokens for o in outs)
    finally:
        router.close()
    report = {"model": args.model, "dtype": str(engine_dtype), "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "rounds": args.rounds, "tokens_equal": True}
    for name in routes:
        report[name] = {k: {"median": statistics.median(v), "min": min(v)} for k, v in times[name].items()}
    for k in ("sequential_s", "burst_s"):
        ratios = [g / c for g, c in zip(times["generate"][k], times["completions"][k])]
        report[f"generate_over_completions_{k[:-2]}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                         "max": max(ratios)}
    emit_json(report, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
