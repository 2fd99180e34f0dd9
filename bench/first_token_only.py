"""Requests their first token ends (max_tokens 1: scoring, classification, a served beam search's steps) on a
real prefill / decode pair over tcp on this host: asked of the prefill worker for the first token alone (no
block reserved on the decode side, no KV moved) against the full transfer every request made before
(``DecodeWorker.ask_first_token_only`` off), in turns A B A B on the same pair of workers, fresh prompts each
round (prefix caching off). Prints JSON: per mode the wall time of the burst, requests/s, the median and p90
latency from submit to the answer, and the KV bytes the prefill worker sent.

    python bench/first_token_only.py [--model smollm2] [--num-requests 32] [--prompt-len 512] [--rounds 2] [--out F]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)


class _Answers:
    """The decode worker's events: when each request got its final token."""

    def __init__(self):
        self.done: dict[str, float] = {}
        self.failed: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, event):
        from pdcluster.node.events import ADMITTED, Admission, Failed, Tokens, expand

        for e in expand(event):
            with self.lock:
                if isinstance(e, Tokens) and e.finished:
                    self.done[e.request_id] = time.monotonic()
                elif isinstance(e, Failed):
                    self.failed.append(f"{e.request_id}: {e.reason}")
                elif isinstance(e, Admission) and e.verdict != ADMITTED:  # no router here to place it again
                    self.failed.append(f"{e.request_id}: admission {e.verdict} {e.reason}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.prefill_node.worker import PrefillWorker

    # A pool that holds the whole burst on the decode side (the full transfers reserve every prompt's blocks there).
    cfg = EngineConfig(model=args.model, max_model_len=args.prompt_len + 64, enable_prefix_caching=False,
                       kv_cache_memory_gib=args.kv_cache_memory_gib)
    tc = TransferConfig(transport="tcp")
    p, d = PrefillWorker("p0", cfg, tc), DecodeWorker("d0", cfg, tc)
    answers = _Answers()
    d.on_event = answers
    rng = random.Random(0)
    results: dict[str, list[dict]] = {"first_token_only": [], "full_transfer": []}
    try:
        assert d.connect_prefill(p.address) == "p0"
        time.sleep(0.5)
        for rnd in range(args.rounds):
            for mode in ("first_token_only", "full_transfer"):
                d.ask_first_token_only = mode == "first_token_only"
                bytes_before = p.stats()["bytes_sent"]
                prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
                ids = [f"{mode}-{rnd}-{i}" for i in range(args.num_requests)]
                t0 = time.monotonic()
                for rid, prompt in zip(ids, prompts):
                    d.submit(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), "p0")
                deadline = t0 + 600
                while time.monotonic() < deadline:
                    with answers.lock:
                        if all(r in answers.done for r in ids) or answers.failed:
                            break
                    time.sleep(0.005)
                if answers.failed:
                    raise RuntimeError(f"failed: {answers.failed[:3]}")
                wall_s = max(answers.done[r] for r in ids) - t0
                latencies = sorted(answers.done[r] - t0 for r in ids)
                time.sleep(0.5)  # the last acks and frees settle before the next burst
                results[mode].append({
                    "wall_s": round(wall_s, 3), "requests_per_s": round(len(ids) / wall_s, 2),
                    "median_latency_s": round(statistics.median(latencies), 3),
                    "p90_latency_s": round(latencies[int(0.9 * (len(latencies) - 1))], 3),
                    "kv_bytes_sent": p.stats()["bytes_sent"] - bytes_before})
    finally:
        p.close()
        d.close()
    summary = {mode: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
               for mode, runs in results.items()}
    emit_json({"model": args.model, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
               "transport": "tcp", "rounds": results, "median": summary,
               "wall_ratio_full_over_first_only": round(summary["full_transfer"]["wall_s"]
                                                        / summary["first_token_only"]["wall_s"], 3)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
