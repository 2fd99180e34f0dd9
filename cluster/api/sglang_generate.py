"""SGLang's native POST /generate, served over the same path as /v1/completions: each prompt is validated as a
completions body (cluster/api/sglang_protocol.py), its choices run as router requests (cluster/api/fanout.py,
cluster/api/choice.py), and the answer takes SGLang's layout:

``{"text": the output text, "output_ids": its token ids, "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", "e2e_latency"}}``; one object for one prompt and n = 1, else a
list (prompt-major: prompt i's sample j is item ``i * n + j``, as SGLang). ``finish_reason``: ``{"type": "stop",
"matched": the stop string, or the token id that ended it}``, ``{"type": "length", "length": max_new_tokens}``,
``{"type": "abort", "message"}``. ``max_new_tokens`` 0 scores the prompt alone (SGLang's prefill-only request:
``input_token_logprobs`` of a given sequence): no output, finish_reason ``{"type": "length", "length": 0}``. With ``return_logprob``: ``output_token_logprobs`` ``[[logprob, token_id,
text|null], ...]`` and, with ``logprob_start_len`` k >= 0, ``input_token_logprobs`` of the prompt from position k (the
first prompt token's logprob null); with ``top_logprobs_num`` N > 0, ``output_top_logprobs`` /
``input_top_logprobs``: per position the N most likely as ``[logprob, token_id, text|null]``. ``text`` is the token's
own string with ``return_text_in_logprobs``, else null. On a decode leg of SGLang's router (its bootstrap fields on a
kv_consumer server) ``input_token_logprobs`` is empty: the router puts the prefill server's in front. Logprobs are log_softmax of the raw logits (as vLLM's
default), -inf shown as -9999.0.

``stream``: server-sent events, each ``data:`` the whole answer so far (SGLang's default, cumulative text and ids;
``index`` names the item in a batch or for n > 1), then ``data: [DONE]``.

``image_data`` gives a prompt's images (cluster/api/sglang_protocol.py): fetched as a chat's are, each image token of
the prompt widened to the model's placeholders in order, as SGLang's processors do.

``rid`` names a prompt's request for POST /abort_request (cluster/api/control_routes.py): its router requests' ids are
``gen-<rid>-<12 hex>-<sample>`` (fanout.named_prompt_id, found again by fanout.named_ids_pattern).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

import anyio
from fastapi import Request

from pdcluster.cluster.api import protocol as wire
from pdcluster.cluster.api.choice import ChoiceRun
from pdcluster.cluster.api.fanout import interleaved, named_prompt_id
from pdcluster.cluster.api.images import generate_images
from pdcluster.cluster.api.logprobs import LOGPROB_FLOOR, Positions, TokenStrings
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.serving import Reply, guarded_sse, serve_runs
from pdcluster.cluster.api.sglang_protocol import GenerateInput, GenerateRequest, LogprobLayout, generate_input
from pdcluster.cluster.api.validation import Prepared, ServerPolicy, prepare
from pdcluster.cluster.metrics import Metrics
from pdcluster.wire.logprobs import TokenLogprobs

REQUEST_ID_PREFIX = "gen"


def _entry(logprob: float | None, token_id: int, strings: TokenStrings | None) -> list:
    return [None if logprob is None else max(float(logprob), LOGPROB_FLOOR), int(token_id),
            None if strings is None else strings(token_id)]


def _top(record: TokenLogprobs | None, num_top: int, strings: TokenStrings | None) -> list | None:
    if record is None:
        return None
    return [_entry(lp, t, strings) for t, lp in zip(record.top_token_ids[:num_top], record.top_logprobs)]


class GenerateAnswer:
    """The SGLang layout of one request's runs."""

    def __init__(self, prep: Prepared, gin: GenerateInput, strings: TokenStrings):
        self.prep, self.gin = prep, gin
        layout = gin.logprobs
        self.strings = strings if layout.return_text_in_logprobs else None
        self.layout: LogprobLayout = layout

    def client_id(self, run: ChoiceRun) -> str:
        rid = self.gin.items[run.request.prompt_index].rid
        if rid is None:
            return run.request.request_id
        return rid if self.prep.n == 1 else f"{rid}-{run.index % self.prep.n}"

    def finish_reason(self, run: ChoiceRun, reason: str | None, output_ids: list[int]) -> dict | None:
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": 0 if self.prep.output.drop_output else run.request.params.max_tokens}
        if reason == "stop":
            stop = run.aligned.detok.stop
            return {"type": "stop", "matched": stop if stop is not None else (output_ids[-1] if output_ids else None)}
        if reason == "abort":
            return {"type": "abort", "message": "the request was aborted"}
        return {"type": reason}

    def answer(self, run: ChoiceRun, text: str, positions: Positions, reason: str | None, num_output: int) -> dict:
        if self.prep.output.drop_output:  # max_new_tokens 0: the prompt scored, nothing shown of the echo or the token
            text, positions, num_output = "", Positions.empty(), 0
        ids = list(positions.token_ids)
        meta = {"id": self.client_id(run), "finish_reason": self.finish_reason(run, reason, ids),
                "prompt_tokens": len(run.request.prompt.token_ids), "completion_tokens": num_output,
                "cached_tokens": run.num_cached, "weight_version": run.weight_version,
                "e2e_latency": time.monotonic() - self.prep.arrival}
        if self.layout.return_logprob:
            meta.update(self._logprobs(run, positions))
        out = {"text": text, "output_ids": ids, "meta_info": meta}
        if self.gin.batch or self.prep.n > 1:
            out["index"] = run.index
        return out

    def _logprobs(self, run: ChoiceRun, positions: Positions) -> dict:
        strings, num_top = self.strings, self.layout.top_logprobs_num
        out = {"output_token_logprobs": [_entry(None if r is None else r.logprob, t, strings)
                                         for t, r in zip(positions.token_ids, positions.records)]}
        if num_top:
            out["output_top_logprobs"] = [_top(r, num_top, strings) for r in positions.records]
        start = self.layout.logprob_start_len
        if not self.layout.shows_prompt:
            out["input_token_logprobs"] = []
            if num_top:
                out["input_top_logprobs"] = []
            return out
        prompt = run.request.prompt.token_ids
        records: list[TokenLogprobs | None] = [None, *(run.prompt_records or [])][:len(prompt)]
        records += [None] * (len(prompt) - len(records))
        out["input_token_logprobs"] = [_entry(None if r is None else r.logprob, t, strings)
                                       for t, r in zip(prompt[start:], records[start:])]
        if num_top:
            out["input_top_logprobs"] = [_top(r, num_top, strings) for r in records[start:]]
        return out

    def json_body(self, resp: Reply) -> dict | list:
        answers = [self.answer(run, run.text, run.positions, run.finish_reason, run.num_output) for run in resp.runs]
        return answers if self.gin.batch or self.prep.n > 1 else answers[0]

    def stream(self, resp: Reply, firsts) -> AsyncIterator[bytes]:
        return guarded_sse(self._events(resp, firsts), resp.runs, self.prep.request_id)

    async def _events(self, resp: Reply, firsts) -> AsyncIterator[bytes]:
        # Each run's answer so far, from the pieces as they are read (a run's own text may be ahead of them).
        texts = {run.index: "" for run in resp.runs}
        shown = {run.index: Positions.empty() for run in resp.runs}
        async with interleaved(resp.runs, firsts) as pieces:
            async for run, piece, reason in pieces:
                texts[run.index] += piece.text
                shown[run.index].extend(piece.positions)
                if reason == "error":
                    yield wire.sse(wire.error_body(f"generation failed: {run.error}", "server_error"))
                    break
                if reason is not None or piece.text or piece.positions.token_ids:
                    num_output = run.num_output if reason is not None else len(shown[run.index].token_ids)
                    yield wire.sse(self.answer(run, texts[run.index], shown[run.index], reason, num_output))
        yield wire.sse("[DONE]")


