"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Timing follows ``vllm bench serve`` so numbers compare across harnesses: TTFT is the arrival of the
first SSE chunk that carries output, each later such chunk adds one inter-token latency (under
speculative decoding one chunk may carry several tokens: ITL is then a per-step latency), E2E ends at
the last such chunk, and the output token count comes from the server's ``usage`` (asked for with
``stream_options.include_usage``), else from our tokenizer, else from the chunk count.

Failures are recorded by kind, never raised: ``http_<status>``, ``timeout`` (the whole request, not one
read, exceeded ``timeout_s``), ``connection``, ``stream_error`` (an error event inside the stream),
``incomplete`` (the stream ended before a finish) and ``no_output``.

``embeddings`` (/v1/embeddings) is one JSON answer, not a stream: its TTFT and E2E are both the time to the whole
answer, and it has no output tokens (``no_output``: an answer without a vector).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from pdcluster.tools.loadtest.datasets import SampleRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}
ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    endpoint: str = "completions"  # a key of ENDPOINTS
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM's extension: exact output lengths, the same work on every server
    timeout_s: float = 300.0  # per request, end to end

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, sample: SampleRequest) -> dict:
        if self.endpoint == "embeddings":  # text or token ids: /v1/embeddings takes either as input
            return {"model": self.model, "input": sample.prompt}
        body = {"model": self.model, "max_tokens": sample.output_len, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            if not isinstance(sample.prompt, str):
                raise ValueError("the chat endpoint takes text prompts: use --prompt-format text")
            content = sample.prompt
            if sample.images:
                content = [*({"type": "image_url", "image_url": {"url": url}} for url in sample.images),
                           {"type": "text", "text": sample.prompt}]
            body["messages"] = [{"role": "user", "content": content}]
        else:
            body["prompt"] = sample.prompt
        return body


@dataclass
class RequestRecord:
    prompt_len: int  # tokens, by our tokenizer (0 = unknown)
    max_tokens: int
    send_time_s: float = 0.0  # perf_counter at send
    end_time_s: float = 0.0  # perf_counter when it ended, answered or failed (a timeline's x)
    ok: bool = False
    ttft_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # output chunk arrivals, from send
    e2e_s: float = 0.0
    output_len: int = 0  # tokens generated
    server_prompt_len: int | None = None  # usage.prompt_tokens, when the server sends usage
    finish_reason: str | None = None
    error_kind: str = ""
    error: str = ""
    generated_text: str = ""

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for a one-token answer (no such time)."""
        if not self.ok or self.output_len < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)

    def fail(self, kind: str, message: str) -> "RequestRecord":
        self.ok, self.error_kind, self.error = False, kind, message[:ERROR_TEXT_LIMIT]
        return self


def _chunk_text(choice: dict, endpoint: str) -> str:
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(http: httpx.AsyncClient, target: Target, sample: SampleRequest,
                       tokenizer=None) -> RequestRecord:
    record = RequestRecord(sample.prompt_len, sample.output_len)
    payload = target.payload(sample)
    record.send_time_s = time.perf_counter()
    exchange = _embed(http, target, payload, record) if target.endpoint == "embeddings" else \
        _stream(http, target, payload, record, tokenizer)
    try:
        await asyncio.wait_for(exchange, timeout=target.timeout_s)
    except asyncio.TimeoutError:
        record.fail("timeout", f"no complete answer within {target.timeout_s:g} s")
    except httpx.TimeoutException as e:
        record.fail("timeout", f"{type(e).__name__}: {e}")
    except httpx.TransportError as e:  # refused, reset, closed mid-stream, protocol errors
        record.fail("connection", f"{type(e).__name__}: {e}")
    record.end_time_s = time.perf_counter()
    return record


async def _stream(http: httpx.AsyncClient, target: Target, payload: dict, record: RequestRecord,
                  tokenizer) -> None:
    start = record.send_time_s
    texts: list[str] = []
    usage: dict | None = None
    done = False
    async with http.stream("POST", target.url, json=payload, headers=target.headers) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", errors="replace")
            record.fail(f"http_{response.status_code}", _error_message(body))
            return
        async for line in response.aiter_lines():
            line = line.strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                record.fail("stream_error", f"not JSON in the stream: {data[:100]!r}")
                return
            if event.get("error"):
                record.fail("stream_error", _error_message(json.dumps(event)))
                return
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                text = _chunk_text(choice, target.endpoint)
                finish = choice.get("finish_reason")
                if text or finish is not None:  # a role-only first chat chunk carries no output
                    record.chunk_times_s.append(now - start)
                    texts.append(text)
                if finish is not None:
                    record.finish_reason = finish
    if not done and record.finish_reason is None:
        record.fail("incomplete", "the stream ended before a finish_reason or [DONE]")
        return
    if not record.chunk_times_s:
        record.fail("no_output", "the stream carried no output")
        return
    record.generated_text = "".join(texts)
    record.ttft_s, record.e2e_s = record.chunk_times_s[0], record.chunk_times_s[-1]
    if usage and isinstance(usage.get("completion_tokens"), int):
        record.output_len = usage["completion_tokens"]
    elif tokenizer is not None:
        record.output_len = len(tokenizer.encode(record.generated_text))
    else:
        record.output_len = len(record.chunk_times_s)
    if usage and isinstance(usage.get("prompt_tokens"), int):
        record.server_prompt_len = usage["prompt_tokens"]
    record.ok = True


async def _embed(http: httpx.AsyncClient, target: Target, payload: dict, record: RequestRecord) -> None:
    response = await http.post(target.url, json=payload, headers=target.headers)
    elapsed_s = time.perf_counter() - record.send_time_s
    if response.status_code != 200:
        record.fail(f"http_{response.status_code}", _error_message(response.text))
        return
    try:
        answer = response.json()
        vector = answer["data"][0]["embedding"]
    except (ValueError, KeyError, IndexError, TypeError):
        record.fail("no_output", f"no embedding in the answer: {response.text[:100]!r}")
        return
    if not vector:
        record.fail("no_output", "the answer's embedding is empty")
        return
    record.chunk_times_s = [elapsed_s]
    record.ttft_s = record.e2e_s = elapsed_s
    record.finish_reason = "stop"
    usage = answer.get("usage") or {}
    if isinstance(usage.get("prompt_tokens"), int):
        record.server_prompt_len = usage["prompt_tokens"]
    record.ok = True


def _error_message(body: str) -> str:
    """OpenAI's ``{"error": {"message": ...}}`` when the server speaks it, else the raw body."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return body.strip() or "(empty body)"
