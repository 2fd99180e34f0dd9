"""The global router of the Ray cluster: places each request on a (prefill, decode) pair, streams its
tokens back, and keeps per-request and per-worker token accounting.

Recovery: when a worker dies (its actor stops answering the health check) or a transfer fails, the
router re-places the request on a healthy pair with prompt + the tokens already streamed as the new
prompt; random draws stay keyed by the original output positions, so the client's stream simply
continues (with greedy sampling it equals an uninterrupted run). Each placement gets its own worker-side
request id (``request_id#attempt``) so late events from a dead placement are ignored.

Accounting (invariant S1, one level up): a request's ``num_computed_tokens`` is whatever its decode
worker last reported after acceptance; a worker's load is *derived* from its requests' reported counts
each time it is read. Nothing here is advanced by "+1 per step", so speculative steps that emit several
tokens (or none) cannot make the router drift.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator

import msgpack
import zmq

from pdcluster.cluster.policies import Breaker, Placer, WorkerView
from pdcluster.cluster.router_api import RouterError, TokenDelta
from pdcluster.engine.block_manager import chained_block_hashes
from pdcluster.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class RequestState:
    request_id: str
    num_prompt_tokens: int
    queue: asyncio.Queue
    prompt_token_ids: list[int] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    emitted: list[int] = field(default_factory=list)  # tokens already streamed to the client
    attempt: int = 0
    recovering: bool = False
    prefill_id: str | None = None
    decode_id: str | None = None
    local: bool = False  # prefilled on the decode worker itself (colocated / conditional)
    num_computed_tokens: int = 0  # authoritative, from the decode worker
    num_output_tokens: int = 0
    reserved_tokens: int = 0  # prompt tokens reserved on the decode worker before its first report
    finished: bool = False
    t_arrival: float = field(default_factory=time.monotonic)
    t_submit: float = 0.0
    t_first_token: float = 0.0
    t_kv_ready: float = 0.0
    t_first_decode: float = 0.0
    # Decode deltas that overtook the prefill worker's first token (two sockets, no cross order).
    early: list = field(default_factory=list)
    failed_pair: tuple | None = None  # (prefill_id, decode_id) of the placement that last failed

    @property
    def pair(self) -> tuple:
        return (None if self.local else self.prefill_id, self.decode_id)

    @property
    def kv_tokens(self) -> int:
        return max(self.num_computed_tokens, self.reserved_tokens)

    @property
    def wid(self) -> str:
        """The id the workers know this placement by."""
        return f"{self.request_id}#{self.attempt}"


async def _no_rewire(worker_id: str) -> None:
    return None


@dataclass
class Decision:
    request_id: str
    prefill_id: str | None
    decode_id: str
    local: bool


class ClusterRouter:
    def __init__(
        self,
        prefill: dict,  # worker_id -> Ray actor handle
        decode: dict,
        tokenizer,
        model_name: str,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        policy: str = "least_loaded",
        mode: str = "disagg",
        num_spec_tokens: int = 0,
        conditional_prefill_tokens: int = 0,  # prompts this short prefill on the decode worker
        busy_prefill_tokens: int = 0,  # when every prefill worker has this much queued: prefill on D
        request_timeout_s: float = 300.0,
        admission_wait_s: float = 30.0,
        event_host: str = "127.0.0.1",
    ):
        self.prefill = prefill
        self.decode = decode
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.mode = mode
        self.placer = Placer(policy, num_spec_tokens)
        self.conditional_prefill_tokens = conditional_prefill_tokens
        self.busy_prefill_tokens = busy_prefill_tokens
        self.request_timeout_s = request_timeout_s
        self.admission_wait_s = admission_wait_s
        self.reserve_timeout_s = 30.0
        self.views = {wid: WorkerView(wid, "prefill", num_blocks, block_size) for wid in prefill}
        self.views.update({wid: WorkerView(wid, "decode", num_blocks, block_size) for wid in decode})
        self.requests: dict[str, RequestState] = {}
        self._by_wid: dict[str, RequestState] = {}
        self._placing: dict[str, list[dict]] = {}  # worker-side ids being reserved -> events that came early
        self.max_recoveries = 3
        self.health_interval_s = 1.0
        self.ping_timeout_s = 5.0
        self.max_strikes = 3
        # One engine step longer than this is a stuck worker, not a slow one (a CPU prefill chunk of
        # 512 tokens on SmolLM2 takes about a second here).
        self.stall_timeout_s = 120.0
        # Circuit breakers per (prefill, decode) pair: a pair whose placements keep failing is skipped
        # for a cool-down, then tried again (policies.Breaker).
        self.breakers: dict[tuple, Breaker] = {}
        self.breaker_threshold = 3
        self.breaker_cooldown_s = 5.0
        self.incarnations: dict[str, str] = {}  # worker id -> the process incarnation its pings report
        # Awaited with a worker id after Ray restarted that worker (launcher re-runs the handshakes).
        self.on_worker_restarted = _no_rewire
        self.recoveries: list[tuple[str, float]] = []  # (request_id, seconds from detection to re-placement)
        self.decisions: list[Decision] = []
        self.reports: list[dict] = []  # recent decode reports (tests compare accounting against them)
        self.keep_reports = False
        self.counters = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "kv_transfer_bytes": 0}
        # Called with (transport, num_bytes, seconds) per finished KV transfer (metrics hook).
        self.on_kv_transfer = lambda transport, num_bytes, seconds: None
        self._rng = random.Random(0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{event_host}")
        self.event_address = f"tcp://{event_host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._event_loop, name="router-events", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()
        self._health_task = loop.create_task(self._health_loop())

    async def _health_loop(self) -> None:
        """Ping every worker; a worker that errors or stays silent is taken out of rotation (its
        requests recovered) and pinged again later: it comes back once it answers (circuit breaker).
        A worker that answers with a new incarnation was restarted by Ray: whatever it held is gone,
        so its requests are recovered and it is re-wired (``on_worker_restarted``) before it rejoins."""
        strikes: dict[str, int] = {}
        while not self._stop.is_set():
            await asyncio.sleep(self.health_interval_s)
            # Concurrently: one silent worker must not delay the verdict on the others.
            await asyncio.gather(*(self._check_worker(wid, handle, strikes)
                                   for wid, handle in [*self.prefill.items(), *self.decode.items()]
                                   if wid in self.views))

    async def _check_worker(self, wid: str, handle, strikes: dict[str, int]) -> None:
        view = self.views[wid]
        incarnation = None
        try:
            alive, incarnation, stalled_s = await asyncio.wait_for(handle.ping.remote(), timeout=self.ping_timeout_s)
            if not alive:
                reason = "its engine thread stopped"
            elif stalled_s > self.stall_timeout_s:
                reason = f"its engine thread has been stuck in one step for {stalled_s:.0f} s"
            else:
                reason = None
            strikes[wid] = 0
        except asyncio.TimeoutError:
            # Slow is not dead (an overloaded CPU delays everything): only repeated silence is.
            strikes[wid] = strikes.get(wid, 0) + 1
            reason = f"no answer to {strikes[wid]} health checks" if strikes[wid] >= self.max_strikes else None
        except Exception as e:  # noqa: BLE001 - the actor is gone or restarting (RayActorError and kin)
            reason = f"{type(e).__name__}"
        known = self.incarnations.get(wid)
        if reason is None and incarnation is not None and known is not None and incarnation != known:
            # Restarted between two checks: its KV, reservations and peers are gone.
            self.mark_down(wid, "restarted by Ray")
            try:
                await self.on_worker_restarted(wid)
            except Exception as e:  # noqa: BLE001 - stays out of rotation; retried on the next check
                log.warning("worker %s restarted but could not be re-wired: %s", wid, e)
                return
            self.incarnations[wid] = incarnation
            log.warning("worker %s restarted (incarnation %s): re-wired, back in rotation", wid, incarnation)
            view.healthy = True
            return
        if reason is None:
            if incarnation is not None and known is None:
                self.incarnations[wid] = incarnation
            if not view.healthy:
                log.warning("worker %s answers again: back in rotation", wid)
                view.healthy = True
        else:
            # Also sweeps requests that reached an already-unhealthy worker (e.g. admitted just before).
            self.mark_down(wid, reason)

    def mark_down(self, worker_id: str, reason: str) -> None:
        """Take a worker out of rotation and recover every request placed on it. Idempotent: every
        path that finds a worker dead (health check, failed reservation) comes through here, so none of
        them can leave its requests behind."""
        view = self.views.get(worker_id)
        if view is not None and view.healthy:
            log.warning("worker %s is unhealthy (%s): recovering its requests", worker_id, reason)
            view.healthy = False
        self.worker_down(worker_id, reason)

    def worker_down(self, worker_id: str, reason: str = "") -> None:
        """Recover every request that still depends on ``worker_id``. A prefill worker stops mattering
        to a request once its KV has landed on the decode worker."""
        for r in list(self.requests.values()):
            if r.finished or r.recovering:
                continue
            on_decode = r.decode_id == worker_id
            on_prefill = r.prefill_id == worker_id and not r.t_kv_ready
            if on_decode or on_prefill:
                self._recover(r, f"worker {worker_id} is down" + (f" ({reason})" if reason else ""))

    def close(self) -> None:
        self._stop.set()
        task = getattr(self, "_health_task", None)
        if task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(task.cancel)
        self._thread.join(2.0)
        self._pull.close(0)

    def _event_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    data = self._pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    event = msgpack.unpackb(data, raw=False)
                except Exception:  # noqa: BLE001 - malformed event: drop, log, live on
                    log.warning("dropping undecodable worker event (%d bytes)", len(data))
                    continue
                if isinstance(event, dict) and self._loop is not None:
                    try:
                        self._loop.call_soon_threadsafe(self.on_event, event)
                    except RuntimeError:  # the loop is closed (shutting down): nobody is listening
                        return

    # ---- accounting (derived, S1) -------------------------------------------------------------------
    def worker_kv_tokens(self, worker_id: str) -> int:
        return sum(r.kv_tokens for r in self.requests.values() if r.decode_id == worker_id)

    def _refresh_views(self) -> None:
        for view in self.views.values():
            view.kv_tokens = 0
            view.num_requests = 0
            view.queued_prefill_tokens = 0
        for r in self.requests.values():
            if r.decode_id in self.views:
                v = self.views[r.decode_id]
                v.kv_tokens += r.kv_tokens
                v.num_requests += 1
            if r.prefill_id in self.views and not r.t_first_token:
                self.views[r.prefill_id].queued_prefill_tokens += r.num_prompt_tokens

    def stats(self) -> dict:
        self._refresh_views()
        total_blocks = sum(v.num_blocks for v in self.views.values() if v.role == "decode") or 1
        used_tokens = sum(v.kv_tokens for v in self.views.values() if v.role == "decode")
        running = sum(1 for r in self.requests.values() if r.t_kv_ready or r.local)
        return {
            "num_requests_running": running,
            "num_requests_waiting": len(self.requests) - running,
            "kv_cache_usage_perc": min(1.0, used_tokens / (total_blocks * self.block_size)),
            "healthy": any(v.healthy for v in self.views.values() if v.role == "decode"),
            "workers": [
                {"worker_id": v.worker_id, "role": v.role, "kv_tokens": v.kv_tokens, "num_requests": v.num_requests,
                 "queued_prefill_tokens": v.queued_prefill_tokens, "healthy": v.healthy}
                for v in self.views.values()
            ],
            **self.counters,
        }

    # ---- events from workers (run on the asyncio loop) -------------------------------------------------
    def on_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "transfer_done":  # may arrive after the request finished: count it regardless
            self.counters["kv_transfer_bytes"] += int(event.get("num_bytes", 0))
            self.on_kv_transfer(str(event.get("transport", "")), int(event.get("num_bytes", 0)),
                                float(event.get("seconds", 0.0)))
            return
        wid = event.get("request_id", "")
        if wid in self._placing:
            # The decode worker can fail a reservation (or stream) before the reserve() call that made
            # it has returned here: keep the event until the placement is registered.
            self._placing[wid].append(event)
            return
        r = self._by_wid.get(wid)
        if r is None or r.finished or r.recovering or r.wid != wid:
            return
        now = time.monotonic()
        if kind == "first_token":
            if event.get("worker_id") != r.prefill_id:
                return
            r.t_first_token = now
            r.emitted.append(int(event["token_id"]))
            r.queue.put_nowait(TokenDelta([int(event["token_id"])], num_prompt_tokens=r.num_prompt_tokens,
                                          num_output_tokens=len(r.emitted),
                                          ttft_breakdown={"queue": r.t_submit - r.t_arrival, "prefill": now - r.t_submit}))
            early, r.early = r.early, []
            for e in early:
                self._on_tokens(r, e, now)
        elif kind == "kv_ready":
            r.t_kv_ready = now
            self.breaker(*r.pair).record_success()  # the pair moved a request's KV: the link works

        elif kind == "tokens":
            self._on_tokens(r, event, now)
        elif kind == "failed":
            if event.get("worker_id") not in (r.prefill_id, r.decode_id):
                return  # from a worker this placement no longer uses
            pair = r.pair
            if self.breaker(*pair).record_failure(now):
                log.warning("placements on %s keep failing (last: %s): skipped for %.0f s", pair,
                            event.get("reason"), self.breaker(*pair).open_until - now)
            r.failed_pair = pair
            self._recover(r, str(event.get("reason")))

    def _on_tokens(self, r: RequestState, event: dict, now: float) -> None:
        if event.get("worker_id") != r.decode_id:
            return
        if not r.local and not r.t_first_token:
            r.early.append(event)
            return
        if self.keep_reports:
            self.reports.append(dict(event))
        # S1: overwrite from the report; never count steps.
        r.num_computed_tokens = int(event["num_computed_tokens"])
        if not r.t_first_decode:
            r.t_first_decode = now
        first_local = not r.t_first_token
        if first_local:
            r.t_first_token = now  # local request: the decode worker produced the first token
            self.breaker(None, r.decode_id).record_success()
        new = list(event["new_token_ids"])
        r.emitted.extend(new)
        # The decode worker counts this placement's outputs; earlier placements' are in its prompt.
        r.num_output_tokens = len(r.emitted)
        delta = TokenDelta(new, num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
                           num_draft_tokens=int(event.get("num_draft_tokens", 0)),
                           num_accepted_tokens=int(event.get("num_accepted_tokens", 0)))
        if first_local:
            delta.ttft_breakdown = {"queue": r.t_submit - r.t_arrival, "prefill": now - r.t_submit}
        if event.get("finished"):
            delta.finished = True
            delta.finish_reason = event.get("finish_reason")
            if not r.local:
                # The rest of the disaggregated TTFT story, known only once the decode side ran.
                delta.ttft_breakdown = {k: v for k, v in self._breakdown(r).items() if k in ("kv_transfer", "first_decode")}
            self.counters["num_draft_tokens"] += delta.num_draft_tokens
            self.counters["num_accepted_tokens"] += delta.num_accepted_tokens
            self._finish(r, delta)
        elif new:
            r.queue.put_nowait(delta)

    def _breakdown(self, r: RequestState) -> dict[str, float]:
        if r.local:
            return {"queue": r.t_submit - r.t_arrival, "prefill": r.t_first_decode - r.t_submit}
        out = {"queue": r.t_submit - r.t_arrival}
        if r.t_first_token:
            out["prefill"] = r.t_first_token - r.t_submit
        if r.t_kv_ready and r.t_first_token:
            out["kv_transfer"] = max(0.0, r.t_kv_ready - r.t_first_token)
        if r.t_first_decode and r.t_kv_ready:
            out["first_decode"] = r.t_first_decode - r.t_kv_ready
        return out

    def _finish(self, r: RequestState, delta: TokenDelta) -> None:
        r.finished = True
        self.requests.pop(r.request_id, None)
        self._by_wid.pop(r.wid, None)
        r.queue.put_nowait(delta)

    def _recover(self, r: RequestState, reason: str) -> None:
        """Re-place a request whose placement failed, continuing its stream; or end it with an error."""
        self._abort_workers(r)
        self._by_wid.pop(r.wid, None)
        remaining = int(r.params["max_tokens"]) - len(r.emitted)
        if remaining <= 0:  # everything was streamed already: nothing to recover
            self._finish(r, TokenDelta([], finished=True, finish_reason="length",
                                       num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=len(r.emitted)))
            return
        if r.attempt >= self.max_recoveries:
            self._finish(r, TokenDelta([], finished=True, finish_reason="error",
                                       error=f"{reason} (gave up after {r.attempt} recoveries)",
                                       num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=len(r.emitted)))
            return
        log.warning("recovering request %s after %d tokens: %s", r.request_id, len(r.emitted), reason)
        r.recovering = True
        r.attempt += 1
        detected = time.monotonic()
        prompt = r.prompt_token_ids + r.emitted
        params = {**r.params, "max_tokens": remaining,
                  "output_position_offset": int(r.params.get("output_position_offset", 0)) + len(r.emitted)}
        r.prefill_id = r.decode_id = None
        r.local = False
        r.num_computed_tokens = 0
        r.t_first_token = r.t_kv_ready = r.t_first_decode = 0.0
        r.early = []

        async def replace_it() -> None:
            try:
                await self._place(r, prompt, params, already_streaming=True)
                self.recoveries.append((r.request_id, time.monotonic() - detected))
            except Exception as e:  # noqa: BLE001 - no healthy pair: end clearly, within the deadline
                self._finish(r, TokenDelta([], finished=True, finish_reason="error",
                                           error=f"{reason}; recovery failed: {e}",
                                           num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=len(r.emitted)))
            finally:
                r.recovering = False

        self._loop.create_task(replace_it())

    def _abort_workers(self, r: RequestState) -> None:
        if r.prefill_id in self.prefill:
            self.prefill[r.prefill_id].abort.remote(r.wid)
        if r.decode_id in self.decode:
            self.decode[r.decode_id].abort.remote(r.wid)

    # ---- requests ------------------------------------------------------------------------------------
    def _wants_local(self, num_prompt_tokens: int) -> bool:
        if self.mode == "colocated" or not self.prefill:
            return True
        if num_prompt_tokens <= self.conditional_prefill_tokens:
            return True
        if self.busy_prefill_tokens:
            self._refresh_views()
            prefills = [v for v in self.views.values() if v.role == "prefill" and v.healthy]
            return all(v.queued_prefill_tokens >= self.busy_prefill_tokens for v in prefills)
        return False

    async def _place(self, r: RequestState, prompt: list[int], params: dict, already_streaming: bool = False) -> None:
        deadline = time.monotonic() + self.admission_wait_s
        hashes = chained_block_hashes(prompt, self.block_size)
        local = self._wants_local(len(prompt))
        while True:
            if r.finished:  # aborted (client, deadline) while it waited for room
                return
            self._refresh_views()
            decodes = self.placer.order_decode([v for v in self.views.values() if v.role == "decode"])
            if not decodes:
                # A worker Ray is restarting comes back within seconds: wait for it, up to the deadline.
                if time.monotonic() > deadline:
                    raise RouterError("no healthy decode worker is available", status=503)
                await asyncio.sleep(0.1)
                continue
            now = time.monotonic()
            prefills = [v for v in self.views.values() if v.role == "prefill" and v.healthy]
            if not prefills:
                local = True  # the whole prefill tier is down: decode workers prefill themselves
            for d in decodes:
                prefill_view = None if local else self._pick_prefill(prefills, d.worker_id, hashes, r.failed_pair, now)
                if (local and not self.breaker(None, d.worker_id).allows(now)) or (not local and prefill_view is None):
                    continue  # every pair with this decode worker is cooling down
                if local:
                    r.decode_id, r.local, r.reserved_tokens = d.worker_id, True, len(prompt)
                    self._register(r)
                    r.t_submit = time.monotonic()
                    self.decode[d.worker_id].add_request.remote(r.wid, prompt, params)
                    self.decisions.append(Decision(r.request_id, None, d.worker_id, True))
                    return
                handle = self.decode[d.worker_id]
                self._placing[r.wid] = []
                try:
                    blocks = await asyncio.wait_for(
                        handle.reserve.remote(r.wid, prefill_view.worker_id, prompt, params), self.reserve_timeout_s)
                except asyncio.CancelledError:
                    handle.abort.remote(r.wid)  # the caller went away mid-reservation: give the blocks back
                    raise
                except asyncio.TimeoutError:
                    # Stuck or overloaded: out of rotation until the health check hears from it again.
                    log.warning("decode worker %s did not answer a reservation within %.0f s", d.worker_id,
                                self.reserve_timeout_s)
                    handle.abort.remote(r.wid)  # a late reservation must not strand blocks
                    d.healthy = False
                    continue
                except Exception as e:  # noqa: BLE001 - the actor is gone: recover what it held, next
                    self.mark_down(d.worker_id, f"reservation failed: {type(e).__name__}")
                    continue
                finally:
                    # Events that overtook the answer; dropped with a failed reservation.
                    early = self._placing.pop(r.wid, [])
                if r.finished:  # aborted by the client or its deadline while we waited
                    handle.abort.remote(r.wid)
                    return
                if blocks is None:
                    continue  # full: next candidate
                r.decode_id, r.prefill_id, r.reserved_tokens = d.worker_id, prefill_view.worker_id, len(prompt)
                self._register(r)
                prefill_view.remember(hashes)
                r.t_submit = time.monotonic()
                self.prefill[prefill_view.worker_id].submit.remote(r.wid, prompt, params, d.worker_id, blocks)
                self.decisions.append(Decision(r.request_id, prefill_view.worker_id, d.worker_id, False))
                if early:
                    # Replayed after this coroutine returns (a failure re-places the request, which
                    # must not start while this placement is still being set up).
                    for event in early:
                        self._loop.call_soon(self.on_event, event)
                return
            if time.monotonic() > deadline:
                raise RouterError("no (prefill, decode) pair can take the request: full, down, or cooling down "
                                  "after repeated failures; try again later", status=503)
            await asyncio.sleep(0.05)

    def breaker(self, prefill_id: str | None, decode_id: str | None) -> Breaker:
        key = (prefill_id, decode_id)
        b = self.breakers.get(key)
        if b is None:
            b = self.breakers[key] = Breaker(self.breaker_threshold, self.breaker_cooldown_s)
        return b

    def _pick_prefill(self, prefills: list[WorkerView], decode_id: str, hashes: list[int], failed_pair,
                      now: float) -> WorkerView | None:
        """The policy's prefill choice among the pairs with ``decode_id`` whose breaker is closed; the
        pair that just failed this request is the last resort."""
        allowed = [v for v in prefills if self.breaker(v.worker_id, decode_id).allows(now)]
        fresh = [v for v in allowed if (v.worker_id, decode_id) != failed_pair]
        return self.placer.pick_prefill(fresh or allowed, hashes)

    def _register(self, r: RequestState) -> None:
        self.requests[r.request_id] = r
        self._by_wid[r.wid] = r

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        if self._loop is None:
            self.start(asyncio.get_running_loop())
        if request_id in self.requests:
            raise RouterError(f"request id {request_id!r} is already in use", status=400, kind="invalid_request_error")
        if not prompt_token_ids:
            raise RouterError("prompt is empty", status=400, kind="invalid_request_error")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RouterError(f"prompt has {len(prompt_token_ids)} tokens, max_model_len is {self.max_model_len}",
                              status=400, kind="invalid_request_error")
        pool_tokens = max((v.num_blocks * v.block_size for v in self.views.values() if v.role == "decode"), default=0)
        if pool_tokens and len(prompt_token_ids) + 1 > pool_tokens:
            raise RouterError(f"prompt has {len(prompt_token_ids)} tokens but the largest decode worker's KV pool "
                              f"holds {pool_tokens}", status=400, kind="invalid_request_error")
        if params.seed is None:
            # Prefill and decode must draw from the same per-position streams.
            params = replace(params, seed=self._rng.randrange(1 << 31))
        r = RequestState(request_id, len(prompt_token_ids), asyncio.Queue(),
                         prompt_token_ids=list(prompt_token_ids), params=asdict(params))
        await self._place(r, list(prompt_token_ids), r.params)
        deadline = r.t_arrival + self.request_timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    delta = await asyncio.wait_for(r.queue.get(), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    if not r.finished:
                        self._finish(r, TokenDelta([], finished=True, finish_reason="error",
                                                   error=f"request timed out after {self.request_timeout_s}s"))
                        self._abort_workers(r)
                    continue
                yield delta
                if delta.finished:
                    return
        finally:
            if not r.finished:  # the consumer went away (client disconnect)
                self._finish(r, TokenDelta([], finished=True, finish_reason="abort"))
                self._abort_workers(r)

    async def abort(self, request_id: str) -> None:
        r = self.requests.get(request_id)
        if r is not None and not r.finished:
            self._finish(r, TokenDelta([], finished=True, finish_reason="abort"))
            self._abort_workers(r)
