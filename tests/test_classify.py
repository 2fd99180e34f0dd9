"""Sequence classifiers (``*ForSequenceClassification``: reward models, classifiers, cross-encoder rerankers) served by
the pooling path: POST /classify, cross-encoder /score and /rerank, ``LLMEngine.classify``.

The checkpoints are made here by transformers (tiny-random's trunk with a random score head: three labels, tied; one
label, untied, a cross-encoder), so the oracle is transformers' own ``ForSequenceClassification`` forward:
- the engine's logits equal transformers' (float32), whole or in prefill chunks, batched beside other requests, and
  every block comes back; probabilities are vLLM's activation (softmax, sigmoid for one label);
- the API answers /classify (text, batches, token ids, chat, raw logits) and scores pairs as a cross-encoder, with a
  clear 4xx for what such a model does not do (generate) and what a causal model does not (classify);
- disaggregated, the prefill worker computes the logits, asked for the first token alone (no KV moves).
"""

from __future__ import annotations

import base64
import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import engine_config, make_engine
from pdcluster.engine.llm_engine import InvalidRequestError
from pdcluster.engine.sampling_params import SamplingParams

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
PROMPTS = [list(range(300, 340)), list(range(500, 505)), list(range(1000, 1077))]
TOL = 1e-4  # float32 logits of order 1 against transformers: the kernels add in another order
PAIRS = [("What is a fox?", "A fox is a small wild animal of the dog family."),
         ("What is a fox?", "Paris is the capital of France."),
         ("How do I add numbers?", "def add(a, b):\n    return a + b")]


def _build(tiny_dir, out, num_labels: int, tied: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig.from_pretrained(tiny_dir)
    cfg.architectures = ["LlamaForSequenceClassification"]
    cfg.num_labels = num_labels
    if num_labels == len(LABELS):
        cfg.id2label, cfg.label2id = dict(LABELS), {v: k for k, v in LABELS.items()}
    cfg.tie_word_embeddings = tied
    cfg.pad_token_id = 2  # transformers pools the last token that is not padding (none is here)
    torch.manual_seed(num_labels)
    model = LlamaForSequenceClassification(cfg).eval()
    causal = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.model.load_state_dict(causal.model.state_dict())
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.1)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    if num_labels == 1:  # a cross-encoder's tokenizer joins a pair with a separator (BERT's [SEP]): "<|endoftext|>"
        tokenizer = json.loads((out / "tokenizer.json").read_text())
        a, b, sep = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}, "<|endoftext|>"
        tokenizer["post_processor"] = {"type": "TemplateProcessing", "single": [a],
                                       "pair": [a, {"SpecialToken": {"id": sep, "type_id": 0}}, b],
                                       "special_tokens": {sep: {"id": sep, "ids": [0], "tokens": [sep]}}}
        (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def three_labels(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("classifier3")
    return out, _build(tiny_dir, out, 3, tied=True)


@pytest.fixture(scope="module")
def cross_encoder(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cross_encoder")
    return out, _build(tiny_dir, out, 1, tied=False)


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ---- the engine ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [512, 16], ids=["whole", "chunks_of_16"])
def test_engine_logits_equal_transformers(three_labels, chunk):
    path, hf = three_labels
    engine = make_engine(str(path), prefill_chunk_size=chunk, num_kv_blocks=64, max_model_len=256)
    logits = engine.classify(PROMPTS, activation=False)
    for ids, got in zip(PROMPTS, logits):
        want = _logits(hf, ids)
        assert got.dtype == np.float32 and got.shape == (3,)
        assert np.abs(got - want).max() < TOL, (got, want)
    probs = engine.classify(PROMPTS)
    for got, raw in zip(probs, logits):
        assert np.abs(got - _softmax(raw)).max() < 1e-6 and abs(float(got.sum()) - 1.0) < 1e-5
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_batched_beside_embeddings_keeps_the_logits(three_labels):
    """Classifications, embeddings of the same prompts and each other's neighbours in one batch: a row's logits
    are its own (the head reads its own last position)."""
    path, hf = three_labels
    engine = make_engine(str(path), prefill_chunk_size=32, num_kv_blocks=64, max_model_len=256)
    params = [SamplingParams(max_tokens=1, pooling=p) for p in ("classify", "last", "classify", "mean", "classify")]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[2]]
    outs = engine.generate(prompts, params)
    for i in (0, 2, 4):
        assert np.abs(outs[i].pooled - _logits(hf, prompts[i])).max() < TOL
    assert outs[1].pooled.shape == (128,)  # an embedding is the hidden state, not the logits


def test_a_classifier_does_not_generate_and_a_causal_model_does_not_classify(three_labels):
    path, _ = three_labels
    engine = make_engine(str(path), num_kv_blocks=64, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="sequence classifier .3 labels.: it does not generate"):
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
    causal = make_engine("tiny-random", num_kv_blocks=64, max_model_len=256)
    for call in (lambda: causal.classify([PROMPTS[0]]),
                 lambda: causal.generate([PROMPTS[0]], SamplingParams(max_tokens=1, pooling="classify"))):
        with pytest.raises(InvalidRequestError, match="has no classification head"):
            call()
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls, classify"):
        SamplingParams(max_tokens=1, pooling="score")
    # The refusal ended nothing else: the classifier still answers.
    assert engine.classify([PROMPTS[1]])[0].shape == (3,)


@pytest.mark.parametrize("family", ["qwen2-yarn", "gemma2", "phi3"])
def test_other_families_classify_as_transformers_does(family, tiny_dir, tmp_path):
    """A classifier of another family (Qwen2 with YaRN, Gemma 2's norms and soft-capped attention, Phi-3's fused
    checkpoint) made by transformers from the families' test configs: its logits are transformers'."""
    import transformers

    from test_model_families import CONFIGS, _redraw_weights

    config_cls, model_cls, kwargs, _ = CONFIGS[family]
    cfg = getattr(transformers, config_cls)(**kwargs, num_labels=2)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls.replace("ForCausalLM", "ForSequenceClassification"))(cfg).eval()
    _redraw_weights(hf)
    hf.save_pretrained(str(tmp_path))
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path)
    engine = make_engine(str(tmp_path), num_kv_blocks=64, max_model_len=128, prefill_chunk_size=16)
    prompts = [list(range(5, 45)), list(range(100, 107))]
    for ids, got in zip(prompts, engine.classify(prompts, activation=False)):
        assert np.abs(got - _logits(hf, ids)).max() < TOL, (family, got, _logits(hf, ids))


