"""The garbage collector and a serving process's start-up objects.

CPython's cyclic collector walks every container object of the generation it collects, and a full
collection walks them all: a process that loaded a model (its modules, the tokenizer, Ray's and FastAPI's
state: hundreds of thousands of objects) pays for walking them whenever the garbage a step makes (per
request: lists of token ids, outputs, scheduled rows) triggers one. Measured with the model stubbed at batch
128 (bench/host_overhead.py), those collections were ~10% of a decode step's host time, paid as pauses of a
few milliseconds in whichever step they fall. ``gc.freeze()`` moves everything alive at the call out of the
collector's sight for good (vLLM's engine core does the same after start-up).

Only for a process that holds one engine for its whole life (a worker actor, ``pdcluster generate``, the HTTP
server): objects frozen are never collected as garbage, so a reference cycle among them that is dropped later
leaks. A process that builds engines one after another (the tests, bench/gpu_check.py's modes) uses
:func:`frozen` around each, which gives them back to the collector after.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


def freeze_startup_objects() -> None:
    """Collect what is garbage now, then freeze everything left (module doc)."""
    gc.collect()
    gc.freeze()


@contextmanager
def frozen():
    """Everything alive on entry frozen while the block runs, then given back to the collector (and collected)."""
    freeze_startup_objects()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()
