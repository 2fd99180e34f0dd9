"""What OpenTelemetry tracing (serve --otlp-traces-endpoint, --collect-detailed-traces) costs a served stream: `pdcluster
serve --mode local` on tiny-random (a fast engine, so the API process's own work shows), `pdcluster loadtest` at a
fixed concurrency, each run once without tracing (A) and once with spans (and their children) sent to a collector on
loopback over HTTP/protobuf that counts them (B), turns A B A B. Prints JSON: output tokens/s, mean TTFT and TPOT per
run, the ratios B/A, and the spans the collector got (one ``llm_request`` per request and its children: queue,
prefill and decode in local mode, kv_transfer and first_decode too disaggregated).

    python bench/tracing_cost.py [--rounds 2] [--num-prompts 256] [--max-concurrency 64] [--out F]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that counts the spans it receives."""

    spans = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's name
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        with _Sink.lock:
            _Sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def run_once(traced: bool, endpoint: str, args) -> dict:
    from pdcluster.tools.server_process import ServeProcess

    flags = ["--model", "tiny-random", "--mode", "local", "--num-kv-blocks", "4096", "--max-model-len", "1024"]
    env = {}
    if traced:
        flags += ["--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all"]
        env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    with ServeProcess(flags, timeout_s=300, extra_env=env) as server, \
            tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run([sys.executable, "-m", "pdcluster.cli", "loadtest", "--base-url", server.base_url, "--model",
                        "tiny-random", "--num-prompts", str(args.num_prompts), "--random-input-len", "128",
                        "--random-output-len", "128", "--ignore-eos", "--max-concurrency", str(args.max_concurrency),
                        "--request-rate", "inf", "--no-progress", "--result-json", result.name], check=True,
                       stdout=subprocess.DEVNULL, timeout=900)
        report = json.load(open(result.name))
    return {"output_throughput": report["output_throughput"], "mean_ttft_ms": report["mean_ttft_ms"],
            "mean_tpot_ms": report["mean_tpot_ms"], "completed": report["completed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    runs: dict[str, list[dict]] = {"off": [], "traced": []}
    for _ in range(args.rounds):
        for name in ("off", "traced"):
            runs[name].append(run_once(name == "traced", endpoint, args))
    sink.shutdown()
    median = {name: {k: statistics.median(r[k] for r in rs) for k in ("output_throughput", "mean_ttft_ms",
                                                                         "mean_tpot_ms")}
              for name, rs in runs.items()}
    emit_json({"model": "tiny-random", "mode": "local", "num_prompts": args.num_prompts,
               "max_concurrency": args.max_concurrency, "input_len": 128, "output_len": 128, "runs": runs,
               "median": median, "spans_received": _Sink.spans,
               "traced_over_off": {k: median["traced"][k] / median["off"][k] for k in median["off"]}}, args.out)


if __name__ == "__main__":
    main()
