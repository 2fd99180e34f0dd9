"""Sleep mode: an idle engine lets go of its memory and takes it back (vLLM's ``LLM.sleep`` / ``wake_up`` and
/sleep, /wake_up; SGLang's /release_memory_occupation, /resume_memory_occupation). An RL trainer on the same
machines trains meanwhile, in the memory the engine held.

Two kinds of memory, named by vLLM's and SGLang's tags:

- ``kv_cache``: the paged KV cache (a decode worker's shared-memory cache too) and a hybrid's Mamba state pool. Its
  contents are forgotten: the device pool's prefix cache is reset first (each block told removed in the KV events,
  so the router's index drops them), each cached block copied into the offload tiers first, as an evicted one is
  (with --kv-offload-host-gib or a disk tier): there a prefix hits again after the wake.
- ``weights``: the checkpoint's tensors (the model, its image tower, an MTP head: what a weight update copies) and a
  draft model's. Level 1 keeps them: vLLM offloads them to CPU memory, and on a CPU they are there already. Level 2
  discards them. The checkpoint's come back with the next weight update (``update_weights_from_disk``, which an RL
  trainer sends anyway: nothing is read twice) or, when the engine is woken whole without one, are read again from
  the checkpoint they were served from, whose files must still hold them (vLLM leaves them garbage until its caller
  reloads them); a draft model's are read again from its directory at that wake (an update leaves the draft as it
  is).

Released memory keeps its addresses: the pages go back to the kernel (``madvise``: MADV_REMOVE for a shared
segment, MADV_DONTNEED for private memory) and fault in again, zeroed, when written. So whatever holds a pointer
into them (the KV transports' shared segments and their peers' mappings, views of the cache, packed weights) keeps
working across a sleep without being told.

Only between requests (``LLMEngine.is_idle``): a router drains first. On CUDA, device memory would have to be
unmapped behind stable addresses (vLLM's CuMemAllocator); that is not built yet: refused by name.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from dataclasses import dataclass, field

import torch

from pdcluster.engine import weight_update

SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's and SGLang's names
LEVEL_TAGS = {1: ("kv_cache",), 2: ("kv_cache", "weights")}  # what each level releases here
_PAGE = mmap.PAGESIZE


class SleepError(ValueError):
    """The call cannot be made (a request runs, an unknown level or tag, a device or split this does not serve);
    nothing changed."""


class EngineSleeping(RuntimeError):
    """A request came while the engine sleeps: not the request's fault (HTTP 503, as vLLM answers then)."""


@dataclass
class SleepState:
    asleep: set[str] = field(default_factory=set)  # tags released and not yet woken
    level: int = 0  # the deepest level asked since the last full wake
    weights_discarded: bool = False  # level 2: nothing restored them since (a weight update or the reload)
    discarded_digest: str = ""  # engine/weight_update.py checkpoint_digest of the weights discarded
    draft_discarded: bool = False  # level 2: a draft model's weights, read again at the full wake
    draft_digest: str = ""
    released_bytes: dict[str, int] = field(default_factory=dict)
    num_sleeps: int = 0
    num_reloads: int = 0  # level-2 weights read again at a wake (none where an update came first)

    def describe(self) -> dict:
        return {"is_sleeping": bool(self.asleep), "sleep_level": self.level if self.asleep else 0,
                "asleep_tags": sorted(self.asleep), "released_bytes": dict(self.released_bytes)}


def check_tags(tags, what: str = "tags") -> tuple[str, ...]:
    """``tags`` as a tuple of SLEEP_TAGS (None: all of them); SleepError naming an unknown one."""
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str):
        tags = [tags]
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise SleepError(f"{what}: {unknown[0]!r} is not one of {', '.join(SLEEP_TAGS)}")
    return tuple(dict.fromkeys(tags))


def check_level(level) -> tuple[str, ...]:
    if isinstance(level, bool) or level not in LEVEL_TAGS:
        raise SleepError(f"level: 1 (discard the KV cache, keep the weights) or 2 (discard both), got {level!r}")
    return LEVEL_TAGS[level]


def sleep(engine, level: int = 1) -> dict:
    """Release what ``level`` names (see the module); returns the state with the bytes given back per tag. An engine
    asleep already goes deeper or stays as it is."""
    tags = check_level(level)
    return release(engine, tags, level)


