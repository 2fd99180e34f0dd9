"""Scoring prompts longer than one prefill chunk (issue 22), the way evaluation harnesses do
(lm-eval-harness: token-id prompts, ``echo: true``, ``logprobs: 1``, ``max_tokens`` 0 or 1, several
requests in flight): every prompt position after the first has its logprob, equal to a transformers
float32 forward within 1e-4, in every mode (local, colocated, disagg over tcp), prefix cache on and off,
with n-gram (and, slow, MTP) speculation.

The bug: a prompt prefilled in several chunks on a decode worker reports each chunk to the router
(a ``Tokens`` event without tokens: the scheduler's count, S1) before the step that samples its first
token and carries its prompt logprobs. Both routers took the request's first *event* for the first
token: the prompt logprobs were read from a chunk report (none) and the real ones dropped, so the API
answered null for every prompt token. The prefill worker sends them with its first token, so disagg
was right, except for a prompt the decode worker prefills itself.

Sizes. The default run uses a prefill chunk of 64 tokens and prompts of 1, chunk - 1, chunk, chunk + 1,
3 x chunk - 5 and 3 x chunk + 7 tokens (the shapes of 1, 511, 512, 513, 1,500 and 1,543 at the default
chunk of 512); the slow tests run those very sizes at the default chunk of 512 (max_model_len 2048:
1,543 tokens plus the output must fit). One cluster per mode, every prompt in flight at once.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass

import httpx
import pytest
import torch

from conftest import engine_config, make_engine, settled_worker_stats
from pdcluster.engine.sampling_params import SamplingParams

TOL = 1e-4
CHUNK = 64
SIZES = (1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK - 5, 3 * CHUNK + 7)
SLOW_CHUNK = 512
SLOW_SIZES = (1, 511, 512, 513, 1500, 3 * SLOW_CHUNK + 7)
SERVED = "smollm2"
API_KEY = "k-22"


# ================================================================================== the oracle


@dataclass
class Reference:
    """transformers fp32 over one prompt: ``token[p]`` the logprob of token p + 1 at position p, ``top[p]``
    the most likely token's logprob there (p < n - 1); ``last_top``: the most likely next token's."""

    token: torch.Tensor
    top: torch.Tensor
    last_top: float


def _random_prompts(sizes, seed: int = 22) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in sizes]


@functools.cache
def _text_tokens() -> tuple[int, ...]:
    """English prose (and a little code) that does not change under us: standard-library docstrings,
    ~4,400 SmolLM2 tokens. Natural text, as harnesses score: on random token ids a few positions'
    logprobs are below -28, where fp32 kernels that add in another order differ by up to 4e-4
    (chunking or not: measured the same with one chunk); on text they stay within 4e-5."""
    import argparse, csv, difflib, doctest, heapq, json, statistics, unittest  # noqa: E401

    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    text = "\n\n".join(m.__doc__ for m in (argparse, unittest, doctest, csv, heapq, difflib, statistics, json))
    return tuple(Tokenizer(resolve_model("smollm2", progress=False)).encode(text))


def _prompts(sizes) -> list[list[int]]:
    """Windows of the text, each from another offset."""
    tokens = _text_tokens()
    prompts = [list(tokens[i * 211 % 800 : i * 211 % 800 + n]) for i, n in enumerate(sizes)]
    assert [len(p) for p in prompts] == list(sizes), "the text is too short for these sizes"
    return prompts


@pytest.fixture(scope="module")
def oracle(hf_model):
    cache: dict[tuple, Reference] = {}

    def reference(ids: list[int]) -> Reference:
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                rows = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
            token = rows[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
            cache[key] = Reference(token, rows[:-1].max(dim=1).values, float(rows[-1].max()))
        return cache[key]

    return reference


def _check_records(records, ids: list[int], ref: Reference) -> None:
    """Engine TokenLogprobs records of a prompt (one per position after the first)."""
    assert records is not None, f"{len(ids)}-token prompt: no prompt logprobs"
    assert len(records) == len(ids) - 1, (len(records), len(ids))
    assert [r.token_id for r in records] == ids[1:]
    got = torch.tensor([r.logprob for r in records], dtype=torch.float32)
    assert torch.allclose(got, ref.token, atol=TOL, rtol=0), float((got - ref.token).abs().max())
    if records and records[0].top_logprobs:
        top = torch.tensor([r.top_logprobs[0] for r in records], dtype=torch.float32)
        assert torch.allclose(top, ref.top, atol=TOL, rtol=0)


# ================================================================================== engine level (no Ray)


def _run_to_completion(engine, prompts, params) -> dict[str, list]:
    """Step the engine; check the contract the routers rely on: a request's prompt logprobs come once,
    on the step output that carries its first token, never on a chunk's output before it."""
    ids = [engine.add_request(p, params) for p in prompts]
    by_id = dict(zip(ids, prompts))
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in by_id:
                continue
            if out.prompt_logprobs is not None:
                assert out.new_token_ids, f"{out.request_id}: prompt logprobs on a chunk without its first token"
                assert out.request_id not in got, f"{out.request_id}: prompt logprobs came twice"
                got[out.request_id] = out.prompt_logprobs
            elif out.new_token_ids:
                assert out.request_id in got, f"{out.request_id}: first token without its prompt logprobs"
    return {i: got.get(i) for i in ids}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [
    # Prefix cache on (warmed with the same prompts first), a step budget that cuts chunks short, and a
    # pool so small that requests are preempted mid-prefill and recomputed.
    dict(enable_prefix_caching=True, max_num_batched_tokens=100, num_kv_blocks=20),
    # Async scheduling (the next chunk is scheduled while one runs) with n-gram speculation.
    dict(async_scheduling=True, spec_method="ngram", num_spec_tokens=3, enable_prefix_caching=False),
    # MTP (a random head: drafts never change logprobs) with the prefix cache on: in the slow pass, which also
    # runs MTP across the disaggregated cluster at the real sizes.
    pytest.param(dict(spec_method="mtp", num_spec_tokens=2), marks=pytest.mark.slow),
], ids=["prefix-cache-budget-preemption", "async-ngram", "mtp"])
def test_engine_prompt_logprobs_come_with_the_first_token(smollm2_dir, oracle, kw):
    kw = {"num_kv_blocks": 128, **kw}
    engine = make_engine("smollm2", dtype="float32", prefill_chunk_size=CHUNK, max_model_len=512, **kw)
    prompts = _prompts(SIZES)
    if engine.config.enable_prefix_caching:
        engine.generate(prompts, SamplingParams(max_tokens=1))  # a later request could hit these blocks
    for params in (SamplingParams(max_tokens=1, prompt_logprobs=1), SamplingParams(max_tokens=3, prompt_logprobs=0)):
        got = _run_to_completion(engine, prompts, params)
        for records, ids in zip(got.values(), prompts):
            _check_records(records, ids, oracle(ids))
    if kw.get("num_kv_blocks") == 20:
        assert engine.scheduler.num_preemptions_total > 0, "the small pool was meant to preempt"
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


