"""Parallel sampling (``n`` > 1) with the prompt computed once: the choices of one request share a
``fork_group``; the first to arrive leads, the others wait here until the leader's prompt KV is in the
prefix cache, then run as ordinary requests whose prompt is a cache hit (only the tail past the last
full block is computed again, plus nothing else). On a decode worker the leader's KV came over the
transfer once; the followers never ask a prefill worker.

The gate only delays followers: if the leader ends or is aborted first, they are released and compute
what the cache no longer holds, so a fork can slow a choice down but never lose it.
"""

from __future__ import annotations

from pdcluster.engine.request import Request


class ForkGate:
    def __init__(self) -> None:
        self._parked: dict[str, list[Request]] = {}  # leader request id -> followers, in arrival order

    def __bool__(self) -> bool:
        return bool(self._parked)

    def __len__(self) -> int:
        return sum(len(v) for v in self._parked.values())

    def park(self, leader_id: str, request: Request) -> None:
        self._parked.setdefault(leader_id, []).append(request)

    def remove(self, request: Request) -> bool:
        for leader_id, followers in self._parked.items():
            if request in followers:
                followers.remove(request)
                if not followers:
                    del self._parked[leader_id]
                return True
        return False

    def release(self, requests: dict[str, Request]) -> list[Request]:
        """Followers whose leader's prompt is cached, or whose leader is gone. A leader whose KV is
        still on its way from a prefill worker (WAITING_FOR_REMOTE_KV: not cached) keeps them."""
        out = []
        for leader_id in list(self._parked):
            leader = requests.get(leader_id)
            if leader is None or leader.is_finished or leader.prompt_cached:
                out += self._parked.pop(leader_id)
        return out