def test_labels_and_activation_read_from_the_config():
    from pdcluster.engine.models.classifier import classifier_spec

    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    assert classifier_spec({"architectures": ["LlamaForCausalLM"]}) is None
    spec = classifier_spec({**arch, "id2label": {"1": "yes", "0": "no"}})
    assert spec.labels == ("no", "yes") and spec.activation == "softmax"
    assert classifier_spec({**arch, "num_labels": 1}).activation == "sigmoid"
    assert classifier_spec(arch).labels == ("LABEL_0", "LABEL_1")  # transformers' default: two
    assert classifier_spec({**arch, "num_labels": 2, "problem_type": "multi_label_classification"}).activation == \
        "sigmoid"
    regression = classifier_spec({**arch, "num_labels": 1, "problem_type": "regression"})
    assert regression.activate(np.array([3.5], dtype=np.float32))[0] == 3.5
    with pytest.raises(ValueError, match="ids must be 0..1"):
        classifier_spec({**arch, "id2label": {"0": "a", "2": "b"}})


def test_a_broken_checkpoint_is_refused_in_one_line(three_labels, tmp_path):
    from safetensors.torch import load_file, save_file

    from pdcluster.engine.models.architectures import load_model

    path, _ = three_labels
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "score.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="needs score.weight"):
        load_model(tmp_path, torch.float32, 256)
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "id2label": {"0": "a", "1": "b"}}))
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"score.weight has shape \(3, 128\), expected \(2, 128\)"):
        load_model(tmp_path, torch.float32, 256)
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GemmaForSequenceClassification"]}))
    with pytest.raises(ValueError, match="sequence classifiers are served for the Llama family and Gemma 2"):
        load_model(tmp_path, torch.float32, 256)


RERANKER = {"architectures": ["LlamaForSequenceClassification"], "method": "from_2_way_softmax",
            "classifier_from_token": ["no", "yes"]}


