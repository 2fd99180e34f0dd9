"""The cluster's LoRA adapters: which a request may name, with each one's content digest, and loading and
unloading them on every worker while serving (``pdcluster serve --enable-lora``; the HTTP routes are
cluster/api/lora_routes.py).

Every worker holds every adapter: a request may be placed on any pair, and the decode worker continues what
the prefill worker started with the same weights. A load therefore goes to all workers at once and counts
only when all of them took it, with the same content (the same files: a shared or identical path on every
node); otherwise the workers that took it unload it again and the caller gets the first reason. An unload
takes the name away at once (the router places no new request with it) and then leaves every worker, each
keeping the weights for the requests still running with them (engine/lora/runtime.py).

The router stamps each request with its adapter's digest (SamplingParams.lora_digest): its block hashes
start from it, here in the KV index as on the workers, and a worker holding other files under the name
refuses it. A worker Ray restarts, or one added later, is given the adapters loaded while serving before it
takes requests (``sync``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0  # reading an adapter's files on every worker


def already_loaded(name: str) -> RouterError:
    """vLLM's answer to loading a name that is loaded (400), word for word: clients match on it."""
    return RouterError(f"The lora adapter '{name}' has already been loaded.", status=400, kind="invalid_request_error")


def not_found(name: str) -> RouterError:
    """vLLM's answer to unloading a name that is not loaded (404), word for word."""
    return RouterError(f"The lora adapter '{name}' cannot be found.", status=404, kind="model_not_found")


def _reason(e: BaseException) -> str:
    """The worker's own message (a Ray task error wraps it in its traceback)."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip()
    return text.splitlines()[-1] if text else repr(cause)


class LoraRegistry:
    def __init__(self, names: tuple[str, ...] = ()):
        # name -> content digest ("" until a worker has said it: the router then leaves the stamp to the worker)
        self.digests: dict[str, str] = dict.fromkeys(names, "")
        self.runtime_paths: dict[str, str] = {}  # adapters loaded while serving: what a new worker is given
        # Held by a load, an unload, and a new or restarted worker's ``sync`` up to its joining the placement:
        # no load misses a worker.
        self.lock = asyncio.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.digests)

    def learn(self, adapters: dict[str, str]) -> None:
        """The start-up adapters' digests, as a worker reports them (``lora_adapters``)."""
        for name, digest in adapters.items():
            if name in self.digests:
                self.digests[name] = digest

    def stamp(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its adapter's digest; RouterError 404 for an adapter no longer served."""
        name = params.lora_name
        if name is None:
            return params
        if name not in self.digests:
            raise RouterError(f"The model `{name}` does not exist (LoRA adapters served: "
                              f"{', '.join(self.digests) or 'none'})", status=404, kind="model_not_found")
        digest = self.digests[name]
        return replace(params, lora_digest=digest) if digest and params.lora_digest is None else params

    async def load(self, name: str, path: str, handles: dict, healthy=lambda worker_id: True) -> str:
        """Load adapter ``name`` from ``path`` on every worker of ``handles`` ({worker id: actor handle});
        returns its digest. RouterError 400 with the reason when a worker refuses it (the others unload it). A
        worker that is down (``healthy`` False) is not waited for: the restart re-wiring gives it the adapter
        (``sync``)."""
        async with self.lock:
            if name in self.digests:
                raise already_loaded(name)
            if not handles:
                raise RouterError("no worker is running to load the adapter on", status=503)
            ids = list(handles)
            answers = await asyncio.gather(
                *(asyncio.wait_for(handles[w].load_lora.remote(name, path), LOAD_TIMEOUT_S) for w in ids),
                return_exceptions=True)
            failed = {w: a for w, a in zip(ids, answers) if isinstance(a, BaseException) and healthy(w)}
            loaded = {w: a for w, a in zip(ids, answers) if not isinstance(a, BaseException)}
            reason = next((f"{_reason(e)} (worker {w})" for w, e in failed.items()), None)
            if not loaded and reason is None:
                reason = "no worker is up to load the adapter on"
            if reason is None and len(set(loaded.values())) > 1:
                reason = (f"LoRA adapter {name!r} ({path}): the workers read different files ("
                          + ", ".join(f"{w}: {d}" for w, d in sorted(loaded.items()))
                          + "); give a path that holds the same adapter on every node")
            if reason is not None:
                await self._unload_on(name, {w: handles[w] for w in loaded})
                raise RouterError(reason, status=400, kind="invalid_request_error")
            digest = next(iter(loaded.values()))
            self.digests[name] = digest
            self.runtime_paths[name] = path
            log.info("LoRA adapter %s (%s) loaded on %d workers", name, digest, len(loaded))
            return digest

    async def unload(self, name: str, handles: dict) -> None:
        """No new request is placed with ``name`` from now on; every worker of ``handles`` lets it go once its
        requests with it end. RouterError 404 for a name not loaded."""
        async with self.lock:
            if name not in self.digests:
                raise not_found(name)
            del self.digests[name]
            self.runtime_paths.pop(name, None)
            await self._unload_on(name, handles)
            log.info("LoRA adapter %s unloaded", name)

    async def sync(self, worker_id: str, handle) -> None:
        """Give a restarted or new worker the adapters loaded while serving (it started with the start-up
        ones only); the caller holds ``lock``. Raises when it cannot take one: it must not serve requests it
        would refuse."""
        for name, path in list(self.runtime_paths.items()):
            digest = await asyncio.wait_for(handle.load_lora.remote(name, path), LOAD_TIMEOUT_S)
            if digest != self.digests.get(name, digest):
                await asyncio.wait_for(handle.unload_lora.remote(name), LOAD_TIMEOUT_S)
                raise RuntimeError(f"worker {worker_id} read other files for LoRA adapter {name!r} at {path} "
                                   f"({digest}, the cluster serves {self.digests[name]})")

    @staticmethod
    async def _unload_on(name: str, handles: dict) -> None:
        answers = await asyncio.gather(
            *(asyncio.wait_for(h.unload_lora.remote(name), LOAD_TIMEOUT_S) for h in handles.values()),
            return_exceptions=True)
        for wid, answer in zip(handles, answers):
            if isinstance(answer, BaseException) and not isinstance(answer, KeyError):
                log.warning("worker %s did not unload LoRA adapter %s: %s", wid, name, _reason(answer))
