"""Embeddings (POST /v1/embeddings, ``LLMEngine.embed``): a prompt's final hidden states pooled into one vector by the
workers that serve generation.

- The engine's vectors equal transformers' (SmolLM2 float32, ``last_hidden_state``: the last position's, or the mean,
  normalised), whole or in prefill chunks, batched or alone; a mean-pooled request takes no prefix-cache hit (it needs
  every position) and a last-token one may; every block comes back.
- The API answers the openai client with those vectors (float and base64), token-id and chat inputs, vLLM's extras,
  and a clear 4xx for every bad input; the pooler comes from a sentence-transformers directory or --pooler-config.
- Disaggregated: the prefill worker computes it, asked for the first token alone (no decode-side block, no KV moved),
  and the vector equals the colocated one; it crosses the worker events and the API processes' frontend codec.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from conftest import engine_config, make_engine
from pdcluster.engine.sampling_params import SamplingParams

SERVED = "smollm2"
CHUNK = 32
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n" * 6,  # 80 tokens: three prefill chunks of 32
    "Hello",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
]
TOL = 2e-5  # float32, against transformers: the kernels add in another order


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine("smollm2", dtype="float32", prefill_chunk_size=CHUNK, max_model_len=512, num_kv_blocks=128)


@pytest.fixture(scope="module")
def oracle(hf_model, engine):
    """transformers' final hidden states (after the last norm) of each text, float32."""
    out = {}
    for text in TEXTS:
        ids = engine.tokenize(text)
        with torch.no_grad():
            out[text] = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    return out


def _reference(hidden: torch.Tensor, pooling: str) -> np.ndarray:
    pooled = hidden[-1] if pooling == "last" else hidden[0] if pooling == "cls" else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


def _all_free(engine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "an embedding request kept blocks"


# ---- the engine ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_engine_embeddings_equal_transformers(engine, oracle, pooling):
    vectors = engine.embed(TEXTS, pooling=pooling)
    for text, vec in zip(TEXTS, vectors):
        ref = _reference(oracle[text], pooling)
        assert vec.dtype == np.float32 and vec.shape == ref.shape == (576,)
        assert np.abs(vec - ref).max() < TOL, (pooling, text[:20], float(np.abs(vec - ref).max()))
        assert abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
    _all_free(engine)
    # The two poolings differ (a test that passed both with one of them would not show it).
    assert np.abs(engine.embed(TEXTS[:1], "last")[0] - engine.embed(TEXTS[:1], "mean")[0]).max() > 0.1


def test_unnormalized_is_the_raw_pooled_state(engine, oracle):
    raw = engine.embed(TEXTS[1:2], pooling="mean", normalize=False)[0]
    assert np.abs(raw - oracle[TEXTS[1]].mean(0).numpy()).max() < 1e-4
    assert float(np.linalg.norm(raw)) > 2.0  # not unit length


def test_chunked_prefill_and_batching_keep_the_vector(engine):
    """One prompt alone in one chunk against the batch above in chunks of 32, beside generations."""
    whole = make_engine("smollm2", dtype="float32", prefill_chunk_size=512, max_model_len=512, num_kv_blocks=128)
    for pooling in ("last", "mean", "cls"):  # cls: the first position's, kept from the first of the chunks
        alone = whole.embed([TEXTS[1]], pooling=pooling)[0]
        ids = [engine.add_request(t, SamplingParams(max_tokens=8)) for t in TEXTS[:2]]
        chunked = engine.embed([TEXTS[1], TEXTS[0]], pooling=pooling)[0]
        while engine.has_unfinished():  # the generations added above
            engine.step()
        assert ids and np.abs(alone - chunked).max() < TOL


def test_mean_and_cls_take_no_prefix_hit_and_last_may(engine):
    prompt = engine.tokenize(TEXTS[1])  # 80 tokens: four full blocks of 16
    for pooling, hit in (("mean", False), ("cls", False), ("last", True)):
        first, second = (engine.generate([prompt], SamplingParams(max_tokens=1, pooling=pooling))[0] for _ in range(2))
        assert (second.num_cached_tokens > 0) is hit, (pooling, second.num_cached_tokens)
        assert np.array_equal(first.pooled, second.pooled)
    _all_free(engine)


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        SamplingParams(max_tokens=1, pooling="max")
    with pytest.raises(ValueError, match="max_tokens 1"):
        SamplingParams(max_tokens=2, pooling="last")


def test_hybrid_model_embeds_the_same_in_chunks():
    """A Mamba hybrid's state passes from chunk to chunk: the mean over 3 chunks equals the one-chunk mean."""
    prompt = list(range(300, 380))
    vecs = [make_engine("tiny-hybrid", dtype="float32", prefill_chunk_size=chunk, max_model_len=256).embed(
        [prompt], pooling=pooling)[0] for pooling in ("mean", "last") for chunk in (32, 256)]
    assert np.abs(vecs[0] - vecs[1]).max() < 1e-5 and np.abs(vecs[2] - vecs[3]).max() < 1e-5
    assert np.abs(vecs[0] - vecs[2]).max() > 1e-3


@pytest.mark.parametrize("kw", [{"async_scheduling": True}, {"spec_method": "ngram", "num_spec_tokens": 3},
                                {"spec_method": "mtp", "num_spec_tokens": 2}], ids=["async", "ngram", "mtp"])
def test_speculation_and_async_scheduling_keep_the_vector(tiny_dir, kw):
    """Beside generations that speculate (or launch steps ahead), an embedding equals the plain engine's."""
    prompts = [list(range(300, 300 + n)) for n in (5, 40, 70)]
    want = {p: make_engine(prefill_chunk_size=16).embed(prompts, pooling=p) for p in ("last", "mean")}
    engine = make_engine(prefill_chunk_size=16, **kw)
    for pooling in ("last", "mean"):
        engine.add_request(list(range(500, 530)), SamplingParams(max_tokens=12))
        got = engine.embed(prompts, pooling=pooling)
        while engine.has_unfinished():
            engine.step()
        assert all(np.abs(g - w).max() < 1e-5 for g, w in zip(got, want[pooling])), (kw, pooling)


# ---- the pooler's configuration -----------------------------------------------------------------------------------

def _st_dir(tmp_path, mode: str, normalize: bool, hf: dict | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    flags = {k: k == mode for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken",
                                    "pooling_mode_max_tokens")}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 576, **flags}))
    (tmp_path / "config.json").write_text(json.dumps(hf or {}))
    return tmp_path


