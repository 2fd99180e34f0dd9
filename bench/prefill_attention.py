"""Causal prefill attention on a GPU, one layer of 16 x 2,048 tokens (TinyLlama's 32 query / 4 KV heads of
64, bf16): torch's FlashAttention-2 varlen op (production, kernels/flash_prefill.py) against cuDNN's
attention, varlen and dense, and FlashAttention-2 through SDPA on dense tensors; then prompts of four
lengths: FlashAttention-2 varlen against one cuDNN call over the batch padded to the longest (copies
included). Each candidate's output
is compared with production's (max abs difference) and timed with triton's do_bench; TFLOP/s counts QK
and PV over half the square. A candidate the GPU or torch refuses is recorded with its error.

    python bench/prefill_attention.py [--num-seqs 16 --seq-len 2048] [--out bench/results/prefill_attention_h100.json]
    python bench/prefill_attention.py --device cpu      # the dry run: shapes only, every candidate refused
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def candidates(q, k, v, cu_seqlens, num_seqs: int, seq_len: int, scale: float) -> dict:
    """name -> a function returning [num_tokens, num_q_heads, head_dim]."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    num_heads, head_dim = q.shape[1], q.shape[2]

    def dense(x):  # [B*S, H, D] -> [B, H, S, D]
        return x.view(num_seqs, seq_len, x.shape[1], head_dim).transpose(1, 2)

    def packed(x):  # [B, H, S, D] -> [B*S, H, D]
        return x.transpose(1, 2).reshape(num_seqs * seq_len, num_heads, head_dim)

    def flash_varlen():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, seq_len, seq_len, 0.0, True,
                                                       False, scale=scale)[0]

    def cudnn_varlen():
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_seqlens, cu_seqlens, seq_len, seq_len, False,
                                                       0.0, True, False, scale=scale)[0]

    def sdpa(backend, gqa: bool):
        def run():
            kk, vv = (k, v) if gqa else (k.repeat_interleave(num_heads // k.shape[1], 1),
                                         v.repeat_interleave(num_heads // k.shape[1], 1))
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(dense(q), dense(kk), dense(vv), is_causal=True, scale=scale,
                                                     enable_gqa=gqa)
            return packed(out)
        return run

    return {"flash_varlen": flash_varlen, "cudnn_varlen": cudnn_varlen,
            "cudnn_dense_gqa": sdpa(SDPBackend.CUDNN_ATTENTION, True),
            "cudnn_dense_repeat_kv": sdpa(SDPBackend.CUDNN_ATTENTION, False),
            "flash_dense_gqa": sdpa(SDPBackend.FLASH_ATTENTION, True)}


def unequal_lengths(q, k, v, n: int, s: int, scale: float, dev: str) -> dict:
    """Prompts of several lengths (s, s - 48, s - 96, s - 144 in turn): FlashAttention-2 varlen (what
    production runs for them) against one cuDNN call over the batch padded at each prompt's end to the
    longest, the padding copies and the gather of the real rows included (padded rows come after the real
    ones: causal attention keeps them out of the real rows' results)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pdcluster.kernels import flash_prefill

    lens = [s - 48 * (i % 4) for i in range(n)]
    total, longest = sum(lens), max(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    qs, ks, vs = q[:total], k[:total], v[:total]
    # Row i of the padded batch: prompt r's token j sits at r * longest + j.
    dest = torch.cat([torch.arange(r * longest, r * longest + n_r) for r, n_r in enumerate(lens)]).to(dev)

    def flash():
        return torch.ops.aten._flash_attention_forward(qs, ks, vs, cu, cu, longest, longest, 0.0, True, False,
                                                       scale=scale)[0]

    def cudnn_padded():
        padded = []
        for x in (qs, ks, vs):
            buf = x.new_zeros((n * longest, *x.shape[1:]))
            buf[dest] = x
            padded.append(buf)
        out = flash_prefill._dense_causal(*padded, n, longest, scale)  # [n, heads, longest, dim]
        return out.transpose(1, 2).reshape(n * longest, *qs.shape[1:])[dest]

    flops = sum(2 * n_r * n_r * q.shape[2] * q.shape[1] for n_r in lens)
    padded_flops = n * 2 * longest * longest * q.shape[2] * q.shape[1]

    def cudnn_run():  # the dry run on a CPU: SDPA's math backend stands in
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if dev == "cuda" else SDPBackend.MATH]):
            return cudnn_padded()

    return {"lens": sorted(set(lens)), "padded_work_ratio": round(padded_flops / flops, 3),
            **measure({"flash_varlen": flash, "cudnn_padded_batch": cudnn_run}, flops, dev, "unequal")}


def measure(fns: dict, flops: int, dev: str, label: str) -> dict:
    """name -> {max_abs_diff against the first that ran, ok, and on CUDA ms and TFLOP/s}, or the error of
    one this GPU or torch refuses (the CPU dry run: FlashAttention's op)."""
    entries: dict = {}
    want = None
    for name, fn in fns.items():
        try:
            got = fn()
            if want is None:
                want = got.float()
            entry = {"max_abs_diff": round(float((got.float() - want).abs().max()), 5)}
            entry["ok"] = entry["max_abs_diff"] < 2e-2
            if dev == "cuda":
                from triton.testing import do_bench

                ms = do_bench(fn, warmup=10, rep=100)
                entry.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        except Exception as e:  # noqa: BLE001 - recorded
            entry = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        entries[name] = entry
        print(label, name, entry, file=sys.stderr, flush=True)
    return entries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import import_pdcluster
    from json_report import emit_json

    import_pdcluster()

    import torch

    dev = args.device
    n, s = (args.num_seqs, args.seq_len) if dev == "cuda" else (2, 64)
    num_heads, num_kv_heads, head_dim = 32, 4, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(n * s, h, head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    cu_seqlens = torch.arange(0, n * s + 1, s, device=dev, dtype=torch.int32)
    scale = head_dim ** -0.5
    flops = 2 * n * s * s * head_dim * num_heads  # QK and PV over half the square
    result: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "num_seqs": n, "seq_len": s,
                    "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "torch": torch.__version__}
    result["candidates"] = measure(candidates(q, k, v, cu_seqlens, n, s, scale), flops, dev, "layer")
    if dev == "cuda":  # production's entry (kernels/flash_prefill.py): which path serves, first call and later
        import time

        import numpy as np

        from pdcluster.kernels import flash_prefill

        result["production"] = {}
        for name, lens in (("equal_1024", np.array([1024] * 3)), ("unequal", np.array([1000, 700, 1536]))):
            rows = int(lens.sum())
            cu = torch.tensor([0, *np.cumsum(lens)], device=dev, dtype=torch.int32)
            before, calls = flash_prefill.num_cudnn_calls, []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = flash_prefill.flash_prefill(q[:rows], k[:rows], v[:rows], cu, int(lens.max()), scale, lens)
                torch.cuda.synchronize()
                calls.append(round((time.perf_counter() - t0) * 1e3, 3))
            result["production"][name] = {"lens": lens.tolist(), "call_ms": calls, "served": out is not None,
                                          "by_cudnn": flash_prefill.num_cudnn_calls > before,
                                          "cudnn_refused": flash_prefill.cudnn_disabled_reason()}
    result["unequal"] = unequal_lengths(q, k, v, n, s, scale, dev)
    timed = {k: e["ms"] for k, e in result["candidates"].items() if e.get("ok") and "ms" in e}
    result["best"] = min(timed, key=timed.get) if timed else None
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
