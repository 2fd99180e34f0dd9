"""The global router of the Ray cluster: places each request on a (prefill, decode) pair and relays the
decode worker's event stream to the client. It does not carry KV descriptors: the decode worker owns
the request and asks the prefill worker for the KV itself (docs/request-path.md).

Recovery: when a worker dies (health.py) or a placement fails (a ``Failed`` event), the request is
placed again on a healthy pair with prompt + the tokens already streamed as the new prompt; random
draws stay keyed by the original output positions, so the client's stream simply continues (with
greedy sampling it equals an uninterrupted run). Each placement has its own worker-side id
(``request_id#n``), so late events of an earlier one are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import replace
from typing import AsyncIterator, Callable

from pdcluster.cluster.api.router_contract import RouterError, TokenDelta
from pdcluster.cluster.delta_queue import DeltaQueue
from pdcluster.cluster.generation_control import GenerationControl, WeightControlled
from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.router.events import EventReceiver
from pdcluster.cluster.router.health import HealthMonitor
from pdcluster.cluster.router.kv_index import KVIndex
from pdcluster.cluster.router.lora import LoraRegistry, _reason
from pdcluster.cluster.router.membership import Membership
from pdcluster.cluster.router.placement import PairPlacement
from pdcluster.cluster.router.recorder import DecisionRecorder
from pdcluster.cluster.router.state import RequestState
from pdcluster.cluster.router.stream import RequestStreams
from pdcluster.cluster.router.submit import Submitter
from pdcluster.cluster.router.weights import WorkerWeights
from pdcluster.cluster.token_deltas import can_merge, merge_queued
from pdcluster.engine.multimodal.limits import DEFAULT_MAX_IMAGES_PER_PROMPT
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.events import (ADMITTED, UNREACHABLE, Admission, Event, Failed, KVEvents, KVReady, StepTokens,
                                   Tokens, WorkerError)

log = logging.getLogger(__name__)

# One worker's flush: its wait for a request that just ended to let go of its blocks, then its tiers' clear
# (node/actor.py FLUSH_IDLE_WAIT_S, FLUSH_TIMEOUT_S), with room to spare.
FLUSH_TIMEOUT_S = 90.0


class ClusterRouter(WeightControlled):
    def __init__(self, prefill: dict, decode: dict, tokenizer, model_name: str, max_model_len: int,
                 block_size: int, config: RouterConfig | None = None, lora_names: tuple[str, ...] = (),
                 max_images_per_prompt: int = DEFAULT_MAX_IMAGES_PER_PROMPT, mm_processor_kwargs: str = "",
                 max_loras: int = 0):
        self.prefill = prefill  # worker id -> Ray actor handle
        self.decode = decode
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_images_per_prompt = max_images_per_prompt  # the workers' --limit-mm-per-prompt (checked there too)
        self.mm_processor_kwargs = mm_processor_kwargs  # the workers' --mm-processor-kwargs (the API counts by it)
        # The LoRA adapters requests may name (the workers' --lora-modules, and those loaded while serving).
        self.lora = LoraRegistry(tuple(lora_names))
        self.max_loras = max_loras  # adapters a worker holds at once; 0: the workers serve no LoRA (stats' "lora")
        self.block_size = block_size
        self.config = config or RouterConfig()
        # Which worker holds which prompt block, in which tier: fed by every worker's KVEvents, read by
        # kv_aware placement; a worker that restarts or leaves is forgotten.
        self.kv_index = KVIndex()
        self.placement = PairPlacement(self.config, self.kv_index)
        self.health = HealthMonitor(self.config, self.placement.views, lambda: {**self.prefill, **self.decode},
                                    self.mark_down)
        self.health.on_worker_reset = self.kv_index.forget_worker
        # A re-wired pair's earlier failures were the missing link's: its breaker closes again.
        self.health.on_pair_rewired = lambda p, d: self.placement.breaker(p, d).record_success()
        self.counters = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "kv_transfer_bytes": 0}
        self.recorder: DecisionRecorder | None = None
        self.streams = RequestStreams(self.counters, lambda: self.recorder,
                                      lambda a: self.placement.breaker(*a.pair).record_success())
        self.membership = Membership(self.placement, self.streams, self.prefill, self.decode, self.health)
        self.submitter = Submitter(self.config, self.placement, self.streams, self.decode, block_size,
                                   self.mark_down)
        # Called with (transport, num_bytes, seconds) per finished KV transfer (metrics hook).
        self.on_kv_transfer = lambda transport, num_bytes, seconds: None
        self._events = EventReceiver(self.config.event_host, self.on_event)
        self.event_address = self._events.address
        self._handlers = {Admission: self._on_admission, Tokens: self._on_tokens, StepTokens: self._on_step_tokens,
                          KVReady: self._on_kv_ready, Failed: self._on_failed, WorkerError: self._on_worker_error,
                          KVEvents: self._on_kv_events}
        self._rng = random.Random(0)
        # Pause / resume and weight updates (cluster/generation_control.py): every request passes its gate.
        views = self.placement.views
        self.generation = GenerationControl(
            self.abort, WorkerWeights(lambda: {**self.prefill, **self.decode},
                                      lambda wid: wid in views and views[wid].healthy, self.mark_down),
            self.config.request_timeout_s)
        self.health.weight_version = self._expected_weight_version
        self.health.on_weights_stale = self._resync_weights
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health_task: asyncio.Task | None = None
        self._closed = False

    # ---- seams ---------------------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, RequestState]:
        return self.streams.requests

    @property
    def lora_names(self) -> tuple[str, ...]:
        return self.lora.names

    async def load_lora(self, name: str, path: str) -> str:
        """Load a LoRA adapter on every worker while serving (cluster/router/lora.py); its digest."""
        views = self.placement.views
        return await self.lora.load(name, path, {**self.prefill, **self.decode},
                                    lambda wid: wid in views and views[wid].healthy)

    async def unload_lora(self, name: str) -> None:
        await self.lora.unload(name, {**self.prefill, **self.decode})

    async def flush_cache(self) -> bool:
        """Every live worker forgets its cached prefixes, in every KV tier (WorkerActor.reset_prefix_cache): SGLang's
        /flush_cache, vLLM's /reset_prefix_cache. True only when every one did. False, asking none, while requests
        are in flight (SGLang refuses then; asking would flush some workers and not others); False when a worker
        refused (a request there), failed or outlasted FLUSH_TIMEOUT_S, each logged (the others have flushed).
        The KV index forgets the flushed blocks by the workers' own "removed" events; the prefix_aware policy's
        memory of where prompts went (WorkerView.recent_hashes) is only the router's, so it is dropped here."""
        if self.generation.num_in_flight or self.streams.requests:
            log.warning("cache not flushed: %d requests in flight", max(self.generation.num_in_flight,
                                                                        len(self.streams.requests)))
            return False
        views = self.placement.views
        handles = {w: h for w, h in {**self.prefill, **self.decode}.items() if w in views and views[w].healthy}
        down = sorted((set(self.prefill) | set(self.decode)) - set(handles))
        if down:  # a worker Ray restarts keeps its disk tier: it may announce those blocks again
            log.warning("cache flush skips workers that are down: %s", ", ".join(down))
        if not handles:
            log.warning("cache not flushed: no worker is up")
            return False
        answers = await asyncio.gather(*(asyncio.wait_for(h.reset_prefix_cache.remote(), FLUSH_TIMEOUT_S)
                                         for h in handles.values()), return_exceptions=True)
        for worker_id, answer in zip(handles, answers):
            if answer is True:
                views[worker_id].recent_hashes.clear()
            else:
                why = ("a request holds blocks there" if answer is False else
                       f"no answer within {FLUSH_TIMEOUT_S:.0f} s" if isinstance(answer, asyncio.TimeoutError)
                       else _reason(answer))
                log.warning("worker %s did not flush its cache: %s", worker_id, why)
        return all(answer is True for answer in answers)

    @property
    def views(self):
        return self.placement.views

    def _expected_weight_version(self) -> str | None:
        """What every worker should serve, for the health check; None while an update or a sync runs (workers
        change one by one) and before any update (a worker's start-up weights are the cluster's)."""
        g = self.generation
        return None if g.weights_path is None or g.update_lock.locked() else g.weight_version

    async def _resync_weights(self, worker_id: str) -> None:
        """Give a worker that missed an update the served weights (the health check found it stale)."""
        handle = {**self.prefill, **self.decode}.get(worker_id)
        if handle is None:
            return
        g = self.generation
        async with g.exclusive():
            await WorkerWeights.sync(worker_id, handle, g.weights_path, g.weight_version, g.weights_digest)

    def record(self) -> DecisionRecorder:
        """Start recording decisions, recoveries and reports (tests, benchmarks); returns the record."""
        self.recorder = DecisionRecorder()
        return self.recorder

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve on ``loop``; calling it again with another loop moves the router there."""
        if self._loop is loop:
            return
        self._loop = loop
        self._events.bind(loop)
        if self._health_task is not None and not self._health_task.done():
            self._health_task.cancel()  # on the loop we leave (asyncio.run cancels its tasks anyway)
        self._health_task = loop.create_task(self.health.run(lambda: self._closed))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        task, loop = self._health_task, self._loop
        if task is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)
        self._events.close()
        self.close_trainer_weights()

    # ---- health ------------------------------------------------------------------------------------
    def mark_down(self, worker_id: str, reason: str) -> None:
        """Take a worker out of rotation and recover every request placed on it. Idempotent: every
        path that finds a worker dead (health check, a submit that failed) comes through here."""
        view = self.placement.views.get(worker_id)
        if view is not None and view.healthy:
            log.warning("worker %s is unhealthy (%s): recovering its requests", worker_id, reason)
            view.healthy = False
        self.worker_down(worker_id, reason)

    def worker_down(self, worker_id: str, reason: str = "") -> None:
        """Recover every request that still depends on ``worker_id``. A prefill worker stops mattering
        to a request once its KV has landed on the decode worker."""
        why = f"worker {worker_id} is down" + (f" ({reason})" if reason else "")
        for a in self.streams.pending():
            if a.decode_id == worker_id:  # its verdict will not come
                a.admitted.set_result(Admission(a.wid, worker_id, UNREACHABLE, why))
        for r in list(self.streams.requests.values()):
            a = r.attempt
            if r.finished or r.recovering or a is None:
                continue
            if a.decode_id == worker_id or (a.prefill_id == worker_id and not a.t_kv_ready):
                self._recover(r, why)

    def stats(self) -> dict:
        """What /health and /metrics show. A worker is listed healthy when it answers its health checks
        and, for a prefill worker, every decode worker is still wired to it: one that a decode worker
        lost (it was frozen past the peer timeout) is listed unhealthy, with the pair under
        ``unwired_pairs``, until the pair is re-wired."""
        self.placement.refresh(self.streams.requests.values())
        decodes = self.placement.role_views("decode")
        total_tokens = sum(v.num_blocks * v.block_size for v in decodes) or self.block_size
        used_tokens = sum(v.kv_tokens for v in decodes)
        running = sum(1 for r in self.streams.requests.values() if r.running)
        unwired = self.placement.unwired_pairs()
        cut_off = {p for p, _ in unwired}
        return {
            "num_requests_running": running,
            "num_requests_waiting": len(self.streams.requests) - running,
            "kv_cache_usage_perc": min(1.0, used_tokens / total_tokens),
            "healthy": any(v.healthy for v in decodes),
            "workers": [
                {"worker_id": v.worker_id, "role": v.role, "pid": v.pid, "kv_tokens": v.kv_tokens,
                 "num_requests": v.num_requests, "queued_prefill_tokens": v.queued_prefill_tokens,
                 "num_state_blocks": v.num_state_blocks, "kv_tiers": v.kv_tiers,
                 "kv_event_source": v.kv_event_source,
                 "healthy": v.healthy and v.worker_id not in cut_off, "draining": v.draining}
                for v in self.placement.views.values()
            ],
            "unwired_pairs": [{"prefill": p, "decode": d} for p, d in unwired],
            "block_size": self.block_size, "num_gpu_blocks": sum(v.num_blocks for v in decodes),
            **self._lora_usage(),
            "weights": self.generation.stats(),
            **self.counters,
        }

    def _lora_usage(self) -> dict:
        """The adapters of the requests running (placed) and waiting (not yet), for stats' "lora"; {} without LoRA."""
        if not self.max_loras:
            return {}
        running, waiting = set(), set()
        for r in self.streams.requests.values():
            if r.params.lora_name is not None:
                (running if r.running else waiting).add(r.params.lora_name)
        return {"lora": {"max_lora": self.max_loras, "running": sorted(running), "waiting": sorted(waiting)}}

    # ---- events (on the asyncio loop) ------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        self._handlers[type(event)](event)

    def _on_worker_error(self, ev: WorkerError) -> None:
        log.warning("worker %s reports its engine thread failed: %s", ev.worker_id, ev.error)

    def _on_kv_events(self, ev: KVEvents) -> None:
        if ev.worker_id not in self.placement.views:  # it left (late events) or is not in the cluster yet
            return
        self.kv_index.apply(ev.worker_id, ev.events)  # kind and tier were checked when the record was decoded

    def _on_admission(self, ev: Admission) -> None:
        # Also for a request that ended meanwhile: its placement loop is waiting for this verdict.
        found = self.streams.lookup(ev.request_id, ev.worker_id, live_only=False)
        if found is None:
            return
        r, a = found
        if a.admitted.done():
            # The verdict was given already: a worker_down answered UNREACHABLE for a decode worker that
            # had admitted it just before dying. The placement loop has moved on (it forgets this
            # placement); taking it as the request's now would make a later worker_down recover the
            # request beside that loop: two placements, one never forgotten (test_soak_long saw it).
            return
        if ev.verdict == ADMITTED and not r.finished:
            self.streams.admitted(r, a)  # now, so the events right behind this one find the placement
        a.admitted.set_result(ev)

    def _on_kv_ready(self, ev: KVReady) -> None:
        # Counted even when the request has finished meanwhile: the bytes moved.
        self.counters["kv_transfer_bytes"] += ev.num_bytes
        self.on_kv_transfer(ev.transport, ev.num_bytes, ev.seconds)
        found = self.streams.lookup(ev.request_id, ev.worker_id)
        if found is not None:
            self.streams.on_kv_ready(*found, ev)

    def _on_step_tokens(self, ev: StepTokens) -> None:
        self.streams.on_step_tokens(ev)  # each row for the request's current placement only, as _on_tokens

    def _on_tokens(self, ev: Tokens) -> None:
        found = self.streams.current(ev.request_id, ev.worker_id)
        if found is not None:
            self.streams.on_tokens(*found, ev)

    def _on_failed(self, ev: Failed) -> None:
        found = self.streams.current(ev.request_id, ev.worker_id)
        if found is None:
            return
        r, a = found
        breaker = self.placement.breaker(*a.pair)
        if breaker.record_failure(time.monotonic()):
            log.warning("placements on %s keep failing (last: %s): skipped for %.0f s", a.pair, ev.reason,
                        breaker.open_until - time.monotonic())
        r.failed_pair = a.pair
        self._recover(r, ev.reason)

    # ---- recovery --------------------------------------------------------------------------------------
    def _recover(self, r: RequestState, reason: str) -> None:
        """Place again a request whose placement failed, continuing its stream; or end it with an error."""
        self._abort_attempt(r)
        remaining = r.params.max_tokens - len(r.emitted)
        if remaining <= 0:  # everything was streamed already: nothing to recover
            self.streams.fail(r, "", reason="length")
            return
        if r.num_recoveries >= self.config.max_recoveries:
            self.streams.fail(r, f"{reason} (gave up after {r.num_recoveries} recoveries)")
            return
        r.num_recoveries += 1
        recovery = r.num_recoveries
        log.warning("recovering request %s after %d tokens: %s", r.request_id, len(r.emitted), reason)
        r.recovering = True
        r.attempt = None
        detected = time.monotonic()
        prompt = r.prompt_token_ids + r.emitted
        params = replace(r.params, max_tokens=remaining,
                         output_position_offset=r.params.output_position_offset + len(r.emitted),
                         prompt_logprobs=None if r.prompt_logprobs_sent else r.params.prompt_logprobs)

        async def place_again() -> None:
            try:
                await self.submitter.place(r, prompt, params)
                if self.recorder is not None:
                    self.recorder.recoveries.append((r.request_id, time.monotonic() - detected))
            except Exception as e:  # noqa: BLE001 - no healthy pair: end clearly, within the deadline
                self.streams.fail(r, f"{reason}; recovery failed: {e}")
            finally:
                if r.num_recoveries == recovery:  # not when its placement failed before this returned: the
                    r.recovering = False           # recovery that started then is still placing

        self._loop.create_task(place_again())

    def _abort_attempt(self, r: RequestState) -> None:
        """Stop the current placement: its decode worker frees its blocks and tells its prefill worker."""
        a = r.attempt
        if a is not None:
            self.streams.forget(a)
            if a.decode_id in self.decode:
                self.decode[a.decode_id].abort.remote(a.wid)

    # ---- requests ------------------------------------------------------------------------------------
    def _check(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """What only the router can know (ids in use, the decode pool); the API validated the rest."""
        if request_id in self.streams.requests:
            raise RouterError(f"request id {request_id!r} is already in use", status=400, kind="invalid_request_error")
        if not prompt_token_ids:
            raise RouterError("prompt is empty", status=400, kind="invalid_request_error")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RouterError(f"prompt has {len(prompt_token_ids)} tokens, max_model_len is {self.max_model_len}",
                              status=400, kind="invalid_request_error")
        pool_tokens = self.placement.pool_tokens()
        if pool_tokens and len(prompt_token_ids) + 1 > pool_tokens:
            raise RouterError(f"prompt has {len(prompt_token_ids)} tokens but the largest decode worker's KV pool "
                              f"holds {pool_tokens}", status=400, kind="invalid_request_error")

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        queue = DeltaQueue()
        merge = can_merge(params)
        async with self._placed(request_id, prompt_token_ids, params, queue.put_nowait):
            while True:  # one generator between the queue and the consumer: every token passes here
                delta = await queue.get()
                if merge:  # deltas that came while the consumer was busy go out as one (one chunk to the client)
                    delta = merge_queued(delta, queue)
                yield delta
                if delta.finished:
                    return

    async def deliver(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      on_delta: Callable[[TokenDelta], None],
                      on_row: Callable[[list[int], int, int, int], bool] | None = None) -> None:
        """The contract's push form (router_contract.py): ``on_delta`` is called from the event handler
        that made each delta, with no queue or task wake-up between (a router process behind API
        processes streams every token of every request through here); ``on_row`` takes plain deltas as
        their parts (RequestStreams.on_step_tokens)."""
        done = asyncio.get_running_loop().create_future()

        def put(delta: TokenDelta) -> None:
            if done.done():  # cancelled: the caller ends the stream itself
                return
            try:
                on_delta(delta)
            except Exception as e:  # noqa: BLE001 - raised from deliver(); the other rows of this event go on
                done.set_exception(e)
                return
            if delta.finished:
                done.set_result(None)

        def put_row(token_ids: list[int], num_output_tokens: int, num_draft_tokens: int,
                    num_accepted_tokens: int) -> bool:
            if done.done():  # as put: nothing reaches a cancelled caller
                return True
            try:
                return on_row(token_ids, num_output_tokens, num_draft_tokens, num_accepted_tokens)
            except Exception as e:  # noqa: BLE001 - as put
                done.set_exception(e)
                return True

        async with self._placed(request_id, prompt_token_ids, params, put, put_row if on_row is not None else None):
            await done

    @contextlib.asynccontextmanager
    async def _placed(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      deliver: Callable[[TokenDelta], None],
                      deliver_row: Callable[[list[int], int, int, int], bool] | None = None):
        """Place the request (RouterError if it cannot be), its deltas going to ``deliver``; leaving the
        block before its final delta (client disconnect, cancellation) aborts it."""
        loop = asyncio.get_running_loop()
        self.start(loop)
        self._check(request_id, prompt_token_ids)
        async with self.generation.entered(request_id, params.fork_group):
            async with self._placed_now(request_id, prompt_token_ids, params, deliver, deliver_row) as r:
                yield r

    @contextlib.asynccontextmanager
    async def _placed_now(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          deliver: Callable[[TokenDelta], None],
                          deliver_row: Callable[[list[int], int, int, int], bool] | None = None):
        loop = asyncio.get_running_loop()
        params = self.generation.stamp(self.lora.stamp(params))
        if params.seed is None:
            # Prefill and decode must draw from the same per-position streams.
            params = replace(params, seed=self._rng.randrange(1 << 31))
        r = RequestState(request_id, list(prompt_token_ids), params, deliver, deliver_row)
        timer = None
        try:
            await self.submitter.place(r, list(prompt_token_ids), params)
            # One timer for the request's deadline, not a timeout around each token's wait (asyncio.wait_for
            # makes a task, a future and a timer a call): at the deadline it ends the request, and the final
            # delta arrives like any other.
            timer = loop.call_later(max(r.t_arrival + self.config.request_timeout_s - time.monotonic(), 0.0),
                                    self._time_out, r)
            yield r
        finally:
            if timer is not None:
                timer.cancel()
                if not r.finished:  # placed, and the consumer went away (client disconnect)
                    self._abort_attempt(r)
                    self.streams.fail(r, "", reason="abort")
            group = params.fork_group
            if group is not None and not any(o.params.fork_group == group for o in self.streams.requests.values()):
                self.submitter.group_pairs.pop(group, None)  # the group's last request ended

    def _time_out(self, r: RequestState) -> None:
        if not r.finished:
            self._abort_attempt(r)
            self.streams.fail(r, f"request timed out after {self.config.request_timeout_s}s")

    async def abort(self, request_id: str) -> None:
        r = self.streams.requests.get(request_id)
        if r is not None and not r.finished:
            self._abort_attempt(r)
            self.streams.fail(r, "", reason="abort")