def test_pooler_config_reads_sentence_transformers_and_overrides(tmp_path):
    from pdcluster.cluster.api.embeddings import PoolerConfig, pooler_config

    assert pooler_config(None) == PoolerConfig("last", True, None)
    st = _st_dir(tmp_path, "pooling_mode_mean_tokens", normalize=False, hf={"matryoshka_dimensions": [64, 256]})
    assert pooler_config(st) == PoolerConfig("mean", False, (64, 256))
    assert pooler_config(st, '{"pooling_type": "LAST", "normalize": true}') == PoolerConfig("last", True, (64, 256))
    with pytest.raises(ValueError, match="unknown keys"):
        pooler_config(st, '{"pooling": "mean"}')
    assert pooler_config(st, {"pooling_type": "CLS"}) == PoolerConfig("cls", False, (64, 256))
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        pooler_config(st, {"pooling_type": "max"})


def test_a_pooling_mode_not_served_turns_the_routes_off_not_the_server(tmp_path):
    """A directory asking for max pooling still serves generation; its embeddings, score and rerank answer 400 naming
    the reason, unless --pooler-config chooses a pooling."""
    import httpx

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.api.embeddings import PoolerConfig, pooler_config
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    cls = _st_dir(tmp_path / "cls", "pooling_mode_cls_token", normalize=True)
    assert pooler_config(cls) == PoolerConfig("cls", True, None)  # a decoder's first token, as vLLM's CLS
    st = _st_dir(tmp_path / "max", "pooling_mode_max_tokens", normalize=True)
    assert "Pooling config asks for a mode not served" in pooler_config(st).unavailable
    assert pooler_config(st, '{"pooling_type": "MEAN"}').unavailable is None
    with pytest.raises(ValueError, match="a JSON object is expected"):
        pooler_config(st, "5")
    with pytest.raises(ValueError, match="Expecting property name"):  # JSONDecodeError: serve says it in one line
        pooler_config(st, "{mean}")
    router = LocalRouter(engine_config(num_kv_blocks=64), request_timeout_s=30)
    try:
        with serving(build_app(router, "tiny-random", pooler=pooler_config(st))) as url:
            for path, body in (("/v1/embeddings", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"}),
                               ("/rerank", {"query": "a", "documents": ["b"]})):
                r = httpx.post(f"{url}{path}", json=body, timeout=30)
                assert r.status_code == 400 and "this server embeds nothing" in r.text, (path, r.text)
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-random", "prompt": "a", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200
    finally:
        router.close()


# ---- the HTTP API (the openai client, one in-process engine) ------------------------------------------------------

@pytest.fixture(scope="module")
def served(smollm2_dir):
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.api.embeddings import PoolerConfig
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    router = LocalRouter(engine_config("smollm2", dtype="float32", prefill_chunk_size=CHUNK, max_model_len=256,
                                       num_kv_blocks=128), request_timeout_s=120)
    try:
        with serving(build_app(router, SERVED, pooler=PoolerConfig("mean", True, (64, 128)))) as url:
            yield url, router
    finally:
        router.close()


def _post(url: str, body: dict):
    import httpx

    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)


