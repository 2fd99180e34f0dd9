"""POST /classify (and /v1/classify), as vLLM serves it for a sequence classifier, and what else such a model changes.

``{"model"?, "input": str | [str] | [int] | [[int]]}`` (or ``messages``: one chat rendered by the template) and vLLM's
extras (``truncate_prompt_tokens``, ``add_special_tokens``, ``priority``, ``activation`` / ``use_activation``) ->
``{"id", "object": "list", "created", "model", "data": [{"index", "label", "probs", "num_classes"}], "usage"}``.

Each input is one router request with ``SamplingParams.pooling == "classify"``: the worker applies the checkpoint's
score head to the last position's final hidden state (engine/models/classifier.py) where the prompt is computed, and
the logits come back as an embedding's vector does (no decode-side block, no KV moved). ``probs`` are the logits
activated as vLLM does (softmax over several labels, a sigmoid for one, or as config.json's ``problem_type`` says;
the raw logits where ``activation`` is false); ``label`` names the highest.

POST /pooling (vLLM's generic pooling route, an embeddings body with vLLM's ``task``): ``data: [{"index", "object":
"pooling", "data"}]`` with an embedding model's vectors, a classifier's probabilities, or a row a prompt token
(``token_embed``, or a token classifier's ``token_classify``: NER; ``serve_pooling``).

A one-label classifier is a cross-encoder: /score and /rerank (cluster/api/scoring.py) read each pair as one input
(``tokenizer(text_1, text_2)``'s pair template) and score it by the head. A classifier does not generate: the
completion, chat and responses routes answer 400 (``check_generates``).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcluster.cluster.api.embeddings import (EmbeddingRequest, PoolerConfig, _prompts, check_available,
                                              check_lengths, embed_all, observe, pooling_params, serve_embeddings)
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import ChatMessage, Prompt, StrictModel
from pdcluster.cluster.api.served_names import answered_name
from pdcluster.cluster.api.serving import ClientGone, unless_disconnected
from pdcluster.cluster.api.validation import check_model
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.models.classifier import ClassifierSpec
from pdcluster.engine.pooling import finish_token_embeddings
from pdcluster.engine.sampling_params import TOKEN_POOLINGS


class ClassifyRequest(StrictModel):
    model: str | None = None
    input: Prompt | None = None
    messages: list[ChatMessage] | None = None  # vLLM's chat classification: one conversation, templated
    user: str | None = None
    # vLLM's extras:
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": the first tokens are kept
    add_special_tokens: bool | None = None  # default: true for input, false for messages (the template's own)
    add_generation_prompt: bool | None = False
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None
    priority: int | None = 0  # lower first (engine/waiting_queue.py)
    activation: bool | None = None  # vLLM's older name of use_activation
    use_activation: bool | None = None  # false: the raw logits


def check_classifier(pooler: PoolerConfig, served_names: tuple[str, ...]) -> ClassifierSpec:
    if pooler.classifier is None:
        raise APIError(400, f"the model {served_names[0]!r} has no classification head: /classify needs a "
                            "*ForSequenceClassification checkpoint", code="unsupported_model")
    if pooler.classifier.per_token:
        raise APIError(400, f"the model {served_names[0]!r} is a token classifier: it labels each token, not the "
                            "sequence; POST /pooling with task token_classify", code="unsupported_model")
    return pooler.classifier


def check_generates(pooler: PoolerConfig, served_names: tuple[str, ...]) -> None:
    """A classifier's checkpoint has no LM head, an encoder generates nothing: generation routes refuse them, in one
    line naming what they serve."""
    if pooler.encoder_only and pooler.classifier is None:
        raise APIError(400, f"the model {served_names[0]!r} is an encoder-only embedding model: it does not "
                            "generate; POST /v1/embeddings, /score or /rerank", code="unsupported_model")
    if pooler.classifier is not None and pooler.classifier.per_token:
        raise APIError(400, f"the model {served_names[0]!r} is a token classifier "
                            f"({pooler.classifier.num_labels} labels): it does not generate; POST /pooling (task "
                            "token_classify) or /v1/embeddings", code="unsupported_model")
    if pooler.classifier is not None:
        raise APIError(400, f"the model {served_names[0]!r} is a sequence classifier "
                            f"({pooler.classifier.num_labels} labels): it does not generate; POST /classify, /score, "
                            "/rerank or /v1/embeddings", code="unsupported_model")


class PoolingRequest(EmbeddingRequest):
    """/pooling's body: an embeddings body, vLLM's ``task`` (POOLING_TASKS; default: the model's own: token_classify
    for a token classifier, classify for a sequence classifier, embed for the rest) and ``use_activation``."""

    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    activation: bool | None = None  # vLLM's older name of use_activation
    use_activation: bool | None = None  # false: the raw logits (classify), rows as they are (token_embed)


def _default_task(pooler: PoolerConfig) -> str:
    if pooler.classifier is None:
        return "embed"
    return "token_classify" if pooler.classifier.per_token else "classify"


async def serve_pooling(body: PoolingRequest, request: Request, router, served_names: tuple[str, ...],
                        pooler: PoolerConfig, metrics: Metrics) -> Response:
    """vLLM's /pooling: what the model pools (``task``), as ``data: [{"index", "object": "pooling", "data"}]``: an
    embedding model's vectors (as /v1/embeddings makes them), a classifier's probabilities (as /classify), or one row
    a prompt token ("token_embed": the final hidden states, each normalised; "token_classify": a token classifier's
    label probabilities)."""
    task = body.task or _default_task(pooler)
    _use_activation(body)  # the two names disagreeing is a 400 whatever the task
    if task in TOKEN_POOLINGS:
        return await serve_token_pooling(body, task, request, router, served_names, pooler, metrics)
    if task == "embed":
        return await serve_embeddings(body, request, router, served_names, pooler, metrics, as_pooling=True)
    if body.dimensions is not None:
        raise APIError(400, "dimensions: a classifier's output has one entry a label: leave dimensions out",
                       param="dimensions")
    common = set(ClassifyRequest.model_fields) & set(PoolingRequest.model_fields)
    as_classify = ClassifyRequest.model_construct(**{k: getattr(body, k) for k in common})  # validated already
    return await serve_classify(as_classify, request, router, served_names, pooler, metrics, as_pooling=True,
                                encoding_format=body.encoding_format)


async def serve_token_pooling(body: PoolingRequest, task: str, request: Request, router, served_names: tuple[str, ...],
                              pooler: PoolerConfig, metrics: Metrics) -> Response:
    """/pooling's per-token tasks: each prompt's rows, [num_tokens][width], as vLLM's ``LLM.encode`` gives them
    (base64: the rows' float32 bytes in order, where ``encoding_format`` says)."""
    spec = pooler.classifier
    if task == "token_classify" and (spec is None or not spec.per_token):
        raise APIError(400, f"task token_classify: the model {served_names[0]!r} has no token classification head "
                            "(a *ForTokenClassification checkpoint)", param="task", code="unsupported_model")
    if task == "token_embed":
        check_available(pooler)
    if body.dimensions is not None:
        raise APIError(400, f"dimensions: not for task {task}: leave dimensions out", param="dimensions")
    activate = _use_activation(body, body.normalize)
    ran = await _run_pooling(body, task, "pool", request, router, served_names, pooler, metrics)
    if ran is None:
        return Response(status_code=499)
    request_id, prompts, flat = ran  # each prompt's rows come back flat, as an embedding's vector does
    data = []
    for i, (raw, ids) in enumerate(zip(flat, prompts)):
        width = raw.shape[0] // len(ids) if ids else 0
        if width == 0 or raw.shape[0] != width * len(ids) or (task == "token_classify" and width != spec.num_labels):
            raise APIError(503, f"{task} failed: {raw.shape[0]} values for {len(ids)} tokens", kind="server_error")
        rows = raw.reshape(len(ids), width)
        if task == "token_classify":
            rows = spec.activate(rows) if activate else rows
        else:
            rows = finish_token_embeddings(rows, activate)
        data.append(_pooling_item(i, rows, body.encoding_format))
    return _list_response(request_id, answered_name(body.model, served_names), data, prompts)


async def serve_classify(body: ClassifyRequest, request: Request, router, served_names: tuple[str, ...],
                         pooler: PoolerConfig, metrics: Metrics, as_pooling: bool = False,
                         encoding_format: str | None = "float") -> Response:
    """``as_pooling``: vLLM's /pooling answer for a classifier (each item ``{"index", "object": "pooling", "data"}``,
    the probabilities, base64 float32 where ``encoding_format`` says)."""
    spec = check_classifier(pooler, served_names)
    activate = _use_activation(body)
    # Each prompt's logits (float32 [num_labels]) come back as an embedding's vector does.
    ran = await _run_pooling(body, "classify", "pool" if as_pooling else "classify",  # vLLM's id prefixes
                             request, router, served_names, pooler, metrics)
    if ran is None:
        return Response(status_code=499)
    request_id, prompts, logits = ran
    data = []
    for i, raw in enumerate(logits):
        if raw.shape != (spec.num_labels,):
            raise APIError(503, f"classification failed: {raw.shape[0]} logits for {spec.num_labels} labels",
                           kind="server_error")
        probs = spec.activate(raw) if activate else raw
        if as_pooling:
            data.append(_pooling_item(i, probs, encoding_format))
            continue
        data.append({"index": i, "label": spec.labels[int(np.argmax(raw))], "probs": probs.tolist(),
                     "num_classes": spec.num_labels})
    return _list_response(request_id, answered_name(body.model, served_names), data, prompts)


def _use_activation(body, fallback: bool | None = None) -> bool:
    """vLLM's ``use_activation`` (``activation`` its older name; ``fallback``: another field that says the same where
    neither is given): true unless one says false; the two names disagreeing is a 400."""
    if body.activation is not None and body.use_activation is not None and body.activation != body.use_activation:
        raise APIError(400, "activation and use_activation disagree: give one", param="use_activation")
    return next((v for v in (body.use_activation, body.activation, fallback) if v is not None), True)


async def _run_pooling(body, pooling: str, id_prefix: str, request: Request, router, served_names: tuple[str, ...],
                       pooler: PoolerConfig, metrics: Metrics) -> tuple[str, list[list[int]], list[np.ndarray]] | None:
    """One router request of ``pooling`` a prompt of ``body`` (its input or messages, truncated and checked), all at
    once: (the request id, the prompts, each one's flat float32 result); None when the client left."""
    lora_name = check_model(body.model, served_names, router.lora_names) if body.model is not None else None
    prompts = await anyio.to_thread.run_sync(_prompts, body, router.tokenizer)
    prompts = check_lengths(prompts, body.truncate_prompt_tokens, router.max_model_len,
                            keep_first=pooler.encoder_only, from_right=body.truncation_side == "right")
    params = pooling_params(pooling, lora_name, body.priority)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    started = time.monotonic()
    try:
        results = await unless_disconnected(embed_all(router, request_id, prompts, params), request)
    except ClientGone:
        return None
    observe(metrics, started, prompts, params, request, request_id)
    return request_id, prompts, results


def _pooling_item(index: int, values: np.ndarray, encoding_format: str | None) -> dict:
    """One /pooling answer: the values as (nested) floats, or their float32 bytes in order, base64."""
    return {"index": index, "object": "pooling",
            "data": base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
            if encoding_format == "base64" else values.tolist()}


def _list_response(request_id: str, model: str, data: list[dict], prompts: list[list[int]]) -> JSONResponse:
    num_prompt = sum(len(ids) for ids in prompts)
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": model,
                         "data": data, "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt,
                                                 "completion_tokens": 0, "prompt_tokens_details": None}})
