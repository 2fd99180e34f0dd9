"""POST /v1/embeddings, as OpenAI and vLLM serve it, from the generative model the server runs.

``{"model"?, "input": str | [str] | [int] | [[int]], "encoding_format"?: "float" | "base64", "dimensions"?,
"user"?}`` and vLLM's extras (``truncate_prompt_tokens``, ``add_special_tokens``, ``normalize``, ``priority``,
``messages`` in place of ``input`` for one chat rendered by the template) -> ``{"object": "list", "data":
[{"object": "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``.

Each input is one router request of one token with ``SamplingParams.pooling``: computed where its prompt is (a
prefill worker asked for the first token alone, or a colocated worker), no decode-side block reserved, no KV moved.
vLLM serves embeddings only from an instance started as a pooling model; here the same workers serve both.

The pooler (``PoolerConfig``): a sentence-transformers directory's own (``modules.json``: its Pooling module's mode,
and whether a Normalize module follows), else the last token, normalised (vLLM's default for a decoder model);
``serve --pooler-config`` overrides either. ``dimensions`` cuts a matryoshka model's vector (its config's
``is_matryoshka`` / ``matryoshka_dimensions``) before normalising; any other model refuses it, as vLLM does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import ChatMessage, Prompt, StrictModel, short
from pdcluster.cluster.api.served_names import answered_name
from pdcluster.cluster.api.serving import ClientGone, unless_disconnected
from pdcluster.cluster.api.tracing import ChoiceTiming, trace_finished
from pdcluster.cluster.api.validation import MAX_PROMPTS, chat_prompt_ids, chat_template_kwargs, check_model
from pdcluster.cluster.api.whole_request import whole_request
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.models.bert_names import is_encoder_dir
from pdcluster.engine.models.classifier import ClassifierSpec, classifier_spec_of_dir
from pdcluster.engine.pooling import finish_embedding, pooled_vector
from pdcluster.engine.sampling_params import POOLING_TYPES, SamplingParams

# sentence-transformers' Pooling modes -> ours (the ones a decoder model's embedding checkpoints use).
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"  # one of engine/sampling_params.POOLING_TYPES
    normalize: bool = True
    # None: the model has no matryoshka training and ``dimensions`` is refused; () any width; else the widths.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # Why this server embeds nothing (its directory asks for a pooling not served here): the routes answer 400 with it.
    unavailable: str | None = None
    # A sequence classifier's labels (engine/models/classifier.py), from its config.json: /classify serves it, a
    # one-label one scores /score and /rerank as a cross-encoder, and it does not generate. None: a causal model.
    classifier: ClassifierSpec | None = None
    # An encoder-only model (engine/models/bert.py: BERT, RoBERTa, XLM-RoBERTa): it pools and does not generate.
    encoder_only: bool = False

    def __post_init__(self) -> None:
        if self.unavailable is None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")


def check_pooler_flag(value: str) -> None:
    """``--pooler-config`` (serve's, run-batch's) checked before any model loads: a bad value is one line naming
    the flag, not a traceback from every API process."""
    from pdcluster.engine.config import ConfigError

    try:
        pooler_config(None, value)
    except ValueError as e:  # json.JSONDecodeError is one
        raise ConfigError(f"--pooler-config: {e}") from e


def pooler_config(model_dir: str | Path | None, override: str | dict | None = None) -> PoolerConfig:
    """The server's pooler: ``override`` (vLLM's ``--pooler-config`` JSON: ``pooling_type`` LAST | MEAN | CLS,
    ``normalize``) over what the model directory says, over the default (last token, normalised)."""
    root = Path(model_dir) if model_dir is not None else None
    encoder_only = is_encoder_dir(root)
    # An encoder's default is its [CLS] token's state (vLLM's for BERT-like models), a decoder's its last token's.
    pooling, normalize = "cls" if encoder_only else "last", True
    matryoshka: tuple[int, ...] | None = None
    unavailable = None
    if root is not None and (root / "modules.json").is_file():
        modules = json.loads((root / "modules.json").read_text())
        types = [str(m.get("type", "")) for m in modules]
        normalize = any(t.endswith("Normalize") for t in types)
        for m in modules:
            if str(m.get("type", "")).endswith("Pooling") and (root / m.get("path", "") / "config.json").is_file():
                cfg = json.loads((root / m["path"] / "config.json").read_text())
                modes = [ours for key, ours in _ST_MODES.items() if cfg.get(key)]
                if len(modes) != 1 or sum(bool(v) for k, v in cfg.items() if k.startswith("pooling_mode_")) != 1:
                    unavailable = (f"the model's sentence-transformers Pooling config asks for a mode not served "
                                   f"here (only {', '.join(_ST_MODES)}, alone): {cfg}; serve --pooler-config chooses one")
                else:
                    pooling = modes[0]
    if root is not None and (root / "config.json").is_file():
        hf = json.loads((root / "config.json").read_text())
        if hf.get("matryoshka_dimensions"):
            matryoshka = tuple(int(d) for d in hf["matryoshka_dimensions"])
        elif hf.get("is_matryoshka"):
            matryoshka = ()
    if override:
        values = json.loads(override) if isinstance(override, str) else override
        if not isinstance(values, dict):
            raise ValueError(f"a JSON object is expected, got {override!r}")
        unknown = sorted(set(values) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"unknown keys {unknown} (known: pooling_type, normalize)")
        if "pooling_type" in values:
            pooling, unavailable = str(values["pooling_type"]).lower(), None
        if "normalize" in values:
            if not isinstance(values["normalize"], bool):
                raise ValueError(f"normalize must be true or false, got {values['normalize']!r}")
            normalize = values["normalize"]
    return PoolerConfig(pooling, normalize, matryoshka, unavailable, classifier_spec_of_dir(root), encoder_only)


def check_available(pooler: PoolerConfig) -> None:
    if pooler.unavailable is not None:
        raise APIError(400, f"this server embeds nothing: {pooler.unavailable}", code="unsupported_model")


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: Prompt | None = None
    messages: list[ChatMessage] | None = None  # vLLM's chat embeddings: one conversation, templated
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras:
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": the first tokens are kept
    add_special_tokens: bool | None = None  # default: true for input, false for messages (the template's own)
    add_generation_prompt: bool | None = False
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None
    normalize: bool | None = None  # default: the server's pooler
    priority: int | None = 0  # lower first (engine/waiting_queue.py)


@dataclass
class _Prepared:
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    normalize: bool
    dimensions: int | None


def _prompts(body: EmbeddingRequest, tokenizer) -> list[list[int]]:
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input (text or token ids) or messages (a chat)", param="input")
    if body.messages is not None:
        return [chat_prompt_ids(body.messages, bool(body.add_generation_prompt), tokenizer,
                                template_kwargs=chat_template_kwargs(body.chat_template_kwargs),
                                add_special_tokens=bool(body.add_special_tokens),
                                continue_final_message=bool(body.continue_final_message))]
    one = body.input
    batch = one if isinstance(one, list) and one and isinstance(one[0], (str, list)) else [one]
    if len(batch) > MAX_PROMPTS:
        raise APIError(400, f"input: a batch of at most {MAX_PROMPTS} inputs is supported, got {len(batch)}: "
                            "split it over several requests", param="input")
    out = []
    for i, item in enumerate(batch):
        label = "input" if len(batch) == 1 else f"input[{i}]"
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=body.add_special_tokens is not False)
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise APIError(400, f"{label}: token ids out of range [0, {tokenizer.vocab_size}): {short(bad[:5])}",
                               param="input")
        if not ids:
            raise APIError(400, f"{label} is empty: give at least one token of text", param="input")
        out.append(ids)
    return out


def check_lengths(prompts: list[list[int]], truncate_prompt_tokens: int | None, max_model_len: int,
                  param: str = "input", keep_first: bool = False, from_right: bool = False) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens`` (each prompt's last k tokens; -1: as many as fit; its first k with
    ``from_right``, truncation_side "right") applied, then every prompt within what a pooling request may hold:
    ``max_model_len`` less the one token it samples. ``keep_first``: an encoder's prompt keeps its first token ([CLS],
    what it pools) and its last k - 1 (from the right: its first k - 1 and its last, [SEP]), as a tokenizer
    truncating keeps its special tokens."""
    limit = max_model_len - 1
    keep = truncate_prompt_tokens
    if keep is not None:
        keep = limit if keep == -1 else keep
        if keep < 1:
            raise APIError(400, f"truncate_prompt_tokens must be >= 1 (or -1 for the context), got "
                                f"{truncate_prompt_tokens}", param="truncate_prompt_tokens")

        def cut(ids: list[int]) -> list[int]:
            if len(ids) <= keep:
                return ids
            if keep_first and keep > 1:  # [CLS] kept, and from the right the last token ([SEP]) too
                return ids[:keep - 1] + ids[-1:] if from_right else ids[:1] + ids[-(keep - 1):]
            return ids[:keep] if from_right else ids[-keep:]

        prompts = [cut(ids) for ids in prompts]
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            label = param if len(prompts) == 1 else f"{param}[{i}]"
            raise APIError(400, f"{label} has {len(ids)} tokens; this server embeds at most {limit} (max_model_len "
                                f"{max_model_len} less one): shorten it or set truncate_prompt_tokens", param=param)
    return prompts


