"""ModernBERT encoders (engine/models/modernbert.py), made tiny by transformers (engine/models/tiny_bert.py: four
layers, layers 0 and 3 global, 1 and 2 a band of +-4 tokens, 4,096 rotary positions) and checked against transformers:

- embeddings pooled by [CLS] and by mean equal transformers' last hidden states, for prompts shorter and longer than
  the band (and than a band chunk), alone and in one batch;
- the cross-encoder (every bias on, mean pooling: ``classifier_pooling``) scores as transformers does;
- the Hub's older config keys (global_attn_every_n_layers, global/local_rope_theta) read as transformers 5's;
- a context longer than the default step: the step grows to hold it unless the user set one (then: refused).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import engine_config, make_engine
from encoder_cuda import assert_equal_to_transformers_on_cuda, on_cuda
from pdcluster.engine.models.tiny_bert import build_tiny_bert, transformers_outputs
from test_bert import DOCS, QUERY, TOL  # the same query and documents as BERT's cross-encoders

WORDS = "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun".split()
TEXTS = ["the quick brown fox", " ".join(WORDS), " ".join(WORDS * 3), "dog"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("modernbert")
    return {kind: build_tiny_bert(root / kind, kind) for kind in ("modernbert", "modernbert-cross")}


def _engine(path, **kwargs):
    kwargs.setdefault("max_model_len", 0)  # the model's own (4,096 positions)
    kwargs.setdefault("num_kv_blocks", 0)
    kwargs.setdefault("max_num_batched_tokens", 4096)
    return make_engine(str(path), **kwargs)


@pytest.mark.parametrize("query_chunk", [256, 8])
def test_embeddings_equal_transformers(models, monkeypatch, query_chunk):
    """[CLS] and mean pooling over prompts of 6 to 50 tokens in one batch: transformers' last hidden states. With
    8-row query chunks the band's chunks meet inside every long prompt."""
    from pdcluster.engine.models import modernbert

    monkeypatch.setattr(modernbert, "LOCAL_QUERY_CHUNK", query_chunk)
    path = models["modernbert"]
    engine = _engine(path)
    assert [len(engine.tokenize(t)) for t in TEXTS] == [6, 19, 53, 3]
    want = transformers_outputs(path, TEXTS)
    cls = engine.embed(TEXTS, pooling="cls", normalize=False)
    mean = engine.embed(TEXTS, pooling="mean", normalize=False)
    for got_cls, got_mean, ref in zip(cls, mean, want):
        assert np.abs(got_cls - ref[0].numpy()).max() < TOL
        assert np.abs(got_mean - ref.mean(0).numpy()).max() < TOL
    alone = engine.embed(TEXTS[2:3], pooling="mean", normalize=False)[0]
    assert np.abs(alone - mean[2]).max() < TOL


def test_the_band_is_the_masked_attention_and_matters(models):
    """band_attention equals dense attention under the |i - j| <= window mask for any chunking, and differs from
    attention over the whole prompt (so a lost band would fail the test above)."""
    from pdcluster.engine.models.modernbert import band_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 50, 8, generator=g) for _ in range(3))
    i = torch.arange(50)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=(i[:, None] - i[None, :]).abs() <= 4)
    for chunk in (1, 7, 8, 64):
        assert (band_attention(q, k, v, 4, chunk) - want).abs().max() < 1e-6
    assert (F.scaled_dot_product_attention(q, k, v) - want).abs().max() > 0.1
    short = torch.randn(2, 5, 8, generator=g)  # within the window: plain attention
    assert torch.equal(band_attention(short, short, short, 4), F.scaled_dot_product_attention(short, short, short))


def test_cross_encoder_scores_equal_transformers(models):
    """Every bias on and mean pooling over the final hidden states: the scores are transformers'."""
    from pdcluster.engine.models.modernbert import ModernBertArch

    path = models["modernbert-cross"]
    arch = ModernBertArch.from_dir(path)
    assert arch.classifier_pooling == "mean" and arch.norm_bias and arch.mlp_bias and arch.attention_bias
    engine = _engine(path)
    want = [float(torch.sigmoid(x)[0]) for x in transformers_outputs(path, [(QUERY, d) for d in DOCS])]
    assert max(want) - min(want) > 0.01
    got = engine.score(QUERY, DOCS)
    assert np.abs(np.array(got) - np.array(want)).max() < TOL, (got, want)
    # A pair carries no token types: the template's ids alone.
    ids = engine.tokenizer.encode_pair(QUERY, DOCS[0])
    assert engine.tokenizer._tok.id_to_token(ids[0]) == "[CLS]"