def test_a_causal_reranker_is_served_by_its_yes_and_no_rows(tiny_dir, hf_tiny):
    """vLLM's conversion of a causal reranker (Qwen3-Reranker) by ``--hf-overrides``: the LM head's "yes" row less its
    "no" row is a one-label head, whose sigmoid is the two-way softmax of the causal model's yes / no logits; with
    no_post_processing each token's row is a label. The checkpoint is not edited: an overlay directory is."""
    config = json.loads((tiny_dir / "config.json").read_text())
    engine = make_engine("tiny-random", num_kv_blocks=64, max_model_len=256, hf_overrides=json.dumps(RERANKER))
    assert json.loads((tiny_dir / "config.json").read_text()) == config  # the checkpoint as it was
    assert engine.model.classifier.spec.labels == ("yes",)
    no, yes = engine.tokenizer.token_to_id("no"), engine.tokenizer.token_to_id("yes")
    for ids, got in zip(PROMPTS, engine.classify(PROMPTS)):
        with torch.no_grad():
            logits = hf_tiny(torch.tensor([ids])).logits[0, -1].double()
        want = torch.softmax(logits[[no, yes]], dim=0)[1].item()
        assert got.shape == (1,) and abs(float(got[0]) - want) < 1e-5, (got, want)
    both = make_engine("tiny-random", num_kv_blocks=64, max_model_len=256,
                       hf_overrides=json.dumps({**RERANKER, "method": "no_post_processing"}))
    raw = both.classify(PROMPTS[:1], activation=False)[0]
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert raw.shape == (2,) and np.abs(raw - logits[[no, yes]].numpy()).max() < TOL
    with pytest.raises(InvalidRequestError, match="does not generate"):
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("overrides, needle", [
    ("[1]", "a JSON object is expected"),
    ("{oops", "hf_overrides: Expecting property name"),
    (json.dumps({**RERANKER, "method": "mean"}), "method must be one of from_2_way_softmax, no_post_processing"),
    (json.dumps({**RERANKER, "classifier_from_token": ["yes"]}), "takes two tokens"),
    (json.dumps({**RERANKER, "classifier_from_token": ["no", "not-a-token-of-it"]}), "is not one token"),
])
def test_bad_overrides_are_one_line(tiny_dir, overrides, needle):
    with pytest.raises(ValueError, match=needle):
        make_engine("tiny-random", num_kv_blocks=64, max_model_len=256, hf_overrides=overrides)


def test_hf_overrides_flag_reaches_the_engine_config():
    import argparse

    from pdcluster.cluster.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--hf-overrides", json.dumps(RERANKER)])
    assert json.loads(engine_config_from_args(args).hf_overrides) == RERANKER


# ---- the HTTP API -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(three_labels):
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    path, _ = three_labels
    router = LocalRouter(engine_config(str(path), prefill_chunk_size=32, max_model_len=256, num_kv_blocks=64),
                         request_timeout_s=60)
    try:
        with serving(build_app(router, "clf", api_key="k")) as url:
            yield url, router
    finally:
        router.close()


