"""KV tiers on a multi-turn workload (issue 27 acceptance), side by side in one run.

ShareGPT conversations replayed turn by turn (tools/loadtest/multiturn.py) against `pdcluster serve`
colocated with two decode workers, each device pool sized to hold about 20% of the workload's working set
(its distinct prompt tokens), in three configurations, one after another on a fresh server each:

    baseline   each worker's own prefix cache, router policy prefix_aware (what we had)
    tiers      + host and disk offload tiers on each worker, router policy kv_aware (KV events)
    no_cache   --no-prefix-caching (the token-exactness reference)

Reported per configuration: TTFT percentiles, prompt tokens computed / total and cached by tier (the
server's /metrics deltas), and whether every turn's output equals the no-cache run's. Prints JSON and
writes --out (default bench/results/kv_tiers.json).

    python bench/kv_tiers.py [--num-conversations 200] [--model smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from pdcluster.tools.loadtest.client import Target
from pdcluster.tools.loadtest.datasets import DatasetOptions
from pdcluster.tools.loadtest.metrics import SLO, summarize
from pdcluster.tools.loadtest.multiturn import load_conversations, run_conversations
from pdcluster.tools.loadtest.server_metrics import scrape, server_delta
from pdcluster.tools.loadtest.tokenizer_source import load_tokenizer
from pdcluster.tools.server_process import ServeProcess

BYTES_PER_TOKEN_GUESS = 23 * 1024  # smollm2 bf16: 30 layers x K,V x 3 heads x 64 x 2 bytes


def config_flags(name: str, blocks_per_worker: int, tier_dir: str, host_gib: float, disk_gib: float) -> list[str]:
    common = ["--mode", "colocated", "--num-decode", "2", "--num-threads", "1",
              "--num-kv-blocks", str(blocks_per_worker)]
    if name == "baseline":
        return common + ["--router-policy", "prefix_aware"]
    if name == "tiers":
        return common + ["--router-policy", "kv_aware", "--kv-offload-host-gib", str(host_gib),
                         "--kv-offload-disk-dir", tier_dir, "--kv-offload-disk-gib", str(disk_gib)]
    if name == "no_cache":
        return common + ["--router-policy", "least_loaded", "--no-prefix-caching"]
    raise ValueError(name)


async def measure(base_url: str, model: str, conversations, args) -> tuple[dict, list[str]]:
    target = Target(base_url=base_url, model=model, timeout_s=args.timeout_s)
    starts = np.zeros(len(conversations))
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        before = await scrape(http, base_url)
        outcome = await run_conversations(target, conversations, starts, args.think_time_s, args.concurrency,
                                          seed=0, progress=not args.no_progress)
        after = await scrape(http, base_url)
    result = summarize(outcome.records, outcome.duration_s, SLO())
    server, breakdown = server_delta(before, after)
    keep = ("completed", "failed", "duration", "total_input_tokens", "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "errors")
    summary = {k: result[k] for k in keep}
    summary["server_metrics"] = server
    summary["ttft_breakdown"] = breakdown
    return summary, [r.generated_text if r.ok else None for r in outcome.records]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-conversations", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16, help="conversations in flight at once")
    p.add_argument("--think-time-s", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.2, help="device pools hold this share of the working set")
    p.add_argument("--host-gib", type=float, default=1.5, help="host tier per worker")
    p.add_argument("--disk-gib", type=float, default=4.0, help="disk tier per worker")
    p.add_argument("--configs", default="tiers,baseline,no_cache")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_tiers.json"))
    args = p.parse_args()

    tokenizer = load_tokenizer(None, args.model)
    conversations = load_conversations(DatasetOptions(num_prompts=args.num_conversations, max_model_len=2048,
                                                      fixed_output_len=args.output_len), tokenizer)
    working_set_tokens = sum(c.turns[-1].prompt_len for c in conversations)
    total_prompt_tokens = sum(c.num_prompt_tokens for c in conversations)
    blocks_per_worker = int(working_set_tokens * args.pool_fraction / 2 / 16)
    result = {"model": args.model, "num_conversations": len(conversations),
              "num_turns": sum(len(c.turns) for c in conversations), "working_set_tokens": working_set_tokens,
              "total_prompt_tokens": total_prompt_tokens, "ideal_computed_fraction":
                  round(working_set_tokens / total_prompt_tokens, 3),
              "device_blocks_per_worker": blocks_per_worker, "workers": "colocated, 2 decode workers, 1 thread each",
              "concurrency": args.concurrency, "think_time_s": args.think_time_s, "output_len": args.output_len,
              "load_avg_1min_at_start": os.getloadavg()[0], "configs": {}}
    outputs = {}
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory(prefix="pdcluster-tiers-") as tier_dir:
            flags = ["--model", args.model] + config_flags(name, blocks_per_worker, tier_dir, args.host_gib,
                                                           args.disk_gib)
            started = time.perf_counter()
            with ServeProcess(flags, timeout_s=600) as server:
                summary, outputs[name] = asyncio.run(measure(server.base_url, args.model, conversations, args))
            summary["wall_s"] = round(time.perf_counter() - started, 1)
            summary["flags"] = flags
        result["configs"][name] = summary
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # so far: a cut-short run keeps this
        print(f"kv_tiers: {name}: {json.dumps({k: summary[k] for k in ('completed', 'p90_ttft_ms')})}",
              file=sys.stderr, flush=True)
    for ref_name in ("no_cache", "baseline"):  # the reference: no cache, else the plain prefix cache
        reference = outputs.get(ref_name)
        for name, texts in outputs.items():
            if reference is not None and name not in ("no_cache", ref_name):
                same = sum(1 for a, b in zip(texts, reference) if a is not None and a == b)
                result["configs"][name][f"outputs_equal_{ref_name}"] = f"{same}/{len(reference)}"
    base, tiers = result["configs"].get("baseline"), result["configs"].get("tiers")
    if base and tiers and base["p90_ttft_ms"] and tiers["p90_ttft_ms"]:
        result["p90_ttft_baseline_over_tiers"] = round(base["p90_ttft_ms"] / tiers["p90_ttft_ms"], 2)
    result["load_avg_1min_at_end"] = os.getloadavg()[0]
    text = json.dumps(result, indent=1)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
