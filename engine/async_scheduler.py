"""Async scheduling (``EngineConfig.async_scheduling``): the CPU schedules step n+1 while step n runs.

Pieces, and the invariant S4 they keep (docs/invariants.md):

- :class:`AsyncStepper` keeps the model runner one step ahead of the scheduler: ``schedule(n+1)``
  overlaps step n, and step n's outputs are read only through its Future, after the step finished:
  nothing reads a value a running step is still producing.
- :class:`AsyncScheduler` schedules a request again while its previous step is in flight: the inputs
  (that step's sampled token and its fresh drafts) are PLACEHOLDERs, and ``num_computed_tokens`` moves
  on at schedule time as if every in-flight draft were accepted. The CPU ``seq_lens`` is therefore an
  upper bound, inflated by the placeholders; ``update_from_output`` takes the rejected drafts back.
- The runner (engine/model_runner.py) fills placeholder rows from its own outputs of the previous step:
  per-request values of that step (rejected-draft counts, drafts) sit in that step's batch order and
  move to the new order through :func:`prev_positions` (new requests, ``prev_idx < 0``, get fresh
  values) - never by row position, since the batch is condensed when requests finish and reordered
  when they join or are preempted. The first input token is read at ``num_tokens_no_spec - 1`` (the
  last committed token, :func:`backup_token_ids`), never at the inflated CPU length, which lies past the
  committed tokens (where ``token_ids_np`` holds -1).

- Launch-ahead (:class:`AsyncStepper`, ``ModelRunner.launch`` / ``finish``): without speculation, penalties
  or grammars, step n+1 is launched before step n is finished; its placeholder rows take step n's sampled
  ids on the device (:func:`fill_ahead_rows`, by request id), so the device never waits for the host's
  bookkeeping of step n. Step n's tokens then land in the mirror only for slots the same request still
  holds (``RequestStates.epoch_np``): the launch of n+1 may have dropped a request and reused its slot.

On a 2-core CPU the overlap buys nothing measurable (scheduling and detokenising are small next to the
forward): bench/spec_decode.py --async-scheduling, SmolLM2 batch 1, one torch thread, 2026-11-22:
12.48 vs 12.52 decode tok/s (ShareGPT) and 13.69 vs 13.03 (HumanEval), sync vs async, within noise;
with speculation async is slower (it must schedule min(k, room) drafts before knowing the match, so
n-gram pads short matches). So it is off by default. The tests show it is lossless.
Blocks freed while a step in flight may still write them (a request aborted, finished or preempted
mid-flight) are fenced (BlockManager): the next step may take them, since it runs after on the same
device queue, but a KV transfer landing in a reservation or an offload load may not until the step
finished (``AsyncScheduler.retire``). In a cluster (`--async-scheduling`) the decode workers launch ahead
(their consumer connector acts only between steps); prefill workers finish each step first (their
producer sends from inside the step).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdcluster.engine.request import Request
from pdcluster.engine.scheduler import Scheduler, StepResult
from pdcluster.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdcluster.wire.kv_connector import KVConnectorOutput

PLACEHOLDER = -1


# ---- per-request values across a reordered batch ---------------------------------------------------
def prev_positions(req_ids: list[str], prev_req_ids: list[str]) -> np.ndarray:
    """For each request of this batch, its row in the previous step's batch, or -1 if it was not there."""
    if req_ids == prev_req_ids:  # a steady batch (most decode steps): the same requests in the same order
        return np.arange(len(req_ids), dtype=np.int64)
    prev_index = {req_id: i for i, req_id in enumerate(prev_req_ids)}
    return np.array([prev_index.get(req_id, -1) for req_id in req_ids], dtype=np.int64)


def carry_over(prev_values: np.ndarray, prev_pos: np.ndarray, fresh) -> np.ndarray:
    """Rows of ``prev_values`` (previous batch order) moved to this batch's order through ``prev_pos``;
    requests new to the batch (``prev_pos < 0``) get ``fresh`` (S4)."""
    out = np.full((len(prev_pos),) + prev_values.shape[1:], fresh, dtype=prev_values.dtype)
    has_prev = prev_pos >= 0
    out[has_prev] = prev_values[prev_pos[has_prev]]
    return out


def backup_token_ids(token_ids_np: np.ndarray, idx_mapping_np: np.ndarray, num_tokens_no_spec_np: np.ndarray) -> np.ndarray:
    """The last committed token of each request: read at ``num_tokens_no_spec - 1``, which async
    scheduling leaves exact, never at the CPU ``seq_lens``, which placeholders inflate (S4)."""
    return token_ids_np[idx_mapping_np, num_tokens_no_spec_np[idx_mapping_np] - 1]


