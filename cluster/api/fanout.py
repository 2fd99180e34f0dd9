"""A request's choices as router requests: ``n`` choices per prompt, a batch of prompts, started
together, collected or interleaved together, and failed together.

This is the one place that turns a request into router requests: when the engine learns to prefill a
prompt once for all its n choices, ``choice_requests`` and ``start_all`` are what change.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from dataclasses import replace
from typing import AsyncIterator

from pdcluster.cluster.api.choice import ChoiceRequest, ChoiceRun
from pdcluster.cluster.api.router_contract import TokenDelta
from pdcluster.cluster.api.text import Piece
from pdcluster.cluster.api.validation import Prepared


def named_prompt_id(prefix: str, client_id: str) -> str:
    """The base of the router request ids of a prompt the client named ``client_id`` (SGLang's rid, vLLM's tokens
    route's request_id): ``<prefix>-<client id>-<12 hex>``, its choices ``<base>-<sample>`` (``choice_requests``). The
    hex keeps two requests under one client id apart; ``named_ids_pattern`` finds them again."""
    return f"{prefix}-{client_id}-{uuid.uuid4().hex[:12]}"


def named_ids_pattern(prefix: str, client_id: str) -> str:
    """The regular expression (re.fullmatch) of every router request id of the prompts named ``client_id`` (its
    aborts: cluster/api/control_routes.py); never one of a client id it is a prefix of (``job-1``, ``job-10``)."""
    return re.escape(f"{prefix}-{client_id}-") + r"[0-9a-f]{12}-[0-9]+"


def choice_requests(prep: Prepared, prompt_ids: list[str] | None = None) -> list[ChoiceRequest]:
    """One router request per choice: prompt i's choice j is choice ``i * n + j`` with request id
    ``<request id>-<choice index>``, or with ``prompt_ids`` (one a prompt: ``named_prompt_id``) ``<prompt_ids[i]>-<j>``.

    Seeds: with ``seed`` s, choice j (of every prompt) samples with seed ``s + j``, so it equals the same
    prompt sent alone (n=1) with seed s + j, token for token (sampling draws are a pure function of the
    seed and the output position, engine/sampler.py). Without a seed each request draws its own.

    With n > 1 the choices of a prompt share a ``fork_group``: the router places them on one worker
    pair, and the prompt is computed (and, disaggregated, transferred) once for all of them
    (engine/forks.py). With echo + logprobs every choice scores the prompt itself (no prefix-cache
    hit for prompt logprobs), so there the prompt is computed per choice.
    """
    out = []
    for i, prompt in enumerate(prep.prompts):
        group = {"fork_group": f"{prep.request_id}-p{i}"} if prep.n > 1 else {}
        for j in range(prep.n):
            index = i * prep.n + j
            # Wrapped within int64, as a seed near the top of the range plus j would overflow the wire.
            seed = {"seed": (prompt.params.seed + j + (1 << 63)) % (1 << 64) - (1 << 63)} \
                if prompt.params.seed is not None else {}
            params = replace(prompt.params, **seed, **group)
            request_id = f"{prep.request_id}-{index}" if prompt_ids is None else f"{prompt_ids[i]}-{j}"
            out.append(ChoiceRequest(index, i, request_id, prompt, params))
    return out


async def start_all(runs: list[ChoiceRun]) -> list[TokenDelta]:
    """Every choice admitted and its first delta, concurrently. If one is refused, its error is raised
    (the caller closes every run, which aborts those already admitted)."""
    results = await asyncio.gather(*(run.start() for run in runs), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


async def collect_all(runs: list[ChoiceRun], firsts: list[TokenDelta]) -> None:
    """Every choice to its end; the first choice that fails ends the wait (the caller closes the rest,
    which aborts them)."""
    tasks = {asyncio.ensure_future(run.collect(first)): run for run, first in zip(runs, firsts)}
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # an exception here is ours: let it propagate
                if tasks[task].finish_reason == "error":
                    return
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


Item = tuple[ChoiceRun, Piece, "str | None"]  # a run, its new piece, its finish reason if that piece ends it


@contextlib.asynccontextmanager
async def interleaved(runs: list[ChoiceRun], firsts: list[TokenDelta]) -> AsyncIterator[AsyncIterator[Item]]:
    """``async with interleaved(...) as pieces``: (run, piece, finish reason once that piece ends the
    run) of every choice as they come, until all finished or one failed (finish reason "error": the
    last item). Leaving the block stops reading. Each run is fed by its own task, which may be ahead of
    the reader: the finish reason travels with the piece, never read off the run."""
    if len(runs) == 1:  # one choice (most requests): read it here, without a task and a queue between
        gen = _one(runs[0], firsts[0])
        try:
            yield gen
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()  # unbounded: the routers' queues would hold it otherwise

    async def pump(run: ChoiceRun, delta: TokenDelta) -> None:
        try:
            while True:
                piece = run.feed(delta)
                queue.put_nowait((run, piece, run.finish_reason))
                if run.finished:
                    return
                delta = await run.next()
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((run, e, None))

    tasks = [asyncio.ensure_future(pump(run, first)) for run, first in zip(runs, firsts)]

    async def pieces() -> AsyncIterator[Item]:
        remaining = len(runs)
        while remaining:
            run, item, finish_reason = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield run, item, finish_reason
            if finish_reason == "error":
                return
            if finish_reason is not None:
                remaining -= 1

    gen = pieces()
    try:
        yield gen
    finally:
        await gen.aclose()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one(run: ChoiceRun, delta: TokenDelta) -> AsyncIterator[Item]:
    """``interleaved``'s items for a single choice: each piece as it is fed, until the choice ends."""
    while True:
        piece = run.feed(delta)
        yield run, piece, run.finish_reason
        if run.finished:
            return
        delta = await run.next()
