"""The scheduler's use of the offload tiers: a waiting request whose prompt continues past the device
prefix cache in a lower tier gets blocks for that part and waits (WAITING_FOR_OFFLOAD) while the loader
thread copies them in; then it goes back to the front of the queue with those tokens computed.

The counts follow S1: the scheduler sets ``num_computed_tokens`` when the load has ended, to the device
prefix plus the blocks that arrived intact (a block that could not be read ends the prefix there; the
request's remaining blocks are simply filled by its own prefill)."""

from __future__ import annotations

from pdcluster.engine.block_manager import BlockManager, chained_block_hashes
from pdcluster.engine.kv_offload.manager import LoadJob, OffloadManager
from pdcluster.engine.request import Request, RequestStatus


class NoOffload:
    """No lower tiers: nothing loads, nothing waits (the scheduler never asks "are there tiers?")."""

    manager = None
    loading: dict[str, Request] = {}

    def try_start(self, request: Request, cached: list[int], block_manager: BlockManager, keep_last: bool) -> bool:
        return False

    def poll(self) -> tuple[list[Request], list[str]]:
        return [], []

    @property
    def num_loading(self) -> int:
        return 0


class OffloadGate(NoOffload):
    def __init__(self, manager: OffloadManager, block_size: int) -> None:
        self.manager = manager
        self.block_size = block_size
        self.loading: dict[str, Request] = {}
        self._device_blocks: dict[str, int] = {}

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def try_start(self, request: Request, cached: list[int], block_manager: BlockManager, keep_last: bool) -> bool:
        """``cached``: the device prefix cache's blocks for the request (already trimmed as the scheduler
        wants). Starts a load and returns True when lower tiers hold the blocks that follow."""
        bs = self.block_size
        usable = request.all_token_ids[: request.num_tokens - 1]  # one token always left to compute
        hashes = chained_block_hashes(usable, bs)[len(cached):]
        num_lower = self.manager.match(hashes)
        if keep_last and num_lower:
            num_lower -= 1  # MTP: the last matched block is recomputed (see Scheduler.schedule)
        if num_lower == 0:
            return False
        if not block_manager.allocate_slots(request, num_lower * bs, cached):
            return False
        request.status = RequestStatus.WAITING_FOR_OFFLOAD
        request.num_cached_tokens = len(cached) * bs
        self.loading[request.request_id] = request
        self._device_blocks[request.request_id] = len(cached)
        block_ids = request.block_ids[len(cached): len(cached) + num_lower]
        self.manager.start_load(LoadJob(request.request_id, hashes[:num_lower], list(block_ids)))
        return True

    def poll(self) -> tuple[list[Request], list[str]]:
        """(requests whose load ended and that continue, ids of loads that ended for requests finished
        meanwhile: their blocks may go back now)."""
        ready, released = [], []
        for job in self.manager.poll():
            request = self.loading.pop(job.request_id, None)
            num_device = self._device_blocks.pop(job.request_id, 0)
            if request is None or request.status != RequestStatus.WAITING_FOR_OFFLOAD:
                released.append(job.request_id)
                continue
            request.num_computed_tokens = (num_device + job.num_loaded) * self.block_size
            request.num_cached_tokens = request.num_computed_tokens
            request.num_offloaded_tokens = job.num_loaded * self.block_size
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready, released
