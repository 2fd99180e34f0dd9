"""What each engine step computed and how long it took, for comparing a served worker with its
`pdcluster profile` (tools/planner/costs.py uses the same features).

With ``PDCLUSTER_STEP_TRACE=DIR`` in a worker's environment, every step is appended to
``DIR/<pid>.jsonl`` as ``{"t", "seconds", "prefill_tokens", "attn", "num_decode", "context"}``
(``t`` is the step's end, Unix seconds): a diagnostic, off by default.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

TRACE_ENV = "PDCLUSTER_STEP_TRACE"


@dataclass
class StepRecord:
    t: float
    seconds: float
    prefill_tokens: int
    attn: float
    num_decode: int
    context: int


def attn_pairs(chunk: int, computed: int) -> float:
    """Query-key pairs of a prefill chunk of ``chunk`` tokens after ``computed`` cached ones."""
    return chunk * (computed + chunk / 2.0)


def step_features(sched) -> tuple[int, float, int, int]:
    """(prompt tokens computed, their query-key pairs, decode rows, sum of decode contexts) of a
    ``SchedulerOutput``; a request still in its prompt is prefill, any other a decode row (drafts
    included in its tokens)."""
    prefill_tokens, attn, num_decode, context = 0, 0.0, 0, 0
    for s in sched.scheduled:
        if s.num_computed_tokens < s.num_prompt_tokens:
            n = s.num_scheduled_tokens
            prefill_tokens += n
            attn += attn_pairs(n, s.num_computed_tokens)
        else:
            num_decode += 1
            context += s.num_computed_tokens + s.num_scheduled_tokens
    return prefill_tokens, attn, num_decode, context


class StepTrace:
    """``directory`` None: ``$PDCLUSTER_STEP_TRACE``; "": no file. ``keep`` > 0 also keeps the last
    ``keep`` records in ``records`` (``pdcluster profile`` reads a served worker's steps that way)."""

    def __init__(self, directory: str | None = None, keep: int = 0):
        directory = directory if directory is not None else os.environ.get(TRACE_ENV) or None
        self.records: deque[StepRecord] | None = deque(maxlen=keep) if keep > 0 else None
        self._file = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(directory) / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - kept open

    @property
    def enabled(self) -> bool:
        return self._file is not None or self.records is not None

    def record(self, sched, seconds: float) -> None:
        if sched is None or not sched.scheduled or not self.enabled:
            return
        rec = StepRecord(time.time(), seconds, *step_features(sched))
        if self.records is not None:
            self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(asdict(rec)) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
