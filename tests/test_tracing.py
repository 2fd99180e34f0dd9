"""OpenTelemetry traces of served requests (vLLM's --otlp-traces-endpoint, --collect-detailed-traces): each choice is
an ``llm_request`` span with vLLM's attributes, a child of the client's W3C trace, sent to a real OTLP collector on
loopback (HTTP/protobuf in process, gRPC through `pdcluster serve`); detailed traces add one child per part of the time
to first token, a disaggregated request's KV transfer and first decode step among them; bad flags are one line."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from concurrent import futures

import httpx
import openai
import pytest

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from pdcluster.cluster.api.app import build_app  # noqa: E402
from pdcluster.cluster.api.tracing import (ChoiceTiming, TracingUnavailable, check_tracing_flags,  # noqa: E402
                                           phases, span_attributes)
from pdcluster.cluster.local_router import LocalRouter  # noqa: E402
from pdcluster.engine.config import EngineConfig  # noqa: E402
from pdcluster.tools.server_process import ServeProcess  # noqa: E402
from test_api import serving  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-random"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Collector:
    """What an OTLP collector received: every span, with its attributes as plain values."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = {a.key: _value(a.value) for a in resource_spans.resource.attributes}.get("service.name")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                           "parent": s.parent_span_id.hex(), "kind": s.kind, "service": service,
                                           "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                           "attributes": {a.key: _value(a.value) for a in s.attributes}})

    def wait_for(self, name: str, count: int, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded
            with self._lock:
                found = [s for s in self.spans if s["name"] == name]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{count} {name!r} spans not received; got {[s['name'] for s in self.spans]}")


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _OtlpHttp(http.server.BaseHTTPRequestHandler):
    collector: Collector

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        type(self).collector.take(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def http_collector():
    collector = Collector()
    handler = type("Handler", (_OtlpHttp,), {"collector": collector})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield collector, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    server.shutdown()
    server.server_close()


class _OtlpGrpc(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def Export(self, request, context):  # noqa: N802 - gRPC's name
        self.collector.take(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_collector():
    import grpc

    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_OtlpGrpc(collector), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


# ---- pieces -------------------------------------------------------------------------------------------------------

def test_phases_follow_one_another_from_the_arrival():
    t = ChoiceTiming("r", MODEL, arrival=10.0, end=12.0, first_token=10.5,
                     ttft_parts={"queue": 0.1, "prefill": 0.3, "kv_transfer": 0.05, "first_decode": 0.02},
                     num_prompt_tokens=7, num_output_tokens=3, finish_reason="stop")
    got = [(name, round(a, 6), round(b, 6)) for name, a, b in phases(t)]
    assert got == [("queue", 10.0, 10.1), ("prefill", 10.1, 10.4), ("kv_transfer", 10.4, 10.45),
                   ("first_decode", 10.45, 10.47), ("decode", 10.5, 12.0)]
    a = span_attributes(t)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.5)
    assert a["gen_ai.latency.time_in_queue"] == 0.1 and a["gen_ai.latency.time_in_model_prefill"] == 0.3
    assert a["pdcluster.latency.kv_transfer"] == 0.05 and a["gen_ai.latency.e2e"] == 2.0
    # A colocated request's parts: no KV transfer to show.
    assert [p[0] for p in phases(ChoiceTiming("r", MODEL, 0.0, 1.0, 0.5, {"queue": 0.0, "prefill": 0.4}, 1, 1,
                                              "stop"))] == ["queue", "prefill", "decode"]


def test_bad_flags_are_one_line(monkeypatch):
    check_tracing_flags("", "")
    with pytest.raises(TracingUnavailable, match="applies with --otlp-traces-endpoint"):
        check_tracing_flags("", "all")
    with pytest.raises(TracingUnavailable, match="'everything' is not one of model, worker, all"):
        check_tracing_flags("http://127.0.0.1:4317", "model,everything")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(TracingUnavailable, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        check_tracing_flags("http://127.0.0.1:4317", "")
    r = subprocess.run([sys.executable, "-m", "pdcluster.cli", "serve", "--model", MODEL, "--mode", "local",
                        "--collect-detailed-traces", "all"], capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "--collect-detailed-traces: applies with" in out and "Traceback" not in out, out


# ---- in process, HTTP/protobuf --------------------------------------------------------------------------------------

def test_a_chat_is_a_span_in_the_clients_trace_with_its_phases(http_collector, monkeypatch):
    collector, endpoint = http_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pd-test")
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=128, max_model_len=512), request_timeout_s=60)
    try:
        app = build_app(router, MODEL, otlp_traces_endpoint=endpoint, collect_detailed_traces="all")
        with serving(app) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0.5, top_p=0.9,
                extra_headers={"traceparent": TRACEPARENT})
            client.completions.create(model=MODEL, prompt="a b c", max_tokens=3, n=2)  # no trace context
            assert app.state.tracer.flush()
        (span,) = [s for s in collector.wait_for("llm_request", 3) if s["trace_id"] == TRACE_ID]
        assert span["parent"] == PARENT_ID and span["kind"] == 2 and span["service"] == "pd-test"  # SERVER
        a = span["attributes"]
        assert a["gen_ai.usage.prompt_tokens"] == answer.usage.prompt_tokens
        assert a["gen_ai.usage.completion_tokens"] == answer.usage.completion_tokens
        assert a["gen_ai.response.model"] == MODEL and a["gen_ai.request.max_tokens"] == 5
        assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert a["gen_ai.latency.time_in_queue"] >= 0 and a["gen_ai.latency.time_in_model_prefill"] > 0
        assert (span["end"] - span["start"]) / 1e9 == pytest.approx(a["gen_ai.latency.e2e"], abs=0.01)
        children = {s["name"]: s for s in collector.spans if s["parent"] == span["span_id"]}
        assert set(children) == {"queue", "prefill", "decode"}
        assert all(c["trace_id"] == TRACE_ID and span["start"] <= c["start"] <= c["end"] <= span["end"] + 10**7
                   for c in children.values())
        assert children["queue"]["end"] == children["prefill"]["start"]
        # The request without a trace context: a trace of its own per choice (n=2), each choice its own span.
        others = [s for s in collector.spans if s["name"] == "llm_request" and s["trace_id"] != TRACE_ID]
        assert len(others) == 2 and all(s["parent"] == "" for s in others)
        assert sorted(s["attributes"]["pdcluster.choice_index"] for s in others) == [0, 1]
    finally:
        router.close()


def test_beam_search_and_embeddings_are_spans_too(http_collector, monkeypatch):
    collector, endpoint = http_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=128, max_model_len=512), request_timeout_s=60)
    try:
        app = build_app(router, MODEL, otlp_traces_endpoint=endpoint)
        with serving(app) as base_url:
            http = httpx.Client(base_url=base_url, timeout=60, headers={"traceparent": TRACEPARENT})
            beams = http.post("/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 3, "n": 2,
                                                       "use_beam_search": True}).json()
            vectors = http.post("/v1/embeddings", json={"model": MODEL, "input": ["x y", "z"]}).json()
            assert app.state.tracer.flush()
        spans = collector.wait_for("llm_request", 4)
        assert all(s["trace_id"] == TRACE_ID and s["parent"] == PARENT_ID for s in spans)
        beam = sorted((s for s in spans if "pdcluster.beam_rank" in s["attributes"]),
                      key=lambda s: s["attributes"]["pdcluster.beam_rank"])
        assert [s["attributes"]["pdcluster.beam_rank"] for s in beam] == [0, 1]
        assert sum(s["attributes"]["gen_ai.usage.completion_tokens"] for s in beam) == \
            beams["usage"]["completion_tokens"]
        embedded = [s for s in spans if s["attributes"]["gen_ai.request.id"].startswith("embd-")]
        assert len(embedded) == 2 and all(s["attributes"]["gen_ai.usage.completion_tokens"] == 0 for s in embedded)
        assert sum(s["attributes"]["gen_ai.usage.prompt_tokens"] for s in embedded) == \
            vectors["usage"]["prompt_tokens"]
    finally:
        router.close()


