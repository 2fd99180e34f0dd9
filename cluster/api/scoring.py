"""POST /score (and /v1/score) and POST /rerank (and /v1/rerank, /v2/rerank), as vLLM serves them: for an embedding
model each text embedded (cluster/api/embeddings.py: the server's pooler), a pair's score the cosine similarity of
its two vectors (vLLM's bi-encoder scoring); for a one-label sequence classifier (a cross-encoder reranker,
cluster/api/classify.py) each pair read as one input and scored by the head, sigmoid-activated as vLLM does.

/score: ``{"model"?, "text_1", "text_2"}`` (or vLLM's other spellings of the pair: ``queries`` with ``documents`` or
``items``, ``data_1`` with ``data_2``), each a string or a list of strings, paired 1:1, 1:N or N:N ->
``{"id", "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}], "usage"}``.
/rerank (Jina's and Cohere's shape): ``{"model"?, "query", "documents", "top_n"?: 0}`` -> ``{"id", "model", "usage",
"results": [{"index", "document": {"text"}, "relevance_score"}]}``, best first, the ``top_n`` best (0: all).
Both take vLLM's ``truncate_prompt_tokens`` (each text's last k tokens, each pair's for a cross-encoder) and
``priority``; ``usage`` counts the tokens of every input read.
"""

from __future__ import annotations

import time
import uuid

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcluster.cluster.api.embeddings import (PoolerConfig, check_available, check_lengths, embed_all, observe,
                                              pooling_params)
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import StrictModel
from pdcluster.cluster.api.served_names import answered_name
from pdcluster.cluster.api.serving import ClientGone, unless_disconnected
from pdcluster.cluster.api.validation import MAX_CHOICES, check_model
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.pooling import finish_embedding

Texts = str | list[str]
# vLLM's spellings of a score request's two sides, first and second.
_PAIR_NAMES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class _ScoringFields(StrictModel):
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int | None = 0  # lower first (engine/waiting_queue.py)


class ScoreRequest(_ScoringFields):
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    def sides(self) -> tuple[list[str], list[str], str, str]:
        """The two sides as lists, and their names (for messages)."""
        given = [(a, b) for a, b in _PAIR_NAMES if getattr(self, a) is not None and getattr(self, b) is not None]
        if len(given) != 1:
            raise APIError(400, "give one pair of texts to score: text_1 and text_2 (or queries with documents or "
                                "items, or data_1 and data_2)", param="text_1")
        first, second = given[0]
        return _as_list(getattr(self, first)), _as_list(getattr(self, second)), first, second


class RerankRequest(_ScoringFields):
    query: str
    documents: Texts
    top_n: int | None = 0


def _as_list(texts: Texts) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def _tokenize(texts: list[str], tokenizer, param: str, add_special_tokens: bool = False) -> list[list[int]]:
    """Each text's ids, as LLMEngine.tokenize makes them (an encoder's with its [CLS] ... [SEP])."""
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            label = param if len(texts) == 1 else f"{param}[{i}]"
            raise APIError(400, f"{label} is empty: give at least one token of text", param=param)
        out.append(ids)
    return out


