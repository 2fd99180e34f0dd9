"""`pdcluster loadtest`: drive an OpenAI-compatible server with a dataset on an arrival schedule and
report latency, throughput and goodput at SLOs, in `vllm bench serve`'s JSON field names.

    pdcluster loadtest --base-url http://127.0.0.1:8000 --model smollm2 --dataset random \\
        --num-prompts 100 --request-rate 2 --slo-ttft-ms 500 --slo-tpot-ms 100 \\
        --result-json out.json --plot out.png
    pdcluster loadtest ... --sweep 1,2,4 --result-json sweep.json --plot sweep.png
    pdcluster loadtest --compare colocated.json disagg.json --plot compare.png
    pdcluster loadtest ... --chaos 'kill-decode@20s,stop-prefill@40s+5s' --result-json chaos.json --plot chaos.png

cli/main.py registers it with ``add_loadtest_parser(sub)``; the parser's ``func`` is ``loadtest_main``.
Mistakes in the arguments raise ``LoadtestError`` (a ValueError), which the top-level CLI prints as one
line and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.util
import math
import os
import sys

import httpx
import numpy as np

from pdcluster.tools.loadtest import multiturn, report
from pdcluster.tools.loadtest.arrivals import ARRIVALS, ArrivalProcess, within_duration
from pdcluster.tools.loadtest.chaos import ChaosEvent, parse_chaos
from pdcluster.tools.loadtest.chaos_report import print_chaos
from pdcluster.tools.loadtest.chaos_run import ChaosSetup, chaos_preflight, run_under_chaos
from pdcluster.tools.loadtest.chaos_targets import require_loopback
from pdcluster.tools.loadtest.client import ENDPOINTS, Target
from pdcluster.tools.loadtest.datasets import DatasetOptions, check_dataset_name
from pdcluster.tools.loadtest.lengths import LengthDist
from pdcluster.tools.loadtest.metrics import SLO, summarize
from pdcluster.tools.loadtest.multiturn import load_workload
from pdcluster.tools.loadtest.runner import http_client, run_workload
from pdcluster.tools.loadtest.server_metrics import scrape, server_delta
from pdcluster.tools.loadtest.tokenizer_source import load_tokenizer

PREFLIGHT_TIMEOUT_S = 10.0
WARMUP_SEED_OFFSET = 1_000_003
SWEEP_SEED_STRIDE = 7919


class LoadtestError(ValueError):
    pass


def add_loadtest_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "loadtest", help="load-test an OpenAI-compatible server (goodput at SLOs, latency CDFs)",
        description="Send a dataset's requests to an OpenAI-compatible server on an arrival schedule; "
                    "report TTFT/TPOT/ITL/E2E, throughput and goodput (vLLM's result field names).")
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    t.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions",
                   help="completions: /v1/completions; chat: /v1/chat/completions; embeddings: /v1/embeddings "
                        "(one JSON answer: TTFT = E2E, no output tokens)")
    t.add_argument("--model", help="the served model name (required unless --compare)")
    t.add_argument("--tokenizer", default=None,
                   help="tokenizer for exact prompt lengths: a pdcluster built-in model or a directory with "
                        "tokenizer.json (default: --model, when it is one of those)")
    t.add_argument("--api-key", default=None, help="Bearer key (default: $PDCLUSTER_API_KEY or $OPENAI_API_KEY)")
    t.add_argument("--timeout-s", type=float, default=300.0, help="per-request limit, send to last token")
    t.add_argument("--no-server-metrics", action="store_true",
                   help="do not read the server's /metrics (TTFT breakdown, request count cross-check)")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", default="random", help="random, sharegpt, sharegpt-multiturn (conversations replayed "
                   "turn by turn; --num-prompts counts conversations), humaneval, or a JSONL file of "
                   '{"prompt": ..., "max_tokens": ...} lines')
    d.add_argument("--think-time-s", type=float, default=0.0,
                   help="sharegpt-multiturn: mean pause (exponential) between an answer and the next turn")
    d.add_argument("--num-prompts", type=int, default=100, help="requests to send (per rate of a sweep)")
    d.add_argument("--random-input-len", default="128", help="random: prompt tokens: N, LOW:HIGH or normal:MEAN:STD")
    d.add_argument("--random-output-len", default="32", help="random: output tokens, same forms")
    d.add_argument("--output-len", type=int, default=None,
                   help="max_tokens for every sharegpt/humaneval/JSONL request (default: per dataset)")
    d.add_argument("--random-images", type=int, default=0, metavar="N",
                   help="random, --endpoint chat: each request also carries N images (seeded JPEG data URLs, all "
                        "different), as vLLM's random-mm dataset; input tokens are the server's usage counts, "
                        "placeholders included")
    d.add_argument("--random-image-size", default="336x336", metavar="WxH", help="the images' width x height")
    d.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="random: send token ids or text (auto: ids on completions, text on chat)")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (vLLM's extension), so every server does the same work")
    d.add_argument("--seed", type=int, default=0, help="seeds the dataset sample and the arrival times")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    a.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    a.add_argument("--burst-size", type=int, default=8, help="requests per burst (--arrival burst)")
    a.add_argument("--sweep", default=None,
                   help="comma-separated request rates, run one after another; rate i draws its prompts with "
                        "seed --seed + 7919*i, so a prefix cache does not carry one rate's prompts into the next")
    a.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    a.add_argument("--duration-s", type=float, default=None, help="send no request later than this")
    a.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent one by one before measuring, left out of every number (a fresh server's "
                        "first requests are slow)")
    s = p.add_argument_group("SLOs and output")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT target for goodput")
    s.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT target for goodput")
    s.add_argument("--result-json", default=None, help="write the result (a sweep: {\"sweep\": [...]}) here")
    s.add_argument("--plot", default=None, help="write a PNG: latency CDFs (and sweep curves)")
    s.add_argument("--label", default=None, help="name of this run in tables, plots and --compare")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="compare two result files (table on stderr; bars with --plot) instead of running")
    c = p.add_argument_group("chaos (a pdcluster server on this host)")
    c.add_argument("--chaos", default=None, metavar="EVENTS",
                   help="hit workers during the run: comma-separated <kill|stop>-<prefill|decode>[N]@<s>s[+<s>s], "
                        "e.g. 'kill-decode@30s,stop-prefill1@60s+5s' (kill: SIGKILL, Ray restarts the worker; "
                        "stop: SIGSTOP, then SIGCONT after the +duration); times from the first measured request")
    c.add_argument("--chaos-recovery-timeout-s", type=float, default=60.0,
                   help="after the load, wait this long at most for hit workers to be back on /health")
    p.set_defaults(func=loadtest_main)
    return p


@dataclasses.dataclass
class Plan:
    target: Target
    rates: list[float]
    arrival: str
    burst_size: int
    dataset: str
    dataset_options: DatasetOptions
    max_concurrency: int | None
    duration_s: float | None
    slo: SLO
    chaos: list[ChaosEvent] | None = None


def loadtest_main(args: argparse.Namespace) -> int:
    try:
        if args.compare:
            return _compare(args)
        return asyncio.run(_run(args, _plan(args)))
    except KeyboardInterrupt:
        print("pdcluster loadtest: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------------------- arguments


def _base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise LoadtestError(f"--base-url: must start with http:// or https://, got {url!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url  # both spellings are common


def _image_size(args: argparse.Namespace) -> tuple[int, int]:
    if args.random_images < 0:
        raise LoadtestError(f"--random-images: must be >= 0, got {args.random_images}")
    if args.random_images and (args.dataset != "random" or args.endpoint != "chat"):
        raise LoadtestError("--random-images: for --dataset random on --endpoint chat")
    width, sep, height = args.random_image_size.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit() and 0 < int(width) <= 4096 and 0 < int(height) <= 4096):
        raise LoadtestError(f"--random-image-size: want WIDTHxHEIGHT (1..4096 each), got {args.random_image_size!r}")
    return int(width), int(height)


def _rates(args: argparse.Namespace) -> list[float]:
    if args.sweep is None:
        rates = [args.request_rate]
    else:
        try:
            rates = [float(x) for x in args.sweep.split(",") if x.strip()]
        except ValueError:
            raise LoadtestError(f"--sweep: want comma-separated request rates like 1,2,4, got {args.sweep!r}") from None
        if not rates or any(math.isinf(r) for r in rates):
            raise LoadtestError(f"--sweep: want finite request rates like 1,2,4, got {args.sweep!r}")
    for r in rates:
        if math.isnan(r) or r <= 0:
            flag = "--sweep" if args.sweep else "--request-rate"
            raise LoadtestError(f"{flag}: request rates must be > 0 requests/s (or inf), got {r:g}")
    return rates


def _positive(flag: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or not value > 0:
        raise LoadtestError(f"{flag}: must be > 0, got {value}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken install
        return False


def _require_tooling(args: argparse.Namespace) -> None:
    """--plot and --chaos use the ``loadtest`` extra: say so before any work, not after the run."""
    for flag, wanted, module in (("--plot", args.plot, "matplotlib"), ("--chaos", args.chaos, "psutil")):
        if wanted and not _importable(module):
            raise LoadtestError(f"{flag}: needs {module}, which this install lacks: pip install 'pdcluster[loadtest]'")


def _chaos(args: argparse.Namespace) -> list[ChaosEvent] | None:
    if args.chaos is None:
        return None
    if args.sweep:
        raise LoadtestError("--chaos: runs with one request rate; drop --sweep")
    try:
        return parse_chaos(args.chaos)
    except ValueError as e:
        raise LoadtestError(f"--chaos: {e}") from None


def _plan(args: argparse.Namespace) -> Plan:
    _require_tooling(args)
    if not args.model:
        raise LoadtestError("--model: required (the served model name), unless you --compare two results")
    check_dataset_name(args.dataset)
    for flag, value in (("--num-prompts", args.num_prompts), ("--timeout-s", args.timeout_s),
                        ("--max-concurrency", args.max_concurrency), ("--duration-s", args.duration_s),
                        ("--output-len", args.output_len), ("--burst-size", args.burst_size)):
        _positive(flag, value)
    if args.num_warmups < 0:
        raise LoadtestError(f"--num-warmups: must be >= 0, got {args.num_warmups}")
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms),
                        ("--chaos-recovery-timeout-s", args.chaos_recovery_timeout_s)):
        _positive(flag, value)
    if args.think_time_s < 0:
        raise LoadtestError(f"--think-time-s: must be >= 0, got {args.think_time_s}")
    chaos = _chaos(args)
    if chaos and args.dataset == multiturn.NAME:
        raise LoadtestError(f"--chaos: not with --dataset {multiturn.NAME} (conversations are not replayed under chaos)")
    rates = _rates(args)
    prompt_format = args.prompt_format
    if prompt_format == "auto":
        prompt_format = "text" if args.endpoint == "chat" else "ids"
    if args.endpoint == "chat" and prompt_format == "ids":
        raise LoadtestError("--prompt-format ids: the chat endpoint takes text; use --prompt-format text")
    options = DatasetOptions(
        num_prompts=args.num_prompts, seed=args.seed,
        input_len=LengthDist.parse(args.random_input_len, "--random-input-len"),
        output_len=LengthDist.parse(args.random_output_len, "--random-output-len"),
        fixed_output_len=args.output_len, prompt_format=prompt_format, chat=args.endpoint == "chat",
        images_per_request=args.random_images, image_size=_image_size(args))
    api_key = args.api_key or os.environ.get("PDCLUSTER_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    target = Target(base_url=_base_url(args.base_url), model=args.model, endpoint=args.endpoint, api_key=api_key,
                    temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.timeout_s)
    ArrivalProcess(args.arrival, rates[0], args.burst_size)  # validates before any work
    if chaos:
        require_loopback(target.base_url)  # it signals processes here: the server must be here too
    return Plan(target, rates, args.arrival, args.burst_size, args.dataset, options, args.max_concurrency,
                args.duration_s, SLO(args.slo_ttft_ms, args.slo_tpot_ms), chaos)


# ---------------------------------------------------------------------------------------- running


async def preflight(target: Target) -> int | None:
    """Fail with one line when the server is unreachable or does not serve the model; return its
    max_model_len when /v1/models reports one."""
    url = target.base_url + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=PREFLIGHT_TIMEOUT_S, trust_env=False) as http:
            response = await http.get(url, headers=target.headers)
    except httpx.HTTPError as e:
        raise LoadtestError(f"--base-url: cannot reach {url} ({type(e).__name__}: {e or 'no answer'}): "
                            "is the server running there?") from None
    if response.status_code == 401:
        raise LoadtestError(f"{url} answered 401: pass the server's key with --api-key")
    if response.status_code != 200:
        raise LoadtestError(f"{url} answered {response.status_code}: is this an OpenAI-compatible server?")
    try:
        models = response.json().get("data") or []
    except (ValueError, AttributeError):
        raise LoadtestError(f"{url} did not answer with JSON: is this an OpenAI-compatible server?") from None
    served = {m.get("id"): m for m in models if isinstance(m, dict)}
    if target.model not in served:
        raise LoadtestError(f"--model: the server does not serve {target.model!r}; it serves "
                            f"{', '.join(repr(k) for k in served) or 'nothing'}")
    max_model_len = served[target.model].get("max_model_len")
    return max_model_len if isinstance(max_model_len, int) else None


async def _run(args: argparse.Namespace, plan: Plan) -> int:
    target = plan.target
    tokenizer = load_tokenizer(args.tokenizer, args.model)
    plan.dataset_options.max_model_len = await preflight(target)
    chaos = None
    if plan.chaos:  # before any load: every event must have a worker to hit here
        chaos = await chaos_preflight(target, plan.chaos, ",".join(e.spec for e in plan.chaos),
                                      args.chaos_recovery_timeout_s)
    seed = plan.dataset_options.seed
    # The server's prefix cache keeps what it has seen: a warm-up or an earlier rate of a sweep that
    # sent the same prompts would make the next run look faster. So each gets prompts (and arrival
    # times) of its own seed; the first rate keeps --seed, so it equals a single run at that rate.
    if args.num_warmups:
        options = dataclasses.replace(plan.dataset_options, num_prompts=args.num_warmups,
                                      seed=seed + WARMUP_SEED_OFFSET)
        await warm_up(target, multiturn.as_requests(load_workload(plan.dataset, options, tokenizer)), tokenizer)
    results = []
    for index, rate in enumerate(plan.rates):
        options = dataclasses.replace(plan.dataset_options, seed=seed + index * SWEEP_SEED_STRIDE)
        requests = load_workload(plan.dataset, options, tokenizer)
        results.append(await run_one_rate(args, plan, rate, requests, options.seed, tokenizer, chaos))
        report.print_summary(results[-1])
        if chaos is not None:
            print_chaos(results[-1]["chaos"])
    if len(results) > 1:
        report.print_sweep(results)
    if args.result_json:
        _write(lambda: report.write_json(args.result_json, {"sweep": results} if args.sweep else results[0]),
               "--result-json", args.result_json)
    if args.plot:
        from pdcluster.tools.loadtest import plot  # matplotlib takes a second to import: only when asked

        if chaos is not None:
            from pdcluster.tools.loadtest.chaos_plot import plot_chaos

            _write(lambda: plot_chaos(results[0], args.plot), "--plot", args.plot)
        else:
            _write(lambda: plot.plot_sweep(results, args.plot) if args.sweep else plot.plot_run(results[0], args.plot),
                   "--plot", args.plot)
    return 0 if any(r["completed"] for r in results) else 1


async def warm_up(target: Target, requests, tokenizer) -> None:
    """Send ``requests`` one at a time, unmeasured, before the first /metrics scrape."""
    if not requests:
        return
    outcome = await run_workload(target, requests, np.zeros(len(requests)), max_concurrency=1,
                                 tokenizer=tokenizer, progress=False)
    failed = [r for r in outcome.records if not r.ok]
    if failed:
        print(f"pdcluster loadtest: warning: {len(failed)} of {len(requests)} warm-up requests failed "
              f"({failed[0].error_kind}: {failed[0].error})", file=sys.stderr)


async def run_one_rate(args, plan: Plan, rate: float, requests, seed: int, tokenizer,
                       chaos: ChaosSetup | None = None) -> dict:
    process = ArrivalProcess(plan.arrival, rate, plan.burst_size)
    send_times_s = process.send_times_s(len(requests), seed)
    n = within_duration(send_times_s, plan.duration_s)
    target = plan.target
    async with http_client(target, 2) as http:
        before = None if args.no_server_metrics else await scrape(http, target.base_url, target.headers)
        section = None
        if plan.dataset == multiturn.NAME:
            outcome = await multiturn.run_conversations(
                target, requests[:n], send_times_s[:n], args.think_time_s, plan.max_concurrency, seed,
                progress=not args.no_progress, description=f"{rate:g} conversations/s")
        elif chaos is None:
            outcome = await run_workload(target, requests[:n], send_times_s[:n], plan.max_concurrency, tokenizer,
                                         progress=not args.no_progress, description=f"{rate:g} req/s")
        else:
            outcome, section = await run_under_chaos(chaos, target, requests[:n], send_times_s[:n], plan.slo,
                                                     plan.max_concurrency, tokenizer, not args.no_progress,
                                                     f"{rate:g} req/s, chaos")
        after = None if before is None else await scrape(http, target.base_url, target.headers)
    result = summarize(outcome.records, outcome.duration_s, plan.slo)
    server, breakdown = server_delta(before, after)
    meta = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if target.endpoint == "chat" else "openai",
        "label": args.label,
        "base_url": target.base_url,
        "endpoint": target.url[len(target.base_url):],
        "model_id": target.model,
        "tokenizer_id": str(tokenizer.model_dir) if tokenizer is not None else None,
        "dataset": plan.dataset,
        "num_prompts": n,
        "request_rate": rate if math.isfinite(rate) else "inf",  # JSON has no infinity (vLLM writes "inf")
        "arrival": plan.arrival,
        "burst_size": plan.burst_size if plan.arrival == "burst" else None,
        "max_concurrency": plan.max_concurrency,
        "seed": seed,
        "duration_limit_s": plan.duration_s,
        "temperature": target.temperature,
        "ignore_eos": target.ignore_eos,
    }
    extra = {} if section is None else {"chaos": section}
    return {**meta, **result, "server_metrics": server, "ttft_breakdown": breakdown, **extra}


def _write(action, flag: str, path: str) -> None:
    try:
        action()
    except OSError as e:
        raise LoadtestError(f"{flag}: cannot write {path}: {e.strerror or e}") from None
    print(f"pdcluster loadtest: wrote {path}", file=sys.stderr)


def _compare(args: argparse.Namespace) -> int:
    _require_tooling(args)
    path_a, path_b = args.compare
    a, b = report.read_result(path_a), report.read_result(path_b)
    names = (report.result_name(a, path_a), report.result_name(b, path_b))
    if names[0] == names[1]:
        names = (f"A: {names[0]}", f"B: {names[1]}")
    report.print_compare(a, b, names)
    if args.plot:
        from pdcluster.tools.loadtest import plot

        _write(lambda: plot.plot_compare(a, b, names, args.plot), "--plot", args.plot)
    return 0
