"""Which kernel runs a decode step's few-row matmul (1 to 128 rows) on CUDA: cuBLAS, or the weight-streaming Triton kernel
(kernels/triton_skinny_gemm.py) with one of its tile configurations, chosen by timing both on the GPU at hand.

A matmul of a few rows is bound by reading its weight; cuBLAS tiles some of a 1B model's shapes too coarsely
to keep an H200's SMs busy there (the kernel's module doc has the profile). Whether the Triton kernel does better
depends on the GPU, the shape and the number of rows, so nothing is assumed: the first time a (weight shape,
dtype, rows, fused SiLU-and-mul) is met outside a CUDA-graph capture (a decode bucket's warm-up runs before its
capture: engine/cuda_graphs.py), each candidate and cuBLAS are timed the way a decode step runs them:

- inside a CUDA graph (launches back to back, no Python between them, as in a replayed step);
- round-robin over every weight of that shape the process holds (the model's layers; copies added up to twice
  the L2), so each read comes from memory as it does in a step, not from the L2 a repeated read would hit;
- after checking the candidate's result against F.linear on the GPU (a kernel that miscompiles is never used).

Only calls inside a CUDA graph take the kernel (kernels/graph_region.py: a decode bucket's warm-up, capture and, on a
CPU, emulated replay); eager calls stay on cuBLAS, whose launch costs the host less.
A candidate is taken only when it is at least MARGIN faster than cuBLAS; the choice is kept for the process
(``choices()`` lists them: bench/gpu_check.py reports them). Off: EngineConfig.skinny_gemm=False
(``--no-skinny-gemm``), deterministic mode (its batch-invariant matmul is the only path there), float32 weights,
CPUs. The search spends at most TUNING_BUDGET_S seconds a process; shapes met after that keep cuBLAS.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import asdict

import torch
import torch.nn.functional as F

from pdcluster.kernels import ops

log = logging.getLogger(__name__)

MAX_ROWS = 128  # kernels/triton_skinny_gemm.MAX_ROWS (not imported: triton loads only where CUDA is)
FMA_MAX_ROWS = 4  # kernels/triton_skinny_gemm.FMA_MAX_ROWS
MARGIN = 0.95  # a candidate must take at most this fraction of cuBLAS's time
TUNING_BUDGET_S = 45.0
_DTYPES = (torch.bfloat16, torch.float16)

_enabled = True
_epilogues = True
_spent_s = 0.0
# (device index, dtype, N, K) -> weak references to the weights of that shape (the timing's round robin).
_weights: dict[tuple, list[weakref.ref]] = {}
# (device index, dtype, N, K, rows, silu_and_mul) -> the chosen tiles (None: cuBLAS).
_chosen: dict[tuple, object] = {}
_records: list[dict] = []



def set_enabled(enabled: bool) -> None:
    """The engine's EngineConfig.skinny_gemm (process-wide: the engine being built decides)."""
    global _enabled
    _enabled = bool(enabled)


def set_epilogues(enabled: bool) -> None:
    """The engine's EngineConfig.skinny_epilogues (process-wide, as set_enabled)."""
    global _epilogues
    _epilogues = bool(enabled)


def epilogues() -> bool:
    """Whether a chosen kernel may run what follows its matmul (kernels/triton_skinny_epilogues.py)."""
    return _epilogues


def takes(weight: torch.Tensor) -> bool:
    """Whether a weight may use the kernel at all (a CUDA 16-bit matrix with unit stride along K)."""
    return weight.is_cuda and weight.dtype in _DTYPES and weight.dim() == 2 and weight.stride(1) == 1 \
        and ops.triton_available()


def register(weight: torch.Tensor) -> None:
    """Note a weight the kernel may run over (engine/linear.Linear does for every CUDA 16-bit weight)."""
    key = _shape_key(weight)
    refs = _weights.setdefault(key, [])
    refs[:] = [r for r in refs if r() is not None]
    refs.append(weakref.ref(weight))


def _shape_key(weight: torch.Tensor) -> tuple:
    return (weight.device.index, weight.dtype, weight.shape[0], weight.shape[1])


def choose(weight: torch.Tensor, rows: int, silu_and_mul: bool, gated: bool = False):
    """The tiles to run ``rows`` rows over ``weight`` with (None: cuBLAS), measured once per key (module doc).
    ``silu_and_mul``: the input is the gate/up output, activated as it is read (the down projection); ``gated``: the
    weight is the gate/up projection's and the output is activated in the matmul's epilogue (None: cuBLAS and the
    SiLU-and-mul kernel)."""
    if not _enabled or rows > MAX_ROWS:
        return None
    rows = measured_rows(rows)
    key = _shape_key(weight) + (rows, silu_and_mul, gated)
    if key in _chosen:
        return _chosen[key]
    if capturing(weight) or _spent_s > TUNING_BUDGET_S:
        return None  # not now: a capture cannot time (the bucket's warm-up before it did, or will)
    _chosen[key] = _tune(weight, rows, silu_and_mul, gated=gated)
    return _chosen[key]


