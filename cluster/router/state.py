"""What the router knows of a request (``RequestState``) and of each placement of it (``Attempt``): a
recovery makes a new Attempt instead of resetting fields by hand."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.engine.sampling_params import SamplingParams


@dataclass
class Attempt:
    request_id: str
    number: int
    decode_id: str
    prefill_id: str | None  # None: the decode worker prefills the prompt itself
    num_prompt_tokens: int  # of this attempt's prompt (the original prompt + tokens already streamed)
    admitted: asyncio.Future  # the decode worker's Admission verdict
    t_submit: float = field(default_factory=time.monotonic)
    num_computed_tokens: int = 0  # authoritative, from the decode worker (S1)
    t_first_token: float = 0.0
    t_kv_ready: float = 0.0
    t_first_decode: float = 0.0
    decided: bool = False  # its Decision is in the router's recorder (when one records)

    @property
    def wid(self) -> str:
        """The id the workers know this placement by: late events of an older one are ignored."""
        return f"{self.request_id}#{self.number}"

    @property
    def local(self) -> bool:
        return self.prefill_id is None

    @property
    def pair(self) -> tuple[str | None, str]:
        return (self.prefill_id, self.decode_id)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the decode worker holds or has reserved (the prompt until it reports)."""
        return max(self.num_computed_tokens, self.num_prompt_tokens)

    def ttft_breakdown(self, t_arrival: float, now: float) -> dict[str, float]:
        out = {"queue": self.t_submit - t_arrival}
        if self.t_first_token:
            out["prefill"] = self.t_first_token - self.t_submit
        if self.local:
            return out
        if self.t_kv_ready and self.t_first_token:
            out["kv_transfer"] = max(0.0, self.t_kv_ready - self.t_first_token)
        if self.t_first_decode and self.t_kv_ready:
            out["first_decode"] = self.t_first_decode - self.t_kv_ready
        return out


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Where the request's deltas go, the final one last, on the loop: the generate() consumer's queue, or
    # (ClusterRouter.deliver) a callback such as the frontend service's outbox.
    deliver: Callable[[TokenDelta], None]
    # Optional: takes a plain delta as its parts (token ids, output tokens so far, draft and accepted tokens),
    # True once taken; False sends it through ``deliver`` as a TokenDelta (RequestStreams.on_step_tokens).
    deliver_row: Callable[[list[int], int, int, int], bool] | None = None
    emitted: list[int] = field(default_factory=list)  # tokens already streamed to the client
    attempt: Attempt | None = None  # the placement that streams now (None while placing)
    num_submits: int = 0  # placements asked for, full answers included (numbers the worker-side ids)
    num_recoveries: int = 0
    recovering: bool = False
    finished: bool = False
    failed_pair: tuple | None = None  # the pair whose placement last failed (tried last)
    num_cached_tokens: int | None = None  # from the first placement's first report
    num_offloaded_tokens: int = 0  # of those, loaded back from a lower KV tier (same report)
    prompt_logprobs_sent: bool = False  # the first placement delivered them (a recovery asks for none)
    t_arrival: float = field(default_factory=time.monotonic)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def running(self) -> bool:
        """Placed and past the prefill: its KV is on the decode worker."""
        a = self.attempt
        return a is not None and (a.local or bool(a.t_kv_ready))
