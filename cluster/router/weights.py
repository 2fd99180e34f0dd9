"""A weight update's calls to the Ray cluster's workers (the targets of cluster/generation_control.py).

Two phases: every worker in rotation reads and checks the checkpoint (``prepare``; on its actor's own thread, so its
health checks go on answering), and only when all could does each copy it in (``commit``, a copy between steps). A
worker that cannot read it makes every worker drop what it read: nothing changed. A worker that fails its commit
(it died meanwhile) is marked down: Ray restarts it, and the restart gives it the weights the cluster serves
(``sync``, beside the LoRA adapters' in cluster/launcher.py) before it takes requests again. Every worker must
read the same contents (engine/weight_update.py ``checkpoint_digest``), as every worker must read the same LoRA
adapter: a path that holds other files on some node is refused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.router.lora import _reason

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S = 1800.0  # reading a checkpoint (a large model from a network disk)
COMMIT_TIMEOUT_S = 180.0
SLEEP_TIMEOUT_S = 330.0  # a worker's own bound (node/actor.py SLEEP_TIMEOUT_S) and the call's way there


class WorkerWeights:
    def __init__(self, handles: Callable[[], dict], healthy: Callable[[str], bool],
                 mark_down: Callable[[str, str], None]):
        self._handles, self._healthy, self._mark_down = handles, healthy, mark_down
        self._prepared: dict = {}

    def _in_rotation(self, what: str) -> dict:
        """The handles of the workers in rotation; RouterError 503 naming ``what`` where none is."""
        handles = {w: h for w, h in self._handles().items() if self._healthy(w)}
        if not handles:
            raise RouterError(f"no worker is up to {what}", status=503)
        return handles

    async def prepare(self, model_path: str, weight_version: str) -> str:
        handles = self._in_rotation("take the weights")
        answers = await _on_each(handles, lambda h: h.prepare_weights.remote(model_path, weight_version),
                                 PREPARE_TIMEOUT_S)
        failed = _failures(handles, answers)
        reason = next((f"{_reason(e)} (worker {w}; no worker changed its weights)" for w, e in failed.items()), None)
        if reason is None and len(set(answers)) > 1:
            reason = (f"the workers read different files at {model_path} ("
                      + ", ".join(f"{w}: {d}" for w, d in sorted(zip(handles, answers)))
                      + "); give a path that holds the same checkpoint on every node")
        self._prepared = handles
        if reason is not None:
            await self.discard()
            raise RouterError(reason, status=400, kind="invalid_request_error")
        return answers[0]

    async def discard(self) -> None:
        handles, self._prepared = self._prepared, {}
        await _on_each(handles, lambda h: h.discard_weights.remote(), COMMIT_TIMEOUT_S)

    async def commit(self) -> list[dict]:
        handles, self._prepared = self._prepared, {}
        answers = await _on_each(handles, lambda h: h.commit_weights.remote(), COMMIT_TIMEOUT_S)
        updates = []
        for worker, answer in zip(handles, answers):
            if isinstance(answer, BaseException):
                # It serves the old weights or none: out of rotation, and its restart brings the new ones (sync).
                self._mark_down(worker, f"it could not take the new weights: {_reason(answer)}")
            else:
                updates.append({"worker_id": worker, **answer})
        if not updates:
            raise RouterError("no worker could take the new weights (each was marked down)", status=503)
        return updates

    async def release(self, tags: tuple[str, ...], level: int) -> list[dict]:
        """Sleep mode: every worker in rotation gives back the memory of ``tags`` (engine/sleep.py). Where one cannot,
        those that could take theirs back: RouterError 400 with its reason, every worker as before."""
        handles = self._in_rotation("put to sleep")
        answers = await _on_each(handles, lambda h: h.release_memory.remote(tags, level), SLEEP_TIMEOUT_S)
        failed = _failures(handles, answers)
        if failed:
            await _on_each({w: h for w, h in handles.items() if w not in failed}, lambda h: h.wake_up.remote(tags),
                           SLEEP_TIMEOUT_S)
            worker, error = next(iter(failed.items()))
            raise RouterError(f"{_reason(error)} (worker {worker}; every worker is awake as before)", status=400,
                              kind="invalid_request_error")
        return list(answers)

    async def wake_up(self, tags: tuple[str, ...]) -> list[dict]:
        """Every worker takes back the memory of ``tags``: each one's sleep state. RouterError 400 with the first
        reason where one cannot (what it could not take back stays asleep; the others are awake)."""
        handles = self._handles()
        answers = await _on_each(handles, lambda h: h.wake_up.remote(tags), SLEEP_TIMEOUT_S)
        failed = _failures(handles, answers)
        if failed:
            worker, error = next(iter(failed.items()))
            raise RouterError(f"{_reason(error)} (worker {worker})", status=400, kind="invalid_request_error")
        return list(answers)

    @staticmethod
    async def sync(worker_id: str, handle, model_path: str | None, weight_version: str, digest: str) -> None:
        """Give a restarted or new worker the weights the cluster serves (``model_path`` None: the checkpoint it
        started with, nothing to do). Raises when it cannot, or when the files at ``model_path`` are no longer
        those of ``digest`` (a trainer wrote the next checkpoint there): it must not serve requests it would
        refuse, nor other weights under the cluster's version."""
        if model_path is None:
            return
        read = await asyncio.wait_for(handle.prepare_weights.remote(model_path, weight_version), PREPARE_TIMEOUT_S)
        if read != digest:
            await asyncio.wait_for(handle.discard_weights.remote(), COMMIT_TIMEOUT_S)
            raise RuntimeError(f"{model_path} no longer holds the checkpoint of weights {weight_version!r} (digest "
                               f"{read}, was {digest}): update the cluster to it for worker {worker_id} to serve")
        await asyncio.wait_for(handle.commit_weights.remote(), COMMIT_TIMEOUT_S)
        log.info("worker %s now serves weights %s (%s)", worker_id, weight_version, model_path)


async def _on_each(handles: dict, call: Callable, timeout_s: float) -> list:
    """``call(handle)`` (a Ray call) on every worker of ``handles`` at once, each bounded by ``timeout_s``: the answers
    in ``handles``' order, the exception where one failed."""
    return await asyncio.gather(*(asyncio.wait_for(call(h), timeout_s) for h in handles.values()),
                                return_exceptions=True)


def _failures(handles: dict, answers: list) -> dict:
    """worker id -> exception, for the workers whose answer is one."""
    return {w: a for w, a in zip(handles, answers) if isinstance(a, BaseException)}