# ================================================================================== the routers (no Ray)


def test_cluster_router_takes_prompt_logprobs_from_the_first_token_not_a_chunk_report():
    """RequestStreams.on_tokens alone: a chunk's report (no tokens) comes first, then the first token
    with the prompt logprobs; the client's first delta must carry them (and the TTFT)."""
    from pdcluster.cluster.router.state import Attempt, RequestState
    from pdcluster.cluster.router.stream import RequestStreams
    from pdcluster.wire.logprobs import TokenLogprobs
    from pdcluster.node.events import Tokens

    streams = RequestStreams({"num_draft_tokens": 0, "num_accepted_tokens": 0}, lambda: None, lambda a: None)
    prompt = list(range(100, 100 + CHUNK + 1))
    delivered = []
    r = RequestState("r", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1), delivered.append)
    a = Attempt("r", 0, "d0", None, len(prompt), admitted=None)
    streams.admitted(r, a)
    records = [TokenLogprobs(t, -1.0, 1, [t], [-1.0]) for t in prompt[1:]]
    streams.on_tokens(r, a, Tokens(request_id=a.wid, worker_id="d0", new_token_ids=[], num_computed_tokens=CHUNK,
                                   num_output_tokens=0))
    assert not delivered and not r.prompt_logprobs_sent and not a.t_first_token
    streams.on_tokens(r, a, Tokens(request_id=a.wid, worker_id="d0", new_token_ids=[7],
                                   num_computed_tokens=len(prompt), num_output_tokens=1, prompt_logprobs=records))
    [delta] = delivered
    assert delta.new_token_ids == [7] and delta.prompt_logprobs == records and "prefill" in delta.ttft_breakdown
    assert r.prompt_logprobs_sent and a.t_first_token


