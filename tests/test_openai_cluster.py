"""Issue 14's engine features through the Ray cluster (real actors, real KV transfer, real SmolLM2 in
float32): logprobs, prompt logprobs and penalties are the offline engine's in every mode and transport
(the prefill worker samples the first token and scores the prompt; the decode worker goes on);
structured output validates on 50 prompts in disagg with and without n-gram speculation, and a decode
worker killed mid-JSON still yields the same valid JSON.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from conftest import engine_config, make_engine, settled_worker_stats, transport_params
from pdcluster.cluster.launcher import Cluster, ClusterSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

NUM_BLOCKS = 256
TOL = 1e-4
PROMPTS = ["The capital of France is", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
           "1, 2, 3, 4, 5, 6, 7,", "Once upon a time"]
# Greedy with every processor on: the first token (sampled on the prefill worker) is biased too.
PARAMS = SamplingParams(max_tokens=12, logprobs=3, prompt_logprobs=2, repetition_penalty=1.3,
                        frequency_penalty=0.4, presence_penalty=0.2, logit_bias=[[28, 1.5]], min_tokens=2)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                   "city": {"type": "string", "enum": ["Paris", "London", "Rome"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SPEC = json.dumps({"type": "json_schema", "schema": SCHEMA})


def _config(**kw):
    return engine_config("smollm2", dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=512,
                         prefill_chunk_size=64, **kw)


async def _collect(router, prompts, params, prefix="r"):
    router.start(asyncio.get_running_loop())

    async def one(i, prompt):
        tokens, logprobs, prompt_logprobs, last = [], [], None, None
        async for delta in router.generate(f"{prefix}-{i}", prompt, params):
            tokens += delta.new_token_ids
            logprobs += delta.logprobs
            if delta.prompt_logprobs is not None:
                assert prompt_logprobs is None, "prompt logprobs came twice"
                prompt_logprobs = delta.prompt_logprobs
            last = delta
        assert last.finished and last.finish_reason in ("length", "stop"), (last.finish_reason, last.error)
        return tokens, logprobs, prompt_logprobs

    return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    engine = make_engine("smollm2", dtype="float32", num_kv_blocks=NUM_BLOCKS)
    prompts = [engine.tokenize(p) for p in PROMPTS]
    return prompts, engine.generate(prompts, PARAMS)


def _same_records(got, want) -> None:
    assert [r.token_id for r in got] == [r.token_id for r in want]
    for g, w in zip(got, want):
        assert abs(g.logprob - w.logprob) < TOL and g.rank == w.rank and g.top_token_ids == w.top_token_ids
        assert all(abs(a - b) < TOL for a, b in zip(g.top_logprobs, w.top_logprobs))


def _check_cluster(spec, reference) -> None:
    prompts, expected = reference
    cluster = Cluster(spec)
    try:
        results = asyncio.run(_collect(cluster.router, prompts, PARAMS))
        for (tokens, logprobs, prompt_logprobs), want in zip(results, expected):
            assert tokens == want.token_ids
            _same_records(logprobs, want.logprobs)
            _same_records(prompt_logprobs, want.prompt_logprobs)
            assert len(prompt_logprobs) == len(want.prompt_token_ids) - 1
        for wid, st in settled_worker_stats(cluster).items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
    finally:
        cluster.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", transport_params())
def test_disagg_logprobs_and_penalties_equal_the_engine(ray_session, reference, transport):
    spec = ClusterSpec(engine=_config(), transfer=TransferConfig(transport=transport, secret="k"), mode="disagg")
    _check_cluster(spec, reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, spec_method", [("colocated", None), ("disagg", "ngram")])
def test_colocated_and_speculative_logprobs_equal_the_engine(ray_session, reference, mode, spec_method):
    kw = {"spec_method": spec_method, "num_spec_tokens": 3} if spec_method else {}
    spec = ClusterSpec(engine=_config(**kw), transfer=TransferConfig(), mode=mode)
    _check_cluster(spec, reference)


def _json_prompts(n):
    return [f"Person {i}: write their name, age and city as JSON." for i in range(n)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec_method", [pytest.param(None, marks=pytest.mark.slow), "ngram"])
def test_structured_output_validates_on_50_prompts_in_disagg(ray_session, smollm2_dir, spec_method):
    kw = {"spec_method": spec_method, "num_spec_tokens": 3} if spec_method else {}
    cluster = Cluster(ClusterSpec(engine=_config(**kw), transfer=TransferConfig(), mode="disagg"))
    try:
        params = SamplingParams(max_tokens=60, temperature=0.9, seed=21, structured_output=SPEC)
        prompts = [cluster.router.tokenizer.encode(p) for p in _json_prompts(50)]
        results = asyncio.run(_collect(cluster.router, prompts, params, prefix="j"))
        for tokens, _, _ in results:
            jsonschema.validate(json.loads(cluster.router.tokenizer.decode(tokens)), SCHEMA)
        for wid, st in settled_worker_stats(cluster).items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
    finally:
        cluster.shutdown()


@pytest.mark.slow  # recovery's exactness is test_recovery.py's, structured output's test_structured_generation.py's
@pytest.mark.timeout(300)
def test_recovery_mid_json_yields_the_same_valid_json(ray_session, smollm2_dir):
    from test_recovery import _stream_and_kill

    params = SamplingParams(max_tokens=60, structured_output=SPEC)
    engine = make_engine("smollm2", dtype="float32", num_kv_blocks=NUM_BLOCKS)
    prompt = engine.tokenize(_json_prompts(1)[0])
    expected = engine.generate([prompt], params)[0].token_ids
    cluster = Cluster(ClusterSpec(engine=_config(), transfer=TransferConfig(), mode="disagg", num_prefill=1,
                                  num_decode=2))
    try:
        tokens, last, _, _ = asyncio.run(_stream_and_kill(cluster, ray_session, prompt, params, kill_after=6,
                                                          kill_role="decode"))
        assert cluster.router.recorder.recoveries, "the request was never recovered"
        assert last.finish_reason == "stop" and tokens == expected
        jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)), SCHEMA)
    finally:
        cluster.shutdown()