def pooling_params(pooling: str, lora_name: str | None, priority: int | None) -> SamplingParams:
    """A pooling request of one token: an embedding's (the server's pooler's type) or a classification's."""
    return SamplingParams(max_tokens=1, pooling=pooling, lora_name=lora_name,
                          priority=0 if priority is None else priority)


async def _prepare(body: EmbeddingRequest, router, served_names: tuple[str, ...], pooler: PoolerConfig,
                   id_prefix: str = "embd") -> _Prepared:
    check_available(pooler)
    lora_name = check_model(body.model, served_names, router.lora_names) if body.model is not None else None
    dimensions = body.dimensions
    if dimensions is not None:
        if pooler.matryoshka_dimensions is None:
            raise APIError(400, f"dimensions: the model {served_names[0]!r} was not trained for shorter embeddings "
                                "(matryoshka): leave dimensions out", param="dimensions",
                           code="unsupported_parameter")
        if dimensions < 1 or (pooler.matryoshka_dimensions and dimensions not in pooler.matryoshka_dimensions):
            allowed = (f"one of {list(pooler.matryoshka_dimensions)}" if pooler.matryoshka_dimensions
                       else ">= 1")
            raise APIError(400, f"dimensions must be {allowed}, got {dimensions}", param="dimensions")
    prompts = await anyio.to_thread.run_sync(_prompts, body, router.tokenizer)
    prompts = check_lengths(prompts, body.truncate_prompt_tokens, router.max_model_len,
                            keep_first=pooler.encoder_only, from_right=body.truncation_side == "right")
    normalize = pooler.normalize if body.normalize is None else body.normalize
    return _Prepared(f"{id_prefix}-{uuid.uuid4().hex}", prompts, pooling_params(pooler.pooling_type, lora_name, body.priority),
                     normalize, dimensions)


