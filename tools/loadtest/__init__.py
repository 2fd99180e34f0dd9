"""`pdcluster loadtest`: a load generator for any OpenAI-compatible server (pdcluster, vLLM, SGLang).

One concern a file:

| file | what |
|---|---|
| `lengths.py` | length distributions (fixed, uniform range, normal) parsed from flags |
| `tokenizer_source.py` | which tokenizer counts the prompt tokens (a built-in model or a directory) |
| `random_prompts.py` | token-exact random prompts |
| `datasets.py` | `SampleRequest` and the loaders: random, sharegpt, humaneval, a JSONL file |
| `arrivals.py` | when each request is sent: Poisson, constant, bursts |
| `client.py` | one streaming request, timed per SSE chunk, errors by kind |
| `runner.py` | sends a workload on its schedule under a concurrency cap, with a progress bar |
| `metrics.py` | TTFT/TPOT/ITL/E2E statistics, throughput, goodput at SLOs (vLLM's field names) |
| `server_metrics.py` | the server's /metrics before and after a run: request counts, TTFT breakdown |
| `report.py` | tables on stderr, result JSON, `--compare` |
| `plot.py` | latency CDFs, sweep curves, comparison bars (matplotlib, Agg) |
| `chaos.py` | the `--chaos` schedule: `kill-decode@30s,stop-prefill1@40s+5s` parsed into events |
| `chaos_targets.py` | a server's worker processes on this host (under the server's pid), signalled safely |
| `chaos_controller.py` | fires the events beside the load, resumes stopped workers, watches /health until each is back |
| `chaos_report.py` | the result's `chaos` section: in-flight requests, recovery times, a per-second timeline |
| `chaos_run.py` | `--chaos` around one run: preflight (every event has a worker), the controller, the section |
| `chaos_plot.py` | throughput, TTFT and healthy workers over time with the events marked |
| `cli.py` | the `loadtest` subcommand |
"""
