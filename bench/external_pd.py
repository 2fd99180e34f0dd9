"""vLLM's external prefill/decode split (serve --kv-transfer-config) at the engine: what a decode instance's first
token costs when it pulls the prompt's KV from the prefill instance that computed it, against computing the prompt
itself. Two engines in this process (the prefill instance's export server answers on 127.0.0.1 over zmq, as between
two hosts), the real model in its default dtype, fresh prompts each round (no prefix hit on either side but the
pulled one), turns A B A B. Prints JSON: per prompt length, the decode instance's time to its first token computing
the prompt (A) and pulling it (B, the pull and the last partial block), the bytes pulled and the pull's rate, and
that both answers were equal.

    python bench/external_pd.py [--model smollm2] [--prompt-lens 512 2048] [--rounds 3] [--out F]
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.loaded_model import LoadedModel
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.node.external_kv import make_external_connector

    kv_config = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    max_len = max(args.prompt_lens) + 64

    def instance(name: str):
        loaded = LoadedModel.load(EngineConfig(model=args.model, dtype="auto", max_model_len=max_len,
                                               kv_transfer_config=kv_config), progress=False)
        connector = make_external_connector(loaded, name)
        return LLMEngine(loaded, connector), connector

    (prefill, p_conn), (decode, d_conn) = instance("prefill"), instance("decode")
    rng = random.Random(0)
    vocab = decode.arch.vocab_size
    rows = []
    for length in args.prompt_lens:
        whole_s, pulled_s, equal = [], [], True
        bytes_before, pulls_before = d_conn.pull_stats.num_bytes, d_conn.pull_stats.num_pulls
        for _ in range(args.rounds):
            for mode in ("whole", "pulled"):
                prompt = [rng.randrange(100, vocab - 100) for _ in range(length)]
                params = SamplingParams(max_tokens=1)
                if mode == "pulled":
                    kv = prefill.generate([prompt], SamplingParams(
                        max_tokens=1, kv_transfer_params={"do_remote_decode": True}))[0].kv_transfer_params
                    params = SamplingParams(max_tokens=1, kv_transfer_params=kv)
                t0 = time.perf_counter()
                out = decode.generate([prompt], params)[0]
                (whole_s if mode == "whole" else pulled_s).append(time.perf_counter() - t0)
                if mode == "pulled":
                    reference = decode.generate([prompt], SamplingParams(max_tokens=1, cache_salt="whole"))[0]
                    equal &= reference.token_ids == out.token_ids
                    prefill.poll_kv()
        pulled_bytes = d_conn.pull_stats.num_bytes - bytes_before
        med_whole, med_pulled = statistics.median(whole_s), statistics.median(pulled_s)
        rows.append({"prompt_tokens": length, "ttft_compute_prompt_s": round(med_whole, 4),
                     "ttft_pulled_s": round(med_pulled, 4), "speedup": round(med_whole / med_pulled, 2),
                     "kv_bytes_per_request": pulled_bytes // max(1, d_conn.pull_stats.num_pulls - pulls_before),
                     "pull_rate_gb_s_upper_bound": round(pulled_bytes / max(1e-9, sum(pulled_s)) / 1e9, 3),
                     "answers_equal": equal})
    p_conn.close()
    d_conn.close()
    emit_json({"model": args.model, "dtype": decode.dtype_name, "threads": torch.get_num_threads(),
               "rounds": args.rounds, "rows": rows,
               "note": "ttft_pulled_s includes the pull over zmq on 127.0.0.1 and the prompt's last partial block; "
                       "the prefill instance's own compute is not in it (the proxy's first leg)"}, args.out)


if __name__ == "__main__":
    main()
