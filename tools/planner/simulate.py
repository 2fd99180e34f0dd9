"""A discrete-event simulation of a pdcluster deployment serving a workload, step by engine step.

What it models, after the code it stands for:

- Router (cluster/router/placement.py, policy least_loaded): a request is placed on arrival. Decode
  workers are tried least loaded first (KV tokens of the requests placed there, ties by worker index);
  a decode worker whose KV pool cannot hold the prompt is skipped, and with none free the request waits
  at the router until a request finishes. Disaggregated, the prefill worker is the one with the fewest
  queued prompt tokens (placed, no first token yet).
- Every worker runs the engine's scheduler (engine/scheduler.py): each step takes the running requests
  first (a decode token each, or their next prompt chunk), then waiting ones FCFS, within
  ``max_num_batched_tokens``, ``prefill_chunk_size`` per request and ``max_num_seqs``. A step costs what
  the profile's fits say (costs.py), including mixed prefill + decode steps (colocated), times the
  profile's served-over-bare factor for the step's kind (served.py: a worker process with its
  transport, control plane and peer beside it steps slower than the bare engine).
- Prefill worker: the step that completes a prompt samples the first token, which goes to the client
  at once (TTFT does not wait for the KV). The KV streams while the forward pass runs and is delivered
  ``CostModel.exposed_transfer_s`` later; the prefill worker's ack poller sends ``TransferDone`` as
  soon as the receiver acknowledges, also while its engine computes the next prompt
  (prefill_node/worker.py), and the request joins the decode worker's next step.
- Decode worker: continuous batching; one token per request per step; a request ends at its output
  length (ignore_eos).
- Shared cores (``shared_cores`` > 0: every worker on one host with that many cores, like this 2-core
  box). CPU is shared fairly by demand: ``k`` busy workers of ``t`` threads and ``background_cores``
  of other work get ``share(k) = min(1, cores / (k * t + background))`` each. The profile's step times
  were measured alone at its own background load (``CostModel.profile_background_cores``), so a busy
  worker runs at ``share(k) / share_at_profile`` of its profiled speed, divided by the profile's
  contention slowdown (``CostModel.corun_factor``: shared memory bandwidth and caches, measured with a
  second engine running and the CPU shares taken out, per pairing of step kinds: a decode step beside a
  prompt being computed suffers more than beside another decode) when another worker computes at the same
  time. Rates are re-evaluated whenever a worker starts or ends a step (processor sharing).
  ``background_cores`` None: the profile's own. ``shared_cores`` = 0: each worker is its own device
  (GPUs): no sharing.
- ``overhead_s``: a fixed serving cost added to every TTFT and end-to-end latency (HTTP, router, the
  Ray call to the decode worker, control-plane hops): the profile does not measure it.

Not modelled: preemption (the KV pool check at placement keeps it rare), speculative decoding,
prefix-cache hits, the HTTP/router process's own CPU use, worker failures.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from pdcluster.tools.planner.costs import CostModel, attn_pairs
from pdcluster.tools.planner.shape import ClusterShape
from pdcluster.tools.planner.workload import SimRequest

MAX_EVENTS_PER_REQUEST = 20_000  # a bound on the loop: a request sees at most output_len + chunks steps


@dataclass
class SimConfig:
    shape: ClusterShape
    shared_cores: float = 0.0
    overhead_s: float = 0.0
    background_cores: float | None = None  # other work's CPU use on the shared host (None: the profile's)
    kv_capacity_tokens: int | None = None  # None: the profile's (serve's default pool); 0: unlimited


@dataclass
class RequestResult:
    """Times are seconds from the start of the run."""

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    t_placed: float = 0.0
    t_prefill_start: float = -1.0
    t_first_token: float = -1.0
    t_kv_ready: float = -1.0
    t_second_token: float = -1.0
    t_done: float = -1.0
    prefill_worker: str | None = None
    decode_worker: str = ""

    @property
    def finished(self) -> bool:
        return self.t_done >= 0


@dataclass
class _Req:
    spec: SimRequest
    result: RequestResult
    computed: int = 0  # prompt tokens computed where the prompt is being prefilled
    num_output: int = 0

    @property
    def in_prompt(self) -> bool:
        return self.computed < self.spec.input_len

    @property
    def kv_tokens(self) -> int:
        """What the router counts for this request on its decode worker (placement.py: kv_tokens)."""
        return self.spec.input_len + max(0, self.num_output - 1)


@dataclass
class _Worker:
    wid: str
    index: int
    role: str  # "prefill" | "decode" | "colocated"
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    placed: list = field(default_factory=list)  # decode side: every unfinished request placed here
    batch: list = field(default_factory=list)  # (request, tokens) of the step in flight
    busy: bool = False
    work_left: float = 0.0  # seconds at full speed left in the step in flight
    rate: float = 1.0
    last_t: float = 0.0
    version: int = 0
    busy_s: float = 0.0
    steps: int = 0
    queued_prompt_tokens: int = 0  # prefill side: placed prompts with no first token yet

    def load(self) -> int:
        return sum(r.kv_tokens for r in self.placed)


class Simulation:
    def __init__(self, cost: CostModel, config: SimConfig):
        self.cost = cost
        self.config = config
        limits = cost.limits
        self.limits = limits
        capacity = config.kv_capacity_tokens if config.kv_capacity_tokens is not None else limits.kv_capacity_tokens
        self.capacity = capacity or 0
        shape = config.shape
        decode_role = "colocated" if shape.mode == "colocated" else "decode"
        self.prefill = [_Worker(f"prefill-{i}", i, "prefill") for i in range(shape.num_prefill)]
        self.decode = [_Worker(f"decode-{j}", j, decode_role) for j in range(shape.num_decode)]
        self.workers = self.prefill + self.decode
        self._events: list = []
        self._seq = itertools.count()
        self._router_queue: deque[_Req] = deque()
        self._to_kick: dict[str, _Worker] = {}  # workers given work at this instant (started together)
        self.now = 0.0

    # ---- events --------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload, version: int = 0) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload, version))

    def run(self, requests: list[SimRequest]) -> list[RequestResult]:
        reqs = [_Req(r, RequestResult(r.index, r.arrival_s, r.input_len, r.output_len)) for r in requests]
        for r in reqs:
            self._push(r.spec.arrival_s, "arrive", r)
        budget = MAX_EVENTS_PER_REQUEST * max(1, len(reqs)) + 1000
        for _ in range(budget):
            if not self._events:
                break
            t, _, kind, payload, version = heapq.heappop(self._events)
            self.now = t
            if kind == "arrive":
                self._router_queue.append(payload)
                self._place_queued()
            elif kind == "kv_ready":
                payload.result.t_kv_ready = t
                worker = self._decode_of(payload)
                worker.waiting.append(payload)
                self._kick(worker)
            elif kind == "step_done" and version == payload.version:
                self._finish_step(payload)
            if not self._events or self._events[0][0] > t:
                self._start_steps()  # everything that happened at this instant is in the queues now
        else:
            raise RuntimeError(f"simulation did not finish within {budget} events")
        return [r.result for r in reqs]

    # ---- router ----------------------------------------------------------------------------------
    def _decode_of(self, r: _Req) -> _Worker:
        return self.decode[int(r.result.decode_worker.rsplit("-", 1)[1])]

    def _fits(self, worker: _Worker, r: _Req) -> bool:
        if not self.capacity:
            return True
        used = sum(x.spec.input_len + x.spec.output_len for x in worker.placed)
        return used + r.spec.input_len + 1 <= self.capacity

    def _place_queued(self) -> None:
        """FCFS: a request that finds no room waits, and so do the ones behind it."""
        while self._router_queue:
            r = self._router_queue[0]
            target = next((w for w in sorted(self.decode, key=lambda w: (w.load(), w.index)) if self._fits(w, r)), None)
            if target is None:
                return
            self._router_queue.popleft()
            r.result.t_placed = self.now
            r.result.decode_worker = target.wid
            target.placed.append(r)
            if self.prefill:
                p = min(self.prefill, key=lambda w: (w.queued_prompt_tokens, w.index))
                p.queued_prompt_tokens += r.spec.input_len
                r.result.prefill_worker = p.wid
                p.waiting.append(r)
                self._kick(p)
            else:
                target.waiting.append(r)
                self._kick(target)

    # ---- workers ---------------------------------------------------------------------------------
    def _schedule(self, w: _Worker) -> list:
        lim = self.limits
        budget = lim.max_num_batched_tokens
        batch = []
        for r in w.running:
            if budget <= 0:
                break
            n = min(r.spec.input_len - r.computed if r.in_prompt else 1, lim.prefill_chunk_size, budget)
            batch.append((r, n))
            budget -= n
        while w.waiting and budget > 0 and len(w.running) < lim.max_num_seqs:
            r = w.waiting.popleft()
            w.running.append(r)
            n = min(r.spec.input_len - r.computed if r.in_prompt else 1, lim.prefill_chunk_size, budget)
            batch.append((r, n))
            budget -= n
        return batch

    def _step_cost(self, batch: list) -> float:
        tokens = num_decode = context = 0
        attn = 0.0
        for r, n in batch:
            if r.in_prompt:
                tokens += n
                attn += attn_pairs(n, r.computed)
            else:
                num_decode += 1
                context += r.spec.input_len + r.num_output
        return self.cost.served_step_s(tokens, attn, num_decode, context)

    def _kick(self, w: _Worker) -> None:
        """Start a step on ``w`` if it is idle, once every event of this instant is in (requests that
        arrive together are scheduled together, as an engine loop that finds them all waiting)."""
        self._to_kick[w.wid] = w

    def _start_steps(self) -> None:
        kicked, self._to_kick = self._to_kick, {}
        for w in kicked.values():
            if w.busy:
                continue
            batch = self._schedule(w)
            if not batch:
                continue
            for r, _ in batch:
                if r.in_prompt and r.result.t_prefill_start < 0:
                    r.result.t_prefill_start = self.now
            w.batch = batch
            w.busy = True
            w.work_left = self._step_cost(batch)
            w.last_t = self.now
            w.steps += 1
        self._rerate()

    @staticmethod
    def _kind(w: _Worker) -> str:
        """What the step in flight mostly is: "prefill" when it computes prompt tokens."""
        return "prefill" if any(r.in_prompt for r, _ in w.batch) else "decode"

    def _rate(self, kind: str, partner_kinds: set[str], num_busy: int) -> float:
        """Speed of a busy worker running a ``kind`` step beside ``num_busy - 1`` others running steps
        of ``partner_kinds``."""
        cores = self.config.shared_cores
        if cores <= 0 or num_busy == 0:
            return 1.0
        threads = max(1, self.cost.threads)
        background = self.config.background_cores
        if background is None:
            background = self.cost.profile_background_cores

        def share(k: int, other: float) -> float:
            return min(1.0, cores / (k * threads + other))

        rate = share(num_busy, background) / share(1, self.cost.profile_background_cores)
        return rate / self.cost.corun_factor(kind, list(partner_kinds))

    def _rerate(self) -> None:
        """Bring every busy worker's progress up to now and (re)schedule its step's end at its new rate."""
        busy = [w for w in self.workers if w.busy]
        kinds = [self._kind(w) for w in busy]
        counts = Counter(kinds)
        for w, kind in zip(busy, kinds):
            partners = {k for k, n in counts.items() if n > (k == kind)}  # kinds of the other busy workers
            rate = self._rate(kind, partners, len(busy))
            elapsed = self.now - w.last_t
            w.work_left = max(0.0, w.work_left - elapsed * w.rate)
            w.busy_s += elapsed
            w.last_t = self.now
            if w.rate != rate or elapsed == 0.0:
                w.rate = rate
                w.version += 1
                self._push(self.now + w.work_left / rate, "step_done", w, w.version)

    def _finish_step(self, w: _Worker) -> None:
        w.busy_s += self.now - w.last_t
        w.last_t = self.now
        w.work_left = 0.0
        w.busy = False
        batch, w.batch = w.batch, []
        for r, n in batch:
            if r.in_prompt:
                r.computed += n
                if not r.in_prompt:
                    self._first_token(w, r)
            else:
                self._decoded(w, r)
        if self._router_queue:
            self._place_queued()
        self._kick(w)

    def _first_token(self, w: _Worker, r: _Req) -> None:
        r.num_output = 1
        r.result.t_first_token = self.now
        if w.role == "prefill":
            w.running.remove(r)
            w.queued_prompt_tokens -= r.spec.input_len
            prefill_s = self.now - r.result.t_prefill_start
            delivered = self.now + self.cost.exposed_transfer_s(r.spec.input_len, prefill_s)
            if r.spec.output_len <= 1:
                self._done(r, self._decode_of(r))
                return
            self._push(delivered, "kv_ready", r)
        elif r.spec.output_len <= 1:
            w.running.remove(r)
            self._done(r, w)

    def _decoded(self, w: _Worker, r: _Req) -> None:
        r.num_output += 1
        if r.num_output == 2:
            r.result.t_second_token = self.now
        if r.num_output >= r.spec.output_len:
            w.running.remove(r)
            self._done(r, w)

    def _done(self, r: _Req, decode_worker: _Worker) -> None:
        r.result.t_done = self.now
        decode_worker.placed.remove(r)


def simulate(cost: CostModel, config: SimConfig, requests: list[SimRequest]) -> tuple[list[RequestResult], dict]:
    """Run one simulation; returns the per-request results and per-worker utilisation."""
    sim = Simulation(cost, config)
    results = sim.run(requests)
    end = max((r.t_done for r in results), default=0.0) or 1.0
    workers = {w.wid: {"role": w.role, "steps": w.steps, "utilization": round(w.busy_s / end, 4)}
               for w in sim.workers}
    return results, workers