@dataclass
class PrevStepOutput:
    """What a step leaves for the next one, in its own batch order."""

    req_ids: list[str]
    num_rejected_np: np.ndarray  # [num_rows]: drafts rejected this step
    draft_token_ids_np: np.ndarray  # [num_rows, num_spec_tokens]: drafts proposed, PLACEHOLDER-padded

    @classmethod
    def empty(cls, num_spec_tokens: int) -> "PrevStepOutput":
        return cls([], np.zeros(0, np.int64), np.full((0, num_spec_tokens), PLACEHOLDER, np.int64))


def fill_placeholder_rows(
    req_ids: list[str],
    scheduled: list[ScheduledRequest],
    idx_mapping_np: np.ndarray,
    prev: PrevStepOutput,
    states,
    starts_np: np.ndarray,
    num_tokens_np: np.ndarray,
    num_output_np: np.ndarray,
    input_token_ids: list[list[int]],
    draft_token_ids: list[list[int]],
) -> None:
    """Turn the scheduler's placeholder rows into real ones, in place, from the previous step's outputs."""
    prev_pos = prev_positions(req_ids, prev.req_ids)
    prev_pos[[s.is_new for s in scheduled]] = -1  # (re)added to the runner: nothing carries over
    num_rejected = carry_over(prev.num_rejected_np, prev_pos, 0)
    drafts = carry_over(prev.draft_token_ids_np, prev_pos, PLACEHOLDER)
    rows = np.flatnonzero([s.placeholder_inputs for s in scheduled])
    last_committed = backup_token_ids(states.token_ids_np, idx_mapping_np[rows], states.num_tokens_np)
    for r, token in zip(rows, last_committed.tolist()):
        s = scheduled[r]
        if prev_pos[r] < 0:
            raise RuntimeError(f"request {s.request_id!r} has placeholder inputs but was not in the previous step")
        # The scheduler's count assumed every in-flight draft accepted; the exact one is that minus the
        # rejected (the mirror itself keeps the scheduler's value, S1).
        starts_np[r] -= num_rejected[r]
        committed = int(states.num_tokens_np[idx_mapping_np[r]])
        assert starts_np[r] == committed - 1, (
            f"{s.request_id}: corrected num_computed {starts_np[r]} != committed {committed} - 1"
        )
        m = s.num_scheduled_tokens - 1
        step_drafts = drafts[r, :m].tolist()
        assert PLACEHOLDER not in step_drafts and token != PLACEHOLDER, f"{s.request_id}: missing draft or token"
        input_token_ids[r] = [token] + step_drafts
        draft_token_ids[r] = step_drafts
        num_output_np[r] += committed - num_tokens_np[r]
        num_tokens_np[r] = committed


@dataclass
class LaunchedTokens:
    """A launched step's sampled ids, still on the device: the next step, launched before this one is
    finished (``AsyncStepper``'s launch-ahead), reads its placeholder inputs from here."""

    req_ids: list[str]
    sample_index_np: np.ndarray  # [num_rows]: the row's entry in ``tokens_dev``, -1 if it samples nothing
    tokens_dev: torch.Tensor  # [num_sampling_rows] int64, on the model's device


def fill_ahead_rows(
    req_ids: list[str],
    scheduled: list[ScheduledRequest],
    prev: LaunchedTokens,
    starts_np: np.ndarray,
    num_tokens_np: np.ndarray,
    num_output_np: np.ndarray,
    placeholder_np: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Placeholder rows of a step launched before the previous one is finished (no speculation, so one
    input token a row and nothing rejected): the counts are made exact in place (the committed length
    is ``num_computed + 1``, with the in-flight token), and the input token is left to the device.
    Returns those rows and where each one's token lies in ``prev.tokens_dev`` (S4: by request id,
    never by row position). ``placeholder_np``: which rows have placeholder inputs, where the caller has them."""
    if placeholder_np is None:
        placeholder_np = np.array([s.placeholder_inputs for s in scheduled], dtype=bool)
    if placeholder_np.all():  # a steady decode batch: every row
        rows = np.arange(len(scheduled))
        prev_pos = prev_positions(req_ids, prev.req_ids)
    else:
        rows = np.flatnonzero(placeholder_np)
        prev_pos = prev_positions([req_ids[r] for r in rows.tolist()], prev.req_ids)
    # A placeholder row is never one the runner (re)adds (the scheduler makes those outside a flight); if it
    # were, its token would not carry over.
    is_new = np.array([scheduled[r].is_new for r in rows.tolist()], dtype=bool)
    src = np.where((prev_pos >= 0) & ~is_new, prev.sample_index_np[np.maximum(prev_pos, 0)], -1)
    num_inputs = np.array([scheduled[r].num_scheduled_tokens for r in rows.tolist()], dtype=np.int64)
    bad = np.flatnonzero((src < 0) | (num_inputs != 1))
    if len(bad):
        r = int(rows[bad[0]])
        raise RuntimeError(f"request {req_ids[r]!r} has placeholder inputs but no token sampled by the "
                           f"step before it, or {scheduled[r].num_scheduled_tokens} inputs")
    committed = starts_np[rows] + 1
    num_output_np[rows] += committed - num_tokens_np[rows]
    num_tokens_np[rows] = committed
    return rows, src


def merge_kv_outputs(a: KVConnectorOutput, b: KVConnectorOutput) -> KVConnectorOutput:
    """What two steps' KV connectors reported, as one report."""
    return KVConnectorOutput(
        finished_sending=a.finished_sending | b.finished_sending,
        finished_recving={**a.finished_recving, **b.finished_recving},
        failed_recving={**a.failed_recving, **b.failed_recving},
        failed=a.failed | b.failed,
    )


