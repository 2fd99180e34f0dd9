"""What sleep mode gives back and costs (engine/sleep.py): an RL trainer on the same machine trains in the memory the
engine held, between rollouts.

One engine on SmolLM2 (or --model) with a KV cache of --kv-gib: after a warm batch of requests, each round puts it to
sleep and wakes it (level 1; level 2 with the wake reading the weights again; level 2 with a weight update in verl's
order: wake the weights, update, wake the KV cache) and records the process's resident memory (VmRSS) awake and
asleep, the time of each call, and the first request's latency after the wake against one before. A fresh engine's
build time (what stopping and restarting it costs, before the process starts) is timed beside. The greedy tokens
after every wake are compared with those before. Prints JSON (and writes it with --out).

    python bench/sleep_mode.py [--model smollm2] [--dtype auto] [--kv-gib 2] [--rounds 3] [--out F.json]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_report import emit_json  # noqa: E402

PROMPT = list(range(100, 164))
NUM_TOKENS = 16


def rss_mib() -> float:
    """The process's resident memory, from its page tables (smaps_rollup: VmRSS's counters are approximate)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.perturbed import perturb_checkpoint
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.sampling_params import SamplingParams

    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_gib=args.kv_gib,
                          enable_prefix_caching=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    started = time.monotonic()
    engine = LLMEngine.from_config(config, progress=False)
    build_s = time.monotonic() - started

    def first_request_s() -> tuple[float, list[int]]:
        t0 = time.monotonic()
        out = engine.generate([PROMPT], params)[0]
        return time.monotonic() - t0, out.token_ids

    first_request_s()  # warm
    before_s, _ = first_request_s()
    start_mib = rss_mib()
    base_dir = resolve_model(args.model, progress=False)
    work = tempfile.TemporaryDirectory(prefix="pdc-sleep-")  # the perturbed checkpoint, removed at the end
    checkpoint = perturb_checkpoint(base_dir, Path(work.name) / "step", 1)
    rounds: dict[str, list[dict]] = {"level1": [], "level2_reload": [], "level2_update": []}
    for r in range(args.rounds):
        for kind in rounds:
            gc.collect()
            _, want = first_request_s()  # this round's weights (an update round changed them)
            awake_mib = rss_mib()
            t0 = time.monotonic()
            state = engine.sleep(level=1 if kind == "level1" else 2)
            sleep_s = time.monotonic() - t0
            asleep_mib = rss_mib()
            t0 = time.monotonic()
            if kind == "level2_update":  # verl's order; alternate the checkpoints so each update writes new weights
                engine.wake_up(["weights"])
                engine.update_weights_from_disk(str(checkpoint) if r % 2 == 0 else str(base_dir),
                                                f"step-{r}")
                engine.wake_up(["kv_cache"])
            else:
                engine.wake_up()
            wake_s = time.monotonic() - t0
            after_s, tokens = first_request_s()
            rounds[kind].append({"sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
                                 "asleep_rss_mib": round(asleep_mib), "released_mib": round(awake_mib - asleep_mib),
                                 "released_by_engine_mib": round(sum(state["released_bytes"].values()) / 2**20),
                                 "first_request_after_wake_s": round(after_s, 4),
                                 "tokens_as_before": tokens == want if kind != "level2_update" else None})
    summary = {kind: {key: statistics.median(x[key] for x in runs) for key in
                      ("sleep_s", "wake_s", "asleep_rss_mib", "released_mib", "released_by_engine_mib",
                       "first_request_after_wake_s")}
               | {"tokens_as_before": all(x["tokens_as_before"] is not False for x in runs)}
               for kind, runs in rounds.items()}
    result = {"model": args.model, "dtype": engine.dtype_name, "kv_cache_gib": args.kv_gib,
              "awake_rss_mib": round(start_mib), "first_request_awake_s": round(before_s, 4),
              "fresh_engine_build_s": round(build_s, 3), "median": summary, "rounds": rounds,
              "num_reloads": engine.sleep_state.num_reloads}
    work.cleanup()
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