def test_openai_client_gets_the_engine_vectors(served, engine):
    import openai

    url, router = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    got = client.embeddings.create(model=SERVED, input=TEXTS)
    want = engine.embed(TEXTS, pooling="mean")
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    for d, ref in zip(got.data, want):
        assert np.abs(np.array(d.embedding, dtype=np.float32) - ref).max() < TOL
    num_tokens = sum(len(engine.tokenize(t)) for t in TEXTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == num_tokens
    # base64 is the float32 bytes of the same vector (what the openai client asks for by default, then decodes).
    b64 = _post(url, {"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vec, np.array(got.data[0].embedding, dtype=np.float32))
    # vLLM's /pooling answers the same vectors as pooling items.
    import httpx

    answer = httpx.post(f"{url}/pooling", json={"input": TEXTS[:2]}, timeout=60).json()
    assert answer["id"].startswith("pool-")
    pooled = answer["data"]
    assert [(d["index"], d["object"]) for d in pooled] == [(0, "pooling"), (1, "pooling")]
    for d, ref in zip(pooled, got.data):
        assert np.abs(np.array(d["data"], dtype=np.float32) - np.array(ref.embedding, dtype=np.float32)).max() < 1e-6
    stats = router.worker.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_token_ids_chat_truncation_normalize_and_dimensions(served, engine):
    url, _ = served
    ids = engine.tokenize(TEXTS[3])
    by_text = np.array(_post(url, {"input": TEXTS[3]}).json()["data"][0]["embedding"])
    by_ids = _post(url, {"input": [ids, ids[-5:]]}).json()["data"]
    assert np.abs(np.array(by_ids[0]["embedding"]) - by_text).max() < TOL
    truncated = _post(url, {"input": [ids], "truncate_prompt_tokens": 5}).json()
    assert truncated["usage"]["prompt_tokens"] == 5
    assert np.abs(np.array(truncated["data"][0]["embedding"]) - np.array(by_ids[1]["embedding"])).max() < TOL
    first = _post(url, {"input": [ids], "truncate_prompt_tokens": 5, "truncation_side": "right"}).json()
    head = np.array(_post(url, {"input": [ids[:5]]}).json()["data"][0]["embedding"])
    assert np.abs(np.array(first["data"][0]["embedding"]) - head).max() < TOL
    assert np.abs(head - np.array(by_ids[1]["embedding"])).max() > 1e-3  # the first 5 tokens, not the last 5
    raw = np.array(_post(url, {"input": TEXTS[3], "normalize": False}).json()["data"][0]["embedding"])
    assert np.abs(raw / np.linalg.norm(raw) - by_text).max() < TOL and np.linalg.norm(raw) > 2
    short = np.array(_post(url, {"input": TEXTS[3], "dimensions": 64}).json()["data"][0]["embedding"])
    assert short.shape == (64,) and abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.abs(short - raw[:64] / np.linalg.norm(raw[:64])).max() < TOL
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    import httpx

    tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    chat = _post(url, {"messages": messages}).json()
    assert chat["usage"]["prompt_tokens"] == tokenized["count"] > 5
    by_chat_ids = _post(url, {"input": [tokenized["tokens"]]}).json()["data"][0]["embedding"]
    assert np.abs(np.array(chat["data"][0]["embedding"]) - np.array(by_chat_ids)).max() < TOL


def test_a_client_that_leaves_aborts_every_input(served, engine):
    """64 long inputs, the client gone after 0.5 s: every input's request is aborted (the prompts computed fall far
    short of all of them) and every block comes back."""
    import time

    import httpx

    url, router = served
    before = router.worker.stats()["num_prompt_tokens_computed"]
    inputs = [[300 + (7 * i + j) % 4000 for j in range(250)] for i in range(64)]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/embeddings", json={"input": inputs}, timeout=0.5)
    left_at = time.monotonic()
    while True:
        stats = router.worker.stats()
        if (stats["num_running"], stats["num_waiting"], stats["num_free_blocks"]) == (0, 0, stats["num_blocks"]) \
                and router.num_open_streams == 0:
            break
        assert time.monotonic() - left_at < 10, f"not settled 10 s after the client left: {stats}"
        time.sleep(0.05)
    assert stats["num_prompt_tokens_computed"] - before < 64 * 250 // 2, "the inputs were not aborted"


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [1, 2, 10 ** 9]}, 400, "input"),
    ({"input": "hi", "dimensions": 100}, 400, "dimensions"),
    ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "hi", "encoding_format": "int8"}, 400, None),
    ({"input": "hi", "model": "gpt-4"}, 404, "model"),
    ({"input": list(range(300, 600))}, 400, "input"),  # 300 tokens: over max_model_len 256
    ({"input": ["a"] * 65}, 400, "input"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
])
def test_bad_input_is_a_clear_4xx(served, body, status, param):
    url, router = served
    r = _post(url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if param is not None:
        assert err.get("param") == param, err
    stats = router.worker.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_and_rerank_are_the_cosines_of_the_embeddings(served, engine):
    """vLLM's /score (1:N, N:N, its four spellings) and /rerank (best first, top_n): a pair's score is the cosine of
    its two texts' vectors (the server's pooler: mean here)."""
    import httpx

    url, router = served
    vec = dict(zip(TEXTS, engine.embed(TEXTS, pooling="mean")))
    query, docs = TEXTS[3], TEXTS[:3]
    one_to_n = httpx.post(f"{url}/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["index"] for d in one_to_n["data"]] == [0, 1, 2] and one_to_n["object"] == "list"
    for d, doc in zip(one_to_n["data"], docs):
        assert d["object"] == "score" and abs(d["score"] - _cos(vec[query], vec[doc])) < 1e-5
    tokens = sum(len(engine.tokenize(t)) for t in [query, *docs])
    assert one_to_n["usage"]["prompt_tokens"] == tokens
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        again = httpx.post(f"{url}/v1/score", json={first: query, second: docs}, timeout=60).json()
        assert [round(d["score"], 5) for d in again["data"]] == [round(d["score"], 5) for d in one_to_n["data"]]
    pairwise = httpx.post(f"{url}/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:]}, timeout=60).json()
    assert [round(d["score"], 5) for d in pairwise["data"]] == [round(_cos(vec[a], vec[b]), 5)
                                                                for a, b in zip(TEXTS[:2], TEXTS[2:])]
    want = sorted(range(3), key=lambda i: _cos(vec[query], vec[docs[i]]), reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = httpx.post(f"{url}{path}", json={"query": query, "documents": docs}, timeout=60).json()
        assert [r["index"] for r in ranked["results"]] == want
        assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in want]
        assert ranked["usage"]["total_tokens"] == tokens
    top = httpx.post(f"{url}/rerank", json={"query": query, "documents": docs, "top_n": 1}, timeout=60).json()
    assert [r["index"] for r in top["results"]] == want[:1]
    assert abs(top["results"][0]["relevance_score"] - _cos(vec[query], vec[docs[want[0]]])) < 1e-5
    stats = router.worker.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_1"),
    ("/score", {"text_1": [], "text_2": ["c"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": ""}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "queries": "a", "documents": "b"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": ["b"] * 128}, "text_2"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "", "documents": ["b"]}, "query"),
    ("/rerank", {"query": "a", "documents": ["b " * 300]}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b"], "model": "gpt-4"}, "model"),
])
def test_bad_scoring_input_is_a_clear_4xx(served, path, body, param):
    import httpx

    url, router = served
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.json()
    stats = router.worker.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_scoring_routes_need_the_api_key(smollm2_dir):
    import httpx

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    router = LocalRouter(engine_config(num_kv_blocks=64), request_timeout_s=30)
    try:
        with serving(build_app(router, "tiny-random", api_key="k-1")) as url:
            for path, body in (("/v1/embeddings", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"}),
                               ("/rerank", {"query": "a", "documents": ["b"]}),
                               ("/v2/rerank", {"query": "a", "documents": ["b"]})):
                assert httpx.post(f"{url}{path}", json=body, timeout=30).status_code == 401, path
                ok = httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer k-1"}, timeout=30)
                assert ok.status_code == 200, (path, ok.text)
    finally:
        router.close()


# ---- the wire ----------------------------------------------------------------------------------------------------

def test_the_vector_crosses_worker_events_and_the_frontend_codec():
    from pdcluster.cluster.api.router_contract import TokenDelta
    from pdcluster.cluster.frontend.protocol import FRONTEND_CODEC, from_delta, is_plain, to_delta
    from pdcluster.engine.pooling import pooled_bytes, pooled_vector
    from pdcluster.kv_transfer import protocol
    from pdcluster.node.events import EVENT_CODEC, Tokens

    vec = np.linspace(-1, 1, 576, dtype=np.float32)
    data = pooled_bytes(vec)
    assert np.array_equal(pooled_vector(data), vec) and len(data) == 4 * 576
    first = protocol.decode(protocol.encode(protocol.FirstToken(request_id="r", token_id=5, pooled=data)), 1 << 20)
    assert first.pooled == data
    tokens = Tokens(request_id="r", worker_id="w", new_token_ids=[5], num_computed_tokens=3, num_output_tokens=1,
                    finished=True, finish_reason="length", pooled=data)
    assert EVENT_CODEC.decode(EVENT_CODEC.encode(tokens), 1 << 20).pooled == data
    delta = TokenDelta([5], finished=True, finish_reason="length", pooled=data)
    assert not is_plain(TokenDelta([5], pooled=data))
    back = from_delta(FRONTEND_CODEC.decode(FRONTEND_CODEC.encode(to_delta("r", delta)), 1 << 20))
    assert back.pooled == data and from_delta(to_delta("r", TokenDelta([5]))).pooled is None


# ---- disaggregated ------------------------------------------------------------------------------------------------

def test_the_prefill_worker_computes_it_and_no_kv_moves(tiny_dir, monkeypatch):
    """A real prefill and decode worker over tcp. Even with the decode worker's first-token-only asks turned off (as
    bench/first_token_only.py turns them off), an embedding is asked of the prefill worker alone: the decode worker
    holds no block for it and no KV moves. The vectors are the single engine's."""
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.engine.pooling import finish_embedding, pooled_vector
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.node.events import KVReady, Tokens
    from test_kv_transfer_e2e import Events, _collect_tokens, _wait_free, connected_pair

    num_blocks = 64
    cfg = engine_config(num_kv_blocks=num_blocks, max_model_len=512, prefill_chunk_size=16)
    prompts = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 17, 45])]
    want = {p: make_engine("tiny-random", num_kv_blocks=num_blocks).embed(prompts, pooling=p) for p in ("last", "mean")}
    monkeypatch.setattr(DecodeWorker, "ask_first_token_only", False)
    events = Events()
    with connected_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        ids = [f"{pooling}{i}" for pooling in want for i in range(len(prompts))]
        for rid in ids:
            pooling, i = rid[:-1], int(rid[-1])
            d.submit(rid, prompts[i], SamplingParams(max_tokens=1, pooling=pooling), "p0")
        _collect_tokens(events, ids)
        with events.lock:
            finals = {e.request_id: e for e in events.items if isinstance(e, Tokens) and e.finished}
            assert not [e for e in events.items if isinstance(e, KVReady)]
        for rid in ids:
            got = finish_embedding(pooled_vector(finals[rid].pooled))
            assert np.abs(got - want[rid[:-1]][int(rid[-1])]).max() < 1e-5, rid
        assert p.stats()["bytes_sent"] == 0
        dst = d.stats()
        assert dst["num_prompt_tokens_computed"] == 0 and dst["num_free_blocks"] == num_blocks
        _wait_free(p, num_blocks, 5)


