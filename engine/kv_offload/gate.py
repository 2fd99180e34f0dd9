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
again before it runs recomputes instead of loading forever)."""

from __future__ import annotations

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.kv_offload.manager import LoadJob, OffloadManager
from pdcluster.engine.request import Request, RequestStatus

MAX_LOADS = 2


class NoOffload:
    """No lower tiers: nothing loads, nothing waits (the scheduler never asks "are there tiers?")."""

    manager = None
    loading: dict[str, Request] = {}

    def try_start(self, request: Request, cached: list[int], block_hashes: list[int], block_manager: BlockManager,
                  keep_last: bool) -> bool:
        return False

    def poll(self, block_manager: BlockManager) -> tuple[list[Request], list[str]]:
        return [], []

    @property
    def num_loading(self) -> int:
        return 0

    def forget(self, request_id: str) -> None:
        pass


class OffloadGate(NoOffload):
    def __init__(self, manager: OffloadManager, block_size: int) -> None:
        self.manager = manager
        self.block_size = block_size
        self.loading: dict[str, Request] = {}
        self._num_loads: dict[str, int] = {}

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
        bs = self.block_size
        hashes = block_hashes[len(cached):]
        num_lower = self.manager.match(hashes)
        if keep_last and num_lower:
            num_lower -= 1  # MTP: the last matched block is recomputed (see Scheduler.schedule)
        if num_lower == 0:
            return False
        if not block_manager.allocate_slots(request, num_lower * bs, cached):
            return False
        request.status = RequestStatus.WAITING_FOR_OFFLOAD
        self.loading[request.request_id] = request
        self._num_loads[request.request_id] = self._num_loads.get(request.request_id, 0) + 1
        block_ids = request.block_ids[len(cached): len(cached) + num_lower]
        self.manager.start_load(LoadJob(request.request_id, hashes[:num_lower], list(block_ids)))
        request.num_offload_base_blocks = len(cached)
        return True

    def poll(self, block_manager: BlockManager) -> tuple[list[Request], list[str]]:
        """(requests whose load ended and that go back to the queue, ids of loads that ended for
        requests finished meanwhile: their blocks may go back now)."""
        ready, released = [], []
        bs = self.block_size
        for job in self.manager.poll():
            request = self.loading.pop(job.request_id, None)
            if request is None or request.status != RequestStatus.WAITING_FOR_OFFLOAD:
                self._num_loads.pop(job.request_id, None)
                released.append(job.request_id)
                continue
            first = request.num_offload_base_blocks
            chunks = [tuple(request.all_token_ids[(first + i) * bs: (first + i + 1) * bs])
                      for i in range(job.num_loaded)]
            block_manager.cache_loaded_blocks(job.block_ids[: job.num_loaded], job.block_hashes[: job.num_loaded],
                                              chunks)
            block_manager.free(request)
            request.num_offloaded_tokens = job.num_loaded * bs
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready, released

    def forget(self, request_id: str) -> None:
        self._num_loads.pop(request_id, None)
