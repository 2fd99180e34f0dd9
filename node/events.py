"""Worker -> router events: frozen dataclasses over the records codec (wire/records.py), one
typed stream per decode worker. The decode worker owns a request once the router has handed it over,
so every event of a request comes from its decode worker, in order, on one zmq socket.

Per request, in order:
    Admission            the verdict on the router's ``submit`` (admitted, full, invalid, unreachable)
    Tokens (first)       the first token, as soon as the prefill worker sampled it (or local prefill)
    KVReady              disaggregated only: the KV landed; the transfer's size and duration
    Tokens ...           decode steps; the last one has ``finished``
    Failed               instead of the rest: the placement failed (the router recovers the request)
A worker whose engine thread died sends ``WorkerError`` (the health check would find it too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.wire.records import Codec, Record

EVENTS_VERSION = 1
ADMITTED, FULL, INVALID, UNREACHABLE = "admitted", "full", "invalid", "unreachable"


@dataclass(frozen=True)
class Admission(Record):
    request_id: str
    worker_id: str
    verdict: str  # ADMITTED | FULL | INVALID | UNREACHABLE
    reason: str = ""


@dataclass(frozen=True)
class Tokens(Record):
    """New tokens of one request; counts are the decode worker's, after acceptance (S1)."""

    request_id: str
    worker_id: str
    new_token_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str = ""  # "" while running; else "stop" | "length" | "abort" | "error"
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (where the prompt was prefilled)
    # Set by the local router's worker (cluster/local_router.py) on a request's first Tokens: seconds
    # queued before its first step, and from then to the first token. The cluster router times these
    # parts itself, from when it submitted and when the first token arrived.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    # With the request's logprobs: one per new token. prompt_logprobs, if asked: on the Tokens that carries
    # the first token (a prompt prefilled here in chunks reports each chunk before it, without tokens).
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class KVReady(Record):
    request_id: str
    worker_id: str
    transport: str
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class Failed(Record):
    request_id: str
    worker_id: str
    reason: str


@dataclass(frozen=True)
class WorkerError(Record):
    worker_id: str
    error: str


Event = Union[Admission, Tokens, KVReady, Failed, WorkerError]
EVENT_CODEC = Codec(EVENTS_VERSION, (Admission, Tokens, KVReady, Failed, WorkerError))
MAX_EVENT_BYTES = 8 << 20
