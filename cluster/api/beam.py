"""vLLM's ``use_beam_search`` for completions and chat: the search of engine/beam_search.py, its model
steps run through the router (each live beam of each prompt one router request of one token, all of a
step at once, so the router spreads them over the workers and the prefix cache serves what beams share).

The answer is one JSON response: per prompt its ``n`` (the beam width) best beams, best first, as choices
``prompt * n + rank`` with their text, finish reason ("stop" at an end token, else "length") and, when asked,
their tokens' logprobs (the model's raw log-probabilities the search scored them by). A step
request the router refuses fails the response with the router's status; a client that goes away stops
the search (the step's requests are aborted). In /metrics each returned beam is one finished request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcluster.cluster.api import protocol as wire
from pdcluster.cluster.api.logprobs import TokenIdStrings, TokenStrings, chat_logprobs, completion_logprobs
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.serving import ClientGone, unless_disconnected
from pdcluster.cluster.api.text import AlignedText
from pdcluster.cluster.api.tracing import ChoiceTiming, trace_finished
from pdcluster.cluster.api.validation import Prepared
from pdcluster.cluster.api.whole_request import whole_request
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.beam_search import Beam, BeamSearch, BeamSearches
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.wire.logprobs import TokenLogprobs


async def _one_step(router, request_id: str, token_ids: list[int], params: SamplingParams) -> TokenLogprobs:
    """One token after ``token_ids`` and its logprob record; the request is aborted if this is cancelled."""
    deltas = await whole_request(router, request_id, token_ids, params, "beam search step")
    records = [record for delta in deltas for record in delta.logprobs]
    if not records:
        raise APIError(503, "beam search step failed: the router sent no token", kind="server_error")
    return records[0]


async def _search(prep: Prepared, router) -> list[list[Beam]]:
    end_ids = frozenset(router.tokenizer.stop_token_ids)
    # Each prompt searches up to its own max_tokens (a default one fills what its context leaves).
    searches = BeamSearches([BeamSearch(p.token_ids, replace(prep.beam, max_tokens=p.params.max_tokens), end_ids)
                             for p in prep.prompts])
    step_params = [prep.beam.step_params(p.params) for p in prep.prompts]
    for step in range(prep.beam.max_tokens):
        batch = searches.pending()
        if not batch:
            break
        tasks = [asyncio.ensure_future(_one_step(router, f"{prep.request_id}-s{step}-{k}", tokens, step_params[i]))
                 for k, (i, tokens) in enumerate(batch)]
        try:
            records = await asyncio.gather(*tasks)
        finally:  # one step failed or the search was cancelled: the others are aborted
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        searches.advance(records)
    skip_special = prep.prompts[0].params.skip_special_tokens
    return searches.best(lambda ids: router.tokenizer.decode(ids, skip_special_tokens=skip_special))


def _logprobs(prep: Prepared, router, beam: Beam, strings: TokenStrings) -> dict | None:
    """The beam's tokens' logprobs as a choice shows them (asked for: ``prep.output.num_logprobs``), each with its
    text offset, read as a streamed choice's are (cluster/api/text.py)."""
    num_top = prep.output.num_logprobs
    if num_top is None:
        return None
    strings = TokenIdStrings(strings) if prep.output.tokens_as_ids else strings
    aligned = AlignedText(router.tokenizer, [], True, skip_special_tokens=prep.prompts[0].params.skip_special_tokens)
    positions = aligned.add(beam.output_token_ids, beam.logprobs, True).positions
    if prep.object_kind == wire.TEXT_COMPLETION:
        return completion_logprobs(positions, num_top, strings)
    return chat_logprobs(positions, num_top, strings)


async def serve_beam_search(prep: Prepared, request: Request, router, metrics: Metrics,
                            strings: TokenStrings) -> Response:
    try:
        results = await unless_disconnected(_search(prep, router), request)
    except ClientGone:
        return Response(status_code=499)
    # Each returned beam counts as a finished request in /metrics (its output tokens as generated ones); the
    # step requests behind them are the search's own business.
    now = time.monotonic()
    timings = []
    for i, (prompt, beams) in enumerate(zip(prep.prompts, results)):
        for rank, beam in enumerate(beams):
            metrics.on_finish(now - prep.arrival, len(prompt.token_ids), len(beam.output_token_ids),
                              beam.finish_reason, lora_name=prompt.params.lora_name)
            timings.append(ChoiceTiming(f"{prep.request_id}-{i * prep.n + rank}", prep.model, prep.arrival, now, None,
                                        {}, len(prompt.token_ids), len(beam.output_token_ids), beam.finish_reason,
                                        params=prompt.params, n=prep.n, extra={"pdcluster.beam_rank": rank}))
    trace_finished(request, timings)
    choices = []
    for i, beams in enumerate(results):
        for rank, beam in enumerate(beams):
            index = i * prep.n + rank
            logprobs = _logprobs(prep, router, beam, strings)
            if prep.object_kind == wire.TEXT_COMPLETION:
                choices.append(wire.completion_choice(index, beam.text, logprobs, beam.finish_reason))
            else:
                choices.append(wire.chat_choice(index, beam.text, logprobs, beam.finish_reason, role=prep.output.role))
    num_prompt = sum(len(p.token_ids) for p in prep.prompts)
    num_output = sum(len(beam.output_token_ids) for beams in results for beam in beams)
    body = {**wire.header(prep.response_id, prep.object_kind, prep.created, prep.model, False),
            "choices": choices, "usage": wire.usage(num_prompt, num_output, 0)}
    return JSONResponse(body)
