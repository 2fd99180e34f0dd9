"""A request's stream back to its client: the router's table of requests and their placements, and
what each decode-worker event does to them. Events of one placement arrive in order on one stream
(node/events.py), so nothing here re-orders.

Accounting (invariant S1, one level up): a placement's ``num_computed_tokens`` is whatever its decode
worker last reported after acceptance; worker load is derived from it when read (placement.py).
Nothing is advanced by "+1 per step", so speculative steps that emit several tokens (or none)
cannot make the router drift.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.cluster.router.recorder import Decision, DecisionRecorder, Report
from pdcluster.cluster.router.state import Attempt, RequestState
from pdcluster.cluster.token_deltas import is_first_token, token_delta
from pdcluster.node.events import KVReady, StepTokens, Tokens


@dataclass(frozen=True)
class Latency:
    t_done: float  # time.monotonic() when the request finished
    ttft_s: float  # arrival at the router -> first token
    tpot_s: float  # mean time per output token after the first


class RequestStreams:
    def __init__(self, counters: dict, recorder: Callable[[], DecisionRecorder | None],
                 on_pair_success: Callable[[Attempt], None]):
        self.counters = counters
        self._recorder = recorder
        self._on_pair_success = on_pair_success
        self.requests: dict[str, RequestState] = {}
        # Recent finished requests' latencies (bounded): what the autoscale planner reads.
        self.latencies: deque[Latency] = deque(maxlen=4096)
        self._by_wid: dict[str, tuple[RequestState, Attempt]] = {}  # every placement that may send events

    # ---- the table ---------------------------------------------------------------------------------
    def expect(self, r: RequestState, a: Attempt) -> None:
        """Route ``a``'s events to ``r`` from now on (before the decode worker is asked: its answer
        may come back before the call returns)."""
        self._by_wid[a.wid] = (r, a)

    def forget(self, a: Attempt) -> None:
        self._by_wid.pop(a.wid, None)

    def admitted(self, r: RequestState, a: Attempt) -> None:
        r.attempt = a
        self.requests[r.request_id] = r
        self.record_decision(r, a)  # as it is made: its tokens may be handled before the placing task resumes

    def record_decision(self, r: RequestState, a: Attempt) -> None:
        """Note placement ``a`` in the recorder (when one records), once."""
        recorder = self._recorder()
        if recorder is not None and not a.decided:
            recorder.decisions.append(Decision(r.request_id, a.prefill_id, a.decode_id, a.local))
            a.decided = True

    def lookup(self, wid: str, worker_id: str, live_only: bool = True) -> tuple[RequestState, Attempt] | None:
        """The request and placement an event is about, or None (stale, another worker, or, with
        ``live_only``, finished)."""
        found = self._by_wid.get(wid)
        if found is None:
            return None
        r, a = found
        if worker_id != a.decode_id or (live_only and r.finished):
            return None
        return found

    def current(self, wid: str, worker_id: str) -> tuple[RequestState, Attempt] | None:
        """As ``lookup``, and only while ``wid`` is the request's placement now (not one a recovery left behind,
        nor one still waiting for its verdict): whose tokens and failures count. A recovery's new placement counts
        from its admission (``admitted`` makes it the request's attempt), not from the return of the call that
        placed it: its first tokens may come before Ray's reply to that call does."""
        found = self._by_wid.get(wid)
        if found is None:
            return None
        r, a = found
        if worker_id != a.decode_id or r.finished or r.attempt is not a:
            return None
        return found

    @property
    def num_placements(self) -> int:
        """Placements whose events are still routed (zero once every request has ended)."""
        return len(self._by_wid)

    def pending_on(self, worker_id: str) -> bool:
        """A placement on ``worker_id`` (either role) is still waiting for its verdict."""
        return any(worker_id in a.pair for a in self.pending())

    def pending(self) -> list[Attempt]:
        """Placements still waiting for their decode worker's verdict."""
        return [a for _, a in self._by_wid.values() if not a.admitted.done()]

    # ---- events ------------------------------------------------------------------------------------
    def on_kv_ready(self, r: RequestState, a: Attempt, ev: KVReady) -> None:
        a.t_kv_ready = time.monotonic()
        self._on_pair_success(a)  # the pair moved a request's KV: the link works

    def on_step_tokens(self, ev: StepTokens) -> None:
        """A decode step's plain rows (not finished, no logprobs). A row that only adds tokens to a stream under
        way (its placement's first token went out, a disaggregated one's first decode step too) and whose consumer
        takes rows (``RequestState.deliver_row``) is applied here: the reported count (S1), the recorder's report,
        the tokens streamed, then the row; no Tokens event or TokenDelta is made for it. At batch 128 that was
        about a third of the router process's CPU per streamed token. Every other row goes through ``on_tokens``
        as the Tokens it stands for, so both paths give the consumer the same tokens and counts."""
        current, worker_id, token_ids = self.current, ev.worker_id, ev.new_token_ids
        recorder = self._recorder()
        start = 0
        for i, (wid, n, computed, output, draft, accepted) in enumerate(zip(
                ev.request_ids, ev.num_new_tokens, ev.num_computed_tokens, ev.num_output_tokens, ev.num_draft_tokens,
                ev.num_accepted_tokens)):
            found = current(wid, worker_id)
            if found is not None:
                r, a = found
                ids = token_ids[start:start + n]
                if not (n and a.t_first_token and (a.t_first_decode or not a.t_kv_ready)
                        and r.deliver_row is not None and r.deliver_row(ids, len(r.emitted) + n, draft, accepted)):
                    self.on_tokens(r, a, ev.row(i, start))
                else:
                    a.num_computed_tokens = computed  # S1: overwrite from the report; never count steps
                    if recorder is not None:
                        recorder.reports.append(Report(computed, computed, r.num_prompt_tokens, output, False))
                    r.emitted.extend(ids)
            start += n

    def on_tokens(self, r: RequestState, a: Attempt, ev: Tokens) -> None:
        now = time.monotonic()
        a.num_computed_tokens = ev.num_computed_tokens  # S1: overwrite from the report; never count steps
        recorder = self._recorder()
        if recorder is not None:
            recorder.reports.append(Report(ev.num_computed_tokens, a.num_computed_tokens, r.num_prompt_tokens,
                                           ev.num_output_tokens, ev.finished))
        new = list(ev.new_token_ids)
        first = is_first_token(ev, bool(a.t_first_token))
        if first:
            a.t_first_token = now
            if a.local:
                a.t_first_decode = now
                self._on_pair_success(a)
        elif new and a.t_kv_ready and not a.t_first_decode:
            a.t_first_decode = now
        if r.num_cached_tokens is None:
            r.num_cached_tokens = min(ev.num_cached_tokens, r.num_prompt_tokens)
            r.num_offloaded_tokens = min(ev.num_offloaded_tokens, r.num_cached_tokens)
        r.emitted.extend(new)
        # The decode worker counts this placement's outputs; earlier placements' are in its prompt.
        # Prompt logprobs: the first placement's (a recovery re-prefills prompt + streamed tokens and
        # asks for none).
        with_prompt_logprobs = r.params.prompt_logprobs is not None and not r.prompt_logprobs_sent
        delta = token_delta(ev, num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=len(r.emitted),
                            num_cached_tokens=r.num_cached_tokens, first=first, prompt_logprobs=with_prompt_logprobs,
                            ttft_breakdown={"queue": a.t_submit - r.t_arrival, "prefill": now - a.t_submit} if first else None,
                            num_offloaded_tokens=r.num_offloaded_tokens, weight_version=r.params.weight_version)
        if first and with_prompt_logprobs:
            r.prompt_logprobs_sent = True
        if ev.finished:
            if not a.local:
                # The rest of the disaggregated TTFT story, known only once the decode side ran.
                tail = a.ttft_breakdown(r.t_arrival, now)
                delta.ttft_breakdown.update({k: v for k, v in tail.items() if k in ("kv_transfer", "first_decode")})
            self.counters["num_draft_tokens"] += delta.num_draft_tokens
            self.counters["num_accepted_tokens"] += delta.num_accepted_tokens
            self.finish(r, delta)
        elif new:
            r.deliver(delta)

    # ---- the end -----------------------------------------------------------------------------------
    def finish(self, r: RequestState, delta: TokenDelta) -> None:
        a = r.attempt
        if delta.finish_reason in ("length", "stop") and a is not None and a.t_first_token:
            now = time.monotonic()
            tpot_s = (now - a.t_first_token) / max(1, len(r.emitted) - 1)
            self.latencies.append(Latency(now, a.t_first_token - r.t_arrival, tpot_s))
        r.finished = True
        self.requests.pop(r.request_id, None)
        if r.attempt is not None:
            self.forget(r.attempt)
        r.deliver(delta)

    def fail(self, r: RequestState, error: str, reason: str = "error") -> None:
        self.finish(r, TokenDelta([], finished=True, finish_reason=reason, error=error or None,
                                  num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=len(r.emitted)))
