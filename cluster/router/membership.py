"""Workers joining and leaving a running cluster. A leaving worker drains: it gets no new placements
at once, and it is removed only when nothing depends on it any more, so nothing is lost and nothing
is recomputed that did not need to be:
- a decode worker, once every request placed on it has finished;
- a prefill worker, once no request still waits for its KV and the worker itself owes no transfer
  (every one acknowledged by its decode worker or revoked: its ``num_transfers`` is zero).
A worker that dies while draining is handled like any dead worker (its requests are recovered)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdcluster.cluster.router.placement import PairPlacement
from pdcluster.cluster.router.stream import RequestStreams


@dataclass(frozen=True)
class DrainResult:
    worker_id: str
    waited_s: float
    num_requests_waited_for: int  # requests that depended on the worker when the drain began


class Membership:
    def __init__(self, placement: PairPlacement, streams: RequestStreams, prefill: dict, decode: dict, health):
        self.placement = placement
        self.streams = streams
        self.prefill = prefill  # worker id -> Ray actor handle (the router's own dicts)
        self.decode = decode
        self.health = health

    def add(self, worker_id: str, role: str, handle, num_blocks: int, block_size: int, incarnation: str | None,
            pid: int | None = None, num_state_blocks: int = 0, kv_event_source: dict | None = None) -> None:
        """Put a started, wired worker into rotation. ``num_state_blocks``: a hybrid decode worker
        reserves that many blocks more per transferred prompt, for its Mamba state. ``kv_event_source``: where it
        publishes vLLM's KV events (its first ping's)."""
        (self.prefill if role == "prefill" else self.decode)[worker_id] = handle
        if incarnation is not None:
            self.health.incarnations[worker_id] = incarnation
        self.placement.add_worker(worker_id, role, num_blocks, block_size)
        self.placement.views[worker_id].pid = pid
        self.placement.views[worker_id].num_state_blocks = num_state_blocks
        self.placement.views[worker_id].kv_event_source = kv_event_source

    def dependents(self, worker_id: str) -> list[str]:
        """Requests that still need ``worker_id``: placed on it as decode, or waiting for its KV."""
        out = []
        for r in self.streams.requests.values():
            a = r.attempt
            if a is not None and (a.decode_id == worker_id or (a.prefill_id == worker_id and not a.t_kv_ready)):
                out.append(r.request_id)
        return out

    async def drain(self, worker_id: str, timeout_s: float, poll_s: float = 0.05) -> DrainResult:
        """Take ``worker_id`` out of rotation, wait until nothing depends on it, then forget it (the
        caller stops the process). Raises TimeoutError (the worker stays out of rotation) if it cannot
        drain within ``timeout_s``."""
        view = self.placement.views.get(worker_id)
        if view is None:
            raise KeyError(f"no worker {worker_id!r} in this cluster")
        view.draining = True
        started = time.monotonic()
        waited_for = len(self.dependents(worker_id))
        deadline = started + timeout_s
        while True:
            if not self.dependents(worker_id) and not self.streams.pending_on(worker_id) \
                    and await self._owes_nothing(worker_id, deadline):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker_id} did not drain within {timeout_s:.0f} s: "
                                   f"{len(self.dependents(worker_id))} requests still depend on it")
            await asyncio.sleep(poll_s)
        self.forget(worker_id)
        return DrainResult(worker_id, time.monotonic() - started, waited_for)

    async def _owes_nothing(self, worker_id: str, deadline: float) -> bool:
        handle = self.prefill.get(worker_id)
        if handle is None:
            return True  # a decode worker: its requests are all the router needs to know
        stats = await asyncio.wait_for(handle.stats.remote(), max(deadline - time.monotonic(), 0.1))
        return stats["num_transfers"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0

    def forget(self, worker_id: str) -> None:
        self.placement.views.pop(worker_id, None)
        self.prefill.pop(worker_id, None)
        self.decode.pop(worker_id, None)
        self.health.forget(worker_id)
        for key in [k for k in self.placement.breakers if worker_id in k]:
            del self.placement.breakers[key]