def release(engine, tags, level: int | None = None) -> dict:
    """Release the memory of ``tags`` (SGLang's release_memory_occupation; ``sleep`` by level). Tag ``weights``
    discards them (level 2)."""
    tags = check_tags(tags)
    _check_can_sleep(engine)
    if engine._stepper is not None:
        engine._stepper.drain()  # async scheduling: a step of finished rows may still be in flight, reading both
    state: SleepState = engine.sleep_state
    started = time.monotonic()
    if "kv_cache" in tags and "kv_cache" not in state.asleep:
        # The pool's contents go, so no hash may point into it; the offload tiers keep a copy of each cached block,
        # as of one evicted (a prefix hits again from host memory after the wake).
        engine.scheduler.block_manager.reset_prefix_cache(evict=True)
        state.released_bytes["kv_cache"] = release_host_memory(_kv_tensors(engine))
        state.asleep.add("kv_cache")
    if "weights" in tags and "weights" not in state.asleep:
        if not state.weights_discarded:
            state.discarded_digest = weight_update.checkpoint_digest(engine.weights_path)
        draft = _draft_model(engine)
        if draft is not None and not state.draft_discarded:
            state.draft_digest = weight_update.checkpoint_digest(draft.source.directory)
            state.draft_discarded = True
        weights = _weight_tensors(engine) + (weight_update.served_tensors(draft) if draft is not None else [])
        state.released_bytes["weights"] = release_host_memory(weights)
        release_checkpoint_mappings(weights)
        state.asleep.add("weights")
        state.weights_discarded = True
        if engine.runner.image_embeds is not None:  # computed by the discarded tower
            engine.runner.image_embeds.clear()
    state.level = max(state.level, level or (2 if "weights" in tags else 1))
    state.num_sleeps += 1
    return {**state.describe(), "seconds": round(time.monotonic() - started, 4)}


def wake_up(engine, tags=None) -> dict:
    """Take back the memory of ``tags`` (None: all; vLLM's wake_up, SGLang's resume_memory_occupation). Once nothing
    sleeps, weights that level 2 discarded and no update restored are read again from the checkpoint they came from;
    SleepError when its files changed since (the weights stay asleep: a weight update brings them back)."""
    tags = check_tags(tags)
    state: SleepState = engine.sleep_state
    started = time.monotonic()
    if "kv_cache" in tags and "kv_cache" in state.asleep:
        # The pages faulted in now, as at start (engine/kv_cache.py), not under the first requests; they read zero.
        populate_host_memory(_kv_tensors(engine))
        state.asleep.discard("kv_cache")
        state.released_bytes.pop("kv_cache", None)
    if "weights" in tags and "weights" in state.asleep:
        state.asleep.discard("weights")
        state.released_bytes.pop("weights", None)
    if not state.asleep and (state.weights_discarded or state.draft_discarded):
        if state.weights_discarded:
            _reload_weights(engine, state)
        if state.draft_discarded:
            _reload_draft(engine, state)
        _trim_heap()  # the checkpoint read beside the served tensors is freed: its heap pages go back too
    if not state.asleep:
        state.level = 0
    return {**state.describe(), "seconds": round(time.monotonic() - started, 4)}


def weights_restored(engine) -> None:
    """A weight update wrote every weight of the checkpoint: whatever level 2 discarded of them is back, and need not
    be read again (a draft model's, which no update writes, is read again once nothing else sleeps)."""
    state: SleepState = engine.sleep_state
    state.weights_discarded = False
    state.discarded_digest = ""
    state.asleep.discard("weights")
    state.released_bytes.pop("weights", None)
    if not state.asleep:
        state.level = 0
        if state.draft_discarded:
            _reload_draft(engine, state)


def check_awake(engine) -> None:
    """EngineSleeping where the engine sleeps (a request must not run on released memory)."""
    state: SleepState = engine.sleep_state
    if state.asleep:
        raise EngineSleeping(f"the model is sleeping ({', '.join(sorted(state.asleep))} released): wake it up first "
                             "(POST /wake_up, or LLMEngine.wake_up())")
    if state.weights_discarded or state.draft_discarded:
        raise EngineSleeping("the model's weights were discarded by a level-2 sleep and could not be read again: "
                             "update them (POST /update_weights_from_disk)")


def _check_can_sleep(engine) -> None:
    if engine.model.device.type != "cpu":
        raise SleepError(f"sleep mode on {engine.model.device.type}: releasing device memory needs it mapped behind "
                         "addresses that survive (vLLM's CuMemAllocator), not built yet; on a CPU the KV cache and "
                         "the weights are given back")
    if engine.model.tp_driver is not None:
        raise SleepError("sleep mode with tensor or pipeline parallelism: the other ranks' memory is not released "
                         "yet; serve with --tensor-parallel-size 1 and --pipeline-parallel-size 1 to sleep")
    if engine.pending_weights is not None:
        raise SleepError("a weight update is prepared and not committed: commit or discard it first")
    if not engine.is_idle():
        raise SleepError(f"{len(engine.scheduler.requests)} requests are here: pause generation first "
                         "(POST /pause?mode=wait, or sleep with mode=wait or mode=abort)")


def _reload_weights(engine, state: SleepState) -> None:
    """Read the discarded weights again from the checkpoint they came from, in place."""
    digest = weight_update.checkpoint_digest(engine.weights_path)
    if digest != state.discarded_digest:
        state.asleep.add("weights")
        raise SleepError(f"{engine.weights_path} no longer holds the checkpoint of weights "
                         f"{engine.weight_version!r} (digest {digest}, was {state.discarded_digest}), so the weights "
                         "level 2 discarded cannot be read again: update the weights (POST /update_weights_from_disk) "
                         "to serve that checkpoint")
    prepared = weight_update.prepare_reload(engine)
    weight_update.copy_prepared(engine, prepared)
    state.num_reloads += 1
    weights_restored(engine)


