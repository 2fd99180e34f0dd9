"""OpenTelemetry traces of served requests (vLLM's ``--otlp-traces-endpoint`` and ``--collect-detailed-traces``):
each choice of a completion, chat or Responses request (each beam a beam search returns, each input of an embedding,
score or classify request) ends as one ``llm_request`` span (kind SERVER) exported over
OTLP to a collector (Jaeger, Tempo, an OpenTelemetry Collector), a child of the client's trace when the request
carried W3C ``traceparent`` / ``tracestate`` headers. Its attributes are vLLM's (``gen_ai.*``: the request's
sampling, token counts, time to first token, queue, prefill, decode, end to end), and ours beside them: the
disaggregated TTFT's KV transfer and first decode step, the prompt tokens a cache served, speculative drafts.
With ``--collect-detailed-traces`` the span has children, one per part of the time to first token (queue, prefill,
kv_transfer, first_decode) and the decode: where a slow first token went, on a trace's timeline.

The exporter speaks gRPC, or HTTP/protobuf where ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` (vLLM's
choice of the variable); ``OTEL_SERVICE_NAME`` names the service (default ``pdcluster``); the SDK's ``OTEL_BSP_*``
variables tune its batching. Spans are handed to the SDK's batch processor: a request's own path never waits on the
collector. Needs the ``otel`` extra (OpenTelemetry's SDK and OTLP exporters); the flag says so in one line.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
DETAILED_CHOICES = ("model", "worker", "all")  # vLLM's values; any of them gives the child spans here
PROTOCOLS = ("grpc", "http/protobuf")


class TracingUnavailable(ValueError):
    """A tracing flag that cannot be served here (no SDK, a bad value); one line naming the flag."""


def check_detailed(value: str) -> bool:
    """``--collect-detailed-traces`` (vLLM's comma-separated model, worker, all): whether child spans are made."""
    if not value:
        return False
    parts = [p.strip() for p in value.split(",")]
    bad = [p for p in parts if p not in DETAILED_CHOICES]
    if bad:
        raise TracingUnavailable(f"--collect-detailed-traces: {bad[0]!r} is not one of {', '.join(DETAILED_CHOICES)}")
    return True


def check_tracing_flags(endpoint: str, detailed: str) -> None:
    """The flags as a server would take them, said in one line before anything starts: a detail level without an
    endpoint, a bad level or protocol, no SDK."""
    if not endpoint:
        if detailed:
            raise TracingUnavailable("--collect-detailed-traces: applies with --otlp-traces-endpoint (nowhere to "
                                     "send the spans)")
        return
    check_detailed(detailed)
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol not in PROTOCOLS:
        raise TracingUnavailable(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: {protocol!r} is not one of "
                                 f"{', '.join(PROTOCOLS)}")
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if protocol == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    import importlib.util

    for name in ("opentelemetry.sdk.trace", module):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise TracingUnavailable(f"--otlp-traces-endpoint: OpenTelemetry's {name} is not installed; "
                                     "pip install 'pdcluster[otel]'")


@dataclass
class ChoiceTiming:
    """What a finished choice tells its span (monotonic seconds, counts, the router's TTFT parts)."""

    request_id: str
    model: str
    arrival: float
    end: float
    first_token: float | None
    ttft_parts: dict[str, float]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    error: str | None = None
    params: Any = None  # SamplingParams
    n: int = 1
    num_cached_tokens: int = 0
    num_offloaded_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RequestTrace:
    """One HTTP request's tracing: the tracer and the client's trace context (None: a trace of its own)."""

    tracer: "RequestTracer"
    context: Any = None

    def record(self, timing: ChoiceTiming) -> None:
        self.tracer.record(timing, self.context)


def trace_finished(request, timings: list[ChoiceTiming]) -> None:
    """Spans of requests answered whole (beam search, embeddings, scores), where the app traces; never raises."""
    trace = trace_of(request)
    if trace is None:
        return
    for timing in timings:
        try:
            trace.record(timing)
        except Exception:  # noqa: BLE001 - tracing never fails a request
            log.exception("tracing request %s failed", timing.request_id)


def trace_of(request) -> RequestTrace | None:
    """The trace of a FastAPI request, where the app traces (``app.state.tracer``, set by build_app)."""
    tracer = getattr(request.app.state, "tracer", None)
    return None if tracer is None else RequestTrace(tracer, tracer.context_of(request.headers))


class RequestTracer:
    def __init__(self, endpoint: str, detailed: bool = False) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise TracingUnavailable(f"--otlp-traces-endpoint: OpenTelemetry's SDK is not installed ({e.name}); "
                                     "pip install 'pdcluster[otel]'") from None
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        if protocol not in PROTOCOLS:
            raise TracingUnavailable(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: {protocol!r} is not one of "
                                     f"{', '.join(PROTOCOLS)}")
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.endpoint, self.detailed = endpoint, detailed
        # Its own provider, not the process-wide one: another library's tracing (or a second app in one process)
        # is left as it is.
        self._provider = TracerProvider(resource=Resource.create({
            "service.name": os.environ.get("OTEL_SERVICE_NAME", "pdcluster"), "pdcluster.process_id": os.getpid()}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pdcluster.cluster.api")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds, self._status, self._in_context = SpanKind, (Status, StatusCode), set_span_in_context
        atexit.register(self.shutdown)

    def context_of(self, headers: Mapping[str, str]):
        """The client's trace context (W3C headers), or None: the span starts a trace of its own."""
        carrier = {h: headers[h] for h in TRACE_HEADERS if h in headers}
        return self._propagator.extract(carrier) if carrier else None

    def record(self, timing: ChoiceTiming, context=None) -> None:
        """The finished choice's span (and, detailed, its children), handed to the batch processor."""
        to_ns = _epoch_ns_of_monotonic()
        start_ns, end_ns = to_ns(timing.arrival), to_ns(timing.end)
        span = self._tracer.start_span("llm_request", context=context, kind=self._kinds.SERVER,
                                       attributes=span_attributes(timing), start_time=start_ns)
        if timing.finish_reason == "error":
            status, code = self._status
            span.set_status(status(code.ERROR, (timing.error or "generation failed")[:500]))
        if self.detailed:
            parent = self._in_context(span)
            for name, begin, end in phases(timing):
                child = self._tracer.start_span(name, context=parent, start_time=to_ns(begin))
                child.end(end_time=to_ns(end))
        span.end(end_time=end_ns)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()


def _epoch_ns_of_monotonic():
    """Monotonic seconds -> epoch nanoseconds, by one reading of both clocks (spans are placed on wall time)."""
    wall_ns, mono = time.time_ns(), time.monotonic()
    return lambda t: wall_ns - int((mono - t) * 1e9)


def span_attributes(t: ChoiceTiming) -> dict[str, Any]:
    """vLLM's attribute names where it has one, ``pdcluster.*`` for what only a disaggregated cluster knows."""
    parts = t.ttft_parts
    attributes: dict[str, Any] = {
        "gen_ai.request.id": t.request_id,
        "gen_ai.response.model": t.model,
        "gen_ai.usage.prompt_tokens": t.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": t.num_output_tokens,
        "gen_ai.latency.e2e": t.end - t.arrival,
        "gen_ai.request.n": t.n,
        "pdcluster.finish_reason": t.finish_reason or "unknown",
        "pdcluster.usage.cached_tokens": t.num_cached_tokens,
        "pdcluster.usage.offloaded_tokens": t.num_offloaded_tokens,
    }
    p = t.params
    if p is not None:
        if p.temperature is not None:
            attributes["gen_ai.request.temperature"] = float(p.temperature)
        if p.top_p is not None:
            attributes["gen_ai.request.top_p"] = float(p.top_p)
        if p.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = int(p.max_tokens)
        if p.lora_name is not None:
            attributes["pdcluster.lora_name"] = p.lora_name
    if t.first_token is not None:
        attributes["gen_ai.latency.time_to_first_token"] = t.first_token - t.arrival
        attributes["gen_ai.latency.time_in_model_decode"] = t.end - t.first_token
    if "queue" in parts:
        attributes["gen_ai.latency.time_in_queue"] = parts["queue"]
        attributes["gen_ai.latency.time_in_model_inference"] = max(0.0, t.end - t.arrival - parts["queue"])
    if "prefill" in parts:
        attributes["gen_ai.latency.time_in_model_prefill"] = parts["prefill"]
    for key in ("kv_transfer", "first_decode"):
        if key in parts:
            attributes[f"pdcluster.latency.{key}"] = parts[key]
    if t.num_draft_tokens:
        attributes["pdcluster.spec.draft_tokens"] = t.num_draft_tokens
        attributes["pdcluster.spec.accepted_tokens"] = t.num_accepted_tokens
    attributes.update(t.extra)
    return attributes


def phases(t: ChoiceTiming) -> list[tuple[str, float, float]]:
    """The detailed children (name, start, end; monotonic seconds): the TTFT's parts one after another from the
    arrival, as the router measured them (queue, prefill until the prefill worker's first token; a disaggregated
    request's KV transfer and first decode step after it), and the decode from the first token the API process
    received to the end."""
    out = []
    at = t.arrival
    for name in ("queue", "prefill", "kv_transfer", "first_decode"):
        seconds = t.ttft_parts.get(name)
        if seconds is None:
            continue
        out.append((name, at, at + max(0.0, seconds)))
        at += max(0.0, seconds)
    if t.first_token is not None:
        out.append(("decode", t.first_token, t.end))
    return out
