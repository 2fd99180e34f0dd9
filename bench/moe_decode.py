"""engine/models/moe.py's two ways to run the experts at decode sizes (issue 26 item 4): one torch._grouped_mm per
projection against the expert loop (F.linear per expert that has rows), timed in turns on the same inputs.

Shape: 128 experts, top-8, hidden 1024, expert width 384 (Qwen3-30B-A3B's expert count and top-k at half
its widths), router weights random so tokens spread over experts. One thread by default.

    python bench/moe_decode.py [--threads 1] [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pdcluster.engine.models.moe import MoeArch, SparseMoe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    E, H, I, K = args.experts, args.hidden, args.width, args.top_k
    arch = MoeArch(num_experts=E, top_k=K, intermediate_size=I, norm_topk_prob=True, sparse_layers=(True,))
    gen = torch.Generator().manual_seed(0)
    print(f"experts {E} top-{K} hidden {H} width {I}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    for dtype in (torch.float32, torch.bfloat16):
        router = torch.randn(E, H, generator=gen).to(dtype)
        gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dtype)
        down = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dtype)
        ways = {"grouped_mm": SparseMoe(arch, router, gate_up, down, use_grouped_mm=True),
                "expert_loop": SparseMoe(arch, router, gate_up, down, use_grouped_mm=False)}
        for tokens in (1, 8, 64):
            x = torch.randn(tokens, H, generator=gen).to(dtype)
            hit = int(ways["grouped_mm"].route(x)[1].unique().numel())
            times = {name: [] for name in ways}
            with torch.inference_mode():
                outs = {name: moe(x) for name, moe in ways.items()}
                for _ in range(args.reps):
                    for name, moe in ways.items():
                        t = time.perf_counter()
                        moe(x)
                        times[name].append(time.perf_counter() - t)
            diff = (outs["grouped_mm"].float() - outs["expert_loop"].float()).abs().max().item()
            row = ", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items())
            print(f"{str(dtype)[6:]:8s} batch {tokens:2d} ({hit:3d} experts hit): {row} (median of {args.reps}; "
                  f"max diff {diff:.1e})", flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
