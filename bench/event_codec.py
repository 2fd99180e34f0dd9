"""The typed records' cost per message (wire/records.py): building, encoding and decoding the worker ->
router ``Tokens`` event (one per request that a step ends or gives logprobs) and a KV-transfer
``TransferRequest`` (a 2,048-token prompt, 128 block ids), best of --repeats runs of --n messages each,
in microseconds a message; and a decode step's events at batch 128 both ways: 128 ``Tokens`` (what the
worker sent before) against one ``StepTokens`` (what it sends now: the router expands its rows), in
milliseconds a step. Prints JSON.

    python bench/event_codec.py [--n 20000] [--repeats 5] [--out bench/results/event_codec.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def best_us(fn, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return round(best * 1e6, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import import_pdcluster
    from json_report import emit_json

    import_pdcluster()
    from pdcluster.kv_transfer import protocol
    from pdcluster.node.events import EVENT_CODEC, MAX_EVENT_BYTES, StepTokens, Tokens

    def tokens() -> Tokens:
        return Tokens(request_id="cmpl-5f0c1a2b3c4d4e5f8a9b0c1d2e3f4a5b-0", worker_id="decode-0-3c6414",
                      new_token_ids=[1234], num_computed_tokens=611, num_output_tokens=100)

    def transfer_request() -> protocol.TransferRequest:
        return protocol.TransferRequest(request_id="cmpl-5f0c1a2b3c4d4e5f8a9b0c1d2e3f4a5b-0",
                                        dst_block_ids=list(range(1000, 1128)), num_tokens=2048,
                                        deadline_unix_s=1.8e9, prompt_token_ids=list(range(2048)),
                                        sampling={"max_tokens": 64, "temperature": 0.0, "seed": 7})

    event, request = tokens(), transfer_request()
    event_bytes, request_bytes = EVENT_CODEC.encode(event), protocol.encode(request)
    assert EVENT_CODEC.decode(event_bytes, MAX_EVENT_BYTES) == event
    assert protocol.decode(request_bytes, 1 << 24) == request
    n, r = args.n, args.repeats
    result = {
        "tokens_event": {"bytes": len(event_bytes), "build_us": best_us(tokens, n, r),
                         "encode_us": best_us(lambda: EVENT_CODEC.encode(event), n, r),
                         "decode_us": best_us(lambda: EVENT_CODEC.decode(event_bytes, MAX_EVENT_BYTES), n, r)},
        "transfer_request": {"bytes": len(request_bytes), "build_us": best_us(transfer_request, n // 10, r),
                             "encode_us": best_us(lambda: protocol.encode(request), n // 10, r),
                             "decode_us": best_us(lambda: protocol.decode(request_bytes, 1 << 24), n // 10, r)},
    }
    e = result["tokens_event"]
    e["per_step_at_batch_128_ms"] = {"worker": round(128 * (e["build_us"] + e["encode_us"]) / 1e3, 3),
                                     "router": round(128 * e["decode_us"] / 1e3, 3)}
    batch = 128
    ids = [f"cmpl-5f0c1a2b3c4d4e5f8a9b0c1d2e3f{i:04x}-0" for i in range(batch)]

    def step_tokens() -> StepTokens:
        return StepTokens("decode-0-3c6414", list(ids), [1] * batch, list(range(1000, 1000 + batch)),
                          list(range(600, 600 + batch)), [100] * batch, [0] * batch, [0] * batch, [0] * batch,
                          [0] * batch)

    step = step_tokens()
    step_bytes = EVENT_CODEC.encode(step)
    assert EVENT_CODEC.decode(step_bytes, MAX_EVENT_BYTES).rows() == step.rows()
    steps = max(n // batch, 20)
    build, encode = best_us(step_tokens, steps, r), best_us(lambda: EVENT_CODEC.encode(step), steps, r)
    decode = best_us(lambda: EVENT_CODEC.decode(step_bytes, MAX_EVENT_BYTES).rows(), steps, r)
    result["step_at_batch_128_ms"] = {
        "per_request_tokens": e["per_step_at_batch_128_ms"],
        "step_tokens": {"bytes": len(step_bytes), "worker": round((build + encode) / 1e3, 3),
                        "router": round(decode / 1e3, 3), "router_includes": "decode and rows()"},
    }
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
