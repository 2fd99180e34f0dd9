"""Torch calls per CUDA-graph decode step outside the graph: the host work a GPU waits on, counted on a CPU.

On a GPU a graph-replayed decode step of a 1.1B model is ~1 ms of kernels; what the host does around the replay
(input staging, the copies into the graph's static buffers, the LM head and sampling, the copy of the sampled ids)
is a few hundred torch calls' worth of Python and launches, and on the H200 of s51 batch 1 was host-bound (1.35 ms
a step launched ahead, against 1.05 ms for one synchronised step). Each torch call costs host time there (a view
~2-5 us, a launch ~5-15 us), so their count per step is a proxy for that overhead which this CPU can measure:
this script runs tiny-random with emulated graphs (engine/cuda_graphs.py: the same static-buffer path, the
captured forward called instead of replayed) and inputs staged through the arenas as on a GPU, and counts every
aten call per step made outside the graph's forward. Views (slices, dtype views, ...) launch nothing on a GPU
and are counted apart. A mixed step (decode rows beside a new prompt) is counted eager and through the piecewise
graphs (``count_mixed``): tiny-random has few layers, so look at the calls a layer adds.

    python bench/graph_step_calls.py [--batches 1,32] [--steps 20] [--out F.json]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIEW_OPS = ("view", "slice", "lift_fresh", "detach", "resolve_", "reshape", "alias", "as_strided", "_unsafe_view",
            "unsqueeze", "squeeze", "select", "expand", "t.default")


def count(batch: int, async_scheduling: bool, steps: int) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.engine.step_inputs import StepInputs

    engine = LLMEngine.from_config(EngineConfig(
        model=str(resolve_model("tiny-random", progress=False)), device="cpu", dtype="float32",
        max_num_seqs=max(batch, 4), max_model_len=512, enable_prefix_caching=False,
        async_scheduling=async_scheduling), progress=False)
    engine.runner.inputs = StepInputs("cpu", staged=True)  # the arenas and their copies, as on a GPU
    engine.runner.use_decode_graphs(emulate=True)
    graphs = engine.runner.graphs
    in_graph = [False]
    call = graphs._call

    def counted_call(bucket):
        in_graph[0] = True
        try:
            return call(bucket)
        finally:
            in_graph[0] = False

    graphs._call = counted_call
    calls: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not in_graph[0]:
                calls[str(func)] += 1
            return func(*args, **(kwargs or {}))

    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([5 + (i * 7 + j) % 200 for j in range(40)], params)
    for _ in range(10):  # prefill done, the buckets captured
        engine.step()
    replays = graphs.num_replays
    with Count():
        for _ in range(steps):
            engine.step()
    if graphs.num_replays - replays != steps:
        raise RuntimeError(f"{graphs.num_replays - replays} of {steps} steps replayed: not all decode steps")
    total = sum(calls.values())
    views = sum(v for k, v in calls.items() if any(m in k for m in VIEW_OPS))
    return {"calls_per_step": round(total / steps, 1), "non_view_calls_per_step": round((total - views) / steps, 1),
            "top": {k: round(v / steps, 1) for k, v in calls.most_common(12)}}


def count_mixed(pieces: bool, steps: int, num_decoding: int = 8, prompt_len: int = 56) -> dict:
    """Torch calls of a mixed step (``num_decoding`` rows decoding beside a new ``prompt_len``-token prompt), eager
    or through the piecewise graphs (engine/piecewise_graphs.py, emulated): with pieces, the calls inside them are
    not counted, except each layer's eager attention (``attend_now``) and what a real replay adds around it
    (AttentionCall.run: three query/key/value slices, the output's slice and its copy: 5 calls)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pdcluster.engine import piecewise_graphs
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.engine.step_inputs import StepInputs

    engine = LLMEngine.from_config(EngineConfig(
        model=str(resolve_model("tiny-random", progress=False)), device="cpu", dtype="float32", max_num_seqs=16,
        max_model_len=512, enable_prefix_caching=False, async_scheduling=False), progress=False)
    engine.runner.inputs = StepInputs("cpu", staged=True)
    engine.runner.use_decode_graphs(emulate=True)
    in_piece, counting, per_call = [False], [False], 5
    calls: collections.Counter = collections.Counter()
    if pieces:
        engine.runner.use_mixed_graphs(512, emulate=True)
        graphs = engine.runner.mixed_graphs
        call, attend_now = graphs._call, piecewise_graphs.attend_now

        def counted_call(bucket, recorder):
            in_piece[0] = True
            try:
                return call(bucket, recorder)
            finally:
                in_piece[0] = False

        def counted_attend(*args, **kwargs):
            in_piece[0] = False
            if counting[0]:
                calls["(AttentionCall.run's slices and output copy)"] += per_call
            try:
                return attend_now(*args, **kwargs)
            finally:
                in_piece[0] = True

        graphs._call = counted_call
        piecewise_graphs.attend_now = counted_attend

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not in_piece[0]:
                calls[str(func)] += 1
            return func(*args, **(kwargs or {}))

    params = SamplingParams(max_tokens=4 * steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(num_decoding):
        engine.add_request([5 + (i * 7 + j) % 200 for j in range(40)], params)
    for _ in range(10):
        engine.step()
    for r in range(2):  # the bucket captured
        engine.add_request([9 + (r * 5 + j) % 200 for j in range(prompt_len)], SamplingParams(max_tokens=1))
        engine.step()
    counting[0] = True
    try:
        with Count():
            for r in range(steps):
                engine.add_request([7 + (r * 11 + j) % 200 for j in range(prompt_len)], SamplingParams(max_tokens=1))
                engine.step()
    finally:
        counting[0] = False
        if pieces:
            piecewise_graphs.attend_now = attend_now
    total = sum(calls.values())
    views = sum(v for k, v in calls.items() if any(m in k for m in VIEW_OPS))
    return {"num_tokens": num_decoding + prompt_len, "num_layers": len(engine.runner.model.layers),
            "calls_per_step": round(total / steps, 1),
            "non_view_calls_per_step": round((total - views) / steps, 1),
            "top": {k: round(v / steps, 1) for k, v in calls.most_common(8)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from json_report import emit_json

    result = {f"{mode}_b{b}": count(b, mode == "async", args.steps)
              for b in (int(x) for x in args.batches.split(",")) for mode in ("sync", "async")}
    result["mixed_eager"] = count_mixed(False, args.steps)
    result["mixed_piecewise"] = count_mixed(True, args.steps)
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
