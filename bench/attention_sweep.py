"""Paged attention launch configurations on a GPU: the fast mode's prefill (16 x 2,048 tokens, 32 query
and 4 KV heads of 64, bf16), a decode batch (128 x 512), decode steps of a few requests (the partition
split against the segment split) and of many (unsplit, the whole context one partition, against 256-
position partitions and 2-16 segments), and (``mla``) DeepSeek's latent attention (kernels/triton_mla_attention.py:
V3's 128 and V2-Lite's 16 heads over 512 + 64 latents; heads a tile, key tile, warps, stages, split), each
configuration checked against the torch reference and timed with triton.testing.do_bench_cudagraph (launch overhead
out, as in the engine's replayed steps). Prints JSON (and writes it with --out).

    python bench/attention_sweep.py [--sections prefill,decode,decode_few,decode_many,mla] [--out bench/results/attention_sweep_h100.json]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def paged_case(num_seqs: int, seq_len: int, q_len: int, device: str = "cuda", block_size: int = 16):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, dim = 32, 4, 64
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(torch.bfloat16).to(device)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = perm[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs * q_len, heads, dim, generator=g).to(torch.bfloat16).to(device)
    return query, cache, tables, seq_lens, qsl, dim**-0.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a few configurations (a dry run)")
    ap.add_argument("--device", default="cuda", help="cpu: the dry run, under TRITON_INTERPRET=1")
    ap.add_argument("--sections", default="prefill,decode,decode_few,decode_many", help="which sweeps (comma-separated)")
    args = ap.parse_args()
    wanted = set(args.sections.split(","))
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import import_pdcluster
    from json_report import emit_json

    import_pdcluster()
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    if args.device == "cuda":
        # Timed inside a CUDA graph, as the engine replays decode steps: a launch from Python costs tens of
        # microseconds, as much as a decode kernel runs, and timed that way every configuration looks alike.
        def do_bench(fn, warmup, rep):  # noqa: ARG001, F811 - warmup: the graph's capture runs it
            return do_bench_cudagraph(fn, rep=max(rep, 20))

    from pdcluster.kernels import reference
    from pdcluster.kernels import triton_paged_attention as attn

    if args.device == "cpu":
        import time

        def do_bench(fn, warmup, rep):  # noqa: ARG001 - the dry run's stand-in
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    dev = args.device
    result: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "prefill": [], "decode": []}
    shapes = {"prefill": (16, 2048, 2048) if not args.quick else (1, 48, 48),
              "decode": (128, 512, 1) if not args.quick else (4, 48, 1)}
    for name, shape in shapes.items():
        if name not in wanted:
            continue
        query, cache, tables, seq_lens, qsl, scale = paged_case(*shape, dev)
        # The reference on a few requests' rows (the whole batch would take minutes in torch).
        n_check = 2 if name == "prefill" else 8
        n_check = min(n_check, tables.shape[0])
        q_check = query[: int(qsl[n_check])]
        want = reference.paged_attention(q_check.float(), cache.float(), tables[:n_check], seq_lens[:n_check],
                                         qsl[: n_check + 1], scale)
        if name == "prefill":
            configs = itertools.product((64, 128), (64, 128), (4, 8), (2, 3))
        else:
            configs = itertools.product((16,), (32, 64, 128), (2, 4), (2, 3, 4))
        if args.quick:
            configs = list(configs)[:2]
        for rows, block_n, warps, stages in configs:
            block_q = attn.block_q_for(8, rows)
            partition = attn.fast_whole_context(tables, cache.shape[2])  # production's, both

            def run():
                return attn.launch(query, cache, tables, seq_lens, qsl, scale, torch.empty_like(query), block_q,
                                   block_n, native_dot=dev == "cuda", partition=partition, num_warps=warps, num_stages=stages)

            entry = {"rows": rows, "block_n": block_n, "num_warps": warps, "num_stages": stages}
            try:
                got = run()[: q_check.shape[0]].float()
                entry["max_abs_err"] = float((got - want).abs().max())
                entry["ok"] = entry["max_abs_err"] < 3e-2
                entry["ms"] = round(do_bench(run, warmup=5, rep=30), 4)
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile (registers)
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            result[name].append(entry)
            print(name, entry, file=sys.stderr, flush=True)
        ranked = sorted((e for e in result[name] if e.get("ok")), key=lambda e: e["ms"])
        result[f"{name}_best"] = ranked[0] if ranked else None
    if "decode_few" in wanted:
        result["decode_few"] = decode_few(dev, args.quick, do_bench)
    if "decode_many" in wanted:
        result["decode_many"] = decode_few(dev, args.quick, do_bench, many=True)
    if "mla" in wanted:
        result["mla"] = mla_decode(dev, args.quick, do_bench)
    emit_json(result, args.out, indent=2)
    return 0


def decode_few(dev: str, quick: bool, do_bench, many: bool = False) -> dict:
    """Decode steps of a few requests (latency-bound: too few (query tile, KV head) programs to fill the
    GPU): the partition split (FAST_PARTITION, before the segments) against the segment split, each
    checked against the reference. Block tables as wide as a CUDA graph's (4,096 positions), since the
    partition split sizes itself from the table's width.

    ``many``: decode steps of many requests (enough programs: production runs them unsplit) against
    2 to 16 segments, whether splitting the context pays there too (the H100's batch-128 decode step
    spent 0.81 ms of 2.5 in attention at ~0.65 of copy bandwidth)."""
    import torch

    from pdcluster.kernels import reference
    from pdcluster.kernels import triton_paged_attention as attn

    if many:
        cases = [(64, 1024), (128, 512), (128, 2048)] if not quick else [(8, 40)]
    else:
        cases = [(1, 512), (1, 4096), (8, 2048), (32, 512)] if not quick else [(1, 40)]
    width_tokens = 4096 if not quick else 64
    out: dict = {}
    for num_seqs, seq_len in cases:
        query, cache, tables, seq_lens, qsl, scale = paged_case(num_seqs, seq_len, 1, dev)
        wide = torch.zeros(num_seqs, width_tokens // cache.shape[2], dtype=tables.dtype, device=tables.device)
        wide[:, : tables.shape[1]] = tables
        n_check = min(4, num_seqs)
        want = reference.paged_attention(query[:n_check].float(), cache.float(), wide[:n_check], seq_lens[:n_check],
                                         qsl[: n_check + 1], scale)
        block_q = attn.block_q_for(8)
        configs = [("production", None, None)] + [("partition", 64, 0)] + [
            ("segments", block_n, segments) for segments in ((2, 4, 8, 16) if many else (8, 16, 32))
            for block_n in (32, 64)]
        if many:  # unsplit in 256-position partitions: production until the whole context became one
            configs.insert(1, ("unsplit_partitions", 64, None))
            # The engine's decode steps (uniform: one program a request, as AttentionMetadata.uniform_q_len gives),
            # and the whole context unsplit by pipeline stages: K/V tiles in flight = (stages - 1) // 2.
            configs[1:1] = [("production_uniform", None, None)] + [
                ("unsplit_stages", block_n, stages) for block_n in (32, 64) for stages in (3, 5, 7)]
        if quick:
            configs = configs[:3]
        entries = []
        for kind, block_n, segments in configs:
            if kind == "production":
                def run():
                    return attn.paged_attention_triton(query, cache, wide, seq_lens, qsl, scale, batch_invariant=False)
            elif kind == "production_uniform":
                def run():
                    return attn.paged_attention_triton(query, cache, wide, seq_lens, qsl, scale, batch_invariant=False,
                                                       uniform_q_len=1)
            elif kind == "unsplit_stages":
                def run(block_n=block_n, stages=segments):
                    return attn.launch(query, cache, wide, seq_lens, qsl, scale, torch.empty_like(query), block_q,
                                       block_n, split=False, native_dot=dev == "cuda", num_warps=4, num_stages=stages,
                                       partition=attn.fast_whole_context(wide, cache.shape[2]), uniform_q=1)
            elif kind == "unsplit_partitions":
                def run(block_n=block_n):
                    return attn.launch(query, cache, wide, seq_lens, qsl, scale, torch.empty_like(query), block_q,
                                       block_n, split=False, native_dot=dev == "cuda", num_warps=4, num_stages=3,
                                       partition=attn.FAST_PARTITION)
            else:
                def run(block_n=block_n, segments=segments):
                    return attn.launch(query, cache, wide, seq_lens, qsl, scale, torch.empty_like(query), block_q,
                                       block_n, split=True, native_dot=dev == "cuda", num_warps=4, num_stages=3,
                                       partition=None if segments else attn.FAST_PARTITION, segments=segments)
            entry = {"kind": kind, "block_n": block_n,
                     **({"num_stages": segments} if kind == "unsplit_stages" else {"segments": segments})}
            kv_bytes = num_seqs * seq_len * 2 * cache.shape[3] * cache.shape[4] * cache.element_size()
            entries.append(timed_decode(entry, run, want, n_check, do_bench, kv_bytes, "kv_tb_per_s"))  # K, V once
            print(f"decode_{'many' if many else 'few'} {num_seqs}x{seq_len}", entries[-1], file=sys.stderr, flush=True)
        ranked = sorted((e for e in entries if e.get("ok")), key=lambda e: e["us"])
        out[f"{num_seqs}x{seq_len}"] = {"configs": entries, "best": ranked[0] if ranked else None}
    return out


def timed_decode(entry: dict, run, want, n_check: int, do_bench, bytes_read: int, rate_key: str) -> dict:
    """``entry`` with one configuration's error on the first ``n_check`` rows against ``want``, its time (us) and
    ``bytes_read`` over that time (TB/s, under ``rate_key``); or the error of a configuration that does not
    compile (registers, shared memory) or run."""
    try:
        got = run()[:n_check].float()
        entry["max_abs_err"] = float((got - want).abs().max())
        entry["ok"] = entry["max_abs_err"] < 3e-2
        entry["us"] = round(do_bench(run, warmup=5, rep=30) * 1e3, 2)
        entry[rate_key] = round(bytes_read / entry["us"] / 1e6, 3)
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return entry


def latent_case(num_seqs: int, seq_len: int, num_heads: int, device: str, block_size: int = 16,
                latent: int = 512, rope: int = 64):
    """A decode step of DeepSeek's absorbed MLA: ``num_heads`` queries a token over one cached latent vector a
    position, in a one-plane bf16 cache with scattered blocks."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    cache = torch.randn(1, num_blocks, block_size, 1, latent + rope, generator=g).to(torch.bfloat16).to(device)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = perm[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    qsl = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs, num_heads, latent + rope, generator=g).to(torch.bfloat16).to(device)
    return query, cache, tables, seq_lens, qsl, (128 + rope) ** -0.5