@pytest.mark.timeout(120)
def test_local_router_first_delta_carries_the_prompt_logprobs(tiny_dir, one_torch_thread):
    """LocalRouter over tiny-random, chunk 16: no delta without tokens before the first token, and the
    first delta has one record per prompt position after the first, across chunk boundaries."""
    from pdcluster.cluster.local_router import LocalRouter

    chunk = 16
    router = LocalRouter(engine_config(prefill_chunk_size=chunk, num_kv_blocks=64, max_model_len=256),
                         request_timeout_s=60)
    prompts = _random_prompts((1, chunk - 1, chunk, chunk + 1, 3 * chunk + 7))

    async def one(i, ids):
        deltas = [d async for d in router.generate(f"p{i}", ids, SamplingParams(max_tokens=1, prompt_logprobs=1))]
        return deltas

    async def main():
        return await asyncio.gather(*[one(i, ids) for i, ids in enumerate(prompts)])

    try:
        for ids, deltas in zip(prompts, asyncio.run(main())):
            assert deltas[0].new_token_ids, f"{len(ids)} tokens: a delta without tokens came first"
            assert deltas[0].prompt_logprobs is not None, f"{len(ids)} tokens: no prompt logprobs on the first delta"
            assert [rec.token_id for rec in deltas[0].prompt_logprobs] == ids[1:]
            assert all(d.prompt_logprobs is None for d in deltas[1:])
            assert "prefill" in deltas[0].ttft_breakdown
    finally:
        router.close()


# ================================================================================== served (HTTP)


def _requests(prompts) -> list[tuple[dict, list[list[int]], int]]:
    """What a harness sends: each prompt alone with max_tokens 0 and with 1, and all of them in one
    batched request (max_tokens 0). Returns (body, prompts of its choices, max_tokens)."""
    base = {"model": SERVED, "echo": True, "logprobs": 1, "temperature": 0}
    out = [({**base, "prompt": ids, "max_tokens": m}, [ids], m) for ids in prompts for m in (0, 1)]
    out.append(({**base, "prompt": prompts, "max_tokens": 0}, prompts, 0))
    return out


async def _score(url: str, prompts) -> list[tuple[list[int], int, dict]]:
    """Every request in flight at once; (prompt, max_tokens, choice's logprobs) per choice."""
    async with httpx.AsyncClient(base_url=url, timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        requests = _requests(prompts)
        answers = await asyncio.gather(*[http.post("/v1/completions", json=body) for body, _, _ in requests])
    out = []
    for (_, choice_prompts, max_tokens), answer in zip(requests, answers):
        assert answer.status_code == 200, answer.text
        choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
        assert len(choices) == len(choice_prompts)
        out += [(ids, max_tokens, c["logprobs"]) for ids, c in zip(choice_prompts, choices)]
    return out


def _check_scores(scores, oracle) -> None:
    for ids, max_tokens, lp in scores:
        n, ref = len(ids), oracle(ids)
        assert len(lp["token_logprobs"]) == n + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        prompt = lp["token_logprobs"][1:n]
        missing = sum(x is None for x in prompt)
        assert not missing, f"{n}-token prompt, max_tokens {max_tokens}: {missing} of {n - 1} positions null"
        got = torch.tensor(prompt, dtype=torch.float32)
        assert torch.allclose(got, ref.token, atol=TOL, rtol=0), (n, float((got - ref.token).abs().max()))
        top = torch.tensor([max(t.values()) for t in lp["top_logprobs"][1:n]], dtype=torch.float32)
        assert torch.allclose(top, ref.top, atol=TOL, rtol=0)
        if max_tokens:  # greedy: the generated token is the most likely one
            assert abs(lp["token_logprobs"][n] - ref.last_top) < TOL


def _same_scores(a, b) -> None:
    assert [(ids, m) for ids, m, _ in a] == [(ids, m) for ids, m, _ in b]
    for (ids, _, x), (_, _, y) in zip(a, b):
        gx, gy = torch.tensor(x["token_logprobs"][1:]), torch.tensor(y["token_logprobs"][1:])
        assert torch.allclose(gx, gy, atol=TOL, rtol=0), (len(ids), float((gx - gy).abs().max()))


def _local_scores(prompts, **kw) -> list:
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    router = LocalRouter(engine_config("smollm2", dtype="float32", **kw), request_timeout_s=300)
    try:
        with serving(build_app(router, SERVED, api_key=API_KEY)) as url:
            scores = asyncio.run(_score(url, prompts))
        stats = router.worker.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], stats
        assert router.num_open_streams == 0
        return scores
    finally:
        router.close()


