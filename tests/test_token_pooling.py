"""Per-token pooling (vLLM's ``token_embed`` and ``token_classify`` tasks): token classifiers (NER:
``BertForTokenClassification``, ``XLMRobertaForTokenClassification``, ``ModernBertForTokenClassification``, made tiny
by transformers, engine/models/tiny_bert.py) and every prompt token's final hidden state, of an encoder and of a
decoder (SmolLM2, chunked), checked against transformers:

- ``LLMEngine.encode(prompts, "token_classify")``: every token's logits equal transformers', in a batch of prompts of
  several lengths; activated per row (softmax); ``token_embed``: every row of the final hidden states, normalised;
- a decoder's prompt in several chunks gives the same rows as in one (no prefix-cache hit for such a request);
- what does not fit is refused in one line: a sequence classification of a token classifier, a token classification
  of a model without the head, generation;
- served: POST /pooling with ``task`` (float and base64), the model's default task, 400s for the rest;
- disaggregated: the prefill worker sends the rows, no KV moves.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from conftest import engine_config, make_engine
from pdcluster.engine.llm_engine import InvalidRequestError
from pdcluster.engine.models.tiny_bert import TOKEN_LABELS, build_tiny_bert, transformers_outputs
from pdcluster.engine.sampling_params import SamplingParams

TEXTS = ["paris is the capital of france", "berlin is in germany , rome in italy",
         "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun", "dog"]
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("token")
    return {kind: build_tiny_bert(root / kind, kind) for kind in ("bert-token", "xlm-roberta-token",
                                                                 "modernbert-token", "bert")}


def _engine(path, **kwargs):
    kwargs.setdefault("max_model_len", 0)
    kwargs.setdefault("num_kv_blocks", 0)
    kwargs.setdefault("max_num_batched_tokens", 4096)
    return make_engine(str(path), **kwargs)


@pytest.mark.parametrize("kind", ["bert-token", "xlm-roberta-token", "modernbert-token"])
def test_token_classify_equals_transformers(models, kind):
    """Every token's logits, a batch of four prompt lengths: transformers' [num_tokens, num_labels]; activated, each
    row's softmax."""
    engine = _engine(models[kind])
    want = transformers_outputs(models[kind], TEXTS)
    raw = engine.encode(TEXTS, "token_classify", activation=False)
    for got, ref, text in zip(raw, want, TEXTS):
        assert got.shape == (len(engine.tokenize(text)), len(TOKEN_LABELS)) == tuple(ref.shape)
        assert np.abs(got - ref.numpy()).max() < TOL
    probs = engine.encode(TEXTS, "token_classify")
    for p, ref in zip(probs, want):
        assert np.abs(p - torch.softmax(ref, -1).numpy()).max() < 1e-6
    assert engine.model.classifier.spec.labels == TOKEN_LABELS


def test_token_embed_of_an_encoder_is_every_final_hidden_state(models):
    path = models["bert"]
    engine = _engine(path)
    want = transformers_outputs(path, TEXTS)
    raw = engine.encode(TEXTS, "token_embed", activation=False)
    unit = engine.encode(TEXTS, "token_embed")
    for r, u, ref in zip(raw, unit, want):
        assert r.shape == tuple(ref.shape) and np.abs(r - ref.numpy()).max() < TOL
        assert np.abs(np.linalg.norm(u, axis=-1) - 1).max() < 1e-5
        assert np.abs(u - r / np.linalg.norm(r, axis=-1, keepdims=True)).max() < 1e-6


def test_token_embed_of_a_chunked_decoder_prompt(smollm2_dir):
    """SmolLM2: a 100-token prompt in 16-token chunks gives the rows it gives in one step, and transformers' last
    hidden states (fp32); the request computes its whole prompt even where the prefix cache holds it."""
    import transformers

    prompt = [(7 * i + 3) % 4000 + 10 for i in range(100)]
    whole = make_engine(smollm2_dir, max_model_len=256, num_kv_blocks=64)
    want = whole.encode([prompt], "token_embed", activation=False)[0]
    chunked = make_engine(smollm2_dir, max_model_len=256, num_kv_blocks=64, prefill_chunk_size=16,
                          enable_prefix_caching=True)
    chunked.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's blocks now in the prefix cache
    got = chunked.encode([prompt], "token_embed", activation=False)[0]
    assert got.shape == (100, whole.model.arch.hidden_size)
    assert np.abs(got - want).max() < 1e-4
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.model(torch.tensor([prompt])).last_hidden_state[0].numpy()
    assert np.abs(want - ref).max() < 1e-3


