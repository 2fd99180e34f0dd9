"""An optional record of what the router decided, for tests and benchmarks (``router.record()``);
a serving router keeps none of it, so nothing grows with the number of requests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decision:
    request_id: str
    prefill_id: str | None
    decode_id: str
    local: bool


@dataclass(frozen=True)
class Report:
    """A decode worker's count and the router's mirror of it, right after the router applied it."""

    reported_computed_tokens: int
    mirrored_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool


@dataclass
class DecisionRecorder:
    decisions: list[Decision] = field(default_factory=list)
    recoveries: list[tuple[str, float]] = field(default_factory=list)  # (request id, detection -> re-placed s)
    reports: list[Report] = field(default_factory=list)
