"""Decode-sized GEMMs on a GPU: the 1.1B Llama's (TinyLlama's shape) projections at 1 to 128 rows, each way we
have to run them, timed as a decode step runs them and reported as weight bandwidth (weight bytes / time; at
these row counts a projection only streams its weight).

The ways: ``F.linear`` on the [out, in] weight (cuBLAS, engine/linear.py's fast mode), the weight pre-transposed
to [in, out] for ``torch.mm``, cuBLASLt as torch's preferred BLAS library, and up to 128 rows every candidate
tile configuration of the weight-streaming Triton matmuls (kernels/triton_skinny_gemm.py; ``skinny:...``; the
engine picks among these and cuBLAS per shape and row count at start-up, engine/skinny_linear.py).

Timed the way engine/skinny_linear.py times them: inside one CUDA graph, each call reading another copy of the
weight, with copies enough to fill twice the L2 (one matrix read again and again would come from L2: the 8 MB
output projection fits in an H100's 50 MB). On the H200 of s51 the batch-1 step's projections ran at ~1.6 TB/s
(2,048 wide) to ~3.4 TB/s (gate/up) of a 4 TB/s copy bandwidth (bench/results/gpu_check_h200.json's profile).

    python bench/gemm_sweep.py [--rows 1,2,4,8,16,32,128] [--out bench/results/gemm_sweep_h200.json]
    python bench/gemm_sweep.py --device cpu      # the dry run: small shapes, timed on the host, interpreted kernels
"""

from __future__ import annotations

import argparse
import os
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
    ap.add_argument("--rows", default="1,2,4,8,16,32,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run interpreted
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import import_pdcluster
    from json_report import emit_json

    import_pdcluster()  # the GPU machine runs this checkout uninstalled

    import torch
    import torch.nn.functional as F

    from pdcluster.engine import skinny_linear
    from pdcluster.kernels import triton_skinny_gemm as sk

    dev = args.device
    dtype = torch.bfloat16
    shapes = SHAPES if dev == "cuda" else [(n, o // 64, i // 64) for n, o, i in SHAPES]
    if dev == "cuda":
        timed_us = skinny_linear._graph_time_us
    else:
        def timed_us(fn, weights) -> float:
            fn(weights[0])
            t0 = time.perf_counter()
            for i in range(4):
                fn(weights[i % len(weights)])
            return (time.perf_counter() - t0) / 4 * 1e6

    result: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "dtype": "bfloat16",
                    "shapes": {}}
    default_blas = torch.backends.cuda.preferred_blas_library() if dev == "cuda" else None
    for name, out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, device=dev, dtype=dtype) * 0.02
        weights = skinny_linear._cold_set(weight)
        weights_t = [w.t().contiguous() for w in weights]
        by_id = {id(w): wt for w, wt in zip(weights, weights_t)}
        weight_bytes = weight.numel() * weight.element_size()
        per_rows: dict = {}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features, device=dev, dtype=dtype)
            want = F.linear(x, weight).float()
            candidates = {"linear": lambda w: F.linear(x, w), "mm_pretransposed": lambda w: torch.mm(x, by_id[id(w)])}
            for tiles in (t for t in sk.CANDIDATE_TILES if t.takes(rows)):
                key = f"skinny:{'dot' if tiles.dot else 'fma'}-n{tiles.block_n}-k{tiles.block_k}-s{tiles.split}"
                candidates[key] = lambda w, tiles=tiles: sk.skinny_gemm(x, w, tiles)
            entry: dict = {"num_copies": len(weights)}
            for cand, fn in candidates.items():
                entry[cand] = _measure(fn, weights, want, timed_us, weight_bytes)
            if dev == "cuda":
                try:
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    entry["linear_cublaslt"] = _measure(lambda w: F.linear(x, w), weights, want, timed_us, weight_bytes)
                finally:
                    torch.backends.cuda.preferred_blas_library(default_blas)
            timed = {k: e["us"] for k, e in entry.items() if isinstance(e, dict) and e.get("ok")}
            entry["best"] = min(timed, key=timed.get) if timed else None
            if name == "gate_up" and rows > sk.FMA_MAX_ROWS:  # the SiLU-and-mul after it, or in the epilogue
                entry["gated"] = _gated(x, weight, weights, rows, timed_us, weight_bytes)
            per_rows[str(rows)] = entry
            print(name, rows, entry.get("best"), {k: v for k, v in timed.items()}, file=sys.stderr, flush=True)
        result["shapes"][name] = {"out_features": out_features, "in_features": in_features,
                                  "weight_bytes": weight_bytes, "rows": per_rows}
        del weights, weights_t, by_id
    emit_json(result, args.out, indent=2)
    return 0


def _gated(x, weight, weights, rows: int, timed_us, weight_bytes: int) -> dict:
    """The gate/up projection and its SiLU-and-mul: cuBLAS then the SiLU kernel, against each dot tiling with the
    activation in its epilogue (what engine/skinny_linear.py weighs for 5 to 128 rows)."""
    import torch.nn.functional as F

    from pdcluster.kernels import ops
    from pdcluster.kernels import triton_skinny_gemm as sk

    want = ops.silu_and_mul(F.linear(x, weight)).float()
    candidates = {"linear+silu_and_mul": lambda w: ops.silu_and_mul(F.linear(x, w))}
    for tiles in (t for t in sk.CANDIDATE_TILES if t.takes(rows, gated=True)):
        key = f"skinny_gated:n{tiles.block_n}-k{tiles.block_k}-s{tiles.split}"
        candidates[key] = lambda w, tiles=tiles: sk.skinny_gemm(x, w, tiles, gated=True)
    entry = {cand: _measure(fn, weights, want, timed_us, weight_bytes) for cand, fn in candidates.items()}
    timed = {k: e["us"] for k, e in entry.items() if e.get("ok")}
    entry["best"] = min(timed, key=timed.get) if timed else None
    return entry


def _measure(fn, weights, want, timed_us, weight_bytes: int) -> dict:
    try:
        got = fn(weights[0]).float()
        err = float((got - want).abs().max())
        us = timed_us(fn, weights)
        return {"us": round(us, 2), "weight_tb_per_s": round(weight_bytes / us / 1e6, 3), "max_abs_diff": round(err, 5),
                "ok": err < 0.05}
    except Exception as e:  # noqa: BLE001 - a way this torch or GPU refuses: recorded
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}


if __name__ == "__main__":
    sys.exit(main())