async def serve_generate(body: GenerateRequest, request: Request, router, served_names: tuple[str, ...],
                         policy: ServerPolicy, metrics: Metrics, strings: TokenStrings):
    gin = await anyio.to_thread.run_sync(generate_input, body, served_names[0], policy.kv_role)  # input_embeds: numpy
    preps = []
    for i, item in enumerate(gin.items):
        try:
            images = await generate_images(item.images, router.tokenizer, router.max_images_per_prompt,
                                           f"image_data[{i}]" if gin.batch else "image_data", policy.media)
            preps.append(await prepare(item.body, router, served_names, policy, images=images))
        except APIError as e:
            if gin.batch:
                e.message = f"prompt {i}: {e.message}"
                e.args = (e.message,)
            raise
    uid = uuid.uuid4().hex[:12]
    item_ids = [named_prompt_id(REQUEST_ID_PREFIX, item.rid) if item.rid is not None
                else f"{REQUEST_ID_PREFIX}-{uid}-p{i}" for i, item in enumerate(gin.items)]
    first = preps[0]
    # One request of every prompt's choices; token ids tracked for output_ids. The prompt's logprobs come with the
    # first delta, streamed or not (validation refuses them in an OpenAI stream, whose chunks have no field for them).
    prep = replace(first, request_id=f"{REQUEST_ID_PREFIX}-{uid}", response_id=f"{REQUEST_ID_PREFIX}-{uid}",
                   prompts=[p for each in preps for p in each.prompts], n=gin.n, stream=gin.stream,
                   include_usage=False, output=replace(first.output, return_token_ids=True))
    answer = GenerateAnswer(prep, gin, strings)
    return await serve_runs(prep, request, router, metrics, strings, answer.stream, answer.json_body, item_ids)