def _reload_draft(engine, state: SleepState) -> None:
    """Read a draft model's discarded weights again from its directory, in place."""
    draft = _draft_model(engine)
    digest = weight_update.checkpoint_digest(draft.source.directory)
    if digest != state.draft_digest:
        state.asleep.add("weights")
        raise SleepError(f"the draft model's directory {draft.source.directory} changed since the sleep (digest "
                         f"{digest}, was {state.draft_digest}): its discarded weights cannot be read again; restart "
                         "the server on the draft wanted")
    weight_update.copy_weights(draft, draft.source.load())
    state.draft_discarded = False
    state.num_reloads += 1


def _draft_model(engine):
    """The draft model a draft-model proposer runs (engine/proposers/draft_model.py), else None."""
    draft = getattr(engine.runner.proposer, "draft", None)
    return draft if getattr(draft, "source", None) is not None else None


def _kv_tensors(engine) -> list[torch.Tensor]:
    tensors = [engine.kv_cache]
    pool = engine.runner.mamba_pool
    if pool is not None:
        tensors += pool.conv + pool.ssm + pool.spec_conv + pool.spec_ssm
    return tensors


def _weight_tensors(engine) -> list[torch.Tensor]:
    """The tensors a weight update writes (engine/weight_update.py ``served_tensors``): the model's, its image
    tower's and an MTP head's."""
    roots = (engine.model, getattr(engine.model, "image_encoder", None),
             getattr(engine.runner.proposer, "head", None))
    return weight_update.served_tensors(roots)


# ---- host memory --------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _trim_heap() -> None:
    trim = getattr(_libc, "malloc_trim", None)  # glibc's
    if trim is not None:
        trim(0)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching them from here


def populate_host_memory(tensors) -> None:
    """Fault in again the pages ``release_host_memory`` gave back (zeroed by the kernel): one madvise a tensor where
    the kernel has MADV_POPULATE_WRITE, else a zero fill (the same pages, written from here)."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        begin, end = _whole_pages(storage.data_ptr(), storage.nbytes())
        if end <= begin or _libc.madvise(begin, end - begin, _MADV_POPULATE_WRITE) != 0:
            tensor.zero_()


def _storage_spans(tensors) -> dict[int, int]:
    """Each CPU storage under ``tensors`` once: its address -> its bytes."""
    spans: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start:
            spans[start] = max(spans.get(start, 0), storage.nbytes())
    return spans


def _whole_pages(start: int, nbytes: int) -> tuple[int, int]:
    """The pages wholly inside [start, start + nbytes): the partial ones at either end may hold another
    allocation's bytes."""
    return -(-start // _PAGE) * _PAGE, (start + nbytes) // _PAGE * _PAGE


def release_host_memory(tensors) -> int:
    """Give the pages wholly inside each tensor's storage back to the kernel, keeping the addresses (see the module);
    the contents read zero (or, for a shared segment another process keeps, are undefined) until written. Returns
    the bytes released. Storages are counted once however many tensors view them."""
    spans = _storage_spans(tensors)
    shared = _shared_memory_mappings() if spans else []
    released = 0
    for start, nbytes in spans.items():
        begin, end = _whole_pages(start, nbytes)
        if end > begin:
            in_shared = any(lo <= begin and end <= hi for lo, hi in shared)
            _madvise(begin, end - begin, mmap.MADV_REMOVE if in_shared else mmap.MADV_DONTNEED)
            released += end - begin
    return released


def release_checkpoint_mappings(tensors) -> None:
    """Drop from this process every page of the private file mappings (a safetensors checkpoint read in place) that
    hold a storage under ``tensors``: the pages the loader read there and no tensor holds any more (converted or
    packed into other memory) stay mapped otherwise. They are the file's (clean, or the discarded weights' own
    copies): reading one again reads the file."""
    starts = sorted(_storage_spans(tensors))
    if not starts:
        return
    for lo, hi in _mappings(lambda perms, path: perms[3] == "p" and path.startswith("/")):
        if any(lo <= start < hi for start in starts):
            _madvise(lo, hi - lo, mmap.MADV_DONTNEED)


def _mappings(keep) -> list[tuple[int, int]]:
    """This process's mappings (start, end) whose permissions and path ``keep(perms, path)`` takes."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if keep(parts[1], path):
                lo, hi = parts[0].split("-")
                found.append((int(lo, 16), int(hi, 16)))
    return found


def _shared_memory_mappings() -> list[tuple[int, int]]:
    """This process's shared mappings of memory segments (memfd, /dev/shm: the shm and cuda_ipc transports' caches),
    whose pages only MADV_REMOVE frees (MADV_DONTNEED would only unmap them here). A shared mapping of any other file
    is left out: MADV_REMOVE would punch a hole in that file."""
    return _mappings(lambda perms, path: perms[3] == "s" and (path.startswith("/memfd:") or
                                                           path.startswith("/dev/shm/")))


def _madvise(address: int, length: int, advice: int) -> None:
    if _libc.madvise(address, length, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise: {os.strerror(errno)}")
