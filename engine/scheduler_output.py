"""What crosses between the scheduler and the model runner each step: the schedule (``SchedulerOutput``,
one ``ScheduledRequest`` a row) and the runner's result (``ModelRunnerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdcluster.wire.logprobs import TokenLogprobs


@dataclass(slots=True)  # built per request per step: slots make that and every read cheaper
class ScheduledRequest:
    request_id: str
    # True the first time the runner sees this request (also after a preemption): it must (re)build
    # its per-request state from ``all_token_ids``.
    is_new: bool
    num_computed_tokens: int  # before this step; authoritative (S1)
    num_scheduled_tokens: int  # input tokens this step, drafts included
    input_token_ids: list[int]  # tokens at positions [num_computed, num_computed + num_scheduled)
    block_ids: list[int] | tuple[int, ...]  # the whole block table (Request.block_table(): a shared tuple)
    num_prompt_tokens: int
    num_tokens: int  # committed tokens (prompt + verified output) before this step
    spec_token_ids: list[int]  # drafts among the input tokens (the last len(spec) of them)
    all_token_ids: list[int] | None = None  # only when is_new
    sampling_params: object = None  # only when is_new
    num_output_tokens: int = 0  # seeds position-keyed sampling (engine/sampler.py)
    # Async scheduling (engine/async_scheduler.py): scheduled behind a step still in flight, so the inputs
    # (that step's sampled token and drafts) are PLACEHOLDERs the runner fills from its own outputs, and
    # num_computed_tokens is an upper bound that assumes every in-flight draft is accepted (S4).
    placeholder_inputs: bool = False

    @classmethod
    def of(cls, request, num_new: int, is_new: bool) -> "ScheduledRequest":
        """A request's next ``num_new`` input tokens (its drafts last), from its ``num_computed_tokens``."""
        start = request.num_computed_tokens
        output, spec = request.output_token_ids, request.spec_token_ids
        num_prompt_tokens = len(request.prompt_token_ids)
        num_tokens = num_prompt_tokens + len(output)
        if num_new == 1 and not spec and output and start == num_tokens - 1:
            inputs = [output[-1]]  # a decode row (most rows of most steps): its newest token
        else:
            inputs = request.token_window(start, num_new)
        params = request.sampling_params
        return cls(  # positional, in field order: one per request per step
            request.request_id,
            is_new,
            start,
            num_new,
            inputs,
            request.block_table(),
            num_prompt_tokens,
            num_tokens,
            list(spec) if spec else [],
            request.all_token_ids if is_new else None,
            params if is_new else None,
            len(output) + params.output_position_offset,
        )


@dataclass(slots=True)
class ScheduledColumns:
    """The rows' per-request values as arrays (one comprehension per field, once per step): what the runner's
    mirror update and its step inputs both read."""

    req_ids: list[str]
    num_computed_np: np.ndarray  # int32 [num_rows]
    num_tokens_np: np.ndarray  # int32
    q_lens_np: np.ndarray  # int32: num_scheduled_tokens
    num_output_np: np.ndarray  # int64
    placeholder_np: np.ndarray  # bool: placeholder_inputs

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest]) -> "ScheduledColumns":
        return cls(
            [s.request_id for s in scheduled],
            np.array([s.num_computed_tokens for s in scheduled], dtype=np.int32),
            np.array([s.num_tokens for s in scheduled], dtype=np.int32),
            np.array([s.num_scheduled_tokens for s in scheduled], dtype=np.int32),
            np.array([s.num_output_tokens for s in scheduled], dtype=np.int64),
            np.array([s.placeholder_inputs for s in scheduled], dtype=bool),
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    # Finished since the previous step: the runner drops their state, the KV connector finalises them.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Async scheduling numbers its steps from 1 (AsyncScheduler): blocks freed while step n may still
    # write them are fenced until step n finished (BlockManager.lift_fences). 0: not numbered.
    step_index: int = 0
    # columns()'s arrays, built on first use (not an init field: dataclasses.replace builds them anew)
    _columns: ScheduledColumns | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def columns(self) -> ScheduledColumns:
        """The rows as arrays, built once (``scheduled`` is not changed after the scheduler returns it)."""
        if self._columns is None:
            self._columns = ScheduledColumns.of(self.scheduled)
        return self._columns


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request: verified tokens of this step (accepted drafts + one sampled), or [] while a chunked
    # prefill is still in progress.
    sampled_token_ids: list[list[int]]
    # Per request: drafts proposed for the next step.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # Per request with ``params.logprobs``: one record per sampled token (else []).
    logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    # Requests with ``params.prompt_logprobs`` whose prompt was completed this step: all positions.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests with ``params.pooling`` whose prompt was completed this step: the pooled vector (float32).
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
