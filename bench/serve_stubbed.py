"""`pdcluster serve` with every engine's model stubbed: its forward returns zeros and its LM head a one-hot row
per sampled position over the first VOCAB_USED ids, so each step costs the host's own work and the requests still
get varied, ordinary tokens to detokenize and stream. On a GPU a decode step is ~1-2 ms and the serving path (HTTP,
SSE, router, detokenizing) is what bounds the served throughput; on a CPU the real model's steps hide that path, so
bench/serve_cpu.py ``--stub-model`` serves through this entry point to measure it. Ray's worker processes
(colocated, disagg) stub theirs through bench/stub_site/sitecustomize.py, from the environment they inherit.

    python bench/serve_stubbed.py serve --mode local --model tiny-random ...   (any `pdcluster serve` flags)
"""

from __future__ import annotations

import itertools
import sys

VOCAB_USED = 512  # the stub's logits columns: ids 0 .. 511 (the sampler takes the argmax; the head is not read)
FIRST_ID = 100  # below it SmolLM2's tokenizer keeps its special tokens
NUM_VARIANTS = 16  # the stub's logits cycle through these (a request's tokens vary step to step)


def _stub(engine) -> None:
    import torch

    model = engine.runner.model
    hidden_size = model.embed_tokens.shape[1]
    # One thread: on a GPU the head and the argmax run there, not in OpenMP threads that spin against the HTTP
    # server's for this machine's cores.
    torch.set_num_threads(1)
    steps = itertools.count()
    logits_by_rows: dict[int, list] = {}  # rows -> NUM_VARIANTS one-hot logits (made once: the stub costs ~nothing)

    def forward(input_ids, *args, **kwargs):
        return torch.zeros(input_ids.shape[0], hidden_size, dtype=model.embed_tokens.dtype)

    def compute_logits(hidden):
        rows = hidden.shape[0]
        variants = logits_by_rows.get(rows)
        if variants is None:
            variants = logits_by_rows[rows] = []
            for v in range(NUM_VARIANTS):
                ids = FIRST_ID + (v * 7 + torch.arange(rows) * 13) % (VOCAB_USED - FIRST_ID)
                logits = torch.zeros(rows, VOCAB_USED)
                logits[torch.arange(rows), ids] = 1.0
                variants.append(logits)
        return variants[next(steps) % NUM_VARIANTS]

    model.forward = forward
    model.compute_logits = compute_logits


def stub_engines(engine_cls) -> None:
    """Every ``engine_cls`` built from now on has its model stubbed once its warm-up (the real model) ran."""
    original_init = engine_cls.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _stub(self)

    engine_cls.__init__ = init


def main(argv: list[str]) -> int:
    import os

    from pdcluster.cli.main import main as pdcluster_main
    from pdcluster.engine.llm_engine import LLMEngine

    stub_engines(LLMEngine)  # this process's (local mode)
    # Ray's worker processes (colocated, disagg): bench/stub_site/sitecustomize.py stubs theirs as they import
    # the engine, from the environment they inherit.
    bench = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(bench, "stub_site"), bench, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["PDCLUSTER_BENCH_STUB_MODEL"] = "1"
    return pdcluster_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
