"""The OpenAI-compatible HTTP API, over any router that keeps router_contract.py's contract (the Ray
cluster's, cluster/router/; one in-process engine's, cluster/local_router.py). One concern a module:

- app.py: ``build_app``, the FastAPI app and its routes;
- protocol.py: the OpenAI wire format (request models; response, chunk and error JSON);
- validation.py: the one validation of a request (body -> prompts + SamplingParams + what the response
  shows), with sampling.py (sampling fields) and structured.py (response_format and tools -> a grammar;
  tool calls out of the text, by tool_parsers/);
- fanout.py: a request's choices (n, a batch of prompts) as router requests, together;
- choice.py: one choice's router stream -> text (stop strings through engine/tokenizer.py's
  Detokenizer) and logprobs kept aligned (text.py), counts, metrics;
- logprobs.py: logprobs in OpenAI's completions and chat layouts;
- serving.py: the choices to a JSON or SSE response (usage, aborts on disconnect);
- responses.py: OpenAI's Responses API (/v1/responses) as a chat completion, its answer and events;
- tokenize_routes.py: /tokenize and /detokenize (not ``tokenize.py``: that would shadow the standard
  library's module wherever this folder lands on sys.path);
- served_names.py: the names the base model is served under (--served-model-name NAME...: any may be asked for,
  answers give the first);
- middleware.py: errors in OpenAI's format (4xx for client mistakes, generic 5xx), the body limit, the
  API key;
- request_tracking.py: GET /load and its count of requests in flight, X-Request-Id on every response (vLLM's
  --enable-server-load-tracking, --enable-request-id-headers);
- weight_routes.py: /pause, /resume, /is_paused (vLLM's) and /update_weights_from_disk, /get_weight_version
  (SGLang's), with --enable-weight-updates (cluster/generation_control.py does the work);
- sglang_routes.py: SGLang's native routes: /generate (sglang_protocol.py: its body as completions bodies;
  sglang_generate.py: its answer and stream), /get_model_info, /get_server_info, /health_generate;
- vllm_tokens.py: vLLM's tokens-in, tokens-out /inference/v1/generate;
- control_routes.py: the aborts (SGLang's /abort_request, vLLM's /abort_requests) and the cache flushes
  (/flush_cache, /reset_prefix_cache), which the router process answers for every API process;
- admin.py: /admin/drain and /admin/workers (``pdcluster drain``), added by the Ray launcher;
- router_contract.py: what the API needs from a router (``Router``, ``TokenDelta``, ``RouterError``).
"""
