"""Placement policies of the global router. Pure functions over the router's worker views, so tests
can check decisions without a cluster.

Load is measured in KV tokens the router knows a worker holds (refreshed from the decode workers'
reports, never advanced locally), plus the speculative slots each running request reserves (MTP-aware).

``kv_aware`` places on the prefix a worker really holds (its prefix cache and offload tiers, from the
workers' KV events: cluster/router/kv_index.py) against its load; see ``kv_aware_score``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_aware", "kv_aware")


def kv_aware_score(overlap_blocks: float, block_size: int, load_tokens: float) -> float:
    """What placing a prompt on a worker is worth, in prompt tokens: the tokens of its prefix the worker
    already holds, minus a load term in the same unit.

        score = overlap_blocks * block_size - load_tokens

    ``overlap_blocks``: the prompt's leading blocks the worker holds, each weighted by its best tier
    (KVIndex.overlap: device 1, host 0.8, disk 0.5, the shared folder 0.4 for every worker: a lower tier still costs a
    copy or a read).

    ``load_tokens``, for a prefill worker: its queued prefill tokens (the prompts placed on it that have
    not produced their first token). A prompt's first token waits for those and then for its own
    uncached tokens, so the score is, up to a constant, minus its time to first token in prefill
    tokens: a worker holding the whole prompt wins as long as it has less than the prompt queued.

    For a decode worker (``decode_load_tokens``): the prompt's full-block tokens times the share of the
    worker's KV pool in use (Placer's decode load: KV tokens held plus the speculative slots of its
    running requests, over its pool). An idle worker forfeits nothing; a full one forfeits the whole
    prompt, more than it can hold of it.

    So an idle worker with no overlap (score 0) beats a hopelessly busy one: a prefill worker with more
    tokens queued than the prompt has, or a decode worker whose pool is full, scores below 0 whatever
    it holds. Ties go to the less loaded worker, then to the lower id. With no overlap anywhere the
    policy is least_loaded."""
    return overlap_blocks * block_size - load_tokens


def decode_load_tokens(view: WorkerView, num_prompt_blocks: int, num_spec_tokens: int) -> float:
    """A decode worker's load term of ``kv_aware_score``: the prompt's full-block tokens times the
    share of its KV pool in use (0 while its pool size is unknown)."""
    capacity_tokens = view.num_blocks * view.block_size
    if capacity_tokens <= 0:
        return 0.0
    return num_prompt_blocks * view.block_size * view.load(num_spec_tokens) / capacity_tokens


@dataclass
class Breaker:
    """Circuit breaker of one (prefill, decode) pair, or of a decode worker running requests alone
    (prefill None). Pairs, not workers: a failed transfer rarely says which side is at fault, and a
    broken link between two healthy workers should not take either out for its other partners.

    Closed: placements go through. ``threshold`` failures in a row open it for a cool-down that doubles
    on every trip (capped); after the cool-down it is half-open: one placement is tried, and its
    failure re-opens the breaker at once while a success closes it. Dead workers are the health
    check's business, not this one's."""

    threshold: int = 3
    cooldown_s: float = 5.0
    max_cooldown_s: float = 120.0
    consecutive_failures: int = 0
    trips: int = 0
    open_until: float = 0.0

    def allows(self, now: float) -> bool:
        return now >= self.open_until

    def record_failure(self, now: float) -> bool:
        """Count a failure; True if this one opened the breaker."""
        self.consecutive_failures += 1
        if self.consecutive_failures < self.threshold:
            return False
        self.open_until = now + min(self.cooldown_s * (2 ** self.trips), self.max_cooldown_s)
        self.trips += 1
        self.consecutive_failures = self.threshold - 1  # half-open after the cool-down: one more failure re-trips
        return True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.trips = 0
        self.open_until = 0.0


@dataclass
class WorkerView:
    worker_id: str
    role: str  # "prefill" | "decode"
    num_blocks: int = 0
    block_size: int = 16
    healthy: bool = True
    draining: bool = False  # leaving: no new placements, its requests finish (cluster/router/membership.py)
    pid: int | None = None  # the worker's process, as its last health check said (None: not known yet)
    # Decode worker: prefill workers it dropped after the control plane's peer timeout and is not
    # wired to again; those pairs cannot serve until the router re-wires them (cluster/router/health.py).
    lost_prefills: set[str] = field(default_factory=set)
    # Derived from requests (see Router): tokens whose KV the worker holds or has reserved.
    kv_tokens: int = 0
    # Hybrid decode worker: a transferred prompt's reservation holds this many blocks more for its Mamba
    # state (they become the request's next KV blocks once the state is read).
    num_state_blocks: int = 0
    num_requests: int = 0
    queued_prefill_tokens: int = 0
    # Per KV tier: {"blocks": held, "capacity_blocks": ...}, as the worker's last health check said (/metrics).
    kv_tiers: dict = field(default_factory=dict)
    # Where it publishes vLLM's KV events (--kv-events-config; KVEventPublisher.source), as its last ping said.
    kv_event_source: dict | None = None
    # Prefix affinity: recently seen prompt block hashes (LRU).
    recent_hashes: OrderedDict = field(default_factory=OrderedDict)

    @property
    def in_rotation(self) -> bool:
        """May take new placements."""
        return self.healthy and not self.draining

    def load(self, num_spec_tokens: int) -> int:
        return self.kv_tokens + self.num_requests * num_spec_tokens

    def remember(self, hashes: list[int], capacity: int = 4096) -> None:
        for h in hashes:
            self.recent_hashes[h] = None
            self.recent_hashes.move_to_end(h)
        while len(self.recent_hashes) > capacity:
            self.recent_hashes.popitem(last=False)

    def prefix_match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.recent_hashes:
                break
            n += 1
        return n


class Placer:
    def __init__(self, policy: str, num_spec_tokens: int = 0, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.num_spec_tokens = num_spec_tokens
        self._rr = {"prefill": 0, "decode": 0}
        self._rng = random.Random(seed)

    def order_decode(self, decodes: list[WorkerView], prompt_hashes: list[int] = (),
                     overlap_blocks: dict[str, float] | None = None) -> list[WorkerView]:
        """Decode candidates, best first (the router tries them in order until one admits).
        ``overlap_blocks``: worker id -> the prompt's weighted prefix it holds (kv_aware)."""
        live = [w for w in decodes if w.in_rotation]
        if not live:
            return []
        if self.policy == "kv_aware":
            overlap = overlap_blocks or {}

            def score(w: WorkerView) -> float:
                load = decode_load_tokens(w, len(prompt_hashes), self.num_spec_tokens)
                return kv_aware_score(overlap.get(w.worker_id, 0.0), w.block_size, load)

            return sorted(live, key=lambda w: (-score(w), w.load(self.num_spec_tokens), w.worker_id))
        if self.policy == "round_robin":
            return self._rotate("decode", live)
        if self.policy == "power_of_two" and len(live) > 2:
            a, b = self._rng.sample(live, 2)
            first = min((a, b), key=lambda w: w.load(self.num_spec_tokens))
            return [first] + sorted((w for w in live if w is not first), key=lambda w: w.load(self.num_spec_tokens))
        return sorted(live, key=lambda w: (w.load(self.num_spec_tokens), w.worker_id))

    def pick_prefill(self, prefills: list[WorkerView], prompt_hashes: list[int],
                     overlap_blocks: dict[str, float] | None = None) -> WorkerView | None:
        live = [w for w in prefills if w.in_rotation]
        if not live:
            return None
        if self.policy == "kv_aware":
            overlap = overlap_blocks or {}
            return min(live, key=lambda w: (
                -kv_aware_score(overlap.get(w.worker_id, 0.0), w.block_size, w.queued_prefill_tokens),
                w.queued_prefill_tokens, w.worker_id))
        if self.policy == "round_robin":
            return self._rotate("prefill", live)[0]
        if self.policy == "power_of_two" and len(live) > 2:
            live = self._rng.sample(live, 2)
        if self.policy == "prefix_aware":
            return max(live, key=lambda w: (w.prefix_match(prompt_hashes), -w.queued_prefill_tokens, w.worker_id))
        return min(live, key=lambda w: (w.queued_prefill_tokens, w.worker_id))

    def _rotate(self, role: str, live: list[WorkerView]) -> list[WorkerView]:
        i = self._rr[role] % len(live)
        self._rr[role] += 1
        return live[i:] + live[:i]