def mla_decode(dev: str, quick: bool, do_bench) -> dict:
    """The latent kernel's decode steps: production (fast mode: native dots; and deterministic mode's fp32 dots)
    against other heads a tile, key tiles, warps and stages (the split by the launch's rule), each checked against the
    reference on a few rows. ``latent_tb_per_s``: the latents' bytes (read once) over the time: the kernel's share of
    HBM bandwidth."""
    from pdcluster.kernels import reference
    from pdcluster.kernels import triton_mla_attention as mla

    latent = 512 if not quick else 32
    rope = 64 if not quick else 16
    cases = [(1, 4096, 128), (32, 2048, 128), (128, 1024, 128), (128, 1024, 16)] if not quick else [(2, 40, 16)]
    native = dev == "cuda"
    out: dict = {}
    for num_seqs, seq_len, heads in cases:
        query, cache, tables, seq_lens, qsl, scale = latent_case(num_seqs, seq_len, heads, dev, latent=latent, rope=rope)
        n_check = min(2, num_seqs)
        want = reference.latent_attention(query[:n_check].float(), cache.float(), tables[:n_check], seq_lens[:n_check],
                                          qsl[: n_check + 1], scale, latent)
        configs = [("production", {}), ("deterministic", {})] + [
            ("launch", dict(heads_block=hb, block_n=bn, num_warps=w, num_stages=st))
            for hb, bn, w, st in itertools.product((16, 32, 64), (32, 64), (4, 8), (1, 2))]
        if quick:
            configs = configs[:4]
        entries = []
        for kind, kw in configs:
            if kind == "production":
                def run():
                    return mla.mla_attention_triton(query, cache, tables, seq_lens, qsl, scale, latent,
                                                    batch_invariant=False)
            elif kind == "deterministic":
                def run():
                    return mla.mla_attention_triton(query, cache, tables, seq_lens, qsl, scale, latent)
            else:
                def run(kw=kw):
                    return mla.launch(query, cache, tables, seq_lens, qsl, scale, latent, native_dot=native, **kw)
            latent_bytes = num_seqs * seq_len * (latent + rope) * cache.element_size()
            entries.append(timed_decode({"kind": kind, **kw}, run, want, n_check, do_bench, latent_bytes,
                                        "latent_tb_per_s"))
            print(f"mla {num_seqs}x{seq_len}x{heads}h", entries[-1], file=sys.stderr, flush=True)
        ranked = sorted((e for e in entries if e.get("ok")), key=lambda e: e["us"])
        out[f"{num_seqs}x{seq_len}x{heads}h"] = {"configs": entries, "best": ranked[0] if ranked else None}
    return out


if __name__ == "__main__":
    sys.exit(main())
