"""The scheduler's use of the offload tiers: a waiting request whose prompt continues past the device
prefix cache in a lower tier gets blocks for that part and waits (WAITING_FOR_OFFLOAD) while the loader
thread copies them in.

When the load ends, the loaded blocks join the device prefix cache (registered under their hashes) and the
request lets go of every block it held, then goes back to the front of the queue: its next schedule finds
them as an ordinary prefix hit. So a waiting request never sits on blocks (requests back from a load
holding blocks while the first of them could not grow would deadlock a full pool, with nothing running to
preempt), and S1 holds as for any prefix hit: the scheduler sets ``num_computed_tokens`` when it takes the
hit. A block that could not be read (deleted or corrupt disk file) ends the loaded prefix there; the rest
is computed. A request loads at most MAX_LOADS times (a pool so full that its loaded blocks are evicted
again before it runs recomputes instead of loading forever).

A decode worker's remote request (engine/remote_admission.py) loads its lower-tier prefix the same way,
at admission: it keeps its blocks (they are its reservation), and when the load ends it goes back to
WAITING_FOR_REMOTE_KV and is handed out (``OffloadPoll.remote_ready``) for the worker to ask the prefill
worker for the blocks after the ones that arrived intact.

A request with a ``kv_source`` (vLLM's external prefill/decode protocol: kv_transfer/connector/external.py)
loads the blocks another instance holds for it the same way, from the source instead of the tiers, once; the
blocks it does not bring are computed."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.kv_offload.manager import LoadJob, OffloadManager
from pdcluster.engine.request import Request, RequestStatus

MAX_LOADS = 2


@dataclass
class OffloadPoll:
    ready: list[Request] = field(default_factory=list)  # local requests back to the queue (front)
    released: list[str] = field(default_factory=list)  # loads that ended for requests finished meanwhile
    remote_ready: list[Request] = field(default_factory=list)  # remote requests whose lower-tier prefix is in


class NoOffload:
    """No lower tiers: nothing loads, nothing waits (the scheduler never asks "are there tiers?")."""

    manager = None
    loading: dict[str, Request] = {}

    def try_start(self, request: Request, cached: list[int], block_hashes: list[int], block_manager: BlockManager,
                  keep_last: bool) -> bool:
        return False

    def num_lower_blocks(self, cached: list[int], block_hashes: list[int], keep_last: bool) -> int:
        return 0

    def start_remote(self, request: Request, num_base_blocks: int, block_hashes: list[int]) -> None:
        raise AssertionError("no lower tiers to load from")

    def poll(self, block_manager: BlockManager) -> OffloadPoll:
        return OffloadPoll()

    @property
    def num_loading(self) -> int:
        return 0

    def forget(self, request_id: str) -> None:
        pass

    def drop_source(self, request: Request) -> None:
        request.kv_source = None

    def settle_evictions(self) -> None:
        """Blocks just taken for a writer outside the steps' queue may be named to it (OffloadManager's)."""


class OffloadGate(NoOffload):
    def __init__(self, manager: OffloadManager, block_size: int) -> None:
        self.manager = manager
        self.block_size = block_size
        self.loading: dict[str, Request] = {}
        self._num_loads: dict[str, int] = {}
        self._remote: set[str] = set()  # of ``loading``, decode-side requests (they keep their blocks)

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def try_start(self, request: Request, cached: list[int], block_hashes: list[int], block_manager: BlockManager,
                  keep_last: bool) -> bool:
        """``cached``: the device prefix cache's blocks for the request (already trimmed as the scheduler
        wants); ``block_hashes``: BlockManager.usable_block_hashes(request). Starts a load and returns True
        when lower tiers hold the blocks that follow."""
        if self._num_loads.get(request.request_id, 0) >= MAX_LOADS:
            return False
        num_lower = self.num_lower_blocks(cached, block_hashes, keep_last)
        source = request.kv_source
        if num_lower == 0 and source is not None:
            # Another instance holds the prompt's first ``source.num_blocks`` blocks (vLLM's external P/D): load
            # those past the device hit, as a lower tier's (under MTP the schedule that takes them as a hit leaves
            # the last one out: it is recomputed).
            num_lower = max(0, min(source.num_blocks, len(block_hashes)) - len(cached))
            if num_lower == 0:
                self.drop_source(request)
                return False
        elif num_lower:
            source = None
        if num_lower == 0:
            return False
        if not block_manager.allocate_slots(request, num_lower * self.block_size, cached, out_of_stream=True):
            return False
        self._num_loads[request.request_id] = self._num_loads.get(request.request_id, 0) + 1
        if source is not None:
            request.kv_source = None  # one pull: what it did not bring is computed
        self._start(request, len(cached), block_hashes[len(cached): len(cached) + num_lower], source)
        return True

    def drop_source(self, request: Request) -> None:
        """The request will not pull the blocks another instance holds for it: that instance may free them."""
        if request.kv_source is not None:
            self.manager.discard_source(request.kv_source)
            request.kv_source = None

    def num_lower_blocks(self, cached: list[int], block_hashes: list[int], keep_last: bool) -> int:
        """How many of the blocks after ``cached`` (the device hit) the lower tiers hold, from the first."""
        num_lower = self.manager.match(block_hashes[len(cached):])
        if keep_last and num_lower:
            num_lower -= 1  # MTP: the last matched block is recomputed (see Scheduler.schedule)
        return num_lower

    def start_remote(self, request: Request, num_base_blocks: int, block_hashes: list[int]) -> None:
        """A remote request holding its reservation: load ``block_hashes`` into its blocks from
        ``num_base_blocks`` on."""
        self._remote.add(request.request_id)
        self._start(request, num_base_blocks, block_hashes)

    def _start(self, request: Request, num_base_blocks: int, block_hashes: list[int], source=None) -> None:
        request.status = RequestStatus.WAITING_FOR_OFFLOAD
        request.num_offload_base_blocks = num_base_blocks
        self.loading[request.request_id] = request
        block_ids = request.block_ids[num_base_blocks: num_base_blocks + len(block_hashes)]
        self.manager.start_load(LoadJob(request.request_id, list(block_hashes), list(block_ids), source=source,
                                        first_block=num_base_blocks))

    def poll(self, block_manager: BlockManager) -> OffloadPoll:
        """The loads that ended: local requests go back to the queue, remote ones to waiting for their
        KV; a request finished meanwhile lets its blocks go now (``released``)."""
        out = OffloadPoll()
        bs = self.block_size
        for job in self.manager.poll():
            request = self.loading.pop(job.request_id, None)
            remote = job.request_id in self._remote
            self._remote.discard(job.request_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_OFFLOAD:
                self._num_loads.pop(job.request_id, None)
                out.released.append(job.request_id)
                continue
            first = request.num_offload_base_blocks
            chunks = [tuple(request.all_token_ids[(first + i) * bs: (first + i + 1) * bs])
                      for i in range(job.num_loaded)]
            block_manager.cache_loaded_blocks(job.block_ids[: job.num_loaded], job.block_hashes[: job.num_loaded],
                                              chunks, request, first)
            request.num_offloaded_tokens = job.num_loaded * bs
            if remote:  # its blocks are its reservation: the ones that did not arrive become destinations
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                out.remote_ready.append(request)
                continue
            block_manager.free(request)
            request.status = RequestStatus.WAITING
            out.ready.append(request)
        return out

    def forget(self, request_id: str) -> None:
        self._num_loads.pop(request_id, None)

    def settle_evictions(self) -> None:
        self.manager.settle_evictions()
