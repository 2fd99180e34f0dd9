"""What the HTTP layer needs from a router: the contract between cluster/api/ and the routers
(cluster/router/router.py for the Ray cluster, cluster/local_router.py for a single in-process engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.engine.sampling_params import SamplingParams


class RouterError(Exception):
    """A request could not be served. ``status`` is the HTTP status the API should answer with."""

    def __init__(self, message: str, status: int = 503, kind: str = "server_error"):
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass
class TokenDelta:
    """New tokens of one request, in order. The last delta of a request has ``finished=True``."""

    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # authoritative count so far (from the decode worker)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prompt tokens served from the prefix cache of the worker that prefilled the prompt (the first
    # placement's: a recovery re-prefills prompt + streamed tokens, which is not the client's prompt).
    num_cached_tokens: int = 0
    # Of those, loaded back from a lower KV tier (host memory, disk: engine/kv_offload/) rather than
    # found in the device pool.
    num_offloaded_tokens: int = 0
    error: str | None = None
    # With ``params.logprobs``: one record per token of ``new_token_ids``, in order.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With ``params.prompt_logprobs``, on the first delta only: one record per prompt position after
    # the first (the first prompt token has no logprob), len = num_prompt_tokens - 1.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Seconds, set on the first delta: queue, prefill, kv_transfer, first_decode (where known).
    ttft_breakdown: dict[str, float] = field(default_factory=dict)
    # An embedding request's vector (params.pooling), on its one delta: float32 little-endian (engine/pooling.py).
    pooled: bytes | None = None
    # On the last delta of a request prefilled for another instance (vLLM's do_remote_decode): where its prompt's
    # KV is held, the response's kv_transfer_params (kv_transfer/connector/external.py).
    kv_transfer_params: dict | None = None
    # On the first delta: the weights the request runs under (SamplingParams.weight_version as the router stamped it:
    # a request never spans a weight update, cluster/generation_control.py). None: the router did not say.
    weight_version: str | None = None


class Router(Protocol):
    model_name: str
    max_model_len: int
    lora_names: tuple[str, ...]  # the LoRA adapters every worker serves (a request names one in ``params.lora_name``)
    tokenizer: object  # pdcluster.engine.tokenizer.Tokenizer
    # Images one prompt may hold, for a model that takes them (EngineConfig.limit_mm_per_prompt; 0: images off).
    max_images_per_prompt: int
    # The workers' --mm-processor-kwargs (EngineConfig.mm_processor_kwargs, its JSON; ""): the API counts an image's
    # placeholders by the same processor settings.
    mm_processor_kwargs: str

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens. Raises RouterError (before the first delta) when it cannot
        be admitted; a failure after that ends the stream with finish_reason="error".

        The API validated the request (cluster/api/validation.py: prompt non-empty, token ids within
        ``tokenizer.vocab_size``, prompt + max_tokens within ``max_model_len``, sampling values): a
        router checks only what it alone knows (request ids in use, whether a worker's KV pool can
        ever hold the prompt). It streams token ids only: text and ``params.stop`` are the API's,
        which ends the stream and calls ``abort`` once the text reaches a stop string."""
        ...

    async def deliver(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      on_delta: Callable[[TokenDelta], None],
                      on_row: Callable[[list[int], int, int, int], bool] | None = None) -> None:
        """``generate`` in push form: ``on_delta`` gets each delta on the loop, the final one last, and
        this returns once the final one was given (RouterError, before any delta, as generate). Cancelling
        it aborts the request, and no delta comes after. For a consumer that only forwards deltas (the
        router process behind API processes, cluster/frontend/service.py): no queue between.

        ``on_row``, where given, may be offered a plain delta (not the first, not the last; tokens and counts
        only, with the first delta's prompt, cached and offloaded counts) as its parts: new token ids, output
        tokens so far, draft and accepted tokens. It answers True once it took it, or False, and then the same
        delta comes to ``on_delta``. A router may never offer one."""
        ...

    async def abort(self, request_id: str) -> None:
        """Client went away or asked to stop: free everything on every worker."""
        ...

    def stats(self) -> dict:
        """Gauges for /metrics and /health: e.g. num_requests_running, num_requests_waiting,
        kv_cache_usage_perc, workers: [...], healthy: bool."""
        ...


class WeightControl(Protocol):
    """What cluster/api/weight_routes.py needs besides ``Router`` (--enable-weight-updates): the local and the Ray
    router have it (cluster/generation_control.py's WeightControlled); an API process behind a router process
    forwards the routes instead (cluster/frontend/admin_proxy.py)."""

    is_paused: bool
    weight_version: str  # "default" until an update

    async def pause(self, mode: str = "abort", timeout_s: float = 600.0) -> int:
        """Stop starting requests; abort or wait for those in flight. RouterError 400 / 504."""
        ...

    # SGLang's weight update from a trainer's process group (cluster/weights_from_trainer.py WeightsFromTrainer:
    # init_group, update, destroy_group).
    trainer_weights: object

    async def resume(self) -> dict | None:
        """Generation goes on (on a trainer's staged weights where it sent some while paused: their update's
        answer). RouterError where those cannot be served (generation stays paused)."""
        ...

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all: bool = False, timeout_s: float = 600.0) -> dict:
        """Every worker serves the checkpoint at ``model_path``; SGLang's answer. RouterError 400 / 503 / 504."""
        ...
