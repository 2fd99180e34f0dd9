"""The app and its routes: POST /v1/completions, POST /v1/chat/completions (streaming SSE or not),
POST /v1/responses (cluster/api/responses.py), GET /v1/models (and /v1/models/{id}), POST /tokenize,
POST /detokenize, GET /health, GET|POST /ping, GET /version, GET /metrics, vLLM's POST /inference/v1/generate
(cluster/api/vllm_tokens.py) and SGLang's native routes (cluster/api/sglang_routes.py), over any router of
router_contract.py. The pieces it composes are listed in __init__.py.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pdcluster.cluster.api.beam import serve_beam_search
from pdcluster.cluster.api.classify import (ClassifyRequest, PoolingRequest, check_generates, serve_classify,
                                            serve_pooling)
from pdcluster.cluster.api.embeddings import EmbeddingRequest, PoolerConfig, pooler_config, serve_embeddings
from pdcluster.cluster.api.generation_defaults import sampling_defaults
from pdcluster.cluster.api.images import image_spec
from pdcluster.cluster.api.invocations import json_object, route_for
from pdcluster.cluster.api.logprobs import TokenStrings
from pdcluster.cluster.api.media_policy import MediaPolicy
from pdcluster.cluster.api.lora_routes import install_lora_routes
from pdcluster.cluster.api.sleep_routes import install_sleep_routes
from pdcluster.cluster.api.weight_routes import install_weight_routes
from pdcluster.cluster.api.middleware import APIError, install_error_handlers, install_middleware
from pdcluster.cluster.api.request_tracking import install_request_tracking
from pdcluster.cluster.api.options import (MAX_LOGPROBS, CorsPolicy, check_max_logprobs, check_response_role,
                                          check_template_kwargs)
from pdcluster.cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from pdcluster.cluster.api.reasoning import check_reasoning_parser, thinking_markers
from pdcluster.cluster.api.responses import ResponsesRequest, serve_response
from pdcluster.cluster.api.scoring import RerankRequest, ScoreRequest, serve_rerank, serve_score
from pdcluster.cluster.api.served_names import check_served_names
from pdcluster.cluster.api.sglang_routes import install_sglang_routes
from pdcluster.cluster.api.serving import serve_request
from pdcluster.cluster.api.tokenize_routes import install_tokenize_routes
from pdcluster.cluster.api.tool_parsers import select_parser
from pdcluster.cluster.api.tracing import RequestTracer, check_detailed, check_tracing_flags
from pdcluster.cluster.api.user_middleware import install_user_middleware
from pdcluster.cluster.api.validation import ServerPolicy, check_model, prepare
from pdcluster.cluster.api.vllm_tokens import TokensRequest, serve_tokens
from pdcluster.cluster.metrics import Metrics

log = logging.getLogger(__name__)


def package_version() -> str:
    """pdcluster's installed version (pyproject.toml), or "unknown" when run from a tree not installed."""
    try:
        return importlib.metadata.version("pdcluster")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# Request bodies up to: text, and a model that takes images (base64 data URLs: a 20 MiB image is 27 MiB).
TEXT_BODY_BYTES = 1 << 20
IMAGE_BODY_BYTES = 32 << 20