def _cluster_scores(prompts, mode: str, conditional_prefill_tokens: int = 0, **kw) -> list:
    """Start one cluster (``mode``), score every prompt through its HTTP API at once, shut it down.
    Disagg: prompts shorter than ``conditional_prefill_tokens`` are prefilled on the decode worker."""
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig
    from test_admin_api import serving

    # A transfer's deadline runs while its prompt waits on the prefill worker: every prompt at once on
    # two shared cores queues longer than the default 30 s (then the router recovers, and may give up).
    transfer = TransferConfig(transport="tcp", secret="k", transfer_timeout_s=600) if mode == "disagg" \
        else TransferConfig()
    cluster = Cluster(ClusterSpec(engine=engine_config("smollm2", dtype="float32", **kw), transfer=transfer,
                                  mode=mode, conditional_prefill_tokens=conditional_prefill_tokens))

    async def main():
        cluster.router.start(asyncio.get_running_loop())
        async with serving(build_app(cluster.router, SERVED, api_key=API_KEY)) as url:
            return await _score(url, prompts)

    try:
        scores = asyncio.run(main())
        for wid, st in settled_worker_stats(cluster, 10).items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
        return scores
    finally:
        cluster.shutdown()


def _chunked(**kw) -> dict:
    return {"prefill_chunk_size": CHUNK, "max_model_len": 512, "num_kv_blocks": 160, **kw}


def _full(**kw) -> dict:
    return {"prefill_chunk_size": SLOW_CHUNK, "max_model_len": 2048, "num_kv_blocks": 1024, **kw}


@pytest.fixture(scope="module")
def colocated_scores(ray_session, smollm2_dir):
    """Colocated, prefix cache on (the default)."""
    return _cluster_scores(_prompts(SIZES), "colocated", **_chunked())


@pytest.mark.timeout(300)
def test_local_scores_every_prompt_position(smollm2_dir, oracle):
    """--mode local (no Ray): the in-process router, prefix cache on."""
    _check_scores(_local_scores(_prompts(SIZES), **_chunked()), oracle)


@pytest.mark.timeout(300)
def test_colocated_scores_every_prompt_position(colocated_scores, oracle):
    _check_scores(colocated_scores, oracle)


@pytest.mark.timeout(300)
def test_disagg_with_ngram_scores_every_prompt_position_and_equals_colocated(ray_session, colocated_scores, oracle):
    """Disagg over tcp, prefix cache off, n-gram speculation on both workers. Prompts up to 2 chunks are
    prefilled on the decode worker (conditional disaggregation), the longer ones on the prefill worker."""
    kw = _chunked(enable_prefix_caching=False, spec_method="ngram", num_spec_tokens=3)
    scores = _cluster_scores(_prompts(SIZES), "disagg", conditional_prefill_tokens=2 * CHUNK, **kw)
    _check_scores(scores, oracle)
    _same_scores(scores, colocated_scores)


# ================================================================================== slow: the real sizes


@pytest.fixture(scope="module")
def colocated_full_scores(ray_session, smollm2_dir):
    return _cluster_scores(_prompts(SLOW_SIZES), "colocated", **_full(spec_method="ngram", num_spec_tokens=3))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kw", [dict(), dict(enable_prefix_caching=False, async_scheduling=True)],
                         ids=["prefix-cache", "async-no-prefix-cache"])
def test_local_full_sizes(smollm2_dir, oracle, kw):
    _check_scores(_local_scores(_prompts(SLOW_SIZES), **_full(**kw)), oracle)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_colocated_ngram_full_sizes(colocated_full_scores, oracle):
    _check_scores(colocated_full_scores, oracle)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kw", [dict(), dict(spec_method="mtp", num_spec_tokens=2, enable_prefix_caching=False)],
                         ids=["prefix-cache", "mtp-no-prefix-cache"])
def test_disagg_full_sizes_equal_colocated(ray_session, colocated_full_scores, oracle, kw):
    """1,500 and 1,543 tokens prefilled on the prefill worker in 3 and 4 chunks: equal to colocated."""
    scores = _cluster_scores(_prompts(SLOW_SIZES), "disagg", **_full(**kw))
    _check_scores(scores, oracle)
    _same_scores(scores, colocated_full_scores)
