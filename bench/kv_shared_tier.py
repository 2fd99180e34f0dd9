"""The shared KV tier (engine/kv_offload/shared_tier.py): what writing every cached block through costs the worker
that computes a prompt, and what a second worker gains by loading it from the folder instead of computing it.

    python bench/kv_shared_tier.py [--model smollm2] [--prompt-len 2000] [--num-prompts 4] [--threads 1]
                                   [--repeats 3] [--out bench/results/kv_shared_tier.json]

Per repeat, in one process: a fresh engine without the tier and one with it (a new folder) each prefill the same
prompts one at a time (max_tokens 1: time to first token); then a third engine on that folder, which never computed
them, serves them again (its prompt tokens come from the folder). Each figure is the median over repeats; the ratios
are taken pair by pair (the same repeat).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_report import emit_json  # noqa: E402


def _engine(model: str, dtype: str, threads: int, blocks: int, folder: str | None):
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    shared = {"kv_offload_shared_dir": folder, "kv_offload_shared_gib": 4.0} if folder else {}
    return LLMEngine.from_config(EngineConfig(model=model, dtype=dtype, num_threads=threads, num_kv_blocks=blocks,
                                              **shared), progress=False)


def _ttfts(engine, prompts) -> tuple[list[float], list[list[int]], list[int]]:
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    seconds, tokens, offloaded = [], [], []
    for prompt in prompts:
        started = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        seconds.append(time.perf_counter() - started)
        tokens.append(list(out.token_ids))
        offloaded.append(out.num_offloaded_tokens)
    return seconds, tokens, offloaded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--folder-root", default=None, help="where the shared folders go (default: the temp directory)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    blocks = args.num_prompts * (args.prompt_len // 16 + 2) + 16  # every prompt fits: no eviction in the way
    rows = []
    for repeat in range(args.repeats):
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        folder = tempfile.mkdtemp(prefix="pdcluster-shared-", dir=args.folder_root)
        try:
            plain = _engine(args.model, args.dtype, args.threads, blocks, None)
            plain_s, plain_tokens, _ = _ttfts(plain, prompts)
            del plain
            writer = _engine(args.model, args.dtype, args.threads, blocks, folder)
            writer_s, writer_tokens, _ = _ttfts(writer, prompts)
            writer.offload.tiers.shared.flush(120)
            writer.offload.close()
            del writer
            reader = _engine(args.model, args.dtype, args.threads, blocks, folder)
            reader_s, reader_tokens, offloaded = _ttfts(reader, prompts)
            reader.offload.close()
            del reader
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rows.append({"plain_s": sum(plain_s), "write_through_s": sum(writer_s), "from_folder_s": sum(reader_s),
                     "tokens_equal": plain_tokens == writer_tokens == reader_tokens,
                     "offloaded_tokens": sum(offloaded)})
        print(f"repeat {repeat}: {rows[-1]}", file=sys.stderr, flush=True)

    def median(key):
        return statistics.median(r[key] for r in rows)

    result = {
        "bench": "kv_shared_tier", "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "prompt_len": args.prompt_len, "num_prompts": args.num_prompts, "repeats": args.repeats,
        "ttft_sum_s": {"no_tier": median("plain_s"), "write_through": median("write_through_s"),
                       "second_worker_from_folder": median("from_folder_s")},
        "write_through_cost_ratio": statistics.median(r["write_through_s"] / r["plain_s"] for r in rows),
        "second_worker_speedup": statistics.median(r["plain_s"] / r["from_folder_s"] for r in rows),
        "tokens_equal_every_repeat": all(r["tokens_equal"] for r in rows),
        "offloaded_tokens_per_repeat": rows[0]["offloaded_tokens"],
        "repeats_detail": rows,
    }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