@pytest.mark.slow  # the default suite serves embeddings disaggregated through `pdcluster serve` (tests/test_serve.py)
@pytest.mark.timeout(300)
def test_disaggregated_cluster_serves_the_colocated_vectors(ray_session, engine):
    """The Ray cluster, --mode disagg over tcp, behind the HTTP API: SmolLM2's vectors equal the engine's, no decode
    worker computed a prompt token, and every worker's blocks are back."""
    import asyncio

    import httpx

    from conftest import settled_worker_stats
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig
    from test_admin_api import serving

    cluster = Cluster(ClusterSpec(engine=engine_config("smollm2", dtype="float32", prefill_chunk_size=CHUNK,
                                                       max_model_len=256, num_kv_blocks=128),
                                  transfer=TransferConfig(transport="tcp", secret="k"), mode="disagg"))

    async def main():
        cluster.router.start(asyncio.get_running_loop())
        async with serving(build_app(cluster.router, SERVED)) as url:
            async with httpx.AsyncClient(timeout=120) as client:
                r = await client.post(f"{url}/v1/embeddings", json={"input": TEXTS})
                return r.status_code, r.json()

    try:
        status, body = asyncio.run(main())
        assert status == 200, body
        want = engine.embed(TEXTS, pooling="last")  # the default pooler: the last token, normalised
        for d, ref in zip(body["data"], want):
            assert np.abs(np.array(d["embedding"], dtype=np.float32) - ref).max() < TOL
        stats = settled_worker_stats(cluster, 10)
        for wid, st in stats.items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
        prefill = [st for wid, st in stats.items() if wid.startswith("p")]
        decode = [st for wid, st in stats.items() if wid.startswith("d")]
        assert prefill and decode and sum(st["num_prompt_tokens_computed"] for st in decode) == 0
    finally:
        cluster.shutdown()