async def _embed_one(router, request_id: str, token_ids: list[int], params: SamplingParams) -> bytes:
    """The pooled vector of one prompt (float32 bytes); the request is aborted if this is cancelled."""
    pooled = (await whole_request(router, request_id, token_ids, params, "embedding"))[-1].pooled
    if not pooled:
        raise APIError(503, "embedding failed: the answer carried no vector", kind="server_error")
    return pooled


async def embed_all(router, request_id: str, prompts: list[list[int]], params: SamplingParams) -> list[np.ndarray]:
    """Each prompt's pooled vector (float32, not normalised), all as router requests at once; one failing or this
    being cancelled (the client left) aborts the others."""
    tasks = [asyncio.ensure_future(_embed_one(router, f"{request_id}-{i}", ids, params))
             for i, ids in enumerate(prompts)]
    try:
        return [pooled_vector(raw) for raw in await asyncio.gather(*tasks)]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def observe(metrics: Metrics, started: float, prompts: list[list[int]], params: SamplingParams, request=None,
            request_id: str = "") -> None:
    """In /metrics each embedded prompt is a finished request with its prompt tokens and none generated; where the
    app traces (``request``: the HTTP request), each is a span too (id ``<request_id>-<i>``, as embed_all names it)."""
    now = time.monotonic()
    for ids in prompts:
        metrics.on_finish(now - started, len(ids), 0, "length", lora_name=params.lora_name)
    if request is not None:
        trace_finished(request, [ChoiceTiming(f"{request_id}-{i}", metrics.model_name, started, now, None, {}, len(ids),
                                              0, "length", params=params) for i, ids in enumerate(prompts)])


async def serve_embeddings(body: EmbeddingRequest, request: Request, router, served_names: tuple[str, ...],
                           pooler: PoolerConfig, metrics: Metrics, as_pooling: bool = False) -> Response:
    """``as_pooling``: vLLM's /pooling answer (each item ``{"index", "object": "pooling", "data"}``)."""
    prep = await _prepare(body, router, served_names, pooler, "pool" if as_pooling else "embd")  # vLLM's ids
    started = time.monotonic()
    try:
        pooled = await unless_disconnected(embed_all(router, prep.request_id, prep.prompts, prep.params), request)
    except ClientGone:
        return Response(status_code=499)
    observe(metrics, started, prep.prompts, prep.params, request, prep.request_id)
    data = []
    for i, raw in enumerate(pooled):
        vec = finish_embedding(raw, prep.normalize, prep.dimensions)
        embedding = (base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
                     if body.encoding_format == "base64" else vec.tolist())
        data.append({"index": i, "object": "pooling", "data": embedding} if as_pooling else
                    {"object": "embedding", "index": i, "embedding": embedding})
    num_prompt = sum(len(ids) for ids in prep.prompts)
    return JSONResponse({"id": prep.request_id, "object": "list", "created": int(time.time()),
                         "model": answered_name(body.model, served_names), "data": data,
                         "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}})
