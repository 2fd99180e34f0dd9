"""A router over ONE in-process colocated decode worker (no Ray, no KV transfer): what
``pdcluster serve --mode local`` and the HTTP tests run. It implements the contract of
cluster/api/router_contract.py exactly as the Ray cluster router does, so the HTTP layer cannot tell them apart.

Events arrive on the worker's engine thread and are handed to the request's asyncio queue with
``loop.call_soon_threadsafe``. Every wait is bounded: a request that hears nothing for
``request_timeout_s`` is aborted and ends with ``finish_reason="error"``. Whatever ends a stream early
(abort, client disconnect, timeout, an exception in the consumer) aborts the request on the worker,
which frees its blocks exactly once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, replace
from typing import AsyncIterator, Callable

from pdcluster.cluster.api.router_contract import RouterError, TokenDelta
from pdcluster.cluster.delta_queue import DeltaQueue
from pdcluster.cluster.generation_control import GenerationControl, WeightControlled
from pdcluster.cluster.router.lora import already_loaded, not_found
from pdcluster.cluster.token_deltas import can_merge, is_first_token, is_progress_report, merge_queued, token_delta
from pdcluster.decode_node.worker import DecodeWorker
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.lora.adapter import LoraAdapterError
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.sleep import SleepError
from pdcluster.engine.weight_update import WeightUpdateError
from pdcluster.node.actor import (LORA_LOAD_TIMEOUT_S, WEIGHTS_COMMIT_TIMEOUT_S, flush_when_idle, sleep_when_idle,
                                  wake_worker)
from pdcluster.node.events import ADMITTED, Admission, Failed, KVEvents, StepTokens, Tokens, WorkerError

class _Aborted:
    """Queued to a stream the router aborted (not a worker event)."""


class _TimedOut:
    """Queued to a stream by its watchdog: nothing came for request_timeout_s (not a worker event)."""


class _Watchdog:
    """Calls ``on_expiry`` once nothing kicked it for ``timeout_s`` and nothing is ``pending`` (events
    queued for a consumer that is slow, not a worker that is stuck). A kick only notes the time (a wait
    with asyncio.wait_for would make a task, a future and a timer for every event); the one timer, when
    it fires early, sleeps again for what is left."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, on_expiry, pending=lambda: False):
        self._loop, self._timeout_s, self._on_expiry, self._pending = loop, timeout_s, on_expiry, pending
        self._last = loop.time()
        self._timer = loop.call_later(timeout_s, self._fire)

    def kick(self) -> None:
        self._last = self._loop.time()

    def cancel(self) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        left = self._last + self._timeout_s - self._loop.time()
        if left > 0 or self._pending():
            self._timer = self._loop.call_later(left if left > 0 else self._timeout_s, self._fire)
        else:
            self._on_expiry()


def _plain_tokens(event) -> bool:
    """A queued worker event that only adds tokens: it may join the delta before it."""
    return isinstance(event, Tokens) and not is_progress_report(event)


def _hand_over_each(items: list[tuple]) -> None:
    """A step's items for one loop, on it: (a stream's ``put_nowait``, (an event,)) or (its ``put_row``, a row's
    parts)."""
    for fn, args in items:
        fn(*args)


