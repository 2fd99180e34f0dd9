"""One router request run to its end for an answer that is not streamed (a beam search's step, an embedding)."""

from __future__ import annotations

import asyncio
import contextlib

from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.router_contract import RouterError, TokenDelta
from pdcluster.engine.sampling_params import SamplingParams


async def whole_request(router, request_id: str, token_ids: list[int], params: SamplingParams,
                        what: str) -> list[TokenDelta]:
    """Every delta of the request, the finished one last. A refusal is an APIError with the router's status; an
    error or abort ends it as a 503 that says ``what`` failed; cancelling this aborts the request."""
    finished = False
    deltas: list[TokenDelta] = []
    try:
        # aclosing: the stream is closed here when the loop leaves it, not whenever its finalizer runs.
        async with contextlib.aclosing(router.generate(request_id, token_ids, params)) as stream:
            async for delta in stream:
                deltas.append(delta)
                if delta.finished:
                    finished = True
                    if delta.finish_reason in ("error", "abort"):
                        raise APIError(503, f"{what} failed: {delta.error or delta.finish_reason}",
                                       kind="server_error")
                    return deltas
    except RouterError as e:
        finished = True  # refused at admission: nothing to abort
        raise APIError(e.status, str(e), kind=e.kind) from e
    finally:
        if not finished:
            await asyncio.shield(router.abort(request_id))
    raise APIError(503, f"{what} failed: the router ended the stream without finishing it", kind="server_error")
