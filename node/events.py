"""Worker -> router events: frozen dataclasses over the records codec (wire/records.py), one
typed stream per worker. The decode worker owns a request once the router has handed it over,
so every event of a request comes from its decode worker, in order, on one zmq socket.

Per request, in order:
    Admission            the verdict on the router's ``submit`` (admitted, full, invalid, unreachable)
    Tokens (first)       the first token, as soon as the prefill worker sampled it (or local prefill)
    KVReady              disaggregated only: the KV landed; the transfer's size and duration
    Tokens ...           decode steps; the last one has ``finished``. A step's plain rows (not the
                         last, no logprobs) travel together, as one ``StepTokens`` for the step
    Failed               instead of the rest: the placement failed (the router recovers the request)
A worker whose engine thread died sends ``WorkerError`` (the health check would find it too).

Not about a request: ``KVEvents``, from every worker (prefill and decode), at most one a turn of its
engine thread: the blocks its engine stored in or removed from each KV tier since the last, for the
router's global index (cluster/router/kv_index.py). A hint, not a ledger: a lost one costs a placement
the overlap it would have seen, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Union

from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.wire.records import Codec, Record, _require, assemble, require_token_columns

EVENTS_VERSION = 2  # 2: StepTokens
ADMITTED, FULL, INVALID, UNREACHABLE = "admitted", "full", "invalid", "unreachable"
KV_EVENT_KINDS = ("stored", "removed")
KV_TIERS = ("device", "host", "disk", "shared")  # engine/kv_offload/: the device pool, then the offload tiers
# Block hashes per KVEvents record: a burst (a reset prefix cache, a long prompt's blocks) goes out as
# several records, each far below MAX_EVENT_BYTES (a hash packs into at most 9 bytes).
MAX_KV_EVENT_HASHES = 65536


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
    num_offloaded_tokens: int = 0  # of those, loaded back from a lower KV tier (host memory, disk)
    # Set by the local router's worker (cluster/local_router.py) on a request's first Tokens: seconds
    # queued before its first step, and from then to the first token. The cluster router times these
    # parts itself, from when it submitted and when the first token arrived.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    # With the request's logprobs: one per new token. prompt_logprobs, if asked: on the Tokens that carries
    # the first token (a prompt prefilled here in chunks reports each chunk before it, without tokens).
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # An embedding request's vector (SamplingParams.pooling), on the Tokens that ends it: float32 little-endian
    # (engine/pooling.py pooled_bytes); b"": none.
    pooled: bytes = b""
    # On the Tokens that ends a request prefilled for another instance (vLLM's do_remote_decode): the answer's
    # kv_transfer_params (kv_transfer/connector/external.py); {}: none.
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)


# StepTokens' per-row columns, each a list[int] with one value per request.
_STEP_COUNT_COLUMNS = ("num_new_tokens", "num_computed_tokens", "num_output_tokens", "num_draft_tokens",
                       "num_accepted_tokens", "num_cached_tokens", "num_offloaded_tokens")


@dataclass(frozen=True)
class StepTokens(Record):
    """One decode step's ``Tokens`` for the requests it advanced that need nothing more said: not
    finished, no logprobs, no prompt logprobs (those go as their own ``Tokens``). Columns, one row per
    request: at batch 128 the worker builds and encodes one record a step instead of 128 and the router
    decodes one (bench/event_codec.py). ``rows()`` gives each row as the ``Tokens`` it stands for."""

    worker_id: str
    request_ids: list[str]
    num_new_tokens: list[int]  # row i's tokens: new_token_ids[sum(num_new_tokens[:i]):][:num_new_tokens[i]]
    new_token_ids: list[int]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]
    num_draft_tokens: list[int]
    num_accepted_tokens: list[int]
    num_cached_tokens: list[int]
    num_offloaded_tokens: list[int]

    def _check_values(self, path: str) -> None:
        require_token_columns(self, path, len(self.request_ids), _STEP_COUNT_COLUMNS)

    @classmethod
    def of_engine_columns(cls, worker_id: str, *columns: list) -> "StepTokens":
        """A step's record from the columns the decode worker gathered from its engine's outputs (plain ints
        and the engine's request ids, in field order), without the field checks of a record built from
        anything else: those cost ~75 us a step at batch 128, ~7% of the engine thread's host time per step,
        and a record that leaves the process is checked as it is encoded (Codec.encode) anyway."""
        return assemble(cls, dict(zip(_STEP_FIELDS, (worker_id, *columns))))

    def rows(self) -> list[Tokens]:
        """Each row as the ``Tokens`` event it stands for (built from this checked record's values)."""
        rows, start = [], 0
        for i, n in enumerate(self.num_new_tokens):
            rows.append(self.row(i, start))
            start += n
        return rows

    def row(self, i: int, start: int) -> Tokens:
        """Row ``i``, whose tokens start at ``new_token_ids[start]``, as the ``Tokens`` event it stands for."""
        return assemble(Tokens, {
            "request_id": self.request_ids[i], "worker_id": self.worker_id,
            "new_token_ids": self.new_token_ids[start:start + self.num_new_tokens[i]],
            "num_computed_tokens": self.num_computed_tokens[i], "num_output_tokens": self.num_output_tokens[i],
            "finished": False, "finish_reason": "", "num_draft_tokens": self.num_draft_tokens[i],
            "num_accepted_tokens": self.num_accepted_tokens[i], "num_cached_tokens": self.num_cached_tokens[i],
            "num_offloaded_tokens": self.num_offloaded_tokens[i], "queue_s": 0.0, "prefill_s": 0.0, "logprobs": [],
            "prompt_logprobs": [], "pooled": b"", "kv_transfer_params": {}})


_STEP_FIELDS = tuple(f.name for f in fields(StepTokens))


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


@dataclass(frozen=True)
class KVEvent(Record):
    """Blocks (chained prefix hashes, engine/block_manager.py) that entered or left one tier."""

    kind: str  # "stored" | "removed"
    tier: str  # "device" | "host" | "disk" | "shared"
    block_hashes: list[int]

    def _check_values(self, path: str) -> None:
        _require(self.kind in KV_EVENT_KINDS, f"{path}.kind", f"expected one of {', '.join(KV_EVENT_KINDS)}",
                 self.kind)
        _require(self.tier in KV_TIERS, f"{path}.tier", f"expected one of {', '.join(KV_TIERS)}", self.tier)


@dataclass(frozen=True)
class KVEvents(Record):
    """One worker's KV events of one turn of its engine thread, oldest first."""

    worker_id: str
    events: list[KVEvent]


def kv_event_records(worker_id: str, drained: list[tuple[str, str, list[int]]]) -> list[KVEvents]:
    """``engine.kv_events.drain()`` as KVEvents records, in order: one, unless it holds more than
    MAX_KV_EVENT_HASHES hashes (then each record but the last holds exactly that many). Neighbouring entries of
    the same kind and tier travel as one KVEvent (the same changes in the same order): the block manager reports
    each evicted block and each request's new full blocks on their own, ~16 entries a decode step at batch 128,
    whose records cost ~100 us a step to build and encode, ~20 us as the two events they are."""
    merged: list[tuple[str, str, list[int]]] = []
    for kind, tier, hashes in drained:
        if merged and merged[-1][0] == kind and merged[-1][1] == tier:
            merged[-1][2].extend(hashes)
        else:
            merged.append((kind, tier, list(hashes)))
    records, batch, room = [], [], MAX_KV_EVENT_HASHES
    for kind, tier, hashes in merged:
        while hashes:
            part, hashes = hashes[:room], hashes[room:]
            batch.append(KVEvent(kind, tier, part))
            room -= len(part)
            if room == 0:
                records.append(KVEvents(worker_id, batch))
                batch, room = [], MAX_KV_EVENT_HASHES
    if batch:
        records.append(KVEvents(worker_id, batch))
    return records


Event = Union[Admission, Tokens, StepTokens, KVReady, Failed, WorkerError, KVEvents]
EVENT_CODEC = Codec(EVENTS_VERSION, (Admission, Tokens, StepTokens, KVReady, Failed, WorkerError, KVEvents))
MAX_EVENT_BYTES = 8 << 20


def expand(event: Event) -> list[Event]:
    """``event`` as per-request events: a ``StepTokens``' rows, anything else alone."""
    return event.rows() if type(event) is StepTokens else [event]
