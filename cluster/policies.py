"""Placement policies of the global router. Pure functions over the router's worker views, so tests
can check decisions without a cluster.

Load is measured in KV tokens the router knows a worker holds (refreshed from the decode workers'
reports, never advanced locally), plus the speculative slots each running request reserves (MTP-aware).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_aware")


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

    def order_decode(self, decodes: list[WorkerView]) -> list[WorkerView]:
        """Decode candidates, best first (the router tries them in order until one admits)."""
        live = [w for w in decodes if w.in_rotation]
        if not live:
            return []
        if self.policy == "round_robin":
            return self._rotate("decode", live)
        if self.policy == "power_of_two" and len(live) > 2:
            a, b = self._rng.sample(live, 2)
            first = min((a, b), key=lambda w: w.load(self.num_spec_tokens))
            return [first] + sorted((w for w in live if w is not first), key=lambda w: w.load(self.num_spec_tokens))
        return sorted(live, key=lambda w: (w.load(self.num_spec_tokens), w.worker_id))

    def pick_prefill(self, prefills: list[WorkerView], prompt_hashes: list[int]) -> WorkerView | None:
        live = [w for w in prefills if w.in_rotation]
        if not live:
            return None
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
