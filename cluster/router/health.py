"""Worker health: ping every worker; a worker that errors or stays silent is taken out of rotation
(its requests recovered) and pinged again later: it comes back once it answers. A worker that answers
with a new incarnation was restarted by Ray: whatever it held is gone, so its requests are recovered
and it is re-wired (``on_worker_restarted``) before it rejoins.

A pair can break while both workers answer: a worker frozen (SIGSTOP, a swap storm) for longer than
the control plane's peer timeout is dropped by its peers, and when it resumes it is the same process
(same incarnation), so nothing would handshake again. A decode worker reports the prefill workers it
lost that way in its ping (``Ping.lost_peers``); the pair is left out of placement and out of /health's
"ok" for that prefill worker, and re-wired (``on_pair_lost``: the decode worker connects again, the
handshake a restart runs) as soon as the prefill worker answers.

A worker that answers with other weights than the cluster serves (it missed an update: it was down, or its commit
failed) is out of rotation until ``on_weights_stale`` has given it the served ones (cluster/router/weights.py);
``weight_version()`` says which version every worker should serve (None while an update runs, or before any)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.policies import WorkerView

log = logging.getLogger(__name__)


async def _no_rewire(worker_id: str) -> None:
    return None


async def _no_pair_rewire(prefill_id: str, decode_id: str) -> None:
    raise RuntimeError("no way to re-wire a pair is configured (ClusterRouter without a launcher)")


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
        # Awaited with (prefill id, decode id) when that decode worker lost that prefill worker to
        # silence while both answer here (the launcher has the decode worker connect again).
        self.on_pair_lost: Callable[[str, str], Awaitable[None]] = _no_pair_rewire
        # Called with (prefill id, decode id) once such a pair is wired again (the router closes its breaker).
        self.on_pair_rewired: Callable[[str, str], None] = lambda prefill_id, decode_id: None
        # Called with a worker id when whatever it held is gone: Ray restarted it, or it left the cluster
        # (the router forgets its blocks in the global KV index).
        self.on_worker_reset: Callable[[str], None] = lambda worker_id: None
        self._strikes: dict[str, int] = {}
        # worker id, or (prefill id, decode id) -> time.monotonic() when it was last wired: a ping asked
        # before that reports a loss the wiring already repaired, and is not acted on.
        self._wired_at: dict = {}
        self._rewiring: dict[tuple[str, str], asyncio.Task] = {}  # one re-wiring of a pair at a time
        # The weight version every worker should serve (None: not checked now), and what brings one in line.
        self.weight_version: Callable[[], str | None] = lambda: None
        self.on_weights_stale: Callable[[str], Awaitable[None]] = _no_rewire
        self._syncing: dict[str, asyncio.Task] = {}  # one weight sync of a worker at a time

    async def run(self, stopped: Callable[[], bool]) -> None:
        while not stopped():
            await asyncio.sleep(self.config.health_interval_s)
            # Concurrently: one silent worker must not delay the verdict on the others.
            await asyncio.gather(*(self.check(wid, handle) for wid, handle in self._handles().items()
                                   if wid in self.views))

    def forget(self, worker_id: str) -> None:
        """A worker left the cluster: drop what was known about it."""
        self.incarnations.pop(worker_id, None)
        self._strikes.pop(worker_id, None)
        self.on_worker_reset(worker_id)
        for key in [k for k in self._wired_at if k == worker_id or (isinstance(k, tuple) and worker_id in k)]:
            del self._wired_at[key]

    async def _ping(self, wid: str, handle):
        """(why the worker is unhealthy or None, its ``Ping`` (node/actor.py) or None when it did not answer)."""
        c = self.config
        try:
            ping = await asyncio.wait_for(handle.ping.remote(), timeout=c.ping_timeout_s)
        except asyncio.TimeoutError:
            # Slow is not dead (an overloaded CPU delays everything): only repeated silence is.
            self._strikes[wid] = self._strikes.get(wid, 0) + 1
            strikes = self._strikes[wid]
            return (f"no answer to {strikes} health checks" if strikes >= c.max_strikes else None), None
        except Exception as e:  # noqa: BLE001 - the actor is gone or restarting (RayActorError and kin)
            return type(e).__name__, None
        self._strikes[wid] = 0
        if not ping.alive:
            return "its engine thread stopped", ping
        if ping.stalled_s > c.stall_timeout_s:
            return f"its engine thread has been stuck in one step for {ping.stalled_s:.0f} s", ping
        return None, ping

    async def check(self, wid: str, handle) -> None:
        view = self.views[wid]
        asked = time.monotonic()
        reason, ping = await self._ping(wid, handle)
        incarnation = ping.incarnation if ping is not None else None
        known = self.incarnations.get(wid)
        if reason is not None:
            # Also sweeps requests that reached an already-unhealthy worker (e.g. admitted just before).
            self._mark_down(wid, reason)
            return
        if incarnation is not None and known is not None and incarnation != known:
            # Restarted between two checks: its KV, reservations and peers are gone.
            self.on_worker_reset(wid)
            self._mark_down(wid, "restarted by Ray")
            try:
                await self.on_worker_restarted(wid)
            except Exception as e:  # noqa: BLE001 - stays out of rotation; retried on the next check
                log.warning("worker %s restarted but could not be re-wired: %s", wid, e)
                return
            self.incarnations[wid] = incarnation
            self._wired(wid)
            view.pid, view.kv_tiers, view.kv_event_source = ping.pid, dict(ping.kv_tiers), ping.kv_event_source
            log.warning("worker %s restarted (incarnation %s): re-wired, back in rotation", wid, incarnation)
            view.healthy = True
            return
        if ping is not None:
            if known is None:
                self.incarnations[wid] = incarnation
            view.pid, view.kv_tiers, view.kv_event_source = ping.pid, dict(ping.kv_tiers), ping.kv_event_source
            self._note_lost(view, ping.lost_peers, asked)
            expected = self.weight_version()
            if expected is not None and ping.weight_version != expected:
                self._mark_down(wid, f"it serves weights {ping.weight_version!r}, the cluster {expected!r}")
                if wid not in self._syncing:
                    self._syncing[wid] = asyncio.get_running_loop().create_task(self._sync_weights(wid))
                return
        if not view.healthy:
            log.warning("worker %s answers again: back in rotation", wid)
            view.healthy = True

    async def _sync_weights(self, worker_id: str) -> None:
        try:
            await self.on_weights_stale(worker_id)
        except Exception as e:  # noqa: BLE001 - stays out of rotation; tried again on a later check
            log.warning("could not give worker %s the served weights: %s", worker_id, e)
        finally:
            self._syncing.pop(worker_id, None)

    # ---- pairs whose decode side lost the prefill peer ----------------------------------------------
    def _wired(self, worker_id: str) -> None:
        """``worker_id`` was (re-)wired to every peer: losses reported before now are repaired."""
        self._wired_at[worker_id] = time.monotonic()
        view = self.views.get(worker_id)
        if view is not None:
            view.lost_prefills.clear()  # a restarted decode worker has no old peers to have lost
        for v in self.views.values():
            v.lost_prefills.discard(worker_id)  # every decode worker connected to the restarted prefill

    def _wired_since(self, prefill_id: str, decode_id: str) -> float:
        at = self._wired_at
        return max(at.get(prefill_id, 0.0), at.get(decode_id, 0.0), at.get((prefill_id, decode_id), 0.0))

    def _note_lost(self, view: WorkerView, lost: tuple[str, ...], asked: float) -> None:
        """Record the prefill workers decode worker ``view`` reports lost; re-wire those that answer."""
        d = view.worker_id
        view.lost_prefills = {p for p in lost if p in self.views and self._wired_since(p, d) < asked}
        for p in sorted(view.lost_prefills):
            if self.views[p].healthy and (p, d) not in self._rewiring:
                self._rewiring[(p, d)] = asyncio.get_running_loop().create_task(self._rewire_pair(p, d))

    async def _rewire_pair(self, prefill_id: str, decode_id: str) -> None:
        log.warning("decode worker %s lost prefill worker %s (silent past the control plane's peer timeout) "
                    "while both answer health checks: re-wiring the pair", decode_id, prefill_id)
        try:
            await self.on_pair_lost(prefill_id, decode_id)
        except Exception as e:  # noqa: BLE001 - the pair stays out of placement; retried on the next check
            log.warning("could not re-wire (%s, %s): %s", prefill_id, decode_id, e)
            return
        finally:
            self._rewiring.pop((prefill_id, decode_id), None)
        self._wired_at[(prefill_id, decode_id)] = time.monotonic()
        view = self.views.get(decode_id)
        if view is not None:
            view.lost_prefills.discard(prefill_id)
        self.on_pair_rewired(prefill_id, decode_id)
        log.warning("pair (%s, %s) re-wired: back in placement", prefill_id, decode_id)
