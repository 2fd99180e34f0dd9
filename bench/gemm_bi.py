"""Batch-invariant linear (kernels/cpu_gemm.py, issue 24) against the engine's linear paths on CPU.

    python bench/gemm_bi.py [--quick] [--variance] > bench/results/gemm_bi.json

Prints JSON. ``timings``: SmolLM2's linear shapes x rows M x threads, milliseconds per call (the minimum
over several timed batches: the box is shared) for ours in bf16 and fp32, oneDNN bf16 with the weight
prepacked (engine/linear.py's bf16 path), and MKL fp32 (``F.linear``); on an AMX machine also ours in bf16
on the avx512_bf16 path (``isa=3``), the one it had before AMX. ``variance`` (with --variance):
for each engine path, which row counts M change row 0 against M=1, and how many of the first M rows
differ from the same row computed alone, bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from pdcluster.engine.linear import Linear
from pdcluster.kernels import cpu_gemm

SHAPES = {  # name: (out_features, in_features), SmolLM2-135M
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = [1, 2, 4, 8, 16, 32, 64, 512, 2048]
VARIANCE_ROWS = [1, 2, 3, 8, 17, 64, 512]


def _time_ms(fns: dict, budget_s: float = 1.0, max_rounds: int = 400) -> dict:
    """Per function, the fastest of its calls, taken in turns (ours, theirs, ours, ...) for about
    ``budget_s``: on a shared box other work only ever makes a call slower, and taking turns gives
    every function the same quiet moments."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    spent, rounds = 0.0, 0
    while rounds < 3 or (spent < budget_s and rounds < max_rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best[name], spent = min(best[name], dt), spent + dt
        rounds += 1
    return {name: round(t * 1e3, 4) for name, t in best.items()}


def timings(rows: list[int], shapes: dict) -> list[dict]:
    out = []
    torch.manual_seed(0)
    amx = cpu_gemm.best_isa(torch.bfloat16) == 4
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.05
        x = torch.randn(max(rows), k)
        w16, x16 = w.bfloat16(), x.bfloat16()
        onednn = Linear(w16)  # prepacked by oneDNN
        ours16, ours32 = cpu_gemm.pack_bi(w16), cpu_gemm.pack_bi(w)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in rows:
                budget = 3.0 if m * n > 64 * 49152 else 1.0
                r = {"shape": name, "n": n, "k": k, "m": m, "threads": threads}
                fns = {"ours_bf16_ms": lambda: cpu_gemm.linear_bi(x16[:m], ours16),
                       "onednn_bf16_prepacked_ms": lambda: onednn(x16[:m]),
                       "ours_fp32_ms": lambda: cpu_gemm.linear_bi(x[:m], ours32),
                       "mkl_fp32_ms": lambda: F.linear(x[:m], w)}
                if amx:  # the avx512_bf16 path this machine used before it had the AMX one
                    fns["ours_bf16_avx512_ms"] = lambda: cpu_gemm.linear_bi(x16[:m], ours16, isa=3)
                r.update(_time_ms(fns, budget))
                r["bf16_ratio"] = round(r["ours_bf16_ms"] / r["onednn_bf16_prepacked_ms"], 3)
                r["fp32_ratio"] = round(r["ours_fp32_ms"] / r["mkl_fp32_ms"], 3)
                print(json.dumps(r), flush=True, file=sys.stderr)
                out.append(r)
    return out


def variance(shapes: dict) -> list[dict]:
    """Row 0 of each path at M rows vs M=1 (bitwise), and rows of an M-row call vs the same row alone."""
    out = []
    torch.manual_seed(0)
    big = max(VARIANCE_ROWS)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k) * 0.05
            x = torch.randn(big, k)
            paths = {
                "onednn_bf16_prepacked": Linear(w.bfloat16()),
                "fp32_engine (MKL; C small-M kernel at 2-8 rows)": Linear(w, pack_float32=name == "lm_head"),
                "ours_bf16": (lambda p: lambda v: cpu_gemm.linear_bi(v, p))(cpu_gemm.pack_bi(w.bfloat16())),
                "ours_fp32": (lambda p: lambda v: cpu_gemm.linear_bi(v, p))(cpu_gemm.pack_bi(w)),
            }
            for path, fn in paths.items():
                xs = x.bfloat16() if "bf16" in path else x
                alone = torch.cat([fn(xs[r:r + 1]) for r in range(64)])
                row0 = fn(xs[:1])[0]
                out.append({
                    "shape": name, "threads": threads, "path": path,
                    "row0_differs_at_m": [m for m in VARIANCE_ROWS[1:] if not torch.equal(fn(xs[:m])[0], row0)],
                    "rows_differing_of_first_64": {m: int((fn(xs[:m])[:64] != alone[:m]).any(1).sum())
                                                   for m in VARIANCE_ROWS[1:]},
                })
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes and rows")
    ap.add_argument("--variance", action="store_true", help="also measure which paths are batch-variant")
    args = ap.parse_args()
    shapes = {k: SHAPES[k] for k in ("qkv", "down")} if args.quick else SHAPES
    rows = [1, 8, 64, 512] if args.quick else ROWS
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "ours_isa_bf16": cpu_gemm.ISA_NAMES.get(cpu_gemm.best_isa(torch.bfloat16)),
                    "ours_isa_fp32": cpu_gemm.ISA_NAMES.get(cpu_gemm.best_isa(torch.float32))},
        "load_average_before": os.getloadavg(),
        "timings": timings(rows, shapes),
        "load_average_after": os.getloadavg(),  # other work on a shared box shows in the 2-thread rows
    }
    if args.variance:
        result["variance"] = variance(shapes)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
