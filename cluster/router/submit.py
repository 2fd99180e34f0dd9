"""Placing one request: try (decode, prefill) pairs best first until a decode worker admits it.

The router hands the request to the decode worker (``submit``: prompt, typed SamplingParams, the
prefill worker to fetch the KV from, or None to prefill there) and awaits its ``Admission`` event on
the worker's event stream. The placement is registered before the call, so the verdict and the
events right behind it find it whichever channel is faster: no re-ordering buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.router.placement import PairPlacement
from pdcluster.cluster.router.state import Attempt, RequestState
from pdcluster.cluster.router.stream import RequestStreams
from pdcluster.engine.block_manager import block_hash_root, block_keys, chained_block_hashes
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.events import ADMITTED, FULL, INVALID

log = logging.getLogger(__name__)


class Submitter:
    def __init__(self, config: RouterConfig, placement: PairPlacement, streams: RequestStreams, decode: dict,
                 block_size: int, mark_down: Callable[[str, str], None]):
        self.config = config
        self.placement = placement
        self.streams = streams
        self.decode = decode  # worker id -> Ray actor handle
        self.block_size = block_size
        self._mark_down = mark_down
        # fork_group -> (prefill_id, decode_id) of the group's first placement; dropped when the
        # group's last request ends (RequestStreams.finish).
        self.group_pairs: dict[str, tuple] = {}
        self._probing: dict[str, asyncio.Task] = {}  # worker id -> its silent-worker probe (_probe_silent)

    async def place(self, r: RequestState, prompt: list[int], params: SamplingParams) -> None:
        """Returns once a decode worker admitted the request (or it finished meanwhile); raises
        RouterError when no pair takes it within ``admission_wait_s`` or it is invalid."""
        deadline = time.monotonic() + self.config.admission_wait_s
        hashes = chained_block_hashes(prompt, self.block_size, block_hash_root(params),
                                      block_keys(params, self.block_size))
        while not r.finished:
            self.placement.refresh(self.streams.requests.values())
            local = self.placement.wants_local(len(prompt), bool(self.placement.role_views("prefill", True)))
            for d, p in self._with_siblings_pair(params, local, hashes, r.failed_pair):
                if r.finished:  # aborted (client, deadline) while it waited for room
                    return
                if await self._try(r, prompt, params, d, p):
                    if p is not None:
                        p.remember(hashes)
                    return
            if not self.placement.role_views("decode", in_rotation_only=True):
                # A worker Ray is restarting comes back within seconds: wait for it, up to the deadline.
                if time.monotonic() > deadline:
                    raise RouterError("no healthy decode worker is available", status=503)
            elif time.monotonic() > deadline:
                raise RouterError("no (prefill, decode) pair can take the request: full, down, or cooling down "
                                  "after repeated failures; try again later", status=503)
            await asyncio.sleep(0.05)

    def _probe_silent(self, worker_id: str, handle) -> None:
        """A worker gave no verdict in time. A killed actor's calls can hang until Ray learns of the
        death (seconds to minutes on a loaded host), so the requests decoding there would wait for their
        deadline when no health check runs (or before its strikes add up): a ping in the background
        settles it. It fails once Ray knows the actor is gone, and then the worker is marked down and
        its requests are recovered; an answer or continued silence leaves the verdict to the health check."""
        if worker_id in self._probing:
            return

        async def probe() -> None:
            try:
                await asyncio.wait_for(handle.ping.remote(), self.config.silent_probe_timeout_s)
            except asyncio.TimeoutError:
                return
            except Exception as e:  # noqa: BLE001 - RayActorError and kin: the actor is gone
                self._mark_down(worker_id, f"gave no verdict, then {type(e).__name__}")
            finally:
                self._probing.pop(worker_id, None)

        self._probing[worker_id] = asyncio.get_running_loop().create_task(probe())

    def _with_siblings_pair(self, params: SamplingParams, local: bool, hashes: list[int], failed_pair):
        """The candidates, led by the pair a sibling choice of the same n > 1 request went to (its decode
        worker then forks the prompt instead of computing or fetching it again: engine/forks.py)."""
        sibling = self.group_pairs.get(params.fork_group) if params.fork_group is not None else None
        now = time.monotonic()
        if sibling is not None and sibling != failed_pair:
            d = self.placement.views.get(sibling[1])
            p = self.placement.views.get(sibling[0]) if sibling[0] is not None else None
            if (d is not None and d.in_rotation
                    and (sibling[0] is None or (p is not None and p.in_rotation and p.worker_id not in d.lost_prefills))
                    and self.placement.breaker(*sibling).allows(now)):
                yield d, p
        yield from self.placement.candidates(local, hashes, failed_pair, now)

    async def _try(self, r: RequestState, prompt: list[int], params: SamplingParams, d, p) -> bool:
        """One submit to decode worker ``d`` (prefill from ``p``, or locally when None): admitted?"""
        r.num_submits += 1
        recovering_before = r.recovering
        a = Attempt(r.request_id, r.num_submits, d.worker_id, p.worker_id if p is not None else None, len(prompt),
                    asyncio.get_running_loop().create_future())
        self.streams.expect(r, a)
        if params.fork_group is not None:  # set before the first await: siblings placed next see it
            self.group_pairs.setdefault(params.fork_group, a.pair)
        handle = self.decode[d.worker_id]
        verdict = None
        try:
            await asyncio.wait_for(handle.submit.remote(a.wid, prompt, params, a.prefill_id),
                                   self.config.admission_timeout_s)
            verdict = await asyncio.wait_for(asyncio.shield(a.admitted), self.config.admission_timeout_s)
        except asyncio.CancelledError:
            handle.abort.remote(a.wid)  # the caller went away mid-admission: give the blocks back
            raise
        except asyncio.TimeoutError:
            # Stuck, overloaded, or dead before Ray said so: out of rotation until the health check
            # hears from it again, and probed, so a death recovers its requests even without one.
            log.warning("decode worker %s gave no verdict within %.0f s", d.worker_id, self.config.admission_timeout_s)
            handle.abort.remote(a.wid)  # a late admission must not strand blocks
            d.healthy = False
            self._probe_silent(d.worker_id, handle)
            return False
        except Exception as e:  # noqa: BLE001 - the actor is gone: recover what it held, next
            self._mark_down(d.worker_id, f"submit failed: {type(e).__name__}")
            # The worker may have admitted the request (its Admission handled: the request was its) before
            # it died under the call: then marking it down started a recovery, which places the request
            # again. This loop stops here, or the request would get a second live placement, one of them
            # never forgotten (test_router_deliver.py: a worker that dies after admitting).
            return r.recovering and not recovering_before
        finally:
            if verdict is None or verdict.verdict != ADMITTED:
                self.streams.forget(a)
                if r.attempt is a:  # admitted before the call failed or timed out (and aborted above): not the
                    r.attempt = None  # request's placement, or a later worker_down would recover it beside this loop
        if verdict.verdict == INVALID:
            raise RouterError(verdict.reason, status=400, kind="invalid_request_error")
        if verdict.verdict == FULL:
            return False  # no decision was made: the next candidate is asked
        self.streams.record_decision(r, a)  # an admission taken on arrival was recorded then
        if verdict.verdict != ADMITTED:  # unreachable prefill, or the decode worker went down
            log.warning("placement of %s on %s failed: %s", r.request_id, a.pair, verdict.reason)
            self.placement.breaker(*a.pair).record_failure(time.monotonic())
            r.failed_pair = a.pair
            return False
        if r.finished:  # aborted by the client or its deadline while we waited
            self.streams.forget(a)
            handle.abort.remote(a.wid)
        return True
