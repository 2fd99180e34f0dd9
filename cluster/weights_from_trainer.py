"""SGLang's weight update from a trainer's process group, for the local and the Ray router: what RL frameworks that
train on other machines than their rollouts call (slime, AReaL, OpenRLHF with SGLang; verl's non-colocated mode).

- ``init_group``: join the trainer's group (cluster/trainer_group.py) as its rank ``rank_offset``.
- ``update``: receive the tensors the call names, by broadcast from rank 0, in order; check them against the served
  checkpoint (Hugging Face names and shapes, cluster/staged_checkpoint.py); then
  - generation running: every worker serves them from the answer on, as one weight update from disk
    (cluster/generation_control.py: in-flight requests finish first, or are aborted; a new weight version);
  - generation paused by the caller (slime, AReaL pause around an update sent in buckets, each call naming the same
    ``weight_version``): they are staged, and the staged tensors of every call since are served together, as one
    update under the last version named, when generation resumes (or an update from disk comes, which refuses while
    any are staged). One version, one set of weights: a bucket never runs as a version of its own.
- ``destroy_group``: leave the group.

The tensors are received before anything else is checked, so the trainer's broadcasts always complete: a refused
update (unknown names, other shapes) answers 400 having taken them, and the trainer goes on. Only an update whose
form is wrong (lengths, dtypes) or that names more bytes than the served checkpoint could hold is refused before,
as its broadcasts cannot be matched anyway.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from pathlib import Path

from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.staged_checkpoint import (StagedCheckpointError, check_names, checkpoint_shapes,
                                                 write_staged_checkpoint)
from pdcluster.cluster.trainer_group import BACKENDS, TrainerGroup, TrainerGroupError, tensor_specs

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's
JOIN_TIMEOUT_S = 600.0
MAX_BYTES_PER_ELEMENT = 8  # an update names at most the served checkpoint's elements, at 8 bytes each


def _bad(message: str) -> RouterError:
    return RouterError(message, status=400, kind="invalid_request_error")


class WeightsFromTrainer:
    def __init__(self, generation, staging_dir: str | None = None):
        self.generation = generation  # cluster/generation_control.py GenerationControl
        self.staging_dir = staging_dir  # where staged checkpoints go (None: the system's temporary directory)
        self.groups: dict[str, TrainerGroup] = {}
        self.staged: dict = {}  # name -> tensor, received while generation was paused, not yet served
        self.staged_version: str | None = None
        self._lock = asyncio.Lock()  # one group operation at a time: a group's broadcasts are matched in order
        self._num_updates = 0
        self._made: list[Path] = []  # the staged checkpoints written here and not removed yet

    # ---- the group ----------------------------------------------------------------------------------
    async def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                         group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo",
                         timeout_s: float = JOIN_TIMEOUT_S) -> dict:
        if backend not in BACKENDS:
            raise _bad(f"backend {backend!r}: this server receives the weights in its router's process, which holds no "
                       f"GPU; make the group with backend 'gloo' (it sends from the trainer's GPUs too)")
        if not 0 < rank_offset < world_size:
            raise _bad(f"rank_offset {rank_offset} must be within the group (1 .. world_size - 1 = {world_size - 1}): "
                       "rank 0 is the trainer, and this server receives as one rank")
        async with self._lock:
            if group_name in self.groups:
                raise _bad(f"group {group_name!r} was joined already: POST /destroy_weights_update_group first")
            group = TrainerGroup(group_name, rank_offset, world_size, backend, timeout_s)
            try:
                # The caller gone, the rendezvous went on: the joined group is kept (the trainer broadcasts into it
                # next; a second join is refused by name until it is destroyed).
                await _to_thread_to_the_end(group.join, master_address, master_port,
                                            if_cancelled=lambda f: f.exception() is None
                                            and self.groups.setdefault(group_name, group))
            except Exception as e:  # noqa: BLE001 - the rendezvous: an unreachable master, a timeout
                raise RouterError(f"joining group {group_name!r} at {master_address}:{master_port} failed: {e}",
                                  status=400, kind="invalid_request_error") from None
            self.groups[group_name] = group
        log.info("joined the trainer's weight group %s as rank %d of %d", group_name, rank_offset, world_size)
        return {"success": True, "message": f"Joined group {group_name} as rank {rank_offset} of {world_size}."}

    async def destroy_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        async with self._lock:
            group = self.groups.pop(group_name, None)
            if group is None:
                raise _bad(f"no group {group_name!r} was joined here")
            await _to_thread_to_the_end(group.close)
        return {"success": True, "message": f"Left group {group_name}."}

    def close(self) -> None:
        """Leave every group; the staged checkpoints go, the one served now too (the workers go with the router)."""
        self._remove_unserved(keep_served=False)
        for group in self.groups.values():
            _close_quietly(group)
        self.groups.clear()

    # ---- an update ----------------------------------------------------------------------------------
    async def update(self, names: list, dtypes: list, shapes: list, group_name: str = DEFAULT_GROUP_NAME,
                     weight_version: str | None = None, abort_all: bool = False,
                     timeout_s: float = 600.0) -> dict:
        async with self._lock:
            group = self.groups.get(group_name)
            if group is None:
                raise _bad(f"no group {group_name!r} was joined here: POST /init_weights_update_group first")
            try:
                specs = tensor_specs(names, dtypes, shapes)
            except TrainerGroupError as e:
                raise _bad(str(e)) from None
            base = self._served_path()
            try:
                served = checkpoint_shapes(base)
            except StagedCheckpointError as e:  # a GGUF file: nothing to replace tensors of
                raise _bad(str(e)) from None
            limit = MAX_BYTES_PER_ELEMENT * sum(math.prod(shape) for shape, _ in served.values())
            if sum(s.num_bytes for s in specs) > limit:
                raise _bad(f"the update names {sum(s.num_bytes for s in specs) / 2**30:.2f} GiB, more than the served "
                           "checkpoint could hold")
            started = time.monotonic()
            try:
                # Cancelled: the tensors are dropped once taken (the caller never heard of them); a failed receive
                # leaves the group as below.
                tensors = await _to_thread_to_the_end(group.receive, specs, if_cancelled=lambda f: f.exception()
                                                      and self._leave_broken(group_name, group))
            except Exception as e:  # noqa: BLE001 - a trainer that died or sent other sizes: the group is broken
                await _to_thread_to_the_end(self._leave_broken, group_name, group)
                raise RouterError(f"receiving the weights over group {group_name!r} failed ({e}); the group is left: "
                                  "POST /init_weights_update_group again", status=503) from None
            received_s = time.monotonic() - started
            try:
                check_names(base, {s.name: s.shape for s in specs}, served)
            except StagedCheckpointError as e:
                raise _bad(f"{e}; the tensors were received and dropped, nothing changed") from None
            update = dict(zip((s.name for s in specs), tensors))
            # Paused by the caller: buckets of one version, served together at the resume. (Not for a gate closed by
            # an update's drain or a sleep: verl's order sleeps, updates, then wakes, with no resume.)
            if self.generation.paused_by_caller:
                self.staged.update(update)
                self.staged_version = weight_version or self.staged_version
                return {"success": True, "num_paused_requests": 0, "weight_version": self.staged_version,
                        "message": f"Received {len(tensors)} tensors in {received_s:.2f} s; {len(self.staged)} staged, "
                                   "served when generation resumes."}
            answer = await self._serve(update, weight_version, abort_all, timeout_s)
            answer["message"] = f"Received {len(tensors)} tensors in {received_s:.2f} s. " + answer["message"]
            return answer

    async def apply_staged(self, timeout_s: float = 600.0) -> dict | None:
        """Serve the staged tensors (on the resume); None when none are."""
        async with self._lock:
            if not self.staged:
                return None
            try:
                answer = await self._serve(self.staged, self.staged_version, False, timeout_s)
            except RouterError as e:
                if e.status == 400:  # they can never be served (a version name used before): dropped
                    self.staged, self.staged_version = {}, None
                raise  # else (workers down, a drain that timed out) kept, for the next resume
            self.staged, self.staged_version = {}, None
            return answer

    def check_nothing_staged(self) -> None:
        """RouterError 409 while tensors are staged (an update from disk would serve without them)."""
        if self.staged:
            raise RouterError(f"{len(self.staged)} tensors received from the trainer are staged while generation is "
                              "paused: POST /continue_generation (or /resume) serves them first", status=409)

    async def _serve(self, tensors: dict, weight_version: str | None, abort_all: bool, timeout_s: float) -> dict:
        base = self._served_path()
        try:
            staged = await _to_thread_to_the_end(write_staged_checkpoint, base, tensors, self.staging_dir,
                                                 if_cancelled=lambda f: f.exception() is None
                                                 and shutil.rmtree(f.result(), ignore_errors=True))
        except StagedCheckpointError as e:
            raise _bad(str(e)) from None
        self._made.append(staged)
        self._num_updates += 1
        version = weight_version or f"trainer-{self._num_updates}"
        try:
            return await self.generation.update_weights(str(staged), version, abort_all, timeout_s)
        finally:
            # Every staged checkpoint but the one served now (this one, or, where the update failed, the one before;
            # an update from disk since serves none of them): no worker reads it any more.
            self._remove_unserved()

    def _leave_broken(self, group_name: str, group: TrainerGroup) -> None:
        if self.groups.get(group_name) is group:
            del self.groups[group_name]
        _close_quietly(group)

    def _remove_unserved(self, keep_served: bool = True) -> None:
        served = self.generation.weights_path
        for path in list(self._made):
            if not (keep_served and served is not None and Path(served) == path):
                shutil.rmtree(path, ignore_errors=True)
                self._made.remove(path)

    def _served_path(self) -> str:
        path = self.generation.weights_path or self.generation.start_path
        if path is None:
            raise RouterError("this router does not know the served checkpoint's directory", status=500)
        return path


async def _to_thread_to_the_end(fn, *args, if_cancelled=None):
    """``fn(*args)`` in a thread. A caller cancelled meanwhile (a client that timed out, a server shutting down) is
    cancelled only once the thread ended: a thread cannot be stopped, and the lock held around it is what keeps one
    call's broadcasts from being matched to the next call's receives (a second update's thread posting its
    broadcasts first would take the first update's tensors). ``if_cancelled(future)`` (the thread's, done) then keeps or
    undoes what the thread made."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                continue  # cancelled again: still wait
            except Exception:  # noqa: BLE001 - reported below
                break
        name = getattr(fn, "__name__", fn)
        log.warning("%s ended after its call was cancelled: %s", name, future.exception() or "done")
        if if_cancelled is not None:
            try:
                if_cancelled(future)
            except Exception:  # noqa: BLE001 - the cancellation goes on
                log.exception("undoing %s after its call was cancelled", name)
        raise


def _close_quietly(group: TrainerGroup) -> None:
    try:
        group.close()
    except Exception as e:  # noqa: BLE001 - a broken group, or shutting down
        log.warning("leaving group %s: %s", group.name, e)

