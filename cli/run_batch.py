"""`pdcluster run-batch`: OpenAI's Batch file format run offline through one in-process engine, as `vllm run-batch`.

Each input line: ``{"custom_id": "...", "method": "POST", "url": URL, "body": {...}}`` with URL one of
``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``, ``/score`` (``/v1/score``),
``/rerank`` (``/v1/rerank``, ``/v2/rerank``), ``/classify`` (``/v1/classify``). Each output line, in the input's order:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``: the answer the HTTP API gives
that body (the same app, called in process: the same validation, defaults and errors), ``error`` null for a 200 and
the answer's ``error`` object otherwise. A line that cannot be read (not JSON, no ``custom_id``, a ``custom_id``
seen before, another method or URL, ``stream`` true) gets an output line of its own with status 400 and says why;
the others still run. Every request is submitted at once (up to ``--max-concurrency`` in flight), so the engine
batches them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path

from pdcluster.cluster.api.served_names import add_served_model_name_arg, check_served_names
from pdcluster.cluster.engine_args import add_engine_args, engine_config_from_args
from pdcluster.engine.config import ConfigError

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/score", "/v1/score",
        "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/classify")


def add_run_batch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run-batch", help="run an OpenAI Batch file (JSONL) offline through one engine",
                       description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("-i", "--input-file", required=True, help="the Batch input (JSONL), or - for stdin")
    p.add_argument("-o", "--output-file", required=True, help="where the answers go (JSONL), or - for stdout")
    add_served_model_name_arg(p, "the names bodies may give as model, as serve's; answers give the first "
                                 "(default: --model)")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at once")
    p.add_argument("--request-timeout-s", type=float, default=3600.0,
                   help="abort a request that makes no progress for this long (queued ones wait their turn)")
    p.add_argument("--pooler-config", default=None, metavar="JSON", help="as serve's: how embeddings pool")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_batch_main)
    return p


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        return Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--input-file: cannot read {path}: {e.strerror or e}") from e


def _refusal(custom_id: str | None, line_no: int, message: str) -> dict:
    return _output(custom_id, 400, {"error": {"message": f"line {line_no}: {message}", "type": "invalid_request_error",
                                              "param": None, "code": None}})


def _output(custom_id: str | None, status: int, body) -> dict:
    error = body.get("error") if status != 200 and isinstance(body, dict) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}", "body": body},
            "error": error}


def parse_line(text: str, line_no: int, seen: set[str]) -> tuple[dict | None, dict | None]:
    """(the request, None), or (None, its refusal's output line)."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        return None, _refusal(None, line_no, f"not JSON: {e}")
    if not isinstance(item, dict):
        return None, _refusal(None, line_no, "expected a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _refusal(None, line_no, "custom_id must be a non-empty string")
    if custom_id in seen:
        return None, _refusal(custom_id, line_no, f"custom_id {custom_id!r} was used on an earlier line: each must "
                                                  "be unique")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        return None, _refusal(custom_id, line_no, f"method must be POST, got {item.get('method')!r}")
    if item.get("url") not in URLS:
        return None, _refusal(custom_id, line_no, f"url must be one of {', '.join(URLS)}, got {item.get('url')!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        return None, _refusal(custom_id, line_no, "body must be a JSON object")
    if body.get("stream"):
        return None, _refusal(custom_id, line_no, "stream must be false (a batch answer is one JSON object)")
    return item, None


async def _run(app, requests: list[tuple[int, dict]], outputs: list, max_concurrency: int, progress) -> None:
    import httpx

    limit = asyncio.Semaphore(max_concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        async def one(index: int, item: dict) -> None:
            async with limit:
                r = await client.post(item["url"], json=item["body"])
            try:
                body = r.json()
            except ValueError:
                body = {"error": {"message": r.text[:2000], "type": "server_error", "param": None, "code": None}}
            outputs[index] = _output(item["custom_id"], r.status_code, body)
            progress.update()

        await asyncio.gather(*(one(index, item) for index, item in requests))


def run_batch_main(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency: must be at least 1, got {args.max_concurrency}")
    if not args.request_timeout_s > 0:
        raise ConfigError(f"--request-timeout-s: must be > 0, got {args.request_timeout_s}")
    if args.pooler_config is not None:  # fastapi and the API modules: only when the flag is given
        from pdcluster.cluster.api.embeddings import check_pooler_flag

        check_pooler_flag(args.pooler_config)
    lines = _read_lines(args.input_file)
    config = engine_config_from_args(args)
    served_model_name = args.model if args.served_model_name is None else args.served_model_name
    check_served_names((served_model_name, *args.served_model_aliases), config.lora_paths())  # before the model loads
    outputs: list = [None] * len(lines)
    requests, seen = [], set()
    for i, text in enumerate(lines):
        if not text.strip():
            continue
        item, refusal = parse_line(text, i + 1, seen)
        if refusal is not None:
            outputs[i] = refusal
        else:
            requests.append((i, item))
    from tqdm import tqdm

    from pdcluster.cluster.api.app import build_app  # torch and the engine: when running, not at --help
    from pdcluster.cluster.local_router import LocalRouter

    router = LocalRouter(config, request_timeout_s=args.request_timeout_s)
    try:
        app = build_app(router, served_model_name, served_model_aliases=args.served_model_aliases,
                        pooler=args.pooler_config)
        with tqdm(total=len(requests), desc="run-batch", unit="req", disable=args.no_progress, file=sys.stderr) as bar:
            asyncio.run(_run(app, requests, outputs, args.max_concurrency, bar))
    finally:
        router.close()
    text = "".join(json.dumps(o) + "\n" for o in outputs if o is not None)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        Path(args.output_file).write_text(text)
    answered = [o for o in outputs if o is not None]
    failed = sum(1 for o in answered if o["response"]["status_code"] != 200)
    print(f"pdcluster run-batch: {len(answered)} requests, {failed} failed (their lines say why)", file=sys.stderr)
    return 0
