"""The router's global KV index: which worker holds which prompt block, in which tier.

Fed by the workers' KV events (blocks stored in / removed from the device pool, the host tier, the disk
tier), keyed by the chained block hash (engine/block_manager.py ``chained_block_hashes``, the same in
every process), so placement scores the prefix a worker really holds instead of guessing from where
requests were sent (llm-d's precise prefix-cache scorer, Dynamo's KV-aware router)."""

from __future__ import annotations

from collections import defaultdict

# Worth of a cached block by tier, in prompt tokens not recomputed per token of the block: a device
# hit costs nothing, a host hit one copy, a disk hit a read (still far cheaper than a prefill), a read from the
# folder every worker shares a little less (it may be a network file system's).
TIER_WEIGHTS = {"device": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.4}
TIERS = tuple(TIER_WEIGHTS)
SHARED = "shared"  # engine/kv_offload/shared_tier.py: one folder for every worker, so a block in it is every worker's


class KVIndex:
    def __init__(self) -> None:
        # block hash -> worker id -> set of tiers holding it on that worker
        self._holders: dict[int, dict[str, set[str]]] = defaultdict(dict)
        self._num_blocks: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(TIERS, 0))
        # The shared folder's blocks, whoever announced them: stored by any worker is there for all, removed by any
        # (a file deleted) is gone for all; a worker that leaves takes nothing of it away.
        self._shared: set[int] = set()

    def stored(self, worker_id: str, tier: str, block_hashes: list[int]) -> None:
        if tier not in TIER_WEIGHTS:
            raise ValueError(f"unknown KV tier {tier!r}; one of {', '.join(TIERS)}")
        if tier == SHARED:
            self._shared.update(block_hashes)
            return
        for h in block_hashes:
            tiers = self._holders[h].setdefault(worker_id, set())
            if tier not in tiers:
                tiers.add(tier)
                self._num_blocks[worker_id][tier] += 1

    def removed(self, worker_id: str, tier: str, block_hashes: list[int]) -> None:
        if tier == SHARED:
            self._shared.difference_update(block_hashes)
            return
        for h in block_hashes:
            workers = self._holders.get(h)
            tiers = workers.get(worker_id) if workers else None
            if not tiers or tier not in tiers:
                continue
            tiers.discard(tier)
            self._num_blocks[worker_id][tier] -= 1
            if not tiers:
                del workers[worker_id]
                if not workers:
                    del self._holders[h]

    def apply(self, worker_id: str, events) -> None:
        """A worker's KV events (node/events.py KVEvent: kind "stored" | "removed", tier, block hashes),
        in order."""
        for e in events:
            (self.stored if e.kind == "stored" else self.removed)(worker_id, e.tier, e.block_hashes)

    def forget_worker(self, worker_id: str) -> None:
        """A worker left or restarted: nothing it held counts any more."""
        for h in list(self._holders):
            workers = self._holders[h]
            if workers.pop(worker_id, None) is not None and not workers:
                del self._holders[h]
        self._num_blocks.pop(worker_id, None)

    def num_blocks(self, worker_id: str) -> dict[str, int]:
        """The worker's blocks by tier; "shared": the shared folder's (every worker's alike)."""
        counts = dict(self._num_blocks.get(worker_id, dict.fromkeys(TIERS, 0)))
        counts[SHARED] = len(self._shared)
        return counts

    def overlap(self, worker_id: str, block_hashes: list[int]) -> float:
        """Weighted length, in blocks, of the prompt prefix the worker holds (a prefix: the first
        block it lacks ends it, as in the workers' own prefix match); a block of the shared folder is every
        worker's."""
        score = 0.0
        for h in block_hashes:
            tiers = self._holders.get(h, {}).get(worker_id)
            if tiers:
                score += max(TIER_WEIGHTS[t] for t in tiers)
            elif h in self._shared:
                score += TIER_WEIGHTS[SHARED]
            else:
                break
        return score