def test_no_endpoint_no_tracer(tiny_dir):
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=256), request_timeout_s=60)
    try:
        assert build_app(router, MODEL).state.tracer is None
    finally:
        router.close()


# ---- through serve, gRPC, disaggregated -----------------------------------------------------------------------------

@pytest.mark.timeout(420)
def test_serve_disagg_sends_spans_over_grpc_with_the_kv_transfer(grpc_collector):
    collector, endpoint = grpc_collector
    flags = ["--model", MODEL, "--mode", "disagg", "--num-prefill", "1", "--num-decode", "1", "--num-kv-blocks", "64",
             "--max-model-len", "256", "--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all"]
    with ServeProcess(flags, timeout_s=300, extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        # Long enough that the router sends it to the prefill worker (short prompts are prefilled by the decode side).
        prompt = list(range(100, 260))
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_headers={"traceparent": TRACEPARENT})
        (span,) = collector.wait_for("llm_request", 1)
        assert span["trace_id"] == TRACE_ID and span["parent"] == PARENT_ID
        a = span["attributes"]
        assert a["gen_ai.usage.prompt_tokens"] == out.usage.prompt_tokens == len(prompt)
        assert a["pdcluster.latency.kv_transfer"] >= 0 and a["pdcluster.latency.first_decode"] >= 0
        names = set()
        for _ in range(100):  # bounded: the children arrive in the same or the next export
            names = {s["name"] for s in collector.spans if s["parent"] == span["span_id"]}
            if "first_decode" in names:
                break
            time.sleep(0.05)
        assert names == {"queue", "prefill", "kv_transfer", "first_decode", "decode"}
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
