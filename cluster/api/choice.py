"""One choice of a response: one router request's TokenDeltas become the text and the logprobs it
shows (cluster/api/text.py keeps them aligned), its counts, its finish reason and its metrics.

Stop strings apply here: when the text reaches one, the choice ends with finish_reason "stop" and the
router request is aborted on close. With echo the prompt (and its logprobs) comes first, with the first
delta, which carries the prompt logprobs. With ``drop_output`` (max_tokens 0 + echo: scoring) the one
generated token is counted nowhere and shown nowhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import anyio

from pdcluster.cluster.api.logprobs import Positions
from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.cluster.api.text import AlignedText, Piece, prompt_positions
from pdcluster.cluster.api.tracing import ChoiceTiming, RequestTrace
from pdcluster.cluster.api.validation import Prepared, PromptInput
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.wire.logprobs import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass
class ChoiceRequest:
    """One router request: choice ``index`` of the response, for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    request_id: str
    prompt: PromptInput
    params: SamplingParams


class ChoiceRun:
    """One choice's stream from the router: shown text and logprob positions, counts, finish, metrics
    (recorded once, on close)."""

    def __init__(self, prep: Prepared, request: ChoiceRequest, router, metrics: Metrics,
                 trace: RequestTrace | None = None):
        self.prep, self.request, self.router, self.metrics = prep, request, router, metrics
        self.trace = trace  # OpenTelemetry (cluster/api/tracing.py): a span when it ends
        self.index = request.index
        out = prep.output
        # Tokens are kept aligned with the text for logprobs and for return_token_ids.
        self.track_tokens = out.num_logprobs is not None or out.return_token_ids
        echo_text = request.prompt.text if out.echo else None
        params = request.params
        self.aligned = AlignedText(router.tokenizer, params.stop, self.track_tokens, base_offset=len(echo_text or ""),
                                   skip_special_tokens=params.skip_special_tokens,
                                   include_stop=params.include_stop_str_in_output)
        self._echo_text = echo_text
        self.stream: AsyncIterator[TokenDelta] | None = None
        self.num_output = self.num_draft = self.num_accepted = self.num_cached = self.num_offloaded = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.kv_transfer_params: dict | None = None  # on a do_remote_decode request's end (wire/external_kv.py)
        self.weight_version: str | None = None  # the weights it runs under, as the router says on the first delta
        # Everything shown so far (a JSON response shows it at once).
        self.text = ""
        self.positions = Positions.empty() if self.track_tokens else None
        # vLLM's prompt_logprobs: the first delta's records (one per prompt token after the first).
        self.prompt_records: list[TokenLogprobs] | None = None
        self._last_token_at: float | None = None
        self._first_token_at: float | None = None
        self._ttft_parts: dict[str, float] = {}  # the router's TTFT parts, as they come (for the trace)
        self._num_deltas = 0
        self._started = False  # the router admitted it and sent a first delta
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_shown_output(self) -> int:
        """Completion tokens billed: none when scoring (the generated token is dropped)."""
        return 0 if self.prep.output.drop_output else self.num_output

    async def start(self) -> TokenDelta:
        """Admission and the first delta: a RouterError here is still an HTTP error status."""
        r = self.request
        self.stream = self.router.generate(r.request_id, r.prompt.token_ids, r.params)
        first = await self.next()
        self._started = True
        return first

    async def next(self) -> TokenDelta:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            return TokenDelta([], finished=True, finish_reason="error",
                              error="the router ended the request without a final status")

    def feed(self, delta: TokenDelta) -> Piece:
        """Account for ``delta``; return what to show now."""
        self._observe(delta)
        first = self._num_deltas == 0
        self._num_deltas += 1
        if self.prep.output.drop_output:
            piece = Piece("", Positions.empty() if self.track_tokens else None)
        else:
            piece = self.aligned.add(delta.new_token_ids, delta.logprobs, delta.finished)
        if first and self._echo_text is not None:
            piece = self._with_prompt(piece, delta)
        if first and self.prep.output.num_prompt_logprobs is not None:
            self.prompt_records = list(delta.prompt_logprobs or [])
        if delta.finished and delta.finish_reason == "error":
            self.finish_reason, self.error = "error", delta.error
        elif self.aligned.hit_stop:  # the text reached a stop string: the request ends here (close aborts it)
            self.finish_reason = "stop"
        elif delta.finished:
            self.finish_reason = "length" if self.prep.output.drop_output else (delta.finish_reason or "stop")
        self.text += piece.text
        if self.track_tokens:
            self.positions.extend(piece.positions)
        return piece

    def _with_prompt(self, piece: Piece, delta: TokenDelta) -> Piece:
        if not self.track_tokens:
            return Piece(self._echo_text + piece.text, None)
        prompt = prompt_positions(self.router.tokenizer, self.request.prompt.token_ids, delta.prompt_logprobs)
        return Piece(self._echo_text + piece.text, prompt + piece.positions)

    def _observe(self, delta: TokenDelta) -> None:
        now = time.monotonic()
        n = len(delta.new_token_ids)
        if delta.ttft_breakdown:
            self._ttft_parts.update(delta.ttft_breakdown)
        if n:
            if self._last_token_at is None:
                self._first_token_at = now
                self.metrics.on_first_token(now - self.prep.arrival, delta.ttft_breakdown)
            else:
                self.metrics.on_tokens(now - self._last_token_at, n)
                # Disaggregated TTFT parts known only later (KV transfer, first decode step).
                self.metrics.observe_ttft_parts(delta.ttft_breakdown)
            self._last_token_at = now
        elif delta.ttft_breakdown and self._last_token_at is not None:
            self.metrics.observe_ttft_parts(delta.ttft_breakdown)
        self.num_output = max(self.num_output + n, delta.num_output_tokens)
        self.num_draft = max(self.num_draft, delta.num_draft_tokens)
        self.num_accepted = max(self.num_accepted, delta.num_accepted_tokens)
        self.num_cached = max(self.num_cached, delta.num_cached_tokens)
        self.num_offloaded = max(self.num_offloaded, delta.num_offloaded_tokens)
        if delta.kv_transfer_params:
            self.kv_transfer_params = delta.kv_transfer_params
        if delta.weight_version:
            self.weight_version = delta.weight_version

    async def collect(self, first: TokenDelta) -> None:
        self.feed(first)
        while not self.finished:
            self.feed(await self.next())

    async def close(self) -> None:
        """Idempotent: abort in the router unless finished there, close the stream, record metrics."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self.finish_reason is None:
                self.finish_reason = "abort"
            try:
                if self.finish_reason == "abort" or self.aligned.hit_stop:
                    await self.router.abort(self.request.request_id)
                aclose = getattr(self.stream, "aclose", None)
                if aclose is not None:
                    await aclose()
            except Exception:  # noqa: BLE001 - cleanup must not mask the request's outcome
                log.exception("closing request %s failed", self.request.request_id)
            if self._started:  # a request refused at admission is no finished request
                first = self.index % self.prep.n == 0  # a prompt's parameters, once (its first choice)
                self.metrics.on_finish(time.monotonic() - self.prep.arrival, len(self.request.prompt.token_ids),
                                       self.num_output, self.finish_reason, self.num_draft, self.num_accepted,
                                       self.num_cached, self.num_offloaded, self.request.params.lora_name,
                                       ttft_s=None if self._first_token_at is None
                                       else self._first_token_at - self.prep.arrival,
                                       ttft_parts=self._ttft_parts, max_tokens=self.request.params.max_tokens
                                       if first else None, n=self.prep.n if first else None)
                if self.trace is not None:
                    self._record_trace()

    def _record_trace(self) -> None:
        r = self.request
        try:
            self.trace.record(ChoiceTiming(
                r.request_id, self.prep.model, self.prep.arrival, time.monotonic(), self._first_token_at,
                dict(self._ttft_parts), len(r.prompt.token_ids), self.num_shown_output, self.finish_reason,
                self.error, r.params, self.prep.n, self.num_cached, self.num_offloaded, self.num_draft,
                self.num_accepted, {"pdcluster.choice_index": self.index}))
        except Exception:  # noqa: BLE001 - tracing never fails a request
            log.exception("tracing request %s failed", r.request_id)
