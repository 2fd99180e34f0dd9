"""An engine whose only work in flight is a KV load (a host-tier hit, another instance's pull) waits for it
(LLMEngine.step, ``wait_done``) instead of running empty steps. A/B on one engine, turns A B A B: the time to the
first token of a prompt whose blocks come back from the host tier, with the wait (A) and without it (B: the wait
patched out, the engine spinning empty steps while the loader thread runs, as before). Prints JSON.

    python bench/offload_load_wait.py [--model smollm2] [--prompt-len 2048] [--rounds 4] [--out F]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.kv_offload.manager import OffloadManager
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    block = 16
    num_blocks = args.prompt_len // block + 16  # one prompt fits; the next one evicts it to the host tier
    engine = LLMEngine.from_config(EngineConfig(model=args.model, dtype="auto", num_kv_blocks=num_blocks,
                                                max_model_len=args.prompt_len + 64, kv_offload_host_gib=1.0))
    rng = random.Random(0)
    vocab = engine.arch.vocab_size
    wait_done = OffloadManager.wait_done
    times: dict[str, list[float]] = {"wait": [], "spin": []}
    loaded_tokens = []
    for _ in range(args.rounds):
        for mode in ("wait", "spin"):
            OffloadManager.wait_done = wait_done if mode == "wait" else (lambda self, timeout_s: None)
            prompt = [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)]
            other = [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)]
            first = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
            engine.generate([other], SamplingParams(max_tokens=1))  # evicts the prompt's blocks to the host tier
            t0 = time.perf_counter()
            again = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
            times[mode].append(time.perf_counter() - t0)
            loaded_tokens.append(again.num_offloaded_tokens)
            assert again.token_ids == first.token_ids
    OffloadManager.wait_done = wait_done
    med = {k: statistics.median(v) for k, v in times.items()}
    emit_json({"model": args.model, "dtype": engine.dtype_name, "prompt_tokens": args.prompt_len,
               "rounds": args.rounds, "tokens_loaded_from_host_tier": min(loaded_tokens),
               "ttft_wait_s": round(med["wait"], 4), "ttft_spin_s": round(med["spin"], 4),
               "speedup": round(med["spin"] / med["wait"], 2), "ttft_wait_all_s": [round(t, 4) for t in times["wait"]],
               "ttft_spin_all_s": [round(t, 4) for t in times["spin"]]}, args.out)


if __name__ == "__main__":
    main()
