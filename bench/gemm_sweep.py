"""Decode-sized GEMMs on a GPU: the 1.1B Llama's (TinyLlama's shape) projections at 1, 32 and 128 rows,
each way torch offers to run them, timed inside a CUDA graph (as the engine replays decode steps) and
reported as weight bandwidth (weight bytes / time; at these row counts a projection only streams its
weight). Production is ``F.linear`` on the [out, in] weight (cuBLAS, engine/linear.py); the others: the
weight pre-transposed to [in, out] for ``torch.mm``, and cuBLASLt as torch's preferred BLAS library. On
the H100 the batch-128 decode step spent ~1.1 ms in these GEMMs against ~0.8 ms of weight bytes at copy
bandwidth (bench/results/gpu_check_h100.json), the small projections at 0.45-0.6 of it.

    python bench/gemm_sweep.py [--out bench/results/gemm_sweep_h100.json]
    python bench/gemm_sweep.py --device cpu      # the dry run: small shapes, timed on the host
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, out_features, in_features): TinyLlama-1.1B's projections (q/k/v and gate/up fused, as we load them).
SHAPES = [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632),
          ("lm_head", 32000, 2048)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,32,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from json_report import emit_json

    import torch
    import torch.nn.functional as F

    dev = args.device
    dtype = torch.bfloat16
    shapes = SHAPES if dev == "cuda" else [(n, o // 64, i // 64) for n, o, i in SHAPES]
    if dev == "cuda":
        from triton.testing import do_bench_cudagraph

        def timed_us(fn) -> float:
            return do_bench_cudagraph(fn, rep=30) * 1e3
    else:
        def timed_us(fn) -> float:
            fn()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            return (time.perf_counter() - t0) / 10 * 1e6

    result: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "dtype": "bfloat16",
                    "shapes": {}}
    default_blas = torch.backends.cuda.preferred_blas_library() if dev == "cuda" else None
    for name, out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, device=dev, dtype=dtype) * 0.02
        weight_t = weight.t().contiguous()
        weight_bytes = weight.numel() * weight.element_size()
        per_rows: dict = {}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features, device=dev, dtype=dtype)
            want = F.linear(x, weight).float()
            candidates = {"linear": lambda: F.linear(x, weight), "mm_pretransposed": lambda: torch.mm(x, weight_t)}
            entry: dict = {}
            for cand, fn in candidates.items():
                entry[cand] = _measure(fn, want, timed_us, weight_bytes)
            if dev == "cuda":
                try:
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    entry["linear_cublaslt"] = _measure(lambda: F.linear(x, weight), want, timed_us, weight_bytes)
                finally:
                    torch.backends.cuda.preferred_blas_library(default_blas)
            timed = {k: e["us"] for k, e in entry.items() if e.get("ok")}
            entry["best"] = min(timed, key=timed.get) if timed else None
            per_rows[str(rows)] = entry
            print(name, rows, entry, file=sys.stderr, flush=True)
        result["shapes"][name] = {"out_features": out_features, "in_features": in_features,
                                  "weight_bytes": weight_bytes, "rows": per_rows}
    emit_json(result, args.out, indent=2)
    return 0


def _measure(fn, want, timed_us, weight_bytes: int) -> dict:
    try:
        got = fn().float()
        err = float((got - want).abs().max())
        us = timed_us(fn)
        return {"us": round(us, 2), "weight_tb_per_s": round(weight_bytes / us / 1e6, 3), "max_abs_diff": round(err, 5),
                "ok": err < 0.05}
    except Exception as e:  # noqa: BLE001 - a way this torch or GPU refuses: recorded
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}


if __name__ == "__main__":
    sys.exit(main())