# ---- the scheduler half ------------------------------------------------------------------------------
@dataclass(slots=True)  # one per request with a step in flight, updated in place every step
class _Flight:
    num_sampling: int  # sampling steps scheduled whose output is not back yet
    num_drafts: int  # drafts in the newest of them
    unreported: deque  # tokens scheduled per step whose output is not back yet, oldest first


class AsyncScheduler(Scheduler):
    """Schedules a request behind its own in-flight step (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_spec_tokens = self.config.num_spec_steps
        # request id -> its steps not reported yet (a prompt chunk's included: it samples nothing)
        self._flights: dict[str, _Flight] = {}
        # Steps scheduled and steps finished so far: the ones between are in flight, and a block freed
        # now may still be written by the newest of them (BlockManager's fences).
        self.num_scheduled_steps = 0
        self.num_finished_steps = 0
        # Requests whose rows need the previous step's token on the host (penalties, grammars): noted when a
        # request is scheduled outside a flight (its first row since admission or preemption, and its prompt
        # chunks), so AsyncStepper._can_launch_ahead need not ask every row's parameters every step.
        self.needs_host_tokens: set[str] = set()

    def schedule(self) -> SchedulerOutput:
        sched = super().schedule()
        self.num_scheduled_steps += 1
        sched.step_index = self.num_scheduled_steps
        return sched

    def retire(self, sched: SchedulerOutput) -> None:
        """Step ``sched`` finished (it and every step before it, in order): what it fenced is free
        for any writer."""
        self.num_finished_steps = max(self.num_finished_steps, sched.step_index)
        self.block_manager.lift_fences(sched.step_index)

    def _write_fence(self) -> int | None:
        in_flight = self.num_scheduled_steps > self.num_finished_steps
        return self.num_scheduled_steps if in_flight else None

    def _num_new_tokens(self, request: Request) -> int:
        flight = self._flights.get(request.request_id)
        if flight is None or not flight.num_sampling:
            return super()._num_new_tokens(request)
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        num_tokens = len(request.prompt_token_ids) + num_out
        if num_out + 1 >= params.max_tokens or num_tokens + 1 >= self.max_model_len:
            return 0  # the in-flight step's first token already ends it
        if not self.num_spec_tokens:
            return 1
        most = 1 + flight.num_drafts  # what the in-flight step may emit: room is counted from that upper bound
        room = min(self.max_model_len - (num_tokens + most), params.max_tokens - (num_out + most)) - 1
        return 1 + max(0, min(self.num_spec_tokens, room))

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        request_id = request.request_id
        flight = self._flights.get(request_id)
        if flight is None or not flight.num_sampling:
            s = super()._scheduled(request, num_new)
            samples = request.num_computed_tokens + num_new >= request.num_tokens
            params = request.sampling_params
            if params.has_penalties or params.structured_output is not None:
                self.needs_host_tokens.add(request_id)
        else:
            num_prompt_tokens, num_output_tokens = len(request.prompt_token_ids), len(request.output_token_ids)
            s = ScheduledRequest(  # positional, in field order (per request per step: half the keyword call's cost)
                request_id,
                False,  # is_new
                request.num_computed_tokens,
                num_new,  # num_scheduled_tokens
                [PLACEHOLDER] * num_new,  # input_token_ids
                request.block_table(),
                num_prompt_tokens,
                num_prompt_tokens + num_output_tokens,  # num_tokens
                [PLACEHOLDER] * (num_new - 1) if num_new > 1 else [],  # spec_token_ids
                None,  # all_token_ids
                None,  # sampling_params
                # As ScheduledRequest.of: a resumed request's draws stay keyed by its original output positions.
                num_output_tokens + request.sampling_params.output_position_offset,
                True,  # placeholder_inputs
            )
            samples = True
        # Optimistic: as if every draft were accepted. _commit_computed takes the rejected back.
        request.num_computed_tokens += num_new
        if flight is None:
            self._flights[request_id] = _Flight(int(samples), len(s.spec_token_ids), deque((num_new,)))
        else:  # in place: one record per request in flight, not one per step
            flight.unreported.append(num_new)
            if samples:
                flight.num_sampling += 1
                flight.num_drafts = len(s.spec_token_ids)
        return s

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[StepResult]:
        self.retire(sched)
        return super().update_from_output(sched, out)

    def _commit_computed(self, request: Request, s: ScheduledRequest, num_rejected: int, sampled: bool) -> int:
        """The optimistic count loses this step's rejected drafts. The count returned, for the base update to
        commit step n with (registering its computed blocks in the prefix cache, ending the request), leaves out
        step n+1, already scheduled, whose KV is not written yet (and never will be if the request ends now,
        e.g. on a stop token)."""
        num = request.num_computed_tokens = request.num_computed_tokens - num_rejected
        flight = self._flights.get(request.request_id)
        if flight is None:
            return num
        if sampled:
            flight.num_sampling -= 1
        queue = flight.unreported
        if queue:
            queue.popleft()  # this step's
        if not queue:
            del self._flights[request.request_id]
            return num
        return num - (queue[0] if len(queue) == 1 else sum(queue))

    def _take_drafts(self, request: Request, drafts: list[int]) -> None:
        pass  # the next step is already scheduled with placeholders; the runner keeps the drafts

    def _preempt(self, request: Request) -> None:
        self._flights.pop(request.request_id, None)  # its in-flight output is dropped on arrival
        self.needs_host_tokens.discard(request.request_id)
        super()._preempt(request)

    def _finish(self, request: Request, status) -> None:
        self._flights.pop(request.request_id, None)
        self.needs_host_tokens.discard(request.request_id)
        super()._finish(request, status)


# ---- the loop --------------------------------------------------------------------------------------
class AsyncStepper:
    """Keeps the runner one step ahead of the scheduler. The runner launches a step (its forward and
    sampling queued on the device) and later finishes it (reads the sampled ids, builds the outputs).
    ``step()`` schedules step n+1 while step n runs, then:

    - launch-ahead, where step n+1 needs nothing of step n on the host (no speculation, penalties,
      grammars or KV connector acting inside steps): n+1 is launched *before* n is finished, its placeholder inputs
      read from n's sampled ids on the device, so the device has n+1 queued while the host waits for n,
      finishes it and updates the scheduler (vLLM's async scheduling). This job runs on the caller's
      thread: the caller waits for n's outputs anyway;
    - otherwise: n is finished, the scheduler updated, rows of requests that ended dropped, then n+1
      launched on the worker thread, so the caller's output processing overlaps that launch.

    Either way step n's outputs reach the scheduler only through its Future, set once n is finished
    (S4). The runner serves one job at a time, in order (a launch-ahead first waits for the worker's)."""

    def __init__(self, scheduler: AsyncScheduler, runner):
        self.scheduler = scheduler
        self.runner = runner
        device = getattr(runner, "device", None)
        # Triton launches on the thread's current CUDA device: the worker thread's is the runner's.
        on_cuda = device is not None and device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdcluster-runner",
                                        initializer=torch.cuda.set_device if on_cuda else None,
                                        initargs=(device,) if on_cuda else ())
        self._last_job = None  # the pool's Future of the newest job queued on the worker thread
        # The newest launched step and the Future its outputs arrive on once the worker finished it.
        self._pending: tuple[SchedulerOutput, Future] | None = None
        self._finish_asked = False  # a finish of the pending step is queued on the worker
        self.num_launched_ahead = 0

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    # ---- worker-thread jobs (one at a time, in submission order) -----------------------------------
    def _launch_job(self, sched: SchedulerOutput, ahead: bool, done: Future, prev_done: Future | None) -> None:
        try:
            self.runner.launch(sched, ahead=ahead)
        except BaseException as e:  # the caller's result() raises it, for this step and the one before
            for future in (done, prev_done):
                if future is not None and not future.done():
                    future.set_exception(e)
            return
        if prev_done is not None:
            self._finish_job(prev_done)

    def _finish_job(self, done: Future) -> None:
        try:
            done.set_result(self.runner.finish())
        except BaseException as e:  # the caller's done.result() raises it
            done.set_exception(e)

    def _submit_launch(self, sched: SchedulerOutput, ahead: bool = False, prev_done: Future | None = None) -> Future:
        """Queue the launch of ``sched`` (then, if given, the finish of the step before it); returns the
        Future of ``sched``'s own outputs, set when a later job finishes it."""
        done: Future = Future()
        self._last_job = self._pool.submit(self._launch_job, sched, ahead, done, prev_done)
        return done

    def _launch_ahead_here(self, sched: SchedulerOutput, prev_done: Future) -> Future:
        """Launch-ahead's job (launch ``sched``, then finish the step before it) on the caller's thread:
        the caller waits for that finish anyway, so the worker thread would add only two hand-offs
        (and the step's data crossing cores): measured on CPU with the model stubbed, the async step's
        host time at batch 128 was 1.7x the synchronous one's. Jobs queued on the worker run first:
        the runner serves one job at a time, in order."""
        if self._last_job is not None:
            self._last_job.result()  # its errors went to the steps' Futures
        done: Future = Future()
        self._launch_job(sched, True, done, prev_done)
        return done

    def _finish_pending(self) -> Future:
        sched, done = self._pending
        if not self._finish_asked and not done.done():
            self._last_job = self._pool.submit(self._finish_job, done)
            self._finish_asked = True
        return done

    # ---- the loop ------------------------------------------------------------------------------------
    def _can_launch_ahead(self, sched: SchedulerOutput) -> bool:
        """Step n+1 needs nothing of step n on the host: no drafts to fill in, no penalty or grammar that
        reads step n's token from the host mirror, no KV connector acting inside steps (a producer's
        sends; a consumer's transfers land between steps, into blocks no step in flight writes)."""
        runner = self.runner
        if sched.is_empty or self.scheduler.num_spec_tokens or runner.num_state_blocks_out:
            return False
        if runner.connector.has_step_hooks:
            return False
        needs = self.scheduler.needs_host_tokens  # every row of sched was scheduled outside a flight first
        return not needs or not any(s.request_id in needs for s in sched.scheduled)

    def step(self) -> tuple[list[StepResult], KVConnectorOutput]:
        if self._pending is None:
            first = self.scheduler.schedule()
            self._pending = (first, self._submit_launch(first))
            self._finish_asked = False
        next_sched = self.scheduler.schedule()  # CPU work for step n+1 while step n runs
        sched, done = self._pending
        if not self._finish_asked and self._can_launch_ahead(next_sched):
            next_done = self._launch_ahead_here(next_sched, prev_done=done)
            self.num_launched_ahead += 1
            runner_output, kv_output = done.result()  # step n is finished: its outputs are final
            results = self.scheduler.update_from_output(sched, runner_output)
        else:
            runner_output, kv_output = self._finish_pending().result()
            results = self.scheduler.update_from_output(sched, runner_output)
            # Always launch, even empty: it carries finished/preempted ids the runner must see.
            next_sched = self._drop_gone(next_sched)
            next_done = self._submit_launch(next_sched)
            if next_sched.is_empty and not self.scheduler.has_work():
                # Idle: that empty step (it tells the runner what finished) is finished at once, so nothing
                # stays in flight and has_work() turns false (a worker loop would spin on empty steps).
                self._pending, self._finish_asked = (next_sched, next_done), False
                _, idle_kv_output = self._finish_pending().result()
                self.scheduler.retire(next_sched)
                self._pending, self._finish_asked = None, False
                return results, merge_kv_outputs(kv_output, idle_kv_output)
        self._pending = (next_sched, next_done)
        self._finish_asked = False
        return results, kv_output

    def _drop_gone(self, sched: SchedulerOutput) -> SchedulerOutput:
        """Rows of requests that finished (or were aborted) while the step was being scheduled."""
        keep = [s for s in sched.scheduled if (r := self.scheduler.requests.get(s.request_id)) is not None
                and not r.is_finished]
        if len(keep) == len(sched.scheduled):
            return sched
        return replace(sched, scheduled=keep, total_num_scheduled_tokens=sum(s.num_scheduled_tokens for s in keep))

    def drain(self) -> None:
        """Wait for the step in flight (its output stays for the next ``step()``: call only when nothing
        is running)."""
        if self._pending is not None:
            self._finish_pending().result()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
