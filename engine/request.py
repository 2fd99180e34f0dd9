"""A request's token state and block table, as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdcluster.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    # Decode side of a KV transfer: in the scheduler from admission, its blocks reserved, its prompt's KV
    # on its way from another worker; in no queue until the connector reports it landed (-> WAITING).
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    # Its prompt's prefix is in a lower KV tier (host memory, disk: engine/kv_offload/): blocks reserved,
    # the loader thread copying it back; in no queue until the load ends (-> WAITING, at the front).
    WAITING_FOR_OFFLOAD = "waiting_for_offload"
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its prompt's KV will not come (the transfer failed)

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES


# Asked per request per step: one lookup of a string (a member's own hash is a Python call: Enum.__hash__).
_FINISHED_VALUES = frozenset(s.value for s in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                                               RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR))


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. The scheduler owns this number (invariant S1): the runner only
    # ever copies it, never advances it.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Draft tokens proposed by the speculative proposer for the next step (not yet verified).
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prefix-cache hit on first schedule (device and lower tiers)
    num_offloaded_tokens: int = 0  # of those, loaded back from a lower tier (host memory, disk)
    num_offload_base_blocks: int = 0  # device-cache blocks before the ones a lower-tier load brings
    num_preemptions: int = 0
    # Speculative-decoding counters reported to the user.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # The prompt's full blocks are registered in the prefix cache (engine/forks.py releases followers).
    prompt_cached: bool = False
    # vLLM's external prefill/decode protocol (kv_transfer/connector/external.py): where the prompt's KV may be
    # pulled from before the first step (taken once by the offload gate), and on a prefill instance the
    # kv_transfer_params its answer gives the proxy (set when it finishes).
    kv_source: object = field(default=None, repr=False, compare=False)
    kv_transfer_out: dict | None = None
    # block_table()'s snapshot and the list it was taken of (see there).
    _block_table: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _block_table_of: list[int] | None = field(default=None, repr=False, compare=False)

    def block_table(self) -> tuple[int, ...]:
        """``block_ids`` as an immutable tuple that the step's consumers (runner, connector) may keep,
        rebuilt only when the table grew or was replaced: a step costs O(1) per request instead of a
        copy of the whole table. A request's list only ever grows (BlockManager appends) until it is
        replaced by a new one (freed: ``[]``), so the same list at the same length holds the same ids."""
        if self._block_table_of is not self.block_ids or len(self._block_table) != len(self.block_ids):
            self._block_table = tuple(self.block_ids)
            self._block_table_of = self.block_ids
        return self._block_table

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Committed tokens: prompt plus verified output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_window(self, start: int, num: int) -> list[int]:
        """Tokens ``start .. start + num`` of prompt + output + drafts, without building the whole list
        (a decode step asks for its last token or two: O(num), not O(context), per request per step)."""
        out: list[int] = []
        end = start + num
        for part in (self.prompt_token_ids, self.output_token_ids, self.spec_token_ids):
            n = len(part)
            if start < n and end > 0:
                out += part[max(start, 0) : min(end, n)]
            start -= n
            end -= n
            if end <= 0:
                break
        return out

    @property
    def is_finished(self) -> bool:
        return self.status.finished
