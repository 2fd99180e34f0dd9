"""Worker health: ping every worker; a worker that errors or stays silent is taken out of rotation
(its requests recovered) and pinged again later: it comes back once it answers. A worker that answers
with a new incarnation was restarted by Ray: whatever it held is gone, so its requests are recovered
and it is re-wired (``on_worker_restarted``) before it rejoins."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.policies import WorkerView

log = logging.getLogger(__name__)


async def _no_rewire(worker_id: str) -> None:
    return None


class HealthMonitor:
    def __init__(self, config: RouterConfig, views: dict[str, WorkerView], handles: Callable[[], dict],
                 mark_down: Callable[[str, str], None]):
        self.config = config
        self.views = views
        self._handles = handles  # worker id -> Ray actor handle, every role
        self._mark_down = mark_down
        self.incarnations: dict[str, str] = {}  # worker id -> the process incarnation its pings report
        # Awaited with a worker id after Ray restarted that worker (the launcher re-runs the handshakes).
        self.on_worker_restarted: Callable[[str], Awaitable[None]] = _no_rewire
        self._strikes: dict[str, int] = {}

    async def run(self, stopped: Callable[[], bool]) -> None:
        while not stopped():
            await asyncio.sleep(self.config.health_interval_s)
            # Concurrently: one silent worker must not delay the verdict on the others.
            await asyncio.gather(*(self.check(wid, handle) for wid, handle in self._handles().items()
                                   if wid in self.views))

    async def _ping(self, wid: str, handle) -> tuple[str | None, str | None]:
        """(why the worker is unhealthy or None, the incarnation it reported or None)."""
        c = self.config
        try:
            alive, incarnation, stalled_s = await asyncio.wait_for(handle.ping.remote(), timeout=c.ping_timeout_s)
        except asyncio.TimeoutError:
            # Slow is not dead (an overloaded CPU delays everything): only repeated silence is.
            self._strikes[wid] = self._strikes.get(wid, 0) + 1
            strikes = self._strikes[wid]
            return (f"no answer to {strikes} health checks" if strikes >= c.max_strikes else None), None
        except Exception as e:  # noqa: BLE001 - the actor is gone or restarting (RayActorError and kin)
            return type(e).__name__, None
        self._strikes[wid] = 0
        if not alive:
            return "its engine thread stopped", incarnation
        if stalled_s > c.stall_timeout_s:
            return f"its engine thread has been stuck in one step for {stalled_s:.0f} s", incarnation
        return None, incarnation

    async def check(self, wid: str, handle) -> None:
        view = self.views[wid]
        reason, incarnation = await self._ping(wid, handle)
        known = self.incarnations.get(wid)
        if reason is not None:
            # Also sweeps requests that reached an already-unhealthy worker (e.g. admitted just before).
            self._mark_down(wid, reason)
            return
        if incarnation is not None and known is not None and incarnation != known:
            # Restarted between two checks: its KV, reservations and peers are gone.
            self._mark_down(wid, "restarted by Ray")
            try:
                await self.on_worker_restarted(wid)
            except Exception as e:  # noqa: BLE001 - stays out of rotation; retried on the next check
                log.warning("worker %s restarted but could not be re-wired: %s", wid, e)
                return
            self.incarnations[wid] = incarnation
            log.warning("worker %s restarted (incarnation %s): re-wired, back in rotation", wid, incarnation)
            view.healthy = True
            return
        if incarnation is not None and known is None:
            self.incarnations[wid] = incarnation
        if not view.healthy:
            log.warning("worker %s answers again: back in rotation", wid)
            view.healthy = True
