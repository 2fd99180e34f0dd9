"""One adapter from a worker's ``Tokens`` event to the client's ``TokenDelta``, for both routers (the
local one and the cluster's), so the HTTP tests, which run on the local router, exercise the same
streaming code the cluster serves with.

What each router knows and passes in: the counts as the client sees them (the cluster router counts
outputs across placements: after a recovery the decode worker's own count starts again), whether this
event carries the request's first token, and the TTFT breakdown it measured.
"""

from __future__ import annotations

from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.node.events import Tokens


def is_progress_report(event: Tokens) -> bool:
    """A prefill chunk's report (S1: the scheduler's count, no tokens yet): nothing for the client."""
    return not event.new_token_ids and not event.finished


def is_first_token(event: Tokens, seen_first_token: bool) -> bool:
    """The event with the request's first token: not its first event (a prompt prefilled in several
    chunks on the decode worker reports each chunk before it, without tokens)."""
    return bool(event.new_token_ids) and not seen_first_token


def token_delta(event: Tokens, *, num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int,
                first: bool, prompt_logprobs: bool, ttft_breakdown: dict[str, float] | None = None,
                num_offloaded_tokens: int = 0, weight_version: str | None = None) -> TokenDelta:
    """The delta for ``event``. On the first token's event: the prompt logprobs (when ``prompt_logprobs``:
    they travel with the first token, engine/model_runner.py), the TTFT breakdown and ``weight_version``."""
    delta = TokenDelta(
        list(event.new_token_ids),
        finished=event.finished,
        finish_reason=(event.finish_reason or None) if event.finished else None,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        num_draft_tokens=event.num_draft_tokens,
        num_accepted_tokens=event.num_accepted_tokens,
        num_cached_tokens=num_cached_tokens,
        num_offloaded_tokens=num_offloaded_tokens,
        logprobs=list(event.logprobs),
        kv_transfer_params=dict(event.kv_transfer_params) if event.finished and event.kv_transfer_params else None,
    )
    if first:
        if prompt_logprobs:
            delta.prompt_logprobs = list(event.prompt_logprobs)
        delta.ttft_breakdown = dict(ttft_breakdown or {})
        delta.pooled = event.pooled or None
        delta.weight_version = weight_version
    return delta


def can_merge(params) -> bool:
    """Whether a request's queued deltas may go out as one. Not with stop strings: the API ends such a request at
    the delta whose text reaches one and counts its tokens through that delta, as the offline engine and vLLM count
    them through the step that reached it; a delta merged from several steps would count later steps' tokens."""
    return not params.stop


def merged(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """``a`` then ``b`` (of one request; ``a`` not its last) as one delta: what a consumer that fell behind
    streams as one chunk (vLLM's output collector merges the same way). Tokens and logprobs in order; the counts
    so far and the end are ``b``'s; the first delta's own fields (prompt logprobs, TTFT parts, the weight version)
    are kept."""
    return TokenDelta(
        a.new_token_ids + b.new_token_ids,
        finished=b.finished,
        finish_reason=b.finish_reason,
        num_prompt_tokens=max(a.num_prompt_tokens, b.num_prompt_tokens),
        num_output_tokens=max(a.num_output_tokens, b.num_output_tokens),
        num_draft_tokens=max(a.num_draft_tokens, b.num_draft_tokens),
        num_accepted_tokens=max(a.num_accepted_tokens, b.num_accepted_tokens),
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
        num_offloaded_tokens=max(a.num_offloaded_tokens, b.num_offloaded_tokens),
        error=b.error,
        logprobs=a.logprobs + b.logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        ttft_breakdown={**b.ttft_breakdown, **a.ttft_breakdown},
        pooled=a.pooled if a.pooled is not None else b.pooled,
        kv_transfer_params=b.kv_transfer_params,
        weight_version=a.weight_version or b.weight_version,
    )


def merge_queued(delta: TokenDelta, queue, joins=None, to_delta=None) -> TokenDelta:
    """``delta`` merged with the items already waiting in ``queue`` (a DeltaQueue) after it: while the request has
    not ended and the next item ``joins`` (default: any), it is taken and merged as ``to_delta(item)`` (default:
    the item is a TokenDelta). The one loop behind every router's merging."""
    while not delta.finished and not queue.empty() and (joins is None or joins(queue.peek())):
        item = queue.get_nowait()
        delta = merged(delta, item if to_delta is None else to_delta(item))
    return delta
