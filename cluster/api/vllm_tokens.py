"""vLLM's tokens-in, tokens-out route, POST /inference/v1/generate (vllm/entrypoints/serve/disagg: what its
"disaggregated everything" front ends and RL rollout workers send once they tokenize themselves), served over the
completions path as /generate is (cluster/api/sglang_generate.py): the request is validated as a /v1/completions
body, so its tokens and logprobs are /v1/completions' for the same request.

Request ``{"request_id"?, "token_ids": [...], "sampling_params": {vLLM's SamplingParams: max_tokens, temperature,
top_p, top_k, min_p, seed, n, stop, stop_token_ids, ignore_eos, min_tokens, logprobs, prompt_logprobs,
repetition_penalty, presence_penalty, frequency_penalty, logit_bias, allowed_token_ids, bad_words, skip_special_tokens,
include_stop_str_in_output, structured_outputs, ...}, "model"?, "stream"?, "stream_options"?, "cache_salt"?,
"priority"?, "kv_transfer_params"?}``. ``max_tokens`` left out runs to the context's end (vLLM's server default).

Answer ``{"request_id", "id", "created", "model", "choices": [{"index", "token_ids", "finish_reason", "logprobs"}],
"usage", "prompt_logprobs", "kv_transfer_params"}``: ``logprobs`` in chat's layout with each token named
``token_id:<id>`` (vLLM's), ``prompt_logprobs`` in vLLM's (``{token_id: {"logprob", "rank", "decoded_token"}}`` a
position, null for the first). ``stream``: a chunk per piece, ``choices[0].token_ids`` its new tokens (the finish reason
on the last), the usage after them with ``stream_options.include_usage``, then ``[DONE]``.

``POST /abort_requests {"request_ids": [...]}`` (vLLM's, for the same front ends) ends the requests of those ids: the
router request ids of a request are ``generate-tokens-<request_id>-<12 hex>-<sample>`` (fanout.named_prompt_id).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import Request
from pydantic import ConfigDict, Field, ValidationError

from pdcluster.cluster.api import protocol as wire
from pdcluster.cluster.api.choice import ChoiceRun
from pdcluster.cluster.api.fanout import interleaved, named_prompt_id
from pdcluster.cluster.api.logprobs import TokenIdStrings, TokenStrings, chat_logprobs
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import StreamOptions, StrictModel
from pdcluster.cluster.api.serving import Reply, guarded_sse, serve_runs
from pdcluster.cluster.api.sglang_protocol import GenerateCompletion
from pdcluster.cluster.api.validation import ServerPolicy, client_request_id, prepare
from pdcluster.cluster.metrics import Metrics

REQUEST_ID_PREFIX = "generate-tokens"

# vLLM SamplingParams fields that say how vLLM's own engine hands outputs back: nothing to do here.
_ENGINE_ONLY = ("detokenize", "output_kind", "extra_args", "skip_clone", "flat_logprobs")


class TokensRequest(StrictModel):
    """vLLM's tokens-in GenerateRequest, the fields served here."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    request_id: str | None = Field(None, min_length=1, max_length=256)
    token_ids: list[int]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int | None = 0
    kv_transfer_params: dict | None = None
    features: None = None  # vLLM's multimodal features: refused (images go through chat completions)


def _completion_body(req: TokensRequest, served_model: str) -> GenerateCompletion:
    params = {k: v for k, v in req.sampling_params.items() if k not in _ENGINE_ONLY}
    for name in ("prompt", "model", "stream", "echo", "return_token_ids", "request_id"):
        if name in params:
            raise APIError(400, f"sampling_params.{name}: not a sampling parameter", param=f"sampling_params.{name}")
    fields = {**params, "model": req.model or served_model, "prompt": req.token_ids, "stream": False,
              "return_token_ids": True, "priority": req.priority or 0}
    for name in ("cache_salt", "kv_transfer_params"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    try:
        body = GenerateCompletion.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"sampling_params.{where}: {err['msg']}", param=f"sampling_params.{where}") from None
    if body.model_extra:
        name = sorted(body.model_extra)[0]
        raise APIError(400, f"sampling_params.{name}: not a sampling parameter served here",
                       param=f"sampling_params.{name}", code="unsupported_parameter")
    return body


class TokensAnswer:
    def __init__(self, request_id: str, strings: TokenStrings, include_usage: bool):
        self.request_id, self.include_usage = request_id, include_usage
        self.strings = TokenIdStrings(strings)  # vLLM's tokens route names each token token_id:<id>
        self.created = int(time.time())

    def _logprobs(self, resp: Reply, positions) -> dict | None:
        num_top = resp.prep.output.num_logprobs
        return None if num_top is None else chat_logprobs(positions, num_top, self.strings)

    def _choice(self, resp: Reply, run: ChoiceRun, positions, finish_reason: str | None) -> dict:
        return {"index": run.index, "token_ids": list(positions.token_ids), "finish_reason": finish_reason,
                "logprobs": self._logprobs(resp, positions)}

    def json_body(self, resp: Reply) -> dict:
        prep = resp.prep
        out = {"request_id": self.request_id, "id": self.request_id, "created": self.created, "model": prep.model,
               "choices": [self._choice(resp, run, run.positions, run.finish_reason) for run in resp.runs],
               "usage": resp.usage(), "prompt_logprobs": None, "kv_transfer_params": resp.runs[0].kv_transfer_params}
        if prep.output.num_prompt_logprobs is not None:
            out["prompt_logprobs"] = resp.prompt_logprobs(resp.runs[0])
        return out

    def stream(self, resp: Reply, firsts) -> AsyncIterator[bytes]:
        return guarded_sse(self._events(resp, firsts), resp.runs, resp.prep.request_id)

    async def _events(self, resp: Reply, firsts) -> AsyncIterator[bytes]:
        async with interleaved(resp.runs, firsts) as pieces:
            async for run, piece, reason in pieces:
                if reason == "error":
                    yield wire.sse(wire.error_body(f"generation failed: {run.error}", "server_error"))
                    break
                if piece.positions.token_ids or reason is not None:
                    yield wire.sse({"request_id": self.request_id, "id": self.request_id,
                                    "choices": [self._choice(resp, run, piece.positions, reason)]})
            else:
                if self.include_usage:
                    yield wire.sse({"request_id": self.request_id, "id": self.request_id, "choices": [],
                                    "usage": resp.usage()})
        yield wire.sse("[DONE]")


async def serve_tokens(body: TokensRequest, request: Request, router, served_names: tuple[str, ...],
                       policy: ServerPolicy, metrics: Metrics, strings: TokenStrings):
    if body.features is not None:
        raise APIError(400, "features: multimodal inputs are not served on this route (POST /v1/chat/completions)",
                       param="features", code="unsupported_parameter")
    completion = _completion_body(body, served_names[0])
    prep = await prepare(completion, router, served_names, policy)
    client_id = client_request_id(body.request_id, "request_id") or uuid.uuid4().hex
    base = named_prompt_id(REQUEST_ID_PREFIX, client_id)
    options = body.stream_options
    include_usage = bool(body.stream and options is not None and options.include_usage)
    # The prompt's logprobs come with the first delta, streamed or not (prepare saw a body that does not stream).
    prep = replace(prep, request_id=base, response_id=client_id, stream=bool(body.stream), include_usage=include_usage)
    answer = TokensAnswer(client_id, strings, include_usage)
    return await serve_runs(prep, request, router, metrics, strings, answer.stream, answer.json_body, [base])
