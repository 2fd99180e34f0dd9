"""The requests a simulation serves: when each arrives, its prompt tokens and its output tokens.

- ``random``: lengths drawn exactly as `pdcluster loadtest --dataset random` draws them for the same
  ``--seed`` (tools/loadtest/datasets.py: input lengths, then output lengths, from one generator),
  and the same arrival process (tools/loadtest/arrivals.py), so a plan and a load test of the same
  flags describe the same requests at the same times. No tokenizer needed.
- ``sharegpt``, ``humaneval`` or a JSONL file of prompts: the load tester's own loader counts the prompt
  tokens (the model's tokenizer), output tokens are each request's ``max_tokens`` (ignore_eos).
- a trace: JSONL, one ``{"arrival_s": 0.0, "input_len": 256, "output_len": 64}`` per request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdcluster.tools.loadtest.arrivals import ArrivalProcess
from pdcluster.tools.loadtest.datasets import DatasetOptions, load_requests
from pdcluster.tools.loadtest.lengths import LengthDist
from pdcluster.tools.loadtest.tokenizer_source import load_tokenizer


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    input_len: int
    output_len: int


def _check_count(num_prompts: int) -> None:
    if num_prompts < 1:
        raise WorkloadError(f"--num-prompts: must be at least 1, got {num_prompts}")


def arrival_times(num: int, rate: float, seed: int, arrival: str = "poisson", burst_size: int = 8) -> np.ndarray:
    try:
        return ArrivalProcess(arrival, rate, burst_size).send_times_s(num, seed)
    except ValueError as e:
        raise WorkloadError(str(e)) from None


def random_workload(num_prompts: int, rate: float, input_len: str, output_len: str, seed: int = 0,
                    arrival: str = "poisson", burst_size: int = 8) -> list[SimRequest]:
    _check_count(num_prompts)
    try:
        in_dist = LengthDist.parse(input_len, "--input-len")
        out_dist = LengthDist.parse(output_len, "--output-len")
    except ValueError as e:
        raise WorkloadError(str(e)) from None
    rng = np.random.default_rng(seed)  # the draw order of loadtest's random_requests
    ins = in_dist.sample(rng, num_prompts).tolist()
    outs = out_dist.sample(rng, num_prompts).tolist()
    times = arrival_times(num_prompts, rate, seed, arrival, burst_size).tolist()
    return [SimRequest(i, t, int(a), int(b)) for i, (t, a, b) in enumerate(zip(times, ins, outs))]


def dataset_workload(dataset: str, num_prompts: int, rate: float, model: str, seed: int = 0,
                     output_len: int | None = None, arrival: str = "poisson", burst_size: int = 8) -> list[SimRequest]:
    """A named dataset or a JSONL file of prompts, tokenized as the load tester counts them."""
    _check_count(num_prompts)
    tokenizer = load_tokenizer(None, model)
    if tokenizer is None:
        raise WorkloadError(f"--dataset {dataset}: needs the tokenizer of the profiled model {model!r}")
    options = DatasetOptions(num_prompts=num_prompts, seed=seed, fixed_output_len=output_len)
    requests = load_requests(dataset, options, tokenizer)
    times = arrival_times(len(requests), rate, seed, arrival, burst_size).tolist()
    return [SimRequest(i, t, max(1, r.prompt_len), max(1, r.output_len))
            for i, (t, r) in enumerate(zip(times, requests))]


def trace_workload(path: str | Path) -> list[SimRequest]:
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"--trace: {p} does not exist")
    out = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            req = SimRequest(len(out), float(d["arrival_s"]), int(d["input_len"]), int(d["output_len"]))
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"--trace: {p}:{lineno}: want {{\"arrival_s\": s, \"input_len\": n, "
                                f"\"output_len\": n}}, got {line[:80]!r} ({type(e).__name__}: {e})") from None
        if not math.isfinite(req.arrival_s) or req.arrival_s < 0 or req.input_len < 1 or req.output_len < 1:
            raise WorkloadError(f"--trace: {p}:{lineno}: arrival_s must be >= 0 and lengths >= 1, got {line[:80]!r}")
        out.append(req)
    if not out:
        raise WorkloadError(f"--trace: {p} has no requests")
    out.sort(key=lambda r: r.arrival_s)
    return [SimRequest(i, r.arrival_s, r.input_len, r.output_len) for i, r in enumerate(out)]


def write_trace(requests: list[SimRequest], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps({"arrival_s": r.arrival_s, "input_len": r.input_len,
                                              "output_len": r.output_len}) + "\n" for r in requests))
