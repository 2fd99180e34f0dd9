"""POST /invocations, vLLM's (and Amazon SageMaker's) one inference path: the body's own fields say which route
answers it, as the route itself would (same validation, same answer, streamed where the body asks).

- ``messages``: chat completions; ``prompt`` (or ``prompt_embeds``): completions;
- ``query`` with ``documents``: rerank; ``text_1`` / ``text_2``, ``queries`` / ``documents``, ``data_1`` /
  ``data_2`` or ``items``: score;
- ``input`` with vLLM's pooling ``task``: /pooling; ``input`` alone: embeddings.
Any other body is a 400 that lists these.
"""

from __future__ import annotations

import json

from fastapi import Request

from pdcluster.cluster.api.middleware import APIError

_SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))
SHAPES = ("messages (chat completions), prompt or prompt_embeds (completions), input (embeddings; with task: pooling), query and "
          "documents (rerank), or text_1 and text_2 / queries and documents / data_1 and data_2 / items (score)")


async def json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise APIError(400, f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object with {SHAPES}")
    return body


def route_for(body: dict) -> str:
    """The route whose request ``body`` is (a key of app.py's routes)."""
    if "messages" in body:
        return "chat"
    if "prompt" in body or "prompt_embeds" in body:
        return "completions"
    if "query" in body and "documents" in body:
        return "rerank"
    if "items" in body or any(a in body and b in body for a, b in _SCORE_PAIRS):
        return "score"
    if "input" in body:
        return "pooling" if "task" in body else "embeddings"
    raise APIError(400, f"/invocations: the body's fields ({', '.join(sorted(body)[:10]) or 'none'}) name no route: "
                        f"give {SHAPES}")