def _post(url: str, path: str, body: dict, key: str | None = "k"):
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def test_classify_route_answers_transformers_probabilities(served, three_labels):
    url, router = served
    _, hf = three_labels
    tok = router.tokenizer
    texts = ["I loved this film.", "The plot was thin and the acting worse."]
    r = _post(url, "/classify", {"model": "clf", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "clf" and len(body["data"]) == 2
    ids = [tok.encode(t, add_special_tokens=True) for t in texts]
    for i, item in enumerate(body["data"]):
        want = _softmax(_logits(hf, ids[i]).astype(np.float64))
        assert item["index"] == i and item["num_classes"] == 3
        assert np.abs(np.array(item["probs"]) - want).max() < 1e-5
        assert item["label"] == LABELS[int(np.argmax(want))]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, ids))
    # Token ids, /v1/classify, raw logits (vLLM's use_activation false, and its older name).
    for extra in ({"use_activation": False}, {"activation": False}):
        r = _post(url, "/v1/classify", {"input": PROMPTS[0], **extra})
        assert r.status_code == 200, r.text
        assert np.abs(np.array(r.json()["data"][0]["probs"]) - _logits(hf, PROMPTS[0])).max() < TOL
    # One chat, rendered by the template.
    messages = [{"role": "user", "content": "Is this good?"}]
    r = _post(url, "/classify", {"messages": messages})
    assert r.status_code == 200, r.text
    want = _softmax(_logits(hf, tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))))
    assert np.abs(np.array(r.json()["data"][0]["probs"]) - want).max() < 1e-5
    # vLLM's /pooling: the same probabilities, as pooling items (base64 float32 where asked).
    r = _post(url, "/pooling", {"input": texts, "messages": None})
    assert r.status_code == 200 and r.json()["id"].startswith("pool-"), r.text
    for item, classified in zip(r.json()["data"], body["data"]):
        assert item["object"] == "pooling"
        assert np.abs(np.array(item["data"]) - np.array(classified["probs"])).max() < 1e-6
    r = _post(url, "/pooling", {"messages": messages, "encoding_format": "base64"})
    got = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), dtype="<f4")
    assert np.abs(got - want).max() < 1e-5
    stats = router.stats()["workers"][0]
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}, 400, "is a sequence classifier (3 labels): it does not"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, 400, "does not generate"),
    ("/v1/responses", {"input": "a"}, 400, "does not generate"),
    ("/score", {"text_1": "a", "text_2": "b"}, 400, "only a one-label classifier (a cross-encoder) scores pairs"),
    ("/classify", {}, 400, "give exactly one of input"),
    ("/classify", {"input": ""}, 400, "input is empty"),
    ("/classify", {"input": [10**6]}, 400, "token ids out of range"),
    ("/classify", {"input": "a", "activation": True, "use_activation": False}, 400, "disagree"),
    ("/classify", {"input": "a", "model": "other"}, 404, "other"),
    ("/classify", {"input": "a " * 400}, 400, "this server embeds at most 255"),
    ("/pooling", {"input": "a", "dimensions": 2}, 400, "leave dimensions out"),
])
def test_what_a_classifier_does_not_do_is_a_clear_4xx(served, path, body, status, needle):
    url, router = served
    r = _post(url, path, {"model": "clf", **body} if "model" not in body else body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"], r.text
    stats = router.stats()["workers"][0]
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_classify_needs_the_api_key_and_a_classifier(served, tiny_dir):
    import httpx

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    url, _ = served
    assert _post(url, "/classify", {"input": "a"}, key=None).status_code == 401
    router = LocalRouter(engine_config(num_kv_blocks=64), request_timeout_s=30)
    try:
        with serving(build_app(router, "tiny-random")) as causal_url:
            r = httpx.post(f"{causal_url}/classify", json={"input": "a"}, timeout=30)
            assert r.status_code == 400 and "has no classification head" in r.text, r.text
    finally:
        router.close()


def test_a_cross_encoder_scores_and_reranks_pairs_by_its_head(cross_encoder):
    """A one-label classifier: /score and /rerank read (query, document) as one input, the tokenizer's pair template
    (transformers' ``tokenizer(q, d)``), and score it sigmoid(logit), as vLLM does."""
    from transformers import AutoTokenizer

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    path, hf = cross_encoder
    hf_tok = AutoTokenizer.from_pretrained(path)
    assert 0 in hf_tok(*PAIRS[0])["input_ids"]  # the separator: a pair is not its two texts run together
    want = [1.0 / (1.0 + np.exp(-float(_logits(hf, hf_tok(q, d)["input_ids"])[0]))) for q, d in PAIRS]
    assert max(want) - min(want) > 0.01  # scores that differ: an order to check
    router = LocalRouter(engine_config(str(path), max_model_len=256, num_kv_blocks=64), request_timeout_s=60)
    try:
        with serving(build_app(router, "ce")) as url:
            r = _post(url, "/score", {"text_1": [q for q, _ in PAIRS], "text_2": [d for _, d in PAIRS]}, key=None)
            assert r.status_code == 200, r.text
            got = [item["score"] for item in r.json()["data"]]
            assert np.abs(np.array(got) - np.array(want)).max() < 1e-5, (got, want)
            # 1:N: the one query against each document.
            docs = [d for _, d in PAIRS[:2]]
            r = _post(url, "/v1/rerank", {"query": PAIRS[0][0], "documents": docs, "top_n": 1}, key=None)
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            best = int(np.argmax(want[:2]))
            assert [x["index"] for x in results] == [best]
            assert abs(results[0]["relevance_score"] - want[best]) < 1e-5
            assert r.json()["usage"]["prompt_tokens"] == sum(len(hf_tok(PAIRS[0][0], d)["input_ids"]) for d in docs)
            r = _post(url, "/classify", {"input": "a fox"}, key=None)  # one label: probs is its sigmoid
            assert r.status_code == 200 and r.json()["data"][0]["num_classes"] == 1
    finally:
        router.close()
    # Offline, vLLM's LLM.score: the same scores, pair by pair and 1:N.
    engine = make_engine(str(path), max_model_len=256, num_kv_blocks=64)
    got = engine.score([q for q, _ in PAIRS], [d for _, d in PAIRS])
    assert np.abs(np.array(got) - np.array(want)).max() < 1e-5
    assert np.abs(np.array(engine.score(PAIRS[0][0], docs)) - np.array(want[:2])).max() < 1e-5
    with pytest.raises(InvalidRequestError, match="1:1, 1:N or N:N"):
        engine.score(["a", "b"], ["c", "d", "e"])


def test_engine_score_of_an_embedding_model_is_the_cosine(three_labels):
    """LLM.score on a model without a one-label head: the cosine of the two texts' embeddings; a classifier of several
    labels refuses to score."""
    engine = make_engine("tiny-random", num_kv_blocks=64, max_model_len=256)
    docs = ["a cat sat", "the stock market fell"]
    a, b, c = engine.embed(["a cat", *docs])
    assert np.abs(np.array(engine.score("a cat", docs)) - np.array([a @ b, a @ c])).max() < 1e-6
    with pytest.raises(InvalidRequestError, match="a classifier of 3 labels does not score pairs"):
        make_engine(str(three_labels[0]), num_kv_blocks=64, max_model_len=256).score("a", "b")


def test_run_batch_classifies(three_labels, tmp_path):
    """`pdcluster run-batch` on a classifier: a /v1/classify line answers the engine's probabilities, a completion
    line the 400 of a model that does not generate."""
    from pdcluster.cli.main import main

    path, hf = three_labels
    lines = [json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/classify", "body": {"input": PROMPTS[:2]}}),
             json.dumps({"custom_id": "g", "method": "POST", "url": "/v1/completions",
                         "body": {"model": str(path), "prompt": "a", "max_tokens": 2}})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "--model", str(path), "--num-kv-blocks", "64", "--max-model-len", "256", "-i", str(src),
                 "-o", str(dst), "--no-progress"]) == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["response"]["status_code"] for o in out] == [200, 400]
    for item, ids in zip(out[0]["response"]["body"]["data"], PROMPTS[:2]):
        assert np.abs(np.array(item["probs"]) - _softmax(_logits(hf, ids).astype(np.float64))).max() < 1e-5
    assert "does not generate" in out[1]["error"]["message"]


