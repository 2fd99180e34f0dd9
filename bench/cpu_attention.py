"""The C paged attention's two bf16 paths on this CPU, one layer: AMX tiles (kernels/csrc/attention_amx.h) against
avx512_bf16 vectors (attend_item_bf16), for prefill (fresh prompts and a chunk after a prefix) and decode batches, in
SmolLM2-135M's shape (9 query / 3 KV heads of 64) and a Llama-8B-like one (32 / 8 of 128). Each case is timed on
the same inputs, both paths alternating, median of --repeats; outputs are compared with the torch reference. Prints
JSON (and writes it with --out).

    python bench/cpu_attention.py [--threads 1] [--repeats 20] [--out bench/results/cpu_attention_amx_s78.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
# name -> (q_lens, seq_lens): prefill of fresh prompts, a chunk after a prefix, decode batches
CASES = {
    "prefill_1x512": ([512], [512]),
    "prefill_1x850": ([850], [850]),
    "prefill_4x200": ([200] * 4, [200] * 4),
    "chunk_256_after_768": ([256], [1024]),
    "decode_32x300": ([1] * 32, [300] * 32),
    "decode_64x1024": ([1] * 64, [1024] * 64),
}


def make_case(q_lens, seq_lens, heads, kv_heads, dim, block_size=16):
    import torch

    g = torch.Generator().manual_seed(0)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(torch.bfloat16)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[at : at + n]
        at += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(torch.bfloat16)
    return query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, dim**-0.5


def time_path(fn, amx: bool, repeats: int) -> tuple[float, object]:
    os.environ["PDCLUSTER_ATTN_AMX"] = "1" if amx else "0"
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from pdcluster.kernels import cpu_ops, reference

    torch.set_num_threads(args.threads)
    if not cpu_ops.attention_amx():
        print(json.dumps({"error": "this CPU (or process) has no AMX tiles: nothing to compare"}))
        return 1
    rows = []
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for name, (q_lens, seq_lens) in CASES.items():
            case = make_case(q_lens, seq_lens, heads, kv_heads, dim)

            def fn(case=case):
                return cpu_ops.paged_attention(*case)

            ms = {}
            outs = {}
            for rnd in range(2):  # A B A B: the median of each path over both rounds
                for amx in (True, False):
                    t, outs[amx] = time_path(fn, amx, args.repeats)
                    ms.setdefault(amx, []).append(t)
            ref = reference.paged_attention(*case).float()
            num_tokens = sum(q_lens)
            row = {
                "shape": shape, "case": name, "num_tokens": num_tokens,
                "amx_ms": round(min(ms[True]), 3), "avx512_bf16_ms": round(min(ms[False]), 3),
                "speedup": round(min(ms[False]) / min(ms[True]), 2),
                "amx_max_abs_err": round((outs[True].float() - ref).abs().max().item(), 4),
                "avx512_max_abs_err": round((outs[False].float() - ref).abs().max().item(), 4),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"bench": "cpu_attention", "threads": args.threads, "repeats": args.repeats,
              "cpu": _cpu_name(), "rows": rows}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
