"""Pausing generation and swapping the weights under a router: what an RL trainer does between rollouts.

One ``GenerationControl`` per router (cluster/router/router.py for the Ray cluster, cluster/local_router.py for one
engine), behind vLLM's routes (POST /pause, /resume, GET /is_paused) and SGLang's (POST /update_weights_from_disk,
GET /get_weight_version): cluster/api/weight_routes.py.

- A request enters through ``entered`` (a context manager around its whole life in the router): while generation is
  paused it waits there, bounded by the router's request timeout, as vLLM queues requests while paused.
- ``pause("abort")`` aborts every request in flight (their streams end with finish_reason "abort"), ``pause("wait")``
  lets them finish; both return once none is left. vLLM's "keep" (freeze them mid-stream and go on after the
  update) is refused: here a request never runs on two sets of weights.
- ``abort_matching`` aborts the requests in flight whose id matches a regular expression (SGLang's /abort_request).
- ``update_weights`` pauses (abort or wait), has every worker read and check the checkpoint (``prepare``), and only
  once all could, copies it in on each (``commit``); a worker that cannot read it leaves every worker as it was. The
  router then stamps each request with the new version (``stamp``): its block hashes start from it (KV of the old
  weights never serves it, in any worker's cache or tier, or in the router's index) and a worker still holding other
  weights refuses it instead of mixing the two (engine/weight_update.py). Then generation resumes, unless a caller
  had paused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import replace
from typing import Awaitable, Callable, Protocol

from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.engine.sampling_params import DEFAULT_WEIGHT_VERSION, SamplingParams
from pdcluster.cluster.weights_from_trainer import WeightsFromTrainer
from pdcluster.engine.weight_update import WeightUpdateError, check_version

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode
DEFAULT_DRAIN_TIMEOUT_S = 600.0
_POLL_S = (0.005, 0.1)  # the drain's poll: first wait, longest wait


class WeightTargets(Protocol):
    """The workers a weight update goes to (every worker of the router)."""

    async def prepare(self, model_path: str, weight_version: str) -> str:
        """Every worker reads and checks the checkpoint; returns its contents' digest (engine/weight_update.py
        ``checkpoint_digest``, the same on every worker). RouterError (400 with the reason) when one cannot or the
        workers read different contents, every worker having dropped what it read."""
        ...

    async def discard(self) -> None:
        """Every worker drops what it prepared."""
        ...

    async def commit(self) -> list[dict]:
        """Every worker serves what it prepared: each one's WeightUpdate as a dict."""
        ...

    async def release(self, tags: tuple[str, ...], level: int) -> list[dict]:
        """Every worker gives back the memory of ``tags`` (engine/sleep.py): each one's sleep state. RouterError 400
        with the reason when one cannot, every worker then awake as before."""
        ...

    async def wake_up(self, tags: tuple[str, ...]) -> list[dict]:
        """Every worker takes back the memory of ``tags``: each one's sleep state. RouterError where one cannot."""
        ...


