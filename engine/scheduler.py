"""Continuous-batching scheduler with a token budget, chunked prefill, prefix caching, speculative
slots and preemption by recompute.

The scheduler is the single source of truth for every request's ``num_computed_tokens`` (invariant S1):
it hands the value to the runner in each step's output, and advances it only after the step's result
comes back, by the number of tokens actually verified (scheduled minus rejected drafts).

It holds every request of its engine in one table (``requests``), including those whose prompt's KV
comes from another worker (decode side of a KV transfer): such a request is admitted with its blocks
reserved (the prefix its own cache holds taken by reference: engine/remote_admission.py) and waits in
status WAITING_FOR_REMOTE_KV, in no queue, until the KV connector reports it landed (then it joins
``waiting`` with the producer's first token) or failed (then it finishes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.forks import ForkGate
from pdcluster.engine.kv_offload.gate import NoOffload, OffloadGate
from pdcluster.engine.kv_offload.manager import OffloadManager
from pdcluster.engine.mamba_state_blocks import tokens_with_state
from pdcluster.engine.multimodal.chunks import chunk_outside_images
from pdcluster.engine.remote_admission import RemoteReservation, reservation_after_load, reserve_remote
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import WHOLE_PROMPT_POOLINGS
from pdcluster.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdcluster.engine.waiting_queue import WaitingQueue, priority_of
from pdcluster.wire.kv_connector import KVConnectorOutput, LoadedKV, SchedulerConnector
from pdcluster.wire.logprobs import TokenLogprobs

if TYPE_CHECKING:
    import numpy as np


# Requests the scheduler holds in no queue: their KV is on its way (another worker, a lower tier).
WAITING_OUTSIDE_QUEUES = (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.WAITING_FOR_OFFLOAD)


@dataclass(slots=True)  # one per request per step
class StepResult:
    request: Request
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    pooled: np.ndarray | None = None  # a pooling request's vector, with its one token


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: set[int],
        connector: SchedulerConnector | None = None,
        num_state_blocks: int = 0,
        offload: OffloadManager | None = None,
        on_kv_event: Callable[..., None] | None = None,
    ):
        config.require_batch_limits()
        self.config = config
        # The KV transfer's scheduler-side hooks (a null object by default): may hold a finished request's
        # blocks until they are sent (producer) or nothing can write them any more (consumer); free_held()
        # releases them.
        self.connector = connector or SchedulerConnector()
        self.held: dict[str, Request] = {}
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        # KV offload tiers (engine/kv_offload/): evicted cached blocks move down; lower-tier hits load back.
        self.offload = OffloadGate(offload, config.block_size) if offload is not None else NoOffload()
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            on_evict=offload.on_evict if offload is not None else None,
            on_cached=offload.on_cached if offload is not None and offload.writes_through else None,
            on_event=(lambda kind, hashes, runs=None: on_kv_event(kind, "device", hashes, runs)) if on_kv_event else None)
        self.waiting = WaitingQueue()  # by priority, first come first served within one
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()
        self._seen_by_runner: set[str] = set()
        self.num_preemptions_total = 0
        self.forks = ForkGate()
        # Prompt tokens this scheduler had computed (prefix-cache hits and transferred KV excluded):
        # the stat that shows a forked prompt was computed once.
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_reused = 0  # of remote requests' prompts, found here instead of transferred
        self.remote_ready: dict[str, RemoteReservation] = {}  # filled by poll_offload, emptied by the engine
        # Slots past a row's tokens the proposer writes draft KV to, reserved with every allocation: MTP's chain
        # k - 1 (engine/proposers/mtp.py), a draft model's k (the sampled token's entry, then k - 1 drafts':
        # engine/proposers/draft_model.py).
        self.num_lookahead_tokens = {"mtp": max(config.num_spec_tokens - 1, 0),
                                     "draft_model": config.num_spec_tokens}.get(config.spec_method, 0)
        # A hybrid in a KV transfer: blocks after each prompt's that carry its Mamba state to the decode
        # worker (engine/mamba_state_blocks.py). A producer allocates them with each prompt's last chunk.
        self.num_state_blocks = num_state_blocks
        self._num_state_blocks_out = num_state_blocks if self.connector.is_producer else 0
        # A model whose images attend to themselves both ways (Gemma 3): no prefill chunk ends inside an image
        # (engine/multimodal/chunks.py). Set by the engine that loaded it.
        self.whole_images = False
        # An encoder-only model (engine/models/bert.py): each prompt is computed in one step, whole, from its first
        # token (every token attends to every other). Set by the engine that loaded it.
        self.whole_prompts = False

    # ---- requests in and out -----------------------------------------------------------------
    def add_request(self, request: Request, follow: str | None = None) -> None:
        """``follow``: a request with the same prompt (engine/forks.py): wait until its prompt is cached."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.sampling_params.kv_transfer_params:  # vLLM's external P/D: its prompt's KV waits elsewhere
            request.kv_source = self.connector.external_source(request)
        leader = self.requests.get(follow) if follow is not None else None
        # Not cached yet: the leader computes its prompt, or waits for its KV (WAITING_FOR_REMOTE_KV).
        if leader is not None and not leader.is_finished and not leader.prompt_cached:
            self.forks.park(follow, request)
            return
        self.waiting.append(request)

    def add_remote_request(self, request: Request) -> RemoteReservation | None:
        """A request whose prompt's KV another worker computes (decode side of a KV transfer). Its blocks
        are taken now (engine/remote_admission.py): the prompt's prefix this worker's cache holds, by
        reference, and reserved ones where the rest of the KV is to land (and a hybrid's state blocks).
        It then waits in WAITING_FOR_REMOTE_KV until ``update_from_kv``. None, nothing changed, when the
        pool cannot hold it now."""
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        reservation = reserve_remote(self.block_manager, self.config, request, self.num_state_blocks, self.offload)
        if reservation is not None:
            if not reservation.num_loading_blocks:  # else WAITING_FOR_OFFLOAD until poll_offload hands it out
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self.requests[request.request_id] = request
            self.num_prompt_tokens_reused += reservation.num_reused_tokens
        return reservation

    def poll_offload(self) -> None:
        """Apply the offload loads that ended: local requests back to the front of the queue, blocks of
        requests finished meanwhile back to the pool, remote requests whose lower-tier prefix is in to
        ``remote_ready`` with their final reservation (the engine hands them to the worker, which asks
        the prefill worker for the blocks after the ones loaded intact)."""
        polled = self.offload.poll(self.block_manager)
        self.waiting.extendleft(reversed(polled.ready))  # they were first in line when their load began
        self.free_held(set(polled.released))
        for request in polled.remote_ready:
            self.num_prompt_tokens_reused += request.num_offloaded_tokens
            self.remote_ready[request.request_id] = reservation_after_load(request, self.config.block_size)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside the step loop (abort, stop string). Frees its blocks once."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status not in WAITING_OUTSIDE_QUEUES and not self.forks.remove(request):
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def has_unfinished(self) -> bool:
        """Requests a step runs (or a fork waits to run). Not those waiting for remote KV: no step
        brings it, the connector's poll does (``update_from_kv``)."""
        return bool(self.waiting or self.running or self.forks or self.offload.num_loading)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KV for r in self.requests.values())

    def has_pending(self) -> bool:
        """Anything left to step for: requests, blocks held for a transfer, or finish notices the
        runner and connector have not seen yet."""
        return self.has_work() or bool(self.held)

    def has_work(self) -> bool:
        """Something a step must run for: requests, or finish notices the runner and connector have not
        seen yet. Not blocks merely held for a transfer: those wait for the receiver's acknowledgement,
        which the connector's poll finds between steps without one."""
        return bool(self.waiting or self.running or self._finished_req_ids or self.forks or self.offload.num_loading)

    def update_from_kv(self, out: KVConnectorOutput) -> tuple[list[Request], dict[str, str]]:
        """Apply what the KV connector reports: requests whose KV landed leave WAITING_FOR_REMOTE_KV (for
        ``waiting``, or finished when the producer's first token already ends them), those whose KV
        will not come finish (FINISHED_ERROR), and held blocks whose transfer is over go back. Returns
        the landed requests and the failed ones' reasons."""
        landed, failed = [], {}
        for request_id, kv in out.finished_recving.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self._land(request, kv)
                landed.append(request)
        for request_id, reason in out.failed_recving.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self._finish(request, RequestStatus.FINISHED_ERROR)  # the connector may keep its blocks
                failed[request_id] = reason
        self.free_held(out.finished_sending | out.failed)  # after the failures: those held are held by now
        return landed, failed

    def _land(self, request: Request, kv: LoadedKV) -> None:
        """The prompt's KV is in ``request.block_ids``: the request continues from the producer's first
        token and drafts, as if it had computed the prompt here (S1: the count is set here)."""
        assert request.block_ids
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_token_ids = [kv.first_token_id]
        request.spec_token_ids = self._cap_drafts(request, kv.draft_token_ids)
        request.status = RequestStatus.WAITING
        if self._check_stop(request, kv.first_token_id):
            self._finish(request, request.status)
        else:
            self.waiting.append(request)

    def free_held(self, request_ids: set[str]) -> None:
        """Release the blocks of finished requests whose KV transfer is over (sent or failed)."""
        for request_id in request_ids:
            request = self.held.pop(request_id, None)
            if request is not None:
                self._free_blocks(request)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        if self.forks:
            self.waiting.extendleft(reversed(self.forks.release(self.requests)))
        self.poll_offload()
        preempted: set[str] = set()

        # The running rows: one pass, its calls bound once (a decode step does this for every row).
        running, chunk_size, allocate = self.running, cfg.prefill_chunk_tokens, self.block_manager.allocate_slots
        # Most urgent first (stable: admission order within a priority; linear on an already sorted list):
        # the budget goes to them, and running.pop() below preempts the least urgent. Every running request
        # came through the waiting queue, which says whether any had a priority other than 0.
        if self.waiting.prioritized:
            running.sort(key=priority_of)
        num_new_tokens, scheduled_row, num_slots = self._num_new_tokens, self._scheduled, self._num_slots
        # A row's slots are its tokens and MTP's lookahead (a hybrid producer's last prompt chunk adds state blocks).
        lookahead, block_size = self.num_lookahead_tokens, cfg.block_size
        plain_slots = not self._num_state_blocks_out
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = min(num_new_tokens(request), chunk_size, budget)
            if self.whole_images and request.sampling_params.mm_inputs:
                num_new = chunk_outside_images(request.sampling_params.mm_inputs, request.num_computed_tokens, num_new)
            if self.whole_prompts and num_new < num_new_tokens(request):
                num_new = 0
            if num_new <= 0:
                i += 1
                continue
            # Most rows of most steps stay inside their last block: BlockManager.allocate_slots' first check, here.
            if not (plain_slots and len(request.block_ids) * block_size >= request.num_computed_tokens + num_new + lookahead):
                while not allocate(request, num_slots(request, request.num_computed_tokens, num_new)):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.add(victim.request_id)
                    if victim is request:
                        break
                if preempted and request.request_id in preempted:
                    break
            scheduled.append(scheduled_row(request, num_new))
            budget -= num_new
            i += 1

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
            # Nothing runs and the head of the queue cannot get its blocks: if requests behind it hold them
            # (prompts whose KV landed from a prefill worker), nothing would ever free them. Free theirs,
            # from the back of the queue, until the head fits (they are computed again when their turn comes).
            while not scheduled and not self.running and self.waiting and self._evict_waiting_holder():
                budget = self._admit_waiting(budget, scheduled)

        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Requests from the front of the waiting queue, while the budget, max_num_seqs and the pool allow;
        returns the budget left."""
        cfg = self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            # Prompt logprobs need every prompt position's logits, mean and per-token pooling every position's hidden
            # state, cls pooling the first's: such a request computes its prompt.
            params = request.sampling_params
            use_cache = (request.num_computed_tokens == 0 and params.prompt_logprobs is None
                         and params.pooling not in WHOLE_PROMPT_POOLINGS)
            # Hashed once here: the device lookup and the lower tiers' both walk them.
            hashes = self.block_manager.usable_block_hashes(request) if use_cache else []
            cached = self.block_manager.find_cached_prefix(request, hashes) if use_cache else []
            if cached and cfg.spec_method == "mtp":
                # The MTP entry of position p depends on token p + 1: the last matched block's last entry
                # was written for whatever followed it in the request that filled it. Recompute that
                # block, so every shared entry's next token is inside the match (as vLLM does for EAGLE).
                cached = cached[:-1]
            if use_cache and self.offload.try_start(request, cached, hashes, self.block_manager,
                                                     cfg.spec_method == "mtp"):
                self.waiting.popleft()  # WAITING_FOR_OFFLOAD: back at the front when its blocks are in
                continue
            num_computed = request.num_computed_tokens + len(cached) * cfg.block_size
            # num_tokens_with_spec: a request prefilled elsewhere may arrive with drafts.
            num_new = min(request.num_tokens_with_spec - num_computed, cfg.prefill_chunk_tokens, budget)
            if self.whole_images and params.mm_inputs:
                num_new = chunk_outside_images(params.mm_inputs, num_computed, num_new)
                if num_new <= 0:  # the step has no room for the image it starts with: next step
                    break
            if self.whole_prompts and (num_computed or num_new < request.num_tokens_with_spec):
                break  # the step has no room for the whole prompt: a later one has
            if not self.block_manager.allocate_slots(request, self._num_slots(request, num_computed, num_new), cached):
                break
            self.waiting.popleft()
            if use_cache:  # of the hit, what a lower-tier load brought (its blocks may be evicted again)
                base_tokens = request.num_offload_base_blocks * cfg.block_size
                request.num_offloaded_tokens = min(request.num_offloaded_tokens, max(0, num_computed - base_tokens))
            if cached:
                request.num_computed_tokens = num_computed
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _evict_waiting_holder(self) -> bool:
        """Free the blocks of the last waiting request (not the head) that holds some, as a preemption by
        recompute that keeps its place in the queue. False if none holds any."""
        for request in reversed(self.waiting):
            if request is self.waiting[0]:
                return False
            if request.block_ids:
                self._release(request)
                request.num_cached_tokens = 0
                return True
        return False

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[StepResult]:
        results = []
        req_ids, requests, running_status = out.req_ids, self.requests, RequestStatus.RUNNING
        # The runner answers in the schedule's order; a dict only if it ever did not.
        index = None if len(req_ids) == len(sched.scheduled) else {req_id: i for i, req_id in enumerate(req_ids)}
        commit, check_stop = self._commit_computed, self._check_stop
        # Without prefix caching there is nothing to register (a call per row saved).
        cache_full_blocks = self.block_manager.cache_full_blocks if self.block_manager.enable_prefix_caching else None
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        num_prompt_tokens_computed = 0
        for row, s in enumerate(sched.scheduled):
            request = requests.get(s.request_id)
            if request is None or request.status is not running_status:
                continue  # finished or aborted while the step ran
            if index is None and req_ids[row] != s.request_id:
                index = {req_id: i for i, req_id in enumerate(req_ids)}
            i = row if index is None else index[s.request_id]
            sampled = out.sampled_token_ids[i]
            spec = s.spec_token_ids
            num_rejected = len(spec) + 1 - len(sampled) if sampled and spec else 0
            # S1: the count moves by what was verified, here and only here. ``num_computed``: the tokens whose
            # KV is written once this step is (async scheduling's own count runs ahead, over steps in flight).
            num_computed = commit(request, s, num_rejected, bool(sampled))
            if spec:
                request.num_draft_tokens += len(spec)
            if request.spec_token_ids:
                request.spec_token_ids = []
            finished = False
            if len(sampled) == 1:  # a decode row's one token (most rows of most steps)
                token_id = sampled[0]
                new_tokens = sampled  # the runner's list of this row, read-only from here on
                output = request.output_token_ids
                output.append(token_id)
                # _check_stop's tests inlined (per request per step); it runs for a row that ends, to say why.
                params = request.sampling_params
                if (token_id in params.stop_token_ids or (token_id in eos_token_ids and not params.ignore_eos)
                        or len(output) >= params.max_tokens
                        or len(request.prompt_token_ids) + len(output) >= max_model_len):
                    finished = check_stop(request, token_id)
            else:
                new_tokens = []
                for token_id in sampled:
                    request.output_token_ids.append(token_id)
                    new_tokens.append(token_id)
                    if check_stop(request, token_id):
                        finished = True
                        break
            if spec and new_tokens:
                # Accepted drafts that reached the output (a stop token can cut a step's tokens short),
                # so len(output) == sampling steps + num_accepted_tokens.
                request.num_accepted_tokens += len(new_tokens) - 1
            # Register computed full blocks even when the request ends now: a finished request's
            # prefix is exactly what the next request with the same prompt wants to hit.
            if cache_full_blocks is not None:
                cache_full_blocks(request, num_computed)
            if s.num_computed_tokens < s.num_prompt_tokens:  # a prompt chunk
                num_prompt_tokens_computed += min(s.num_computed_tokens + s.num_scheduled_tokens,
                                                  s.num_prompt_tokens) - s.num_computed_tokens
            if not request.prompt_cached and num_computed >= len(request.prompt_token_ids):
                request.prompt_cached = True
            if finished:
                # A step scheduled behind this one (async) never counts now: its row is dropped, or its
                # output is on arrival (the request is finished).
                request.num_computed_tokens = num_computed
                self.running.remove(request)
                # Drafts proposed from this step's output travel with a KV transfer (prefill side).
                request.spec_token_ids = list(out.spec_token_ids[i]) if out.spec_token_ids and sampled else []
                self._finish(request, request.status)
            elif sampled and out.spec_token_ids and out.spec_token_ids[i]:
                self._take_drafts(request, out.spec_token_ids[i])
            new_logprobs = out.logprobs[i][: len(new_tokens)] if out.logprobs else []
            results.append(StepResult(request, new_tokens, finished, new_logprobs,
                                      out.prompt_logprobs.get(s.request_id) if out.prompt_logprobs else None,
                                      out.pooled.get(s.request_id) if out.pooled else None))
        self.num_prompt_tokens_computed += num_prompt_tokens_computed
        return results

    # ---- helpers ---------------------------------------------------------------------------------
    def _num_slots(self, request: Request, num_computed: int, num_new: int) -> int:
        """Token slots to allocate after ``num_computed`` for ``num_new`` tokens: MTP's lookahead, and
        for a hybrid producer the state blocks once the chunk completes the prompt."""
        n = num_new + self.num_lookahead_tokens
        if self._num_state_blocks_out and num_computed + num_new >= len(request.prompt_token_ids):
            end = tokens_with_state(request.num_prompt_tokens, self.config.block_size, self._num_state_blocks_out)
            n = max(n, end - num_computed)
        return n

    # The three hooks below are what async scheduling (engine/async_scheduler.py) overrides.
    def _num_new_tokens(self, request: Request) -> int:
        """Tokens a running request wants this step: its uncomputed committed tokens and drafts."""
        return (len(request.prompt_token_ids) + len(request.output_token_ids) + len(request.spec_token_ids)
                - request.num_computed_tokens)  # num_tokens_with_spec, without its two property calls

    def _commit_computed(self, request: Request, s: ScheduledRequest, num_rejected: int, sampled: bool) -> int:
        """Move the request's count past step ``s`` (its rejected drafts taken back); returns the tokens whose KV
        is written once that step is."""
        request.num_computed_tokens = num = s.num_computed_tokens + s.num_scheduled_tokens - num_rejected
        return num

    def _take_drafts(self, request: Request, drafts: list[int]) -> None:
        request.spec_token_ids = self._cap_drafts(request, drafts)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        is_new = request.request_id not in self._seen_by_runner
        if is_new:
            self._seen_by_runner.add(request.request_id)
        spec = request.spec_token_ids
        if spec and (num_spec_in_input := max(0, request.num_computed_tokens + num_new - request.num_tokens)) < len(spec):
            # The budget cut the drafts short: keep only those that are scheduled.
            request.spec_token_ids = request.spec_token_ids[:num_spec_in_input]
        return ScheduledRequest.of(request, num_new, is_new)

    def _cap_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        room = min(
            self.max_model_len - request.num_tokens,
            request.sampling_params.max_tokens - len(request.output_token_ids),
        ) - 1
        return list(drafts[: max(room, 0)])

    def stops_on(self, params, token_id: int) -> bool:
        """Whether ``token_id`` ends a request with ``params`` as a stop (finish_reason "stop")."""
        return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if self.stops_on(params, token_id):
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
            return True
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= params.max_tokens or len(request.prompt_token_ids) + num_output_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, go back to the front of the queue."""
        self._release(request)
        self.waiting.appendleft(request)

    def _free_blocks(self, request: Request) -> None:
        """Every path that frees a request's blocks comes here, fenced while steps are in flight."""
        self.block_manager.free(request, self._write_fence())

    def _write_fence(self) -> int | None:
        """The newest step that may still write blocks freed now: none here (a synchronous step is
        over before anything is freed); AsyncScheduler's has steps in flight."""
        return None

    def _release(self, request: Request) -> None:
        """Drop a request's KV, keep its tokens: it is computed again when next scheduled."""
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._seen_by_runner.discard(request.request_id)  # the runner rebuilds it when resumed

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        # The connector may keep the blocks: a producer's until they are sent, a consumer's reserved ones
        # until nothing can write them any more (a revoke not yet confirmed). free_held() frees them.
        # A request whose offload load is under way: the loader may still write its blocks (gate.poll frees them).
        loading = request.request_id in self.offload.loading
        self.offload.forget(request.request_id)
        self.offload.drop_source(request)
        if self.connector.request_finished(request) or loading:
            self.held[request.request_id] = request
        else:
            self._free_blocks(request)
        self.requests.pop(request.request_id, None)
        self._seen_by_runner.discard(request.request_id)
        self._finished_req_ids.add(request.request_id)