async def _similarities(router, served_names: tuple[str, ...], pooler: PoolerConfig, metrics: Metrics, request: Request,
                        body: _ScoringFields, firsts: list[str], seconds: list[str], first_name: str,
                        second_name: str, prefix: str) -> tuple[list[float], int] | None:
    """Each pair's score (the one first text against every second, or pair by pair) and the tokens read; None when
    the client left. An embedding model's score is the cosine of the two texts' vectors; a one-label classifier's
    (a cross-encoder) is its head's on the pair read as one input."""
    cross = pooler.classifier is not None
    if cross and pooler.classifier.per_token:
        raise APIError(400, f"the model {served_names[0]!r} is a token classifier: it labels each token and scores "
                            "no pairs; POST /pooling with task token_classify", code="unsupported_model")
    if cross and pooler.classifier.num_labels != 1:
        raise APIError(400, f"the model {served_names[0]!r} is a classifier of {pooler.classifier.num_labels} "
                            "labels: only a one-label classifier (a cross-encoder) scores pairs; POST /classify",
                       code="unsupported_model")
    if not cross:
        check_available(pooler)
    lora_name = check_model(body.model, served_names, router.lora_names) if body.model is not None else None
    if not firsts or not seconds:
        raise APIError(400, "at least one text is needed on each side", param=second_name)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise APIError(400, f"input lengths must be 1:1, 1:N or N:N, got {len(firsts)}:{len(seconds)}",
                       param=second_name)
    if len(firsts) + len(seconds) > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} texts a request, got {len(firsts) + len(seconds)}: split it",
                       param=second_name)
    tokenizer = router.tokenizer
    if cross:
        pairs = list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds))
        prompts = await anyio.to_thread.run_sync(lambda: _tokenize_pairs(pairs, tokenizer, second_name))
        params = pooling_params("classify", lora_name, body.priority)
    else:
        prompts = await anyio.to_thread.run_sync(
            lambda: _tokenize(firsts, tokenizer, first_name, pooler.encoder_only)
            + _tokenize(seconds, tokenizer, second_name, pooler.encoder_only))
        params = pooling_params(pooler.pooling_type, lora_name, body.priority)
    prompts = check_lengths(prompts, body.truncate_prompt_tokens, router.max_model_len, param=second_name,
                            keep_first=pooler.encoder_only)
    started = time.monotonic()
    try:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        pooled = await unless_disconnected(embed_all(router, request_id, prompts, params), request)
    except ClientGone:
        return None
    observe(metrics, started, prompts, params, request, request_id)
    num_tokens = sum(len(ids) for ids in prompts)
    if cross:
        return [float(pooler.classifier.activate(logits)[0]) for logits in pooled], num_tokens
    vectors = [finish_embedding(v, normalize=True) for v in pooled]  # unit length: a dot product is the cosine
    queries, documents = vectors[: len(firsts)], vectors[len(firsts):]
    if len(queries) == 1:
        queries = queries * len(documents)
    return [float(np.dot(q, d)) for q, d in zip(queries, documents)], num_tokens


def _tokenize_pairs(pairs: list[tuple[str, str]], tokenizer, param: str) -> list[list[int]]:
    """Each (first, second) as one cross-encoder input: the tokenizer's pair template, as transformers' and vLLM's."""
    out = []
    for i, (first, second) in enumerate(pairs):
        if not first or not second:
            raise APIError(400, f"pair {i} has an empty text: give at least one token of text on each side",
                           param=param)
        out.append(tokenizer.encode_pair(first, second))
    return out


async def serve_score(body: ScoreRequest, request: Request, router, served_names: tuple[str, ...], pooler: PoolerConfig,
                      metrics: Metrics) -> Response:
    firsts, seconds, first_name, second_name = body.sides()
    result = await _similarities(router, served_names, pooler, metrics, request, body, firsts, seconds,
                                 first_name, second_name, "score")
    if result is None:
        return Response(status_code=499)
    scores, num_tokens = result
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": answered_name(body.model, served_names),
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}})


async def serve_rerank(body: RerankRequest, request: Request, router, served_names: tuple[str, ...],
                       pooler: PoolerConfig, metrics: Metrics) -> Response:
    documents = _as_list(body.documents)
    top_n = body.top_n or 0
    if top_n < 0:
        raise APIError(400, f"top_n must be >= 0 (0: every document), got {top_n}", param="top_n")
    result = await _similarities(router, served_names, pooler, metrics, request, body, [body.query], documents,
                                 "query", "documents", "rerank")
    if result is None:
        return Response(status_code=499)
    scores, num_tokens = result
    ranked = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
    if top_n:
        ranked = ranked[:top_n]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": answered_name(body.model, served_names),
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                         "results": [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]}
                                     for i in ranked]})
