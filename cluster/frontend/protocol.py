"""API process <-> router process records, over the records codec (wire/records.py), on one zmq
ROUTER socket in the router's process (cluster/frontend/service.py) and a DEALER in each API process
(remote_router.py). The socket is an ipc path in a directory only this user can enter.

API process -> router (a DEALER in each API process, to one ROUTER):
    Hello        once connected: which process (its index), the PULL socket it reads the router's
                 messages on (``endpoint``), then that its HTTP server is up (``ready``)
    Generate     a request to place: prompt ids and its SamplingParams as a map
    Abort        stop a request (client gone, stop string, consumer failed)
    AdminCall    an /admin/* HTTP request, answered by the router process's admin routes
Router -> API process (a PUSH to that process's PULL; Welcome answers on the ROUTER):
    Welcome      the answer to Hello: what the app needs to know about the model
    Deltas       every delta ready for that process since the last send, in order per request: the
                 plain ones (see ``Deltas``) as columns, the rest as ``Delta`` records
    Refused      a Generate the router would not admit (before any delta): the HTTP status to answer
    Stats        the router's gauges, every ``STATS_INTERVAL_S``: /health and /metrics read the last,
                 and a process that hears nothing for ``SILENCE_LIMIT_S`` takes the router for dead
    AdminReply   the answer to an AdminCall
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.wire.records import Codec, Record, _require, require_token_columns

FRONTEND_VERSION = 3  # 2: Deltas.full_positions; 3: Delta.weight_version
# A Generate carries a prompt (up to max_model_len ids, ~5 bytes each) and a Deltas batch a step's
# tokens for every request of a process; 64 MiB is far above both.
MAX_FRONTEND_BYTES = 64 << 20
STATS_INTERVAL_S = 0.5
SILENCE_LIMIT_S = 10.0


@dataclass(frozen=True)
class Hello(Record):
    index: int  # the API process's index, 0..N-1
    endpoint: str = ""  # its PULL socket ("": a handshake, answered with Welcome only)
    ready: bool = False  # its HTTP server listens


@dataclass(frozen=True)
class Welcome(Record):
    model_name: str
    max_model_len: int
    tokenizer_dir: str
    lora_names: list[str] = field(default_factory=list)  # the router's LoRA adapters (Router.lora_names)
    max_images_per_prompt: int = 0  # Router.max_images_per_prompt
    mm_processor_kwargs: str = ""  # Router.mm_processor_kwargs


@dataclass(frozen=True)
class Generate(Record):
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # dataclasses.asdict(SamplingParams)


@dataclass(frozen=True)
class Abort(Record):
    request_id: str


@dataclass(frozen=True)
class Delta(Record):
    """One TokenDelta of one request (router_contract.py says what each field means); "" and an empty
    list stand for None."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0
    num_offloaded_tokens: int = 0
    error: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    has_prompt_logprobs: bool = False
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    ttft_breakdown: dict[str, Any] = field(default_factory=dict)
    pooled: bytes = b""  # an embedding's vector, float32 little-endian; b"": none
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)  # {}: none
    weight_version: str = ""  # "": none


# Deltas' per-row columns, each a list[int] with one value per plain row.
_ROW_COUNT_COLUMNS = ("num_new_tokens", "num_output_tokens", "num_draft_tokens", "num_accepted_tokens")


@dataclass(frozen=True)
class Deltas(Record):
    """A batch for one API process, in the order the router made its deltas. Rows: plain deltas (not a
    request's first or last, no logprobs, no error), whose other fields the process knows from the request's
    first delta; at batch 128 a decode step costs one record, not 128 (as the workers' StepTokens). ``full``:
    every other delta, ``full[j]`` applied before row ``full_positions[j]`` (after every row when that is the
    number of rows; positions never decrease). A router that fell behind drains many steps' events at once:
    a request's first delta and the rows right behind it then share a batch."""

    request_ids: list[str]
    num_new_tokens: list[int]  # row i's tokens: new_token_ids[sum(num_new_tokens[:i]):][:num_new_tokens[i]]
    new_token_ids: list[int]
    num_output_tokens: list[int]
    num_draft_tokens: list[int]
    num_accepted_tokens: list[int]
    full: list[Delta]
    full_positions: list[int]

    def _check_values(self, path: str) -> None:
        num_rows = len(self.request_ids)
        require_token_columns(self, path, num_rows, _ROW_COUNT_COLUMNS)
        positions = self.full_positions
        _require(len(positions) == len(self.full), f"{path}.full_positions",
                 f"expected {len(self.full)} values (one a full delta)", f"{len(positions)} values")
        _require(all(0 <= a <= b for a, b in zip(positions, positions[1:] + [num_rows])), f"{path}.full_positions",
                 f"expected non-decreasing row positions in 0..{num_rows}", positions)


def is_plain(delta: TokenDelta) -> bool:
    """A delta that can travel as a Deltas row (given it is not its request's first)."""
    return not (delta.finished or delta.logprobs or delta.prompt_logprobs is not None or delta.error
                or delta.ttft_breakdown or delta.pooled is not None)


@dataclass(frozen=True)
class Refused(Record):
    request_id: str
    message: str
    status: int
    kind: str


@dataclass(frozen=True)
class Stats(Record):
    stats: dict[str, Any]  # with the router's LoRA adapter names under LORA_NAMES_KEY (they change with --enable-lora)


LORA_NAMES_KEY = "lora_names"


@dataclass(frozen=True)
class AdminCall(Record):
    call_id: int
    method: str
    path: str  # with the query string
    header_names: list[str]
    header_values: list[str]
    body: bytes


@dataclass(frozen=True)
class AdminReply(Record):
    call_id: int
    status: int
    header_names: list[str]
    header_values: list[str]
    body: bytes


FRONTEND_CODEC = Codec(FRONTEND_VERSION, [Hello, Welcome, Generate, Abort, Delta, Deltas, Refused, Stats,
                                          AdminCall, AdminReply])


def to_delta(request_id: str, delta: TokenDelta) -> Delta:
    return Delta(request_id, list(delta.new_token_ids), delta.finished, delta.finish_reason or "",
                 delta.num_prompt_tokens, delta.num_output_tokens, delta.num_draft_tokens, delta.num_accepted_tokens,
                 delta.num_cached_tokens, delta.num_offloaded_tokens, delta.error or "", list(delta.logprobs),
                 delta.prompt_logprobs is not None, list(delta.prompt_logprobs or ()), dict(delta.ttft_breakdown),
                 delta.pooled or b"", dict(delta.kv_transfer_params or {}), delta.weight_version or "")


def from_delta(d: Delta) -> TokenDelta:
    return TokenDelta(list(d.new_token_ids), finished=d.finished, finish_reason=d.finish_reason or None,
                      num_prompt_tokens=d.num_prompt_tokens, num_output_tokens=d.num_output_tokens,
                      num_draft_tokens=d.num_draft_tokens, num_accepted_tokens=d.num_accepted_tokens,
                      num_cached_tokens=d.num_cached_tokens, num_offloaded_tokens=d.num_offloaded_tokens,
                      error=d.error or None, logprobs=list(d.logprobs),
                      prompt_logprobs=list(d.prompt_logprobs) if d.has_prompt_logprobs else None,
                      ttft_breakdown={k: float(v) for k, v in d.ttft_breakdown.items()}, pooled=d.pooled or None,
                      kv_transfer_params=dict(d.kv_transfer_params) or None, weight_version=d.weight_version or None)


def sampling_map(params) -> dict[str, Any]:
    return dataclasses.asdict(params)