class GenerationControl:
    def __init__(self, abort: Callable[[str], Awaitable[None]], targets: WeightTargets, admit_timeout_s: float):
        self._abort = abort
        self._targets = targets
        self._admit_timeout_s = admit_timeout_s
        self._open = asyncio.Event()
        self._open.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused_by_caller = False
        self._in_flight: set[str] = set()
        self._groups: dict[str, int] = {}  # fork group -> its choices in flight
        self.update_lock = asyncio.Lock()  # one update at a time; a joining worker's sync holds it too
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.weights_path: str | None = None  # None: the checkpoint the workers started with
        self.start_path: str | None = None  # that checkpoint's directory (set by the router's maker)
        self.weights_digest = ""  # engine/weight_update.py checkpoint_digest of what is served since an update
        self._used: dict[str, str] = {}  # version -> the digest of the contents it named
        self.num_updates = 0
        self.last_update_s = 0.0
        self.asleep_tags: set[str] = set()  # engine/sleep.py's tags the workers released (sleep mode)
        self.sleep_level = 0

    def _bind(self) -> None:
        """The gate and the lock on the running loop: a router moved to another loop (router.start) takes its
        state along, not primitives bound to the loop it left."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            was_open, self._open = self._open.is_set(), asyncio.Event()
            if was_open:
                self._open.set()
            self.update_lock = asyncio.Lock()
        self._loop = loop

    def exclusive(self) -> asyncio.Lock:
        """The update lock on the running loop: held by an update, and by a worker's weight sync (no update passes
        a joining worker by)."""
        self._bind()
        return self.update_lock

    # ---- requests -----------------------------------------------------------------------------------
    @property
    def is_paused(self) -> bool:
        return not self._open.is_set()

    @property
    def paused_by_caller(self) -> bool:
        """Paused by /pause (not only for an update's drain or a sleep): until /resume."""
        return self._paused_by_caller

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep_tags)

    def stats(self) -> dict:
        """For the router's stats (/health, /metrics)."""
        return {"weight_version": self.weight_version, "paused": self.is_paused, "num_updates": self.num_updates,
                "last_update_s": round(self.last_update_s, 3), "sleep_level": self.sleep_level if self.asleep_tags
                else 0}

    def _sleeping(self) -> RouterError:
        return RouterError(f"the model is sleeping ({', '.join(sorted(self.asleep_tags))} released): POST /wake_up "
                           "first", status=503)

    def _open_unless_held(self) -> None:
        """Open the gate unless a caller paused generation or the workers sleep."""
        if not self._paused_by_caller and not self.asleep_tags:
            self._open.set()

    @contextlib.asynccontextmanager
    async def entered(self, request_id: str, fork_group: str | None = None):
        """Around a request's life in the router: waits while generation is paused (RouterError 503 after the
        router's request timeout), then counts it in flight until the block ends. A choice of an n > 1 request
        (``fork_group``) whose sibling is in flight does not wait: the choices of one request run on one set of
        weights, and the drain waits for it as for its siblings."""
        if self.asleep_tags:  # as vLLM answers while it sleeps, at once
            raise self._sleeping()
        if not self._open.is_set() and (fork_group is None or not self._groups.get(fork_group)):
            self._bind()
            try:
                await asyncio.wait_for(self._open.wait(), self._admit_timeout_s)
            except asyncio.TimeoutError:
                if self.asleep_tags:  # it came during the drain before a sleep
                    raise self._sleeping() from None
                raise RouterError(f"generation is paused (POST /resume) and stayed paused for "
                                  f"{self._admit_timeout_s:.0f} s", status=503) from None
        self._in_flight.add(request_id)  # no await since the gate: an update that closes it now waits for this one
        if fork_group is not None:
            self._groups[fork_group] = self._groups.get(fork_group, 0) + 1
        try:
            yield
        finally:
            self._in_flight.discard(request_id)
            if fork_group is not None:
                left = self._groups.pop(fork_group) - 1
                if left:
                    self._groups[fork_group] = left

    async def abort_matching(self, pattern: str) -> int:
        """SGLang's /abort_request by id pattern: abort every request in flight whose router id the regular
        expression ``pattern`` matches whole (``re.fullmatch``: "" matches only an empty id); their streams end with
        finish_reason "abort". Returns how many. ValueError when ``pattern`` is no regular expression."""
        try:
            matcher = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"abort pattern {pattern!r} is not a regular expression: {e}") from None
        matched = [request_id for request_id in self._in_flight if matcher.fullmatch(request_id)]
        answers = await asyncio.gather(*(self._abort(request_id) for request_id in matched), return_exceptions=True)
        for request_id, answer in zip(matched, answers):
            if isinstance(answer, BaseException):
                log.warning("aborting request %s failed: %s", request_id, answer)
        return len(matched)

    def stamp(self, params: SamplingParams) -> SamplingParams:
        """``params`` under the weights the workers serve now."""
        if params.weight_version == self.weight_version:
            return params
        return replace(params, weight_version=self.weight_version)

    # ---- pause / resume -----------------------------------------------------------------------------
    async def pause(self, mode: str = "abort", timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> int:
        """Stop starting requests; ``mode`` abort: end those in flight, wait: let them finish. Returns once none is
        in flight, with how many there were; RouterError 400 for another mode, 504 when they outlast ``timeout_s``
        (generation stays paused)."""
        check_mode(mode)
        self._bind()
        self._open.clear()
        self._paused_by_caller = True
        return await self._drain(mode, timeout_s)

    def resume(self) -> None:
        self._paused_by_caller = False
        if not self.update_lock.locked():  # an update resumes when it ends
            self._open_unless_held()

    async def _drain(self, mode: str, timeout_s: float) -> int:
        count = len(self._in_flight)
        deadline = time.monotonic() + timeout_s
        wait_s = _POLL_S[0]
        while self._in_flight:
            if mode == "abort":  # again each time: a request may have been between the gate and its placement
                await asyncio.gather(*(self._abort(rid) for rid in list(self._in_flight)), return_exceptions=True)
            if time.monotonic() > deadline:
                raise RouterError(f"{len(self._in_flight)} requests still ran after {timeout_s:.0f} s (generation "
                                  "stays paused: POST /resume, or pause with mode=abort)", status=504)
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, _POLL_S[1])
        return count

    # ---- weights ------------------------------------------------------------------------------------
    async def update_weights(self, model_path: str, weight_version: str | None = None, abort_all: bool = False,
                             timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> dict:
        """Every worker serves the checkpoint at ``model_path`` from the answer on (see the module). Returns
        SGLang's answer ({"success", "message", "num_paused_requests"}) with the version and each worker's figures;
        RouterError 400 when the checkpoint does not fit (nothing changed), 504 when the requests in flight outlast
        ``timeout_s`` (nothing changed, generation goes on)."""
        async with self.exclusive():
            try:
                version = check_version(weight_version or f"{model_path.rstrip('/').rsplit('/', 1)[-1]}-"
                                                          f"{len(self._used) + 1}", {}, "")  # the name's form
            except WeightUpdateError as e:
                raise RouterError(str(e), status=400, kind="invalid_request_error") from None
            self._open.clear()
            started = time.monotonic()
            try:
                num_paused = await self._drain("abort" if abort_all else "wait", timeout_s)
                digest = await self._targets.prepare(model_path, version)
                try:
                    check_version(version, self._used, digest)
                except WeightUpdateError as e:
                    await self._targets.discard()
                    raise RouterError(str(e), status=400, kind="invalid_request_error") from None
                updates = await self._targets.commit()
                self.weight_version, self.weights_path, self.weights_digest = version, model_path, digest
                self._used[version] = digest
                self.num_updates += 1
                self.last_update_s = time.monotonic() - started
                self.asleep_tags.discard("weights")  # every weight written: a level-2 sleep's are back
            finally:
                self._open_unless_held()
        log.info("weights %s (%s) served by %d workers", version, model_path, len(updates))
        return {"success": True, "message": f"Succeeded to update model weights ({version}).",
                "num_paused_requests": num_paused, "weight_version": version, "workers": updates}


    # ---- sleep mode ---------------------------------------------------------------------------------
    async def sleep(self, tags: tuple[str, ...], level: int, mode: str = "wait",
                    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> dict:
        """Every worker gives back the memory of ``tags`` (engine/sleep.py; ``level`` as vLLM's). Requests in flight
        finish first (``mode`` wait) or end (abort); from the answer on until the wake-up, requests are answered 503
        at once, as vLLM answers while it sleeps. RouterError 400 when a worker cannot (every worker awake again),
        504 when the requests in flight outlast ``timeout_s`` (nothing released, generation goes on)."""
        check_mode(mode)
        async with self.exclusive():
            self._open.clear()
            try:
                await self._drain(mode, timeout_s)
                workers = await self._targets.release(tuple(tags), level)
            except BaseException:
                self._open_unless_held()
                raise
            self.asleep_tags.update(tags)
            self.sleep_level = max(self.sleep_level, level)
        log.info("workers asleep (%s), level %d", ", ".join(sorted(self.asleep_tags)), self.sleep_level)
        return {"is_sleeping": True, "sleep_level": self.sleep_level, "asleep_tags": sorted(self.asleep_tags),
                "workers": workers}

    async def wake_up(self, tags: tuple[str, ...]) -> dict:
        """Every worker takes back the memory of ``tags``; generation goes on once nothing sleeps (unless a caller
        paused it). RouterError where a worker cannot (its reason; what it could not take back stays asleep)."""
        async with self.exclusive():
            try:
                workers = await self._targets.wake_up(tuple(tags))
            except BaseException:
                self._open_unless_held()  # what it asked stays asleep where a worker could not take it back
                raise
            self.asleep_tags = {tag for worker in workers for tag in worker.get("asleep_tags", ())}
            if not self.asleep_tags:
                self.sleep_level = 0
            self._open_unless_held()
        log.info("workers awake (%s)", ", ".join(tags))
        return {"is_sleeping": bool(self.asleep_tags), "asleep_tags": sorted(self.asleep_tags), "workers": workers}


def check_mode(mode: str) -> None:
    if mode == "keep":
        raise RouterError("mode=keep is not supported here: a request never runs on two sets of weights; pause "
                          "with mode=wait (in-flight requests finish) or mode=abort", status=400,
                          kind="invalid_request_error")
    if mode not in PAUSE_MODES:
        raise RouterError(f"mode: one of abort, wait (got {mode!r})", status=400, kind="invalid_request_error")


class WeightControlled:
    """The routes' side of a router that has a ``generation`` (GenerationControl): cluster/api/router_contract.py's
    WeightControl, the same for the local and the Ray router."""

    generation: GenerationControl
    _trainer_weights: WeightsFromTrainer | None = None

    @property
    def trainer_weights(self) -> WeightsFromTrainer:
        """SGLang's weight update from a trainer's process group (cluster/weights_from_trainer.py)."""
        if self._trainer_weights is None:
            self._trainer_weights = WeightsFromTrainer(self.generation)
        return self._trainer_weights

    def close_trainer_weights(self) -> None:
        if self._trainer_weights is not None:
            self._trainer_weights.close()

    async def pause(self, mode: str = "abort", timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> int:
        """vLLM's pause_generation: how many requests were in flight."""
        return await self.generation.pause(mode, timeout_s)

    async def resume(self) -> dict | None:
        """Generation goes on, on the weights a trainer sent while it was paused where it did (their update's
        answer; None where none came). RouterError where they cannot be served: generation stays paused."""
        answer = await self._trainer_weights.apply_staged() if self._trainer_weights is not None else None
        self.generation.resume()
        return answer

    @property
    def is_paused(self) -> bool:
        return self.generation.is_paused

    @property
    def weight_version(self) -> str:
        return self.generation.weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all: bool = False, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> dict:
        """Every worker serves the checkpoint at ``model_path``."""
        if self._trainer_weights is not None:
            self._trainer_weights.check_nothing_staged()
        return await self.generation.update_weights(model_path, weight_version, abort_all, timeout_s)

    async def abort_matching(self, pattern: str) -> int:
        """SGLang's abort_request by id pattern: how many requests in flight it aborted."""
        return await self.generation.abort_matching(pattern)

    @property
    def is_sleeping(self) -> bool:
        return self.generation.is_sleeping

    async def sleep(self, tags: tuple[str, ...], level: int, mode: str = "wait",
                    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> dict:
        """Every worker gives back the memory of ``tags`` (engine/sleep.py)."""
        return await self.generation.sleep(tags, level, mode, timeout_s)

    async def wake_up(self, tags: tuple[str, ...]) -> dict:
        return await self.generation.wake_up(tags)