class _TimedDecodeWorker(DecodeWorker):
    """A colocated DecodeWorker whose first ``Tokens`` event of a request also says how long the request
    queued before its first step (``queue_s``) and how long that first token took (``prefill_s``):
    the queue and prefill parts of TTFT. It also publishes ``snapshot``, its ``stats()`` as of the last
    turn of its loop, so readers on other threads never wait for a step. Bookkeeping stays on the
    engine thread."""

    def __init__(self, worker_id: str, engine_config: EngineConfig):
        self._tick_started = time.monotonic()
        self._submitted_at: dict[str, float] = {}  # request id -> when submit() was called
        self._scheduled_at: dict[str, float] = {}  # request id -> first schedule, until its first event
        # Requests whose first Tokens event went out: written on the engine thread only, read by the router there.
        self.first_sent: set[str] = set()
        self.snapshot: dict | None = None
        super().__init__(worker_id, engine_config, transfer=None)  # starts the engine thread

    def submit(self, request_id, prompt_token_ids, params, prefill_id=None) -> None:
        self.post(self._submit_timed, time.monotonic(), request_id, list(prompt_token_ids), params)

    def _submit_timed(self, submitted_at, request_id, prompt_token_ids, params) -> None:
        self._submitted_at[request_id] = submitted_at
        self._submit(request_id, prompt_token_ids, params, None)

    def tick(self) -> bool:
        self._tick_started = time.monotonic()  # a step schedules at its start
        busy = super().tick()
        for request in self.engine.scheduler.running:
            if request.request_id not in self.first_sent:
                self._scheduled_at.setdefault(request.request_id, self._tick_started)
        self.snapshot = self._stats()  # one reference swap: readers see a whole dict
        return busy

    def emit(self, event) -> None:
        if isinstance(event, Tokens):
            event = self.timed(event)
            if event.finished:
                self._forget(event.request_id)
        elif isinstance(event, Failed):
            self._forget(event.request_id)
        super().emit(event)  # a StepTokens' rows are timed by the router, which expands it (timed())

    def timed(self, event: Tokens) -> Tokens:
        """``event``, with the TTFT parts when it carries its request's first token. The first token's
        event, not the first event: a prompt longer than one prefill chunk reports each chunk before it
        (Tokens without tokens: the scheduler's count, S1)."""
        request_id = event.request_id
        if not event.new_token_ids or request_id in self.first_sent:
            return event
        self.first_sent.add(request_id)
        scheduled = self._scheduled_at.pop(request_id, self._tick_started)
        submitted = self._submitted_at.pop(request_id, scheduled)
        return replace(event, queue_s=max(scheduled - submitted, 0.0), prefill_s=max(time.monotonic() - scheduled, 0.0))

    def _abort(self, request_id: str) -> None:
        self._forget(request_id)
        super()._abort(request_id)

    def _forget(self, request_id: str | None) -> None:
        self._submitted_at.pop(request_id, None)
        self._scheduled_at.pop(request_id, None)
        self.first_sent.discard(request_id)


class _EngineWeights:
    """A weight update's targets (cluster/generation_control.py): the one engine. It reads the checkpoint on a thread
    of its own (the engine only reads its config for it) and copies it in on the engine thread."""

    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    async def prepare(self, model_path: str, weight_version: str) -> str:
        try:
            return await asyncio.to_thread(self.worker.engine.prepare_weights, model_path, weight_version)
        except WeightUpdateError as e:
            raise RouterError(str(e), status=400, kind="invalid_request_error") from None

    async def discard(self) -> None:
        self.worker.engine.discard_weights()

    async def commit(self) -> list[dict]:
        update = await asyncio.to_thread(self.worker.call, self.worker.engine.commit_weights,
                                         timeout_s=WEIGHTS_COMMIT_TIMEOUT_S)
        return [{"worker_id": self.worker.worker_id, **asdict(update)}]

    async def release(self, tags: tuple[str, ...], level: int) -> list[dict]:
        return [await _sleep_call(sleep_when_idle, self.worker, tags, level)]

    async def wake_up(self, tags: tuple[str, ...]) -> list[dict]:
        return [await _sleep_call(wake_worker, self.worker, tags)]


async def _sleep_call(fn, *args) -> dict:
    """``fn`` (node/actor.py's sleep_when_idle or wake_worker) off the event loop; its SleepError as a 400."""
    try:
        return await asyncio.to_thread(fn, *args)
    except SleepError as e:
        raise RouterError(str(e), status=400, kind="invalid_request_error") from None