def test_the_hub_config_keys_read_as_transformers_5s(models, tmp_path):
    """The Hub's ModernBERT configs say global_attn_every_n_layers, global_rope_theta and local_rope_theta (no
    layer_types, no rope_parameters): the same arch. A scaled rotary embedding is refused in one line."""
    import shutil

    from pdcluster.engine.models.modernbert import ModernBertArch

    src = models["modernbert"]
    new = ModernBertArch.from_dir(src)
    assert new.global_layers == (True, False, False, True) and new.local_window == 4
    assert (new.rope_theta, new.local_rope_theta) == (160000.0, 10000.0)  # the global layers' base, the local
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    cfg = json.loads((hub / "config.json").read_text())
    del cfg["layer_types"], cfg["rope_parameters"]
    cfg.update(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0)
    (hub / "config.json").write_text(json.dumps(cfg))
    assert ModernBertArch.from_dir(hub) == new
    cfg["local_rope_theta"] = 500.0
    (hub / "config.json").write_text(json.dumps(cfg))
    assert ModernBertArch.from_dir(hub).local_rope_theta == 500.0
    changed = _engine(hub).embed(TEXTS[1:2], pooling="mean", normalize=False)[0]
    assert np.abs(changed - _engine(src).embed(TEXTS[1:2], pooling="mean", normalize=False)[0]).max() > 1e-3
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    (hub / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        ModernBertArch.from_dir(hub)


def test_a_context_longer_than_the_default_step(models):
    """4,096 positions over the CPU's default 2,048-token step: the step grows to the context (vLLM's rule for models
    that never split a prompt) and a 2,500-token prompt is transformers'; a step the user set too small is refused."""
    path = models["modernbert"]
    engine = make_engine(str(path), max_model_len=0, num_kv_blocks=0)
    assert engine.config.max_num_batched_tokens == 4096
    text = " ".join(WORDS * 160)
    ids = engine.tokenize(text)
    assert 2048 < len(ids) <= 4096
    want = transformers_outputs(path, [text])[0].mean(0).numpy()
    got = engine.embed([text], pooling="mean", normalize=False)[0]
    assert np.abs(got - want).max() < 1e-4
    with pytest.raises(ValueError, match="raise --max-num-batched-tokens"):
        make_engine(str(path), max_model_len=0, num_kv_blocks=0, max_num_batched_tokens=2048)


def test_bf16_embedding_is_the_same_alone_and_in_a_batch(models):
    engine = _engine(models["modernbert"], dtype="bfloat16")
    batch = engine.embed(TEXTS, pooling="cls")
    for text, vec in zip(TEXTS, batch):
        assert np.array_equal(engine.embed([text], pooling="cls")[0], vec)


def test_served_embeddings_and_rerank(models):
    """The real HTTP app over a local router: /v1/embeddings (the openai client) answers the engine's vectors,
    /rerank orders by transformers' cross-encoder scores, completions answer 400."""
    import httpx
    from openai import OpenAI

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    path = models["modernbert"]
    want = _engine(path).embed(TEXTS, pooling="cls")
    router = LocalRouter(engine_config(str(path), max_model_len=0, num_kv_blocks=0), request_timeout_s=60)
    try:
        with serving(build_app(router, "emb")) as url:
            got = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).embeddings.create(model="emb",
                                                                                                input=TEXTS)
            for item, w in zip(got.data, want):
                assert np.abs(np.array(item.embedding) - w).max() < 1e-5
            r = httpx.post(f"{url}/v1/completions", json={"model": "emb", "prompt": "the fox", "max_tokens": 3},
                           timeout=30)
            assert r.status_code == 400 and "encoder-only embedding model" in r.text, r.text
    finally:
        router.close()
    path = models["modernbert-cross"]
    scores = [float(torch.sigmoid(x)[0]) for x in transformers_outputs(path, [(QUERY, d) for d in DOCS])]
    router = LocalRouter(engine_config(str(path), max_model_len=0, num_kv_blocks=0), request_timeout_s=60)
    try:
        with serving(build_app(router, "rr")) as url:
            r = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCS}, timeout=30)
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == list(np.argsort(scores)[::-1])
            assert np.abs(np.array([x["relevance_score"] for x in results]) - np.sort(scores)[::-1]).max() < 1e-5
    finally:
        router.close()


def test_the_prefill_worker_scores_a_pair_and_no_kv_moves(models):
    """A real prefill and decode worker over tcp: the cross-encoder's logits (mean-pooled) come back alone, equal to
    the single engine's; no byte of KV is sent and every block is free after."""
    from disagg_pooling import pooled_over_tcp

    from pdcluster.engine.sampling_params import SamplingParams

    path = models["modernbert-cross"]
    engine = _engine(path)
    pairs = [engine.tokenizer.encode_pair(QUERY, d) for d in DOCS]
    want = engine.classify(pairs, activation=False)
    got = pooled_over_tcp(engine_config(str(path), max_model_len=0, num_kv_blocks=0, max_num_batched_tokens=4096),
                          pairs, SamplingParams(max_tokens=1, pooling="classify"))
    for i, (vec, logits) in enumerate(zip(got, want)):
        assert np.abs(vec - logits).max() < 1e-5, i


# ---- on a GPU -----------------------------------------------------------------------------------------------------

@on_cuda
def test_on_cuda_embeddings_and_scores_equal_transformers(models):
    """float32 on the GPU: [CLS] and mean embeddings (band and global layers) and the mean-pooled cross-encoder."""
    assert_equal_to_transformers_on_cuda(_engine, models["modernbert"], models["modernbert-cross"], TEXTS, QUERY,
                                         DOCS)