def test_generate_cli_on_a_classifier_is_one_line(three_labels, capsys):
    from pdcluster.cli.main import main

    path, _ = three_labels
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--num-kv-blocks", "64",
                 "--max-model-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "does not generate" in err and "Traceback" not in err


# ---- disaggregated ------------------------------------------------------------------------------------------------

def test_the_prefill_worker_classifies_and_no_kv_moves(three_labels):
    """A real prefill and decode worker over tcp: the decode worker asks the prefill worker for the logits alone (no
    decode-side block, no KV moved); they equal the single engine's."""
    from disagg_pooling import pooled_over_tcp

    path, _ = three_labels
    num_blocks = 64
    cfg = engine_config(str(path), num_kv_blocks=num_blocks, max_model_len=256, prefill_chunk_size=16)
    want = make_engine(str(path), num_kv_blocks=num_blocks, max_model_len=256).classify(PROMPTS, activation=False)
    got = pooled_over_tcp(cfg, PROMPTS, SamplingParams(max_tokens=1, pooling="classify"))
    for i, (vec, logits) in enumerate(zip(got, want)):
        assert np.abs(vec - logits).max() < 1e-5, i


# ---- on a GPU -----------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_logits_equal_transformers(three_labels):
    """float32 on the GPU with decode CUDA graphs and async scheduling: the head's logits are transformers'."""
    path, hf = three_labels
    engine = make_engine(str(path), device="cuda", num_kv_blocks=64, max_model_len=256, prefill_chunk_size=32,
                         async_scheduling=True)
    for ids, got in zip(PROMPTS, engine.classify(PROMPTS, activation=False)):
        assert np.abs(got - _logits(hf, ids)).max() < 1e-4
