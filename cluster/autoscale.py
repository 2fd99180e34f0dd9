"""SLO-driven autoscaling of prefill and decode workers (`pdcluster serve --autoscale`).

A planner in the router process reads what the router knows (recent requests' TTFT and TPOT, the
queue, KV usage) every ``interval_s`` and decides at most one action: add a worker (Ray finds it a
slot; on a real cluster the Ray autoscaler adds a node when none is free) or drain one (no new
placements, removed when nothing depends on it: cluster/router/membership.py). ``decide`` is a pure
function of a ``Snapshot``, so the policy is tested without a cluster; ``Planner.run`` applies it.

Policy (the 90th percentile over ``window_s``):
- TTFT over its SLO, or requests queueing: the prefill side is short. Add a prefill worker (disagg)
  or a decode worker (colocated: decode workers prefill).
- TPOT over its SLO, or KV usage over ``kv_high``: add a decode worker.
- Both under ``low_fraction`` of their SLOs, nothing queued and KV usage under ``kv_low``: drain one
  worker, decode first (the role with more workers above its minimum).
- After any action, wait ``cooldown_s`` before the next (a new worker needs its first requests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleConfig:
    min_prefill: int = 1
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 1
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    interval_s: float = 2.0
    window_s: float = 20.0
    cooldown_s: float = 10.0
    min_samples: int = 4  # finished requests in the window before latencies count
    low_fraction: float = 0.3
    kv_high: float = 0.9
    kv_low: float = 0.3

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 0 <= lo <= hi:
                raise ValueError(f"--min-{role}/--max-{role}: need 0 <= min <= max, got {lo} and {hi}")
        if self.slo_ttft_ms <= 0 or self.slo_tpot_ms <= 0:
            raise ValueError("--slo-ttft-ms and --slo-tpot-ms must be > 0")


@dataclass(frozen=True)
class Snapshot:
    num_prefill: int  # workers in rotation
    num_decode: int
    p90_ttft_ms: float | None  # None: too few finished requests in the window
    p90_tpot_ms: float | None
    num_waiting: int
    kv_usage: float
    disagg: bool


@dataclass(frozen=True)
class Action:
    kind: str  # "add" | "drain"
    role: str  # "prefill" | "decode"
    reason: str


def decide(s: Snapshot, c: AutoscaleConfig) -> Action | None:
    ttft_high = (s.p90_ttft_ms is not None and s.p90_ttft_ms > c.slo_ttft_ms) or s.num_waiting > 0
    tpot_high = (s.p90_tpot_ms is not None and s.p90_tpot_ms > c.slo_tpot_ms) or s.kv_usage > c.kv_high
    if tpot_high and s.num_decode < c.max_decode:
        return Action("add", "decode", f"p90 TPOT {s.p90_tpot_ms} ms / KV usage {s.kv_usage:.2f} over target")
    if ttft_high:
        role = "prefill" if s.disagg else "decode"
        if getattr(s, f"num_{role}") < getattr(c, f"max_{role}"):
            return Action("add", role, f"p90 TTFT {s.p90_ttft_ms} ms / {s.num_waiting} waiting over target")
        return None
    quiet = (s.p90_ttft_ms is not None and s.p90_ttft_ms < c.low_fraction * c.slo_ttft_ms
             and s.p90_tpot_ms is not None and s.p90_tpot_ms < c.low_fraction * c.slo_tpot_ms
             and s.num_waiting == 0 and s.kv_usage < c.kv_low)
    idle = s.p90_ttft_ms is None and s.num_waiting == 0 and s.kv_usage == 0.0  # nothing finished lately
    if quiet or idle:
        why = "idle" if idle else "well under both SLOs"
        if s.num_decode > c.min_decode:
            return Action("drain", "decode", why)
        if s.disagg and s.num_prefill > c.min_prefill:
            return Action("drain", "prefill", why)
    return None


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class Planner:
    """Applies ``decide`` to a running ``Cluster`` (cluster/launcher.py). ``decisions`` keeps the last
    actions (bounded) for /metrics and tests; every action is logged."""

    def __init__(self, cluster, config: AutoscaleConfig, on_action=lambda action: None):
        self.cluster = cluster
        self.config = config
        self.on_action = on_action
        self.decisions: list[tuple[float, Action, str]] = []  # (time, action, worker id), last 100
        self._last_action_at = 0.0

    def snapshot(self) -> Snapshot:
        router = self.cluster.router
        now = time.monotonic()
        recent = [x for x in router.streams.latencies if now - x.t_done <= self.config.window_s]
        enough = len(recent) >= self.config.min_samples
        stats = router.stats()
        return Snapshot(
            num_prefill=len(router.placement.role_views("prefill", in_rotation_only=True)),
            num_decode=len(router.placement.role_views("decode", in_rotation_only=True)),
            p90_ttft_ms=p90([x.ttft_s * 1e3 for x in recent]) if enough else None,
            p90_tpot_ms=p90([x.tpot_s * 1e3 for x in recent]) if enough else None,
            num_waiting=stats["num_requests_waiting"],
            kv_usage=stats["kv_cache_usage_perc"],
            disagg=self.cluster.spec.mode == "disagg",
        )

    async def step(self) -> Action | None:
        """One look: act if the policy says so and the cool-down has passed."""
        if time.monotonic() - self._last_action_at < self.config.cooldown_s:
            return None
        action = decide(self.snapshot(), self.config)
        if action is None:
            return None
        self._last_action_at = time.monotonic()
        if action.kind == "add":
            worker_id = await self.cluster.add_worker(action.role)
        else:
            worker_id = self._least_loaded(action.role)
            await self.cluster.remove_worker(worker_id)
        log.warning("autoscale: %s %s worker %s (%s)", action.kind, action.role, worker_id, action.reason)
        self.decisions = (self.decisions + [(time.monotonic(), action, worker_id)])[-100:]
        self.on_action(action)
        self._last_action_at = time.monotonic()
        return action

    def _least_loaded(self, role: str) -> str:
        router = self.cluster.router
        router.placement.refresh(router.streams.requests.values())
        views = router.placement.role_views(role, in_rotation_only=True)
        return min(views, key=lambda v: (v.num_requests, v.kv_tokens, v.worker_id)).worker_id

    async def run(self, stopped) -> None:
        while not stopped():
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except Exception as e:  # noqa: BLE001 - a failed action is logged; the next look tries again
                log.warning("autoscale action failed: %s", e)