def test_what_does_not_fit_is_refused(models):
    token = _engine(models["bert-token"])
    with pytest.raises(InvalidRequestError, match="token_classify"):
        token.classify(TEXTS[:1])
    with pytest.raises(InvalidRequestError, match="token classifier"):
        token.generate(["paris"], SamplingParams(max_tokens=2))
    plain = _engine(models["bert"])
    with pytest.raises(InvalidRequestError, match="no token classification head"):
        plain.encode(TEXTS[:1], "token_classify")
    with pytest.raises(InvalidRequestError, match="pooling_task must be one of"):
        plain.encode(TEXTS[:1], "tokens")
    # The tasks a token classifier keeps: its rows, and an embedding ([CLS]).
    assert token.encode(TEXTS[:1], "embed")[0].shape == (token.model.arch.hidden_size,)


def test_served_pooling_tasks(models):
    """POST /pooling: a token classifier's default task is token_classify (its rows of probabilities, float and
    base64); token_embed; /classify, /score and completions answer 400 naming what to use."""
    import httpx

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    path = models["modernbert-token"]
    engine = _engine(path)
    want = engine.encode(TEXTS, "token_classify")
    want_rows = engine.encode(TEXTS[:1], "token_embed")[0]
    router = LocalRouter(engine_config(str(path), max_model_len=0, num_kv_blocks=0), request_timeout_s=60)
    try:
        with serving(build_app(router, "ner")) as url:
            r = httpx.post(f"{url}/pooling", json={"input": TEXTS}, timeout=60)
            assert r.status_code == 200, r.text
            body = r.json()
            for item, w in zip(body["data"], want):
                assert item["object"] == "pooling" and np.abs(np.array(item["data"]) - w).max() < 1e-5
            assert body["usage"]["prompt_tokens"] == sum(len(w) for w in want)
            r = httpx.post(f"{url}/pooling", json={"input": TEXTS[0], "task": "token_classify",
                                                   "encoding_format": "base64", "use_activation": False}, timeout=60)
            rows = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), "<f4").reshape(-1, len(TOKEN_LABELS))
            assert np.abs(rows - engine.encode(TEXTS[:1], "token_classify", activation=False)[0]).max() < 1e-5
            r = httpx.post(f"{url}/pooling", json={"input": TEXTS[0], "task": "token_embed"}, timeout=60)
            assert np.abs(np.array(r.json()["data"][0]["data"]) - want_rows).max() < 1e-5
            for route, payload, needle in (
                    ("/classify", {"input": TEXTS[0]}, "token classifier"),
                    ("/score", {"text_1": "a", "text_2": "b"}, "token classifier"),
                    ("/v1/completions", {"model": "ner", "prompt": "the", "max_tokens": 2}, "token classifier"),
                    ("/pooling", {"input": TEXTS[0], "task": "classify"}, "token_classify"),
                    ("/pooling", {"input": TEXTS[0], "task": "tokens"}, "task"),
                    ("/pooling", {"input": TEXTS[0], "task": "token_embed", "dimensions": 4}, "dimensions")):
                r = httpx.post(f"{url}{route}", json=payload, timeout=30)
                assert 400 <= r.status_code < 500 and needle in r.text, (route, payload, r.status_code, r.text)
    finally:
        router.close()


def test_the_prefill_worker_sends_the_rows_and_no_kv_moves(models):
    from disagg_pooling import pooled_over_tcp

    path = models["xlm-roberta-token"]
    engine = _engine(path)
    prompts = [engine.tokenize(t) for t in TEXTS]
    want = engine.encode(prompts, "token_classify", activation=False)
    got = pooled_over_tcp(engine_config(str(path), max_model_len=0, num_kv_blocks=0), prompts,
                          SamplingParams(max_tokens=1, pooling="token_classify"))
    for flat, w, ids in zip(got, want, prompts):
        assert np.abs(flat.reshape(len(ids), -1) - w).max() < 1e-5