def measured_rows(rows: int) -> int:
    """The row count a choice for ``rows`` rows is measured at: exact for the elementwise kernel's few, else the
    power of two the dot kernel pads them to (a decode bucket of 48 rows takes the choice measured at 64), so a
    process measures each shape at most at 1, 2, 3, 4, 8, 16, 32, 64 and 128 rows."""
    return rows if rows <= FMA_MAX_ROWS else 1 << (rows - 1).bit_length()


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream (never for a CPU tensor)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def choices() -> list[dict]:
    """What was measured and chosen so far in this process (for reports)."""
    return list(_records)


def reset() -> None:
    """Forget every choice (tests)."""
    global _spent_s
    _chosen.clear()
    _records.clear()
    _spent_s = 0.0


def _tune(weight: torch.Tensor, rows: int, silu_and_mul: bool, timer=None, gated: bool = False):
    """Time cuBLAS and every candidate (``timer(fn, weights)`` -> microseconds a call; the CUDA-graph timing by
    default), record the measurement, and return the fastest candidate at least MARGIN faster than cuBLAS
    (None: cuBLAS). A candidate that raises or disagrees with cuBLAS is skipped. ``gated``: cuBLAS's time includes
    the SiLU-and-mul kernel after it, which the candidates compute in their epilogue."""
    global _spent_s
    from pdcluster.kernels import triton_skinny_gemm as sk

    timer = timer or _graph_time_us
    t0 = time.perf_counter()
    n, k = weight.shape
    record = {"n": n, "k": k, "rows": rows, "silu_and_mul": silu_and_mul, "gated": gated,
              "dtype": str(weight.dtype).split(".")[-1]}
    best = None
    try:
        weights = _cold_set(weight)
        gen = torch.Generator(device=weight.device).manual_seed(0)
        a = torch.randn(rows, 2 * k if silu_and_mul else k, device=weight.device, generator=gen).to(weight.dtype)

        def cublas(w: torch.Tensor) -> torch.Tensor:
            out = F.linear(ops.silu_and_mul(a) if silu_and_mul else a, w)
            return ops.silu_and_mul(out) if gated else out

        reference = cublas(weight).float()
        best_us = base_us = timer(cublas, weights)
        record["cublas_us"] = round(base_us, 2)
        timed = []
        for tiles in (t for t in sk.CANDIDATE_TILES if t.takes(rows, gated)):
            def run(w: torch.Tensor, tiles=tiles) -> torch.Tensor:
                return sk.skinny_gemm(a, w, tiles, silu_and_mul=silu_and_mul, gated=gated)

            entry = asdict(tiles)
            timed.append(entry)
            try:
                if not _agrees(run(weight).float(), reference):
                    log.warning("skinny GEMM tiles %s disagree with cuBLAS on [%d, %d] x %d rows: not used", tiles,
                                n, k, rows)
                    entry["wrong"] = True
                    continue
                us = timer(run, weights)
            except Exception as e:  # noqa: BLE001 - e.g. a configuration this GPU cannot compile: skip it
                entry["error"] = f"{type(e).__name__}: {e}"
                continue
            entry["us"] = round(us, 2)
            if us < (base_us * MARGIN if best is None else best_us):
                best, best_us = tiles, us
        record.update(candidates=timed, chosen=None if best is None else asdict(best), chosen_us=round(best_us, 2))
    except Exception as e:  # noqa: BLE001 - a failed measurement leaves cuBLAS, the path that always works
        log.warning("skinny GEMM tuning failed on [%d, %d] x %d rows (%s: %s): cuBLAS", n, k, rows, type(e).__name__, e)
        record["error"], best = f"{type(e).__name__}: {e}", None
    record["seconds"] = round(time.perf_counter() - t0, 3)
    _spent_s += record["seconds"]
    _records.append(record)
    if best is not None:
        log.info("skinny GEMM for [%d, %d] x %d rows%s: %s, %.1f us against cuBLAS's %.1f us", n, k, rows,
                 " (SiLU-and-mul fused)" if silu_and_mul else "", best, record["chosen_us"], record["cublas_us"])
    return best


def _cold_set(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weights a timing reads in turn: every held weight of ``weight``'s shape (the model's layers), and on a
    GPU temporary copies until together they are twice its L2 (a 4-layer model's 8 MB matrices would otherwise be
    read from L2, which no step of a real model does); fewer where memory is short."""
    weights = [w for w in (r() for r in _weights.get(_shape_key(weight), [])) if w is not None] or [weight]
    if not weight.is_cuda:
        return weights
    want_bytes = 2 * torch.cuda.get_device_properties(weight.device).L2_cache_size
    nbytes = weight.numel() * weight.element_size()
    copies = []
    while (len(weights) + len(copies)) * nbytes < want_bytes and len(copies) < 64:
        try:
            copies.append(torch.empty_like(weight).copy_(weight))
        except torch.cuda.OutOfMemoryError:
            break
    return weights + copies


def _agrees(out: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal to cuBLAS's result up to 16-bit rounding of sums taken in another order."""
    return bool(((out - reference).abs() <= reference.abs() * 2 ** -6 + 1e-2).all())


def _graph_time_us(fn, weights: list[torch.Tensor], replays: int = 3) -> float:
    """Microseconds per call of ``fn(w)``, captured in one CUDA graph over ``weights`` in turn (at least 16
    calls), replayed ``replays`` times after a warm replay."""
    device = weights[0].device
    calls = max(16, len(weights))
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # compile and warm outside the capture
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end)
    del graph
    return ms * 1e3 / (replays * calls)
