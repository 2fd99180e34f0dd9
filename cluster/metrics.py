"""Prometheus metrics of the serving front end, named like vLLM's (``vllm:`` -> ``pdcluster:``, same
suffixes and a ``model_name`` label) so dashboards carry over, plus what no other system has: TTFT
broken into queue, prefill, KV transfer and first decode step, and KV transfer volume per transport.

Each ``Metrics`` owns its CollectorRegistry, so several apps (tests) never collide. With several API
processes (``serve --api-servers N``: cluster/frontend/) every process writes its values to one
prometheus_client multiprocess directory (``enable_multiprocess``) and a scrape, whichever process
answers it, merges them all: counters and histograms summed, gauges the most recently set. Gauges are
refreshed from ``router.stats()`` when /metrics is scraped (``refresh``); everything else is observed
as requests run (the HTTP layer calls ``on_*``; the cluster router calls ``observe_kv_transfer``).
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values
from prometheus_client.multiprocess import MultiProcessCollector

# --metrics-prefix: ours, or vLLM's (every metric named as vLLM names it: llm-d's endpoint picker, KEDA and HPA rules and
# Grafana dashboards written for vLLM read a pdcluster server unchanged).
METRIC_PREFIXES = ("pdcluster", "vllm")

# vLLM's buckets, so histogram_quantile panels compare like with like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for request_params_n
# The TTFT parts (keys of TokenDelta.ttft_breakdown) and their histograms.
TTFT_PARTS = ("queue", "prefill", "kv_transfer", "first_decode")
# Where cached prompt tokens came from: the worker's device pool, or loaded back from an offload tier
# (host memory, disk: engine/kv_offload/).
CACHE_TIERS = ("device", "offload")


def observe_many(hist, value: float, count: int) -> None:
    """``count`` observations of one ``value`` in a Histogram's child: what ``count`` calls of ``observe`` record, in
    one increment of its sum and of the value's bucket (each call costs ~2 us in multiprocess mode, a streamed token's
    several percent of an API process). prometheus_client has no weighted observe, so this reads the child's own
    ``_sum``, ``_buckets`` and ``_upper_bounds``; a layout without them gets the ``count`` calls
    (tests/test_metrics_batched.py pins the two to the same exposition)."""
    if count == 1:
        hist.observe(value)
        return
    try:
        total, buckets, bounds = hist._sum, hist._buckets, hist._upper_bounds
    except AttributeError:
        for _ in range(count):
            hist.observe(value)
        return
    total.inc(value * count)
    for bound, bucket in zip(bounds, buckets):
        if value <= bound:
            bucket.inc(count)
            break


def enable_multiprocess(directory: str) -> None:
    """Metrics made in this process from now on keep their values in ``directory`` (prometheus_client's
    multiprocess mode, which it otherwise reads from the environment when first imported)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.MultiProcessValue()


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "", multiprocess_dir: str | None = None, prefix: str = "pdcluster"):
        """``multiprocess_dir``: render every process's values in that directory (``enable_multiprocess``
        must have been called with it in each process first). ``prefix``: one of METRIC_PREFIXES."""
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"--metrics-prefix: {prefix!r} is not one of {', '.join(METRIC_PREFIXES)}")
        self.prefix = p = prefix + ":"
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.multiprocess_dir = multiprocess_dir
        r, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(p + name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def model_counter(name: str, doc: str) -> Counter:  # one series: this model's
            return Counter(p + name, doc, m, registry=r).labels(model_name)

        def model_gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, m, registry=r, multiprocess_mode="mostrecent").labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival at the API to first token).",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to last token.", E2E_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.ttft_parts = {
            part: hist(f"ttft_{part}_seconds", f"The {part.replace('_', ' ')} part of the time to first token.",
                       TTFT_BUCKETS)
            for part in TTFT_PARTS
        }
        self.prompt_tokens_total = model_counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens_total = model_counter("generation_tokens", "Tokens generated.")
        cached = Counter(p + "prompt_tokens_cached", "Prompt tokens served from a KV cache instead of computed, "
                         "by tier: device (the prefix cache in the worker's pool) or offload (loaded back from "
                         "host memory or disk).", m + ["tier"], registry=r)
        self.prompt_tokens_cached = {tier: cached.labels(model_name, tier) for tier in CACHE_TIERS}
        self._success = Counter(p + "request_success", "Finished requests by finish reason.",
                                m + ["finished_reason"], registry=r)
        self._lora_requests = Counter(p + "lora_requests", "Finished requests that ran with a LoRA adapter, by "
                                      "adapter.", m + ["lora_name"], registry=r)
        self._lora_tokens = Counter(p + "lora_generation_tokens", "Tokens generated with a LoRA adapter, by "
                                    "adapter.", m + ["lora_name"], registry=r)
        self.spec_draft = model_counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = model_counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._kv_bytes = Counter(p + "kv_transfer_bytes", "KV cache bytes moved from prefill to decode.",
                                 m + ["transport"], registry=r)
        self._kv_seconds = Counter(p + "kv_transfer_seconds", "Seconds spent moving KV cache.",
                                   m + ["transport"], registry=r)
        self.running = model_gauge("num_requests_running", "Requests in a decode batch.")
        self.waiting = model_gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = model_gauge("kv_cache_usage_perc", "KV cache usage (1 = full).")
        self._autoscale = Counter(p + "autoscale_actions", "Workers added or drained by the autoscaler.",
                                  m + ["action", "role"], registry=r)
        self._workers = Gauge(p + "num_workers", "Workers in rotation.", m + ["role"], registry=r,
                              multiprocess_mode="mostrecent")
        self._tier_blocks = Gauge(p + "kv_tier_blocks", "KV blocks held per tier, summed over workers "
                                  "(device: in use by requests; host, disk: offloaded blocks kept; shared: the folder every worker "
                                  "shares, counted once).",
                                  m + ["tier"], registry=r, multiprocess_mode="mostrecent")
        self._tier_capacity = Gauge(p + "kv_tier_capacity_blocks", "KV blocks each tier can hold, summed "
                                    "over workers.", m + ["tier"], registry=r, multiprocess_mode="mostrecent")
        self._tiers_seen: set[str] = set()
        # What llm-d's endpoint picker reads besides the request gauges (the model server protocol of the Gateway API
        # Inference Extension): the KV block size and pool size as labels of an info gauge, and the LoRA adapters
        # running and waiting as labels of one whose value is when it was set (the newest set wins).
        self._cache_info = Gauge(p + "cache_config_info", "KV cache configuration (labels; value 1): the block size "
                                 "and the decode workers' device pool in blocks.", ["block_size", "num_gpu_blocks"],
                                 registry=r, multiprocess_mode="mostrecent")
        self._cache_info_labels: tuple[str, str] | None = None
        # vLLM's per-request phases and parameters (its Grafana dashboard's panels), from what the API process saw:
        # the queue and prefill parts of the time to first token (the router's), the decode from the first token to
        # the last, the inference from the end of the queue to the last, each request's mean time per output token.
        self.request_queue = hist("request_queue_time_seconds", "Time waiting to be placed (the queue part of the "
                                  "time to first token).", E2E_BUCKETS)
        self.request_prefill = hist("request_prefill_time_seconds", "Time in prefill (placed to first token).",
                                    E2E_BUCKETS)
        self.request_decode = hist("request_decode_time_seconds", "Time in decode (first token to last).",
                                   E2E_BUCKETS)
        self.request_inference = hist("request_inference_time_seconds", "Time placed (queue end to last token).",
                                      E2E_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds", "Each request's mean time per output "
                                 "token after the first.", ITL_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens each request asked for.",
                                      TOKEN_BUCKETS)
        self.params_n = hist("request_params_n", "The n each request asked for.", N_BUCKETS)
        # Weight updates (cluster/generation_control.py): which weights are served, whether generation is paused.
        self._weights_info = Gauge(p + "weight_version_info", "The weight version the workers serve (label; value 1): "
                                   "'default' until an update", ["weight_version"], registry=r,
                                   multiprocess_mode="mostrecent")
        self._weights_label: str | None = None
        self._paused = Gauge(p + "generation_paused", "1 while generation is paused (POST /pause, a weight update)",
                             registry=r, multiprocess_mode="mostrecent")
        self._weight_updates = Gauge(p + "weight_updates", "Weight updates done since the server started",
                                     registry=r, multiprocess_mode="mostrecent")
        self._weight_update_s = Gauge(p + "weight_update_last_seconds", "How long the last weight update took, from "
                                      "the pause to the resume", registry=r, multiprocess_mode="mostrecent")
        self._sleep_level = Gauge(p + "engine_sleep_level", "Sleep mode: 0 awake, 1 the KV cache released, 2 the "
                                  "weights too (POST /sleep?level=N until /wake_up)", registry=r,
                                  multiprocess_mode="mostrecent")
        self._lora_info = Gauge(p + "lora_requests_info", "LoRA adapters of the requests running and waiting "
                                "(labels; value: when set)", ["max_lora", "running_lora_adapters",
                                                              "waiting_lora_adapters"],
                                registry=r, multiprocess_mode="mostrecent")

    # ---- per request (the HTTP layer) ---------------------------------------------------------------
    def on_first_token(self, ttft_s: float, breakdown: dict[str, float]) -> None:
        self.ttft.observe(ttft_s)
        self.observe_ttft_parts(breakdown)

    def observe_ttft_parts(self, breakdown: dict[str, float]) -> None:
        for part, seconds in breakdown.items():
            hist = self.ttft_parts.get(part)
            if hist is not None and seconds >= 0:
                hist.observe(seconds)

    def on_tokens(self, gap_s: float, num_tokens: int) -> None:
        """``num_tokens`` arrived ``gap_s`` after the previous ones (several in one step under
        speculative decoding, or steps merged for a stream that lagged): each counts as one inter-token
        interval of ``gap_s / num_tokens``."""
        observe_many(self.itl, gap_s / num_tokens, num_tokens)

    def on_finish(self, e2e_s: float, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str,
                  num_draft_tokens: int = 0, num_accepted_tokens: int = 0, num_cached_tokens: int = 0,
                  num_offloaded_tokens: int = 0, lora_name: str | None = None, ttft_s: float | None = None,
                  ttft_parts: dict[str, float] | None = None, max_tokens: int | None = None,
                  n: int | None = None) -> None:
        """``num_cached_tokens``: of the prompt's, served from a cache; ``num_offloaded_tokens``: of those,
        loaded back from an offload tier (the rest were in the device pool); ``lora_name``: the request's LoRA
        adapter (None: the base model). ``ttft_s`` (None: no token came) and the router's ``ttft_parts`` give the
        request's phases; ``max_tokens`` and ``n`` (once per request: its first choice's) what it asked for."""
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            decode_s = max(0.0, e2e_s - ttft_s)
            self.request_decode.observe(decode_s)
            if num_output_tokens > 1:
                self.request_tpot.observe(decode_s / (num_output_tokens - 1))
            parts = ttft_parts or {}
            if parts.get("queue", -1.0) >= 0:
                self.request_queue.observe(parts["queue"])
                self.request_inference.observe(max(0.0, e2e_s - parts["queue"]))
            if parts.get("prefill", -1.0) >= 0:
                self.request_prefill.observe(parts["prefill"])
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        if n is not None:
            self.params_n.observe(n)
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_output_tokens)
        self.prompt_tokens_total.inc(num_prompt_tokens)
        offloaded = min(num_offloaded_tokens, num_cached_tokens)
        self.prompt_tokens_cached["device"].inc(num_cached_tokens - offloaded)
        self.prompt_tokens_cached["offload"].inc(offloaded)
        self.generation_tokens_total.inc(num_output_tokens)
        self._success.labels(self.model_name, finish_reason or "unknown").inc()
        if lora_name is not None:
            self._lora_requests.labels(self.model_name, lora_name).inc()
            self._lora_tokens.labels(self.model_name, lora_name).inc(num_output_tokens)
        if num_draft_tokens:
            self.spec_draft.inc(num_draft_tokens)
            self.spec_accepted.inc(num_accepted_tokens)

    # ---- the cluster router -------------------------------------------------------------------------
    def observe_kv_transfer(self, transport: str, num_bytes: int, seconds: float) -> None:
        self._kv_bytes.labels(self.model_name, transport).inc(num_bytes)
        self._kv_seconds.labels(self.model_name, transport).inc(seconds)

    def observe_autoscale(self, action) -> None:
        """``action``: cluster/autoscale.py Action."""
        self._autoscale.labels(self.model_name, action.kind, action.role).inc()

    # ---- scrape -------------------------------------------------------------------------------------
    def refresh(self, stats: dict) -> None:
        """Gauges from ``router.stats()`` (missing keys leave a gauge as it was)."""
        for gauge, key in ((self.running, "num_requests_running"), (self.waiting, "num_requests_waiting"),
                           (self.kv_usage, "kv_cache_usage_perc")):
            value = stats.get(key)
            if isinstance(value, (int, float)):
                gauge.set(value)
        workers = stats.get("workers")
        if isinstance(workers, list):
            for role in ("prefill", "decode"):
                in_rotation = [w for w in workers if w.get("role") == role and w.get("healthy", True)
                               and not w.get("draining", False)]
                self._workers.labels(self.model_name, role).set(len(in_rotation))
            self._refresh_tiers(workers)
        if isinstance(stats.get("block_size"), int) and isinstance(stats.get("num_gpu_blocks"), int):
            labels = (str(stats["block_size"]), str(stats["num_gpu_blocks"]))
            if labels != self._cache_info_labels:  # one series: the pool's size changes as workers come and go
                self._cache_info.clear()
                self._cache_info.labels(*labels).set(1)
                self._cache_info_labels = labels
        weights = stats.get("weights")
        if isinstance(weights, dict):
            version = str(weights.get("weight_version", ""))
            if version != self._weights_label:  # one series: the version served now
                self._weights_info.clear()
                self._weights_info.labels(version).set(1)
                self._weights_label = version
            self._paused.set(1 if weights.get("paused") else 0)
            self._weight_updates.set(weights.get("num_updates", 0))
            self._weight_update_s.set(weights.get("last_update_s", 0.0))
            self._sleep_level.set(weights.get("sleep_level", 0))
        lora = stats.get("lora")
        if isinstance(lora, dict):
            self._lora_info.labels(str(lora.get("max_lora", 0)), ",".join(lora.get("running", ())),
                                   ",".join(lora.get("waiting", ()))).set_to_current_time()

    def _refresh_tiers(self, workers: list) -> None:
        """Per tier, the workers' ``kv_tiers`` summed (a tier no worker reports any more reads 0); the shared tier,
        one folder every worker reports, counted once (the largest report: the freshest look at it)."""
        held, capacity = dict.fromkeys(self._tiers_seen, 0), dict.fromkeys(self._tiers_seen, 0)
        for w in workers:
            tiers = w.get("kv_tiers") if isinstance(w, dict) else None
            for tier, usage in (tiers or {}).items():
                add = max if tier == "shared" else (lambda a, b: a + b)
                held[tier] = add(held.get(tier, 0), usage.get("blocks", 0))
                capacity[tier] = add(capacity.get(tier, 0), usage.get("capacity_blocks", 0))
        for tier in held:
            self._tier_blocks.labels(self.model_name, tier).set(held[tier])
            self._tier_capacity.labels(self.model_name, tier).set(capacity[tier])
        self._tiers_seen |= set(held)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)
