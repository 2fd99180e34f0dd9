"""Where a request goes: worker views (accounting derived from the requests' reported counts, S1),
the policy (cluster/policies.py) and the circuit breakers per (prefill, decode) pair."""

from __future__ import annotations

from typing import Iterable, Iterator

from pdcluster.cluster.policies import Breaker, Placer, WorkerView
from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.router.kv_index import KVIndex
from pdcluster.cluster.router.state import RequestState
from pdcluster.engine.mamba_state_blocks import tokens_with_state


class PairPlacement:
    def __init__(self, config: RouterConfig, kv_index: KVIndex | None = None):
        self.config = config
        self.placer = Placer(config.policy, config.num_spec_tokens)
        # What each worker holds, from its KV events (kv_aware reads it; the router feeds it).
        self.kv_index = kv_index if kv_index is not None else KVIndex()
        self.views: dict[str, WorkerView] = {}
        self.breakers: dict[tuple, Breaker] = {}

    def add_worker(self, worker_id: str, role: str, num_blocks: int, block_size: int) -> None:
        self.views[worker_id] = WorkerView(worker_id, role, num_blocks, block_size)

    def role_views(self, role: str, in_rotation_only: bool = False) -> list[WorkerView]:
        return [v for v in self.views.values() if v.role == role and (v.in_rotation or not in_rotation_only)]

    def refresh(self, requests: Iterable[RequestState]) -> None:
        """Recompute every view's load from the requests (never advanced locally: S1)."""
        for view in self.views.values():
            view.kv_tokens = view.num_requests = view.queued_prefill_tokens = 0
        for r in requests:
            a = r.attempt
            if a is None:
                continue
            if a.decode_id in self.views:
                view = self.views[a.decode_id]
                view.kv_tokens += self._held_tokens(view, a)
                view.num_requests += 1
            if a.prefill_id in self.views and not a.t_first_token:
                self.views[a.prefill_id].queued_prefill_tokens += a.num_prompt_tokens

    @staticmethod
    def _held_tokens(view: WorkerView, a) -> int:
        """Token slots the attempt holds on its decode worker: its KV, and for a hybrid's transferred
        prompt the state blocks after the prompt's (reserved with it, KV blocks afterwards)."""
        if not view.num_state_blocks or a.prefill_id is None:
            return a.kv_tokens
        return max(a.kv_tokens, tokens_with_state(a.num_prompt_tokens, view.block_size, view.num_state_blocks))

    def breaker(self, prefill_id: str | None, decode_id: str | None) -> Breaker:
        key = (prefill_id, decode_id)
        b = self.breakers.get(key)
        if b is None:
            b = self.breakers[key] = Breaker(self.config.breaker_threshold, self.config.breaker_cooldown_s)
        return b

    def wants_local(self, num_prompt_tokens: int, has_prefill_tier: bool) -> bool:
        """Prefill on the decode worker: colocated mode, a short prompt, or a saturated prefill tier."""
        c = self.config
        if c.mode == "colocated" or not has_prefill_tier:
            return True
        if num_prompt_tokens <= c.conditional_prefill_tokens:
            return True
        if c.busy_prefill_tokens:
            prefills = self.role_views("prefill", in_rotation_only=True)
            return all(v.queued_prefill_tokens >= c.busy_prefill_tokens for v in prefills)
        return False

    def candidates(self, local: bool, hashes: list[int], failed_pair, now: float) -> Iterator[tuple[WorkerView, WorkerView | None]]:
        """(decode, prefill or None) pairs to try, best first; pairs cooling down are left out. Lazy:
        the prefill policy is asked only for the decode worker tried next (round robin advances once
        per placement). With the whole prefill tier down, or unreachable from a decode worker (it lost
        every prefill worker in rotation: ``lost_prefills``), decode workers prefill themselves."""
        overlaps = self._overlaps(hashes) if self.placer.policy == "kv_aware" else None
        decodes = self.placer.order_decode(self.role_views("decode"), hashes, overlaps)
        prefills = self.role_views("prefill", in_rotation_only=True)
        for d in decodes:
            reachable = [p for p in prefills if p.worker_id not in d.lost_prefills]
            if local or not reachable:
                if self.breaker(None, d.worker_id).allows(now):
                    yield d, None
                continue
            p = self._pick_prefill(reachable, d.worker_id, hashes, failed_pair, now, overlaps)
            if p is not None:
                yield d, p

    def unwired_pairs(self) -> list[tuple[str, str]]:
        """(prefill, decode) pairs of known workers whose decode side lost the prefill peer."""
        return [(p, d.worker_id) for d in self.role_views("decode") for p in sorted(d.lost_prefills)
                if p in self.views]

    def _overlaps(self, hashes: list[int]) -> dict[str, float]:
        """Worker id -> the weighted length, in blocks, of the prompt's prefix it holds."""
        return {wid: self.kv_index.overlap(wid, hashes) for wid in self.views} if hashes else {}

    def _pick_prefill(self, prefills: list[WorkerView], decode_id: str, hashes: list[int], failed_pair,
                      now: float, overlaps: dict[str, float] | None = None) -> WorkerView | None:
        """The policy's prefill choice among the pairs with ``decode_id`` whose breaker is closed; the
        pair that just failed this request is the last resort."""
        allowed = [v for v in prefills if self.breaker(v.worker_id, decode_id).allows(now)]
        fresh = [v for v in allowed if (v.worker_id, decode_id) != failed_pair]
        return self.placer.pick_prefill(fresh or allowed, hashes, overlaps)

    def pool_tokens(self) -> int:
        """KV tokens the largest decode worker holds: no prompt longer than this can ever run."""
        return max((v.num_blocks * v.block_size for v in self.role_views("decode")), default=0)