class LocalRouter(WeightControlled):
    """Router contract (cluster/api/router_contract.py) over one colocated DecodeWorker built from ``engine_config``."""

    def __init__(self, engine_config: EngineConfig, request_timeout_s: float = 300.0, worker_id: str = "local"):
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
        self.request_timeout_s = request_timeout_s
        self.worker = _TimedDecodeWorker(worker_id, engine_config)
        engine = self.worker.engine
        self.model_name = engine_config.model
        self.max_model_len = engine.max_model_len
        self.max_images_per_prompt = engine.max_images_per_prompt
        self.mm_processor_kwargs = engine_config.mm_processor_kwargs
        self.lora_names = engine.lora_names
        self.tokenizer = engine.tokenizer
        # request id -> (its event loop, its queue); written on the loop, read on the engine thread.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaQueue]] = {}
        self._closed = False
        self.worker.on_event = self._on_event
        # Pause / resume and weight updates (cluster/generation_control.py): every request passes its gate.
        self.generation = GenerationControl(self.abort, _EngineWeights(self.worker), request_timeout_s)
        self.generation.start_path = engine.weights_path

    # ---- engine thread ------------------------------------------------------------------------------
    def _on_event(self, event) -> None:
        if isinstance(event, KVEvents):  # one engine: nothing to place, no index to feed
            return
        if isinstance(event, WorkerError):  # the engine thread is dying: fail every stream
            failure = Failed(request_id="", worker_id=event.worker_id, reason=f"engine worker failed: {event.error}")
            for loop, queue in list(self._streams.values()):
                self._deliver(loop, queue, failure)
            return
        if isinstance(event, StepTokens):
            self._on_step_tokens(event)
            return
        stream = self._streams.get(event.request_id)
        if stream is not None:
            self._deliver(*stream, event)

    def _on_step_tokens(self, event: StepTokens) -> None:
        """A step's plain rows, with one hand-over per event loop for the whole step (each call_soon_threadsafe
        wakes the loop). A row that only adds tokens to a stream under way (its first token went out: events of
        one stream reach its loop in order, so the consumer has had it) whose consumer takes rows (``deliver``'s
        ``on_row``) goes as its parts; no ``Tokens`` event or ``TokenDelta`` is made for it (as the cluster
        router's RequestStreams.on_step_tokens). Every other row goes as the ``Tokens`` it stands for."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        streams, first_sent, token_ids = self._streams, self.worker.first_sent, event.new_token_ids
        start = 0
        for i, (request_id, n) in enumerate(zip(event.request_ids, event.num_new_tokens)):
            stream = streams.get(request_id)
            if stream is not None:
                loop, consumer = stream
                if n and type(consumer) is _Push and consumer.put_row is not None and request_id in first_sent:
                    parts = (token_ids[start:start + n], event.num_output_tokens[i], event.num_draft_tokens[i],
                             event.num_accepted_tokens[i], event, i, start)
                    item = (consumer.put_row, parts)
                else:
                    item = (consumer.put_nowait, (self.worker.timed(event.row(i, start)),))
                by_loop.setdefault(loop, []).append(item)
            start += n
        for loop, items in by_loop.items():
            self._call_on(loop, _hand_over_each, items)

    @property
    def num_open_streams(self) -> int:
        """Requests whose stream has not ended (tests check that everything ended)."""
        return len(self._streams)

    @staticmethod
    def _deliver(loop: asyncio.AbstractEventLoop, queue: DeltaQueue, event: dict) -> None:
        LocalRouter._call_on(loop, queue.put_nowait, event)

    @staticmethod
    def _call_on(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- the contract -------------------------------------------------------------------------------
    def _admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self._closed or self.worker.loop_error is not None:
            reason = "router is closed" if self._closed else f"engine worker failed: {self.worker.loop_error!r}"
            raise RouterError(f"cannot serve requests: {reason}", status=503)
        if request_id in self._streams:
            raise RouterError(f"request id {request_id!r} is already in use", status=400,
                              kind="invalid_request_error")
        # The API validated the request; what only this router knows is the size of its KV pool. Reads
        # only the engine's fixed limits: safe off its thread.
        engine = self.worker.engine
        need = -(-(len(prompt_token_ids) + 1 + engine.config.num_spec_steps) // engine.config.block_size)
        if not prompt_token_ids or need > engine.kv_spec.num_blocks:
            raise RouterError(f"prompt has {len(prompt_token_ids)} tokens and needs {need} KV blocks, but the pool "
                              f"holds {engine.kv_spec.num_blocks}", status=400, kind="invalid_request_error")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        self._admit(request_id, prompt_token_ids, params)
        async with self.generation.entered(request_id, params.fork_group):
            async for delta in self._generate(request_id, prompt_token_ids, self.generation.stamp(params)):
                yield delta

    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[TokenDelta]:
        self._admit(request_id, prompt_token_ids, params)
        queue = DeltaQueue()
        loop = asyncio.get_running_loop()
        self._streams[request_id] = (loop, queue)
        watchdog = _Watchdog(loop, self.request_timeout_s, lambda: queue.put_nowait(_TimedOut()),
                             pending=lambda: not queue.empty())
        deltas = _Deltas(request_id, len(prompt_token_ids), params, self.request_timeout_s)
        merge = can_merge(params)
        try:
            self.worker.submit(request_id, prompt_token_ids, params)
            while True:
                event = await queue.get()
                if not isinstance(event, _TimedOut):
                    watchdog.kick()
                delta = deltas.of(event)
                if delta is None:
                    continue
                if merge:  # tokens that came while the consumer was busy go out as one delta (one chunk to the client)
                    delta = merge_queued(delta, queue, _plain_tokens, deltas.of)
                yield delta
                if delta.finished:
                    return
        finally:
            watchdog.cancel()
            self._streams.pop(request_id, None)
            if not deltas.ended_on_worker:
                self.worker.abort(request_id)  # idempotent; frees the blocks on the engine thread

    async def deliver(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      on_delta: Callable[[TokenDelta], None],
                      on_row: Callable[[list[int], int, int, int], bool] | None = None) -> None:
        """The contract's push form (a router process behind API processes streams every token through it): each
        event's delta goes to ``on_delta`` from the loop's hand-over of the engine's step, with no queue, waiter
        or generator per request in between (as ClusterRouter.deliver). With ``on_row``, a step's row of a stream
        under way goes to it as its parts (_on_step_tokens); one it declines comes to ``on_delta`` as its delta."""
        self._admit(request_id, prompt_token_ids, params)
        async with self.generation.entered(request_id, params.fork_group):
            await self._deliver_now(request_id, prompt_token_ids, self.generation.stamp(params), on_delta, on_row)

    async def _deliver_now(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                           on_delta: Callable[[TokenDelta], None],
                           on_row: Callable[[list[int], int, int, int], bool] | None = None) -> None:
        self._admit(request_id, prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        deltas = _Deltas(request_id, len(prompt_token_ids), params, self.request_timeout_s)

        def on_event(event) -> None:
            if done.done():  # ended (or cancelled): the rest is not the caller's
                return
            if not isinstance(event, _TimedOut):
                watchdog.kick()
            delta = deltas.of(event)
            if delta is None:
                return
            try:
                on_delta(delta)
            except Exception as e:  # noqa: BLE001 - raised from deliver(); the step's other rows go on
                done.set_exception(e)
                return
            if delta.finished:
                done.set_result(None)

        def on_row_parts(token_ids: list[int], num_output_tokens: int, num_draft_tokens: int,
                         num_accepted_tokens: int, step: StepTokens, i: int, start: int) -> None:
            if done.done():
                return
            watchdog.kick()
            try:
                taken = on_row(token_ids, num_output_tokens, num_draft_tokens, num_accepted_tokens)
            except Exception as e:  # noqa: BLE001 - as on_event's
                done.set_exception(e)
                return
            if not taken:  # declined: the same row as the delta it stands for
                on_event(step.row(i, start))

        self._streams[request_id] = (loop, _Push(on_event, on_row_parts if on_row is not None else None))
        watchdog = _Watchdog(loop, self.request_timeout_s, lambda: on_event(_TimedOut()))
        try:
            self.worker.submit(request_id, prompt_token_ids, params)
            await done
        finally:
            watchdog.cancel()
            self._streams.pop(request_id, None)
            if not deltas.ended_on_worker:
                self.worker.abort(request_id)  # idempotent; frees the blocks on the engine thread

    async def load_lora(self, name: str, path: str) -> str:
        """Load a LoRA adapter while serving (--enable-lora; LLMEngine.load_lora): its digest."""
        if name in self.lora_names:
            raise already_loaded(name)
        engine = self.worker.engine

        def load() -> tuple[str, tuple[str, ...]]:
            return engine.load_lora(name, path), engine.lora_names

        try:
            digest, self.lora_names = await asyncio.to_thread(self.worker.call, load, timeout_s=LORA_LOAD_TIMEOUT_S)
        except LoraAdapterError as e:
            raise RouterError(str(e), status=400, kind="invalid_request_error") from None
        return digest

    async def unload_lora(self, name: str) -> None:
        if name not in self.lora_names:
            raise not_found(name)
        engine = self.worker.engine

        def unload() -> tuple[str, ...]:
            engine.unload_lora(name)
            return engine.lora_names

        self.lora_names = await asyncio.to_thread(self.worker.call, unload)

    async def flush_cache(self) -> bool:
        """Forget every cached prefix, in every KV tier (LLMEngine.reset_prefix_cache, on the engine thread): SGLang's
        /flush_cache, vLLM's /reset_prefix_cache. False, nothing changed, while a request is on the engine (one that
        just ended is given a moment: node/actor.py flush_when_idle)."""
        if self.generation.num_in_flight or self._streams:
            return False  # at once: the wait below is for a request that just ended, not one that runs
        return await asyncio.to_thread(flush_when_idle, self.worker)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        self.worker.abort(request_id)
        if stream is not None:
            self._deliver(*stream, _Aborted())

    def stats(self) -> dict:
        """Never blocks: the worker's figures as of its last loop turn (at most a step old)."""
        if self._closed or self.worker.loop_error is not None:
            return {"healthy": False, "error": "router is closed" if self._closed else repr(self.worker.loop_error),
                    "num_requests_running": 0, "num_requests_waiting": 0, "workers": []}
        s = self.worker.snapshot
        if s is None:  # the engine thread has not turned once yet: nothing can have run
            n = self.worker.engine.kv_spec.num_blocks
            s = {"worker_id": self.worker.worker_id, "num_free_blocks": n, "num_blocks": n, "num_running": 0,
                 "num_waiting": 0, "num_reserved": 0}
        return {
            "healthy": True,
            "mode": "local",
            "num_requests": len(self._streams),  # open streams, including those not yet on the engine
            "num_requests_running": s["num_running"],
            "num_requests_waiting": s["num_waiting"],
            "kv_cache_usage_perc": 1.0 - s["num_free_blocks"] / s["num_blocks"],
            "block_size": self.worker.engine.config.block_size, "num_gpu_blocks": s["num_blocks"],
            **({"lora": s["lora"]} if "lora" in s else {}),
            "weights": self.generation.stats(),
            "workers": [s if (publisher := self.worker.kv_event_publisher) is None
                        else {**s, "kv_event_source": publisher.source()}],
        }

    def close(self) -> None:
        """Stop the engine thread; open streams end with an error."""
        self._closed = True
        for loop, queue in list(self._streams.values()):
            self._deliver(loop, queue, Failed(request_id="", worker_id="", reason="router is shutting down"))
        self.worker.close()
        self.close_trainer_weights()