def test_the_vector_reaches_an_api_process(tiny_dir):
    """Behind --api-servers N the API process's RemoteRouter gets the router process's vector (frontend codec)."""
    from pdcluster.cluster.api.embeddings import _embed_one
    from pdcluster.cluster.local_router import LocalRouter
    from pdcluster.engine.pooling import finish_embedding, pooled_vector
    from test_api_servers import with_one_api_process

    prompt = list(range(300, 340))
    want = make_engine("tiny-random", num_kv_blocks=64).embed([prompt])[0]
    router = LocalRouter(engine_config(num_kv_blocks=64), request_timeout_s=60)

    async def body(remote):
        raw = await _embed_one(remote, "e1", prompt, SamplingParams(max_tokens=1, pooling="last"))
        assert np.abs(finish_embedding(pooled_vector(raw)) - want).max() < 1e-5

    with_one_api_process(router, body)


# ---- on a GPU -----------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mixed_graph_tokens", [0, 512], ids=["eager_prefill", "piecewise_graphs"])
def test_on_cuda_embeddings_equal_transformers(tiny_dir, mixed_graph_tokens):
    """float32 on the GPU, decode CUDA graphs on (and prefill in piecewise graphs, whose hidden states are a static
    buffer the next step rewrites), async scheduling, generations beside: the vectors are transformers'."""
    from transformers import AutoModelForCausalLM

    engine = make_engine("tiny-random", device="cuda", num_kv_blocks=256, prefill_chunk_size=32,
                         mixed_cuda_graph_tokens=mixed_graph_tokens, async_scheduling=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).cuda().eval()
    prompts = [list(range(100 + i, 100 + i + n)) for i, n in enumerate([5, 40, 77])]
    for pooling in ("last", "mean"):
        engine.add_request(list(range(600, 630)), SamplingParams(max_tokens=16, ignore_eos=True))
        got = engine.embed(prompts, pooling=pooling)
        while engine.has_unfinished():
            engine.step()
        for prompt, vec in zip(prompts, got):
            with torch.no_grad():
                hidden = model.model(torch.tensor([prompt], device="cuda")).last_hidden_state[0].cpu()
            ref = _reference(hidden, pooling)
            assert np.abs(vec - ref).max() < 1e-4, (pooling, len(prompt), float(np.abs(vec - ref).max()))