def build_app(router, served_model_name: str, api_key: str | None = None, max_body_bytes: int | None = None,
              metrics: Metrics | None = None, tool_call_parser: str = "auto",
              reasoning_parser: str | None = None, runtime_lora: bool = False,
              pooler: PoolerConfig | str | None = None, media: MediaPolicy | None = None,
              generation_config: str = "auto", override_generation_config: dict | None = None,
              chat_template: str | None = None, default_chat_template_kwargs: dict | None = None,
              cors: CorsPolicy | None = None, fastapi_docs: bool = True, max_logprobs: int = MAX_LOGPROBS,
              force_include_usage: bool = False, return_tokens_as_token_ids: bool = False,
              kv_transfer: bool = False, kv_role: str = "", served_model_aliases: tuple[str, ...] = (), response_role: str = "assistant",
              trust_request_chat_template: bool = False, server_load_tracking: bool = False,
              request_id_headers: bool = False, metrics_prefix: str = "pdcluster", otlp_traces_endpoint: str = "",
              collect_detailed_traces: str = "", weight_updates: bool = False, weight_staging_dir: str = "",
              sleep_mode: bool = False, middleware: tuple[str, ...] = (),
              router_control: bool = True) -> FastAPI:
    """``served_model_aliases``: more names the base model is served under, after ``served_model_name`` (vLLM's
    --served-model-name NAME...): a request's ``model`` may be any, /v1/models lists each, answers and metrics give
    ``served_model_name`` (cluster/api/served_names.py); ValueError for an empty or repeated name, or one that is a
    LoRA adapter's. ``runtime_lora``: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    (cluster/api/lora_routes.py; the workers must run with EngineConfig.enable_lora). ``tool_call_parser``: the model's tool-call format for tool_choice "auto" (cluster/api/tool_parsers/:
    hermes, llama3_json, pythonic; ``auto`` reads it off the chat template, and without one "auto" is
    refused). ``reasoning_parser``: qwen3 or deepseek_r1 to give chat answers' reasoning apart
    (cluster/api/reasoning.py); None: the text as the model wrote it. ``pooler``: how /v1/embeddings pools
    (cluster/api/embeddings.py), or the JSON of ``serve --pooler-config`` over what the model's directory says (None:
    that alone; without one, the last token, normalised). ``max_body_bytes`` (None: 1 MiB, 32 MiB for a model that
    takes images, whose data URLs carry them, or with prompts as embeddings): larger bodies get 413. ``media``: where chat images may be fetched
    from (cluster/api/media_policy.py; None: data: and http(s) URLs of any host, no file: URLs).
    ``generation_config`` / ``override_generation_config``: where requests' sampling defaults come from (vLLM's flags:
    cluster/api/generation_defaults.py; auto: the model's generation_config.json). ``chat_template`` (a template's
    text) renders chats in place of the model's, ``default_chat_template_kwargs`` go under every request's
    chat_template_kwargs (vLLM's --chat-template and --default-chat-template-kwargs): set on the router's tokenizer,
    so chat completions, /tokenize and chat embeddings all render alike. ``cors``: the browser pages that may call
    (None: none); ``fastapi_docs`` false leaves /docs, /redoc and /openapi.json out. ``max_logprobs`` (-1: the
    vocabulary), ``force_include_usage``, ``return_tokens_as_token_ids``: vLLM's flags of those names, for every
    request (cluster/api/validation.py ServerPolicy). ``kv_transfer``: the workers run with --kv-transfer-config, so
    requests' kv_transfer_params (vLLM's external prefill/decode protocol) are served, not refused; ``kv_role`` its
    kv_role, which says whether SGLang's router's bootstrap fields make a request a prefill or a decode leg
    (wire/sglang_bootstrap.py).
    ``response_role`` (vLLM's --response-role): a chat answer's role; ``trust_request_chat_template``: a chat request's
    ``chat_template`` renders its prompt instead of being refused. ``server_load_tracking`` (GET /load counts the
    requests in flight) and ``request_id_headers`` (X-Request-Id on every response): cluster/api/request_tracking.py.
    ``metrics_prefix``: /metrics names (pdcluster or vllm: cluster/metrics.py). ``otlp_traces_endpoint`` /
    ``collect_detailed_traces``: each request's OpenTelemetry span (cluster/api/tracing.py;
    "": none); TracingUnavailable (a ValueError) where they cannot be served. ``weight_updates``: serve the routes an RL
    trainer drives (pause, resume, weight updates: cluster/api/weight_routes.py) on ``router`` (a LocalRouter or
    ClusterRouter; an API process behind a router process installs cluster/frontend/admin_proxy.py's instead).
    ``sleep_mode``: serve /sleep, /wake_up, /is_sleeping and SGLang's release / resume_memory_occupation likewise
    (cluster/api/sleep_routes.py).
    SGLang's native routes (/generate, /abort_request, /flush_cache, ...: cluster/api/sglang_routes.py) are always
    served. ``middleware``: vLLM's --middleware names, the operator's ASGI middleware outermost
    (cluster/api/user_middleware.py). ``router_control`` false leaves /abort_request and the flushes to an API process's proxy (the router
    process answers them)."""
    media = media or MediaPolicy()
    served_names = check_served_names((served_model_name, *served_model_aliases), router.lora_names)
    if max_body_bytes is None:
        # Images' data URLs and prompts given as embeddings need larger bodies than text.
        takes_tensors = image_spec(router.tokenizer) is not None or media.enable_prompt_embeds
        max_body_bytes = IMAGE_BODY_BYTES if takes_tensors else TEXT_BODY_BYTES
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes!r}")
    if chat_template is not None or default_chat_template_kwargs:
        router.tokenizer.use_chat_template(chat_template, check_template_kwargs(
            default_chat_template_kwargs or {}, "default_chat_template_kwargs"))
    tool_parser = select_parser(tool_call_parser, getattr(router.tokenizer, "chat_template", None))
    check_reasoning_parser(reasoning_parser)
    policy = ServerPolicy(
        tool_parser=tool_parser, reasoning_parser=reasoning_parser, media=media,
        thinking_markers=None if reasoning_parser is None else thinking_markers(reasoning_parser, router.tokenizer),
        defaults=sampling_defaults(getattr(router.tokenizer, "model_dir", None), generation_config,
                                   override_generation_config),
        max_logprobs=router.tokenizer.vocab_size if check_max_logprobs(max_logprobs) == -1 else max_logprobs,
        force_include_usage=force_include_usage, return_tokens_as_token_ids=return_tokens_as_token_ids,
        kv_transfer=kv_transfer, kv_role=kv_role or ("kv_both" if kv_transfer else ""),
        response_role=check_response_role(response_role),
        trust_request_chat_template=trust_request_chat_template)
    if not isinstance(pooler, PoolerConfig):
        pooler = pooler_config(getattr(router.tokenizer, "model_dir", None), pooler)
    metrics = metrics or Metrics(served_model_name, prefix=metrics_prefix)
    if metrics.prefix != metrics_prefix + ":":
        raise ValueError(f"metrics named {metrics.prefix}* given to an app built for --metrics-prefix {metrics_prefix}")
    docs = {} if fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pdcluster", description="OpenAI-compatible API of a disaggregated prefill/decode cluster",
                  **docs)
    app.state.router, app.state.metrics = router, metrics
    check_tracing_flags(otlp_traces_endpoint, collect_detailed_traces)
    app.state.tracer = (RequestTracer(otlp_traces_endpoint, check_detailed(collect_detailed_traces))
                        if otlp_traces_endpoint else None)
    started = int(time.time())
    strings = TokenStrings(router.tokenizer)  # token id -> its string in logprobs, shared by all requests
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_generates(pooler, served_names)
        prep = await prepare(body, router, served_names, policy, request.headers.get("x-request-id"))
        if prep.beam is not None:
            return await serve_beam_search(prep, request, router, metrics, strings)
        return await serve_request(prep, request, router, metrics, strings)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_generates(pooler, served_names)
        prep = await prepare(body, router, served_names, policy, request.headers.get("x-request-id"))
        if prep.beam is not None:
            return await serve_beam_search(prep, request, router, metrics, strings)
        return await serve_request(prep, request, router, metrics, strings)

    @app.post("/inference/v1/generate")  # vLLM's tokens in, tokens out (cluster/api/vllm_tokens.py)
    async def generate_tokens(body: TokensRequest, request: Request):
        check_generates(pooler, served_names)
        return await serve_tokens(body, request, router, served_names, policy, metrics, strings)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        check_generates(pooler, served_names)
        return await serve_response(body, request, router, served_names, metrics, strings, policy)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await serve_embeddings(body, request, router, served_names, pooler, metrics)

    # vLLM's scoring routes for an embedding model: /score beside /v1 (and its older /v1/score), /rerank as Jina's and
    # Cohere's clients call it (/v1/rerank, /v2/rerank): cluster/api/scoring.py.
    async def score(body: ScoreRequest, request: Request):
        return await serve_score(body, request, router, served_names, pooler, metrics)

    async def rerank(body: RerankRequest, request: Request):
        return await serve_rerank(body, request, router, served_names, pooler, metrics)

    async def classify(body: ClassifyRequest, request: Request):  # vLLM's, for a sequence classifier
        return await serve_classify(body, request, router, served_names, pooler, metrics)

    for path in ("/classify", "/v1/classify"):
        app.add_api_route(path, classify, methods=["POST"])

    @app.post("/pooling")  # vLLM's generic route: an embedding model's vectors or a classifier's probabilities
    async def pooling(body: PoolingRequest, request: Request):
        return await serve_pooling(body, request, router, served_names, pooler, metrics)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

    def model_card(model_id: str) -> dict:
        # Each served name is a card of its own over the same model (vLLM's: root = the model for each).
        card = {"id": model_id, "object": "model", "created": started, "owned_by": "pdcluster",
                "root": router.model_name, "parent": None, "max_model_len": router.max_model_len}
        if model_id not in served_names:  # a LoRA adapter over the base model (vLLM's card: parent = the first name)
            card.update(root=model_id, parent=served_names[0])
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in (*served_names, *router.lora_names)]}

    @app.get("/v1/models/{model_id:path}")  # OpenAI's retrieve (client.models.retrieve)
    async def model(model_id: str):
        check_model(model_id, served_names, router.lora_names)  # 404 model_not_found for another name
        return model_card(model_id)

    @app.get("/health")
    async def health():
        try:
            stats = router.stats()  # on the loop, as the router's own state lives there; must not block
        except Exception as e:  # noqa: BLE001 - unhealthy, say why
            return JSONResponse({"status": "unhealthy", "error": f"router stats failed: {e!r}"}, status_code=503)
        healthy = bool(stats.get("healthy", True))
        return JSONResponse({"status": "ok" if healthy else "unhealthy", **stats},
                            status_code=200 if healthy else 503)

    async def ping():  # vLLM's (SageMaker's) liveness path, GET or POST: /health's status, no body
        return Response(status_code=(await health()).status_code)

    for method in ("GET", "POST"):  # one route a method: one OpenAPI operation id each
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    # vLLM's (SageMaker's) one inference path: the body's shape says which route answers it (invocations.py).
    routes = {"chat": (ChatCompletionRequest, chat_completions), "completions": (CompletionRequest, completions),
              "embeddings": (EmbeddingRequest, embeddings), "pooling": (PoolingRequest, pooling),
              "score": (ScoreRequest, score), "rerank": (RerankRequest, rerank)}

    @app.post("/invocations")
    async def invocations(request: Request):
        body = await json_object(request)
        model, handler = routes[route_for(body)]
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await handler(parsed, request)

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.get("/kv_event_sources")
    async def kv_event_sources():
        """vLLM's: where each worker publishes its KV events (--kv-events-config), by rank; {} without."""
        workers = router.stats().get("workers", [])
        return {str(w["kv_event_source"]["rank"]): w["kv_event_source"] for w in workers
                if isinstance(w, dict) and w.get("kv_event_source")}

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            metrics.refresh(router.stats())
        except Exception as e:  # noqa: BLE001 - still serve the counters
            log.warning("router stats failed while scraping metrics: %r", e)
        return Response(metrics.render(), media_type=metrics.content_type)

    install_tokenize_routes(app, router, served_names, media)
    try:
        check_generates(pooler, served_names)
        generates = True
    except APIError:
        generates = False
    install_sglang_routes(app, router, served_names, policy, metrics, strings, generates, package_version(),
                          router_control)
    if runtime_lora:
        install_lora_routes(app, router, served_model_name, served_model_aliases)
    if weight_updates:
        install_weight_routes(app, router, weight_staging_dir)
    if sleep_mode:
        install_sleep_routes(app, router)
    install_middleware(app, max_body_bytes, api_key, cors)
    install_request_tracking(app, server_load_tracking, request_id_headers)  # every answer gets its id
    install_user_middleware(app, middleware)  # the operator's, outermost (as vLLM's): they see every request
    return app