class _Push:
    """A stream's consumer in the push form (LocalRouter.deliver): events are handed to ``on_event`` as they come,
    on the stream's loop (where the pull form's DeltaQueue takes them); with ``on_row_parts``, the rows of a stream
    under way as their parts (LocalRouter._on_step_tokens)."""

    __slots__ = ("put_nowait", "put_row")

    def __init__(self, on_event, on_row_parts=None):
        self.put_nowait, self.put_row = on_event, on_row_parts


class _Deltas:
    """One request's worker events as the client's deltas: None for what the client is not told (a prefill chunk's
    progress, an admission), a final error delta for a failure, a refusal or silence. ``ended_on_worker``: the
    worker (or an abort already sent to it) ended the request, so leaving the stream must not abort it again."""

    def __init__(self, request_id: str, num_prompt_tokens: int, params: SamplingParams, timeout_s: float):
        self.request_id, self.num_prompt, self.timeout_s = request_id, num_prompt_tokens, timeout_s
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.weight_version = params.weight_version
        self.seen_first_token = False
        self.ended_on_worker = False

    def of(self, event) -> TokenDelta | None:
        if isinstance(event, Tokens):
            if is_progress_report(event):
                return None  # a prefill chunk's progress report: nothing for the client yet
            first = is_first_token(event, self.seen_first_token)
            self.seen_first_token = self.seen_first_token or first
            self.ended_on_worker = event.finished
            return token_delta(event, num_prompt_tokens=self.num_prompt, num_output_tokens=event.num_output_tokens,
                               num_cached_tokens=event.num_cached_tokens, first=first,
                               prompt_logprobs=self.wants_prompt_logprobs,
                               ttft_breakdown={"queue": event.queue_s, "prefill": event.prefill_s} if first else None,
                               num_offloaded_tokens=event.num_offloaded_tokens,
                               weight_version=self.weight_version)
        if isinstance(event, _TimedOut):  # leaving the stream aborts it on the worker
            return _error_delta(self.num_prompt, f"request {self.request_id} made no progress for "
                                                 f"{self.timeout_s:g} s and was aborted")
        if isinstance(event, _Aborted):
            self.ended_on_worker = True  # LocalRouter.abort told the worker
            return TokenDelta([], finished=True, finish_reason="abort", num_prompt_tokens=self.num_prompt)
        if isinstance(event, Failed):
            return _error_delta(self.num_prompt, event.reason or "request failed")
        if isinstance(event, Admission) and event.verdict != ADMITTED:
            return _error_delta(self.num_prompt, f"not admitted ({event.verdict}): {event.reason}")
        return None


def _error_delta(num_prompt_tokens: int, message: str) -> TokenDelta:
    return TokenDelta([], finished=True, finish_reason="error", num_prompt_tokens=num_prompt_tokens, error=message)
