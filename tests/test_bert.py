"""Encoder-only models (engine/models/bert.py): BERT and XLM-RoBERTa embedding models and cross-encoders, made tiny by
transformers (engine/models/tiny_bert.py) and checked against transformers itself:

- embeddings pooled by [CLS] and by mean equal transformers' last hidden states, in a batch of prompts of different
  lengths; a pair's token types (BERT: 1 from its second text on) and RoBERTa's positions (from pad + 1) as the
  tokenizer and transformers make them;
- a cross-encoder's scores (sigmoid of its head over [CLS]) equal transformers', offline and served (/score, /rerank);
- a prompt is never split across steps (a step too small for one is refused at load; prompts wait for a step that
  holds them whole), nothing is prefix-cached, and the model does not generate (a clear error, HTTP 400);
- bf16 (the CPU default): a prompt's embedding is the same alone and in a batch;
- disaggregated, the prefill worker pools and no KV moves.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import engine_config, make_engine
from encoder_cuda import assert_equal_to_transformers_on_cuda, on_cuda
from pdcluster.engine.llm_engine import InvalidRequestError
from pdcluster.engine.models.tiny_bert import build_tiny_bert, transformers_outputs
from pdcluster.engine.sampling_params import SamplingParams

TEXTS = ["the quick brown fox", "paris is the capital of france . berlin is in germany , rome in italy",
         "an encoder reads every token both ways and pools them into one vector", "dog"]
QUERY = "what is the capital of france ?"
DOCS = ["paris is the capital and largest city of france .", "the lazy dog sleeps in the warm sun",
        "berlin is in germany", "keys and values move between prefill and decode workers"]
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return {kind: build_tiny_bert(root / kind, kind) for kind in ("bert", "bert-cross", "xlm-roberta",
                                                                 "xlm-roberta-cross")}


def _engine(path, **kwargs):
    kwargs.setdefault("max_model_len", 0)  # the model's own (64 positions)
    kwargs.setdefault("num_kv_blocks", 0)
    return make_engine(str(path), **kwargs)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_embeddings_equal_transformers(models, kind):
    """[CLS] and mean pooling over a batch of prompts of four lengths: transformers' last hidden states, row 0 and
    the mean over the prompt (its [CLS] and [SEP] included, as sentence-transformers' mean over the mask)."""
    engine = _engine(models[kind])
    want = transformers_outputs(models[kind], TEXTS)
    cls = engine.embed(TEXTS, pooling="cls", normalize=False)
    mean = engine.embed(TEXTS, pooling="mean", normalize=False)
    for got_cls, got_mean, ref in zip(cls, mean, want):
        assert np.abs(got_cls - ref[0].numpy()).max() < TOL
        assert np.abs(got_mean - ref.mean(0).numpy()).max() < TOL
    # Normalised (vLLM's default): unit length, the same direction.
    unit = engine.embed(TEXTS[:1], pooling="cls")[0]
    assert abs(np.linalg.norm(unit) - 1) < 1e-5 and np.abs(unit - cls[0] / np.linalg.norm(cls[0])).max() < 1e-6
    # The prompt is what the tokenizer's template makes of the text: [CLS] / <s> first, [SEP] / </s> last.
    ids = engine.tokenize(TEXTS[0])
    special = ("[CLS]", "[SEP]") if kind == "bert" else ("<s>", "</s>")
    assert [engine.tokenizer._tok.id_to_token(i) for i in (ids[0], ids[-1])] == list(special)


def test_the_tiny_models_are_the_same_on_every_build(tmp_path):
    """Two builds give one tokenizer and one set of weights. (A WordPiece vocabulary trained by tokenizers broke ties
    in hash order: five builds gave five vocabularies, and a CI run got a model on which the check below held by a
    fifth of its margin.)"""
    from tokenizers import Tokenizer

    a, b = (build_tiny_bert(tmp_path / name, "bert-cross") for name in ("a", "b"))
    assert Tokenizer.from_file(str(a / "tokenizer.json")).get_vocab() == \
        Tokenizer.from_file(str(b / "tokenizer.json")).get_vocab()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_roberta_positions_count_from_pad_plus_one(models):
    """XLM-R's prompts take positions pad + 1 on: ours computed from 0 would differ from transformers' (this is what
    makes the test above fail when the offset is lost)."""
    from pdcluster.engine.models.bert import BertArch

    arch = BertArch.from_dir(models["xlm-roberta"])
    assert arch.family == "roberta" and arch.position_offset == arch.pad_token_id + 1 == 2
    assert arch.max_position_embeddings == 64  # the table's 66 rows less the offset


@pytest.mark.parametrize("kind", ["bert-cross", "xlm-roberta-cross"])
def test_cross_encoder_scores_equal_transformers(models, kind):
    """A (query, document) pair read as the tokenizer's pair template, with BERT's token types 1 from the document on:
    sigmoid(head([CLS])) equals transformers' given the tokenizer's type ids; the raw logits too."""
    engine = _engine(models[kind])
    want = [float(torch.sigmoid(x)[0]) for x in transformers_outputs(models[kind], [(QUERY, d) for d in DOCS])]
    assert max(want) - min(want) > 0.01  # an order to check
    got = engine.score(QUERY, DOCS)
    assert np.abs(np.array(got) - np.array(want)).max() < TOL, (got, want)
    pairs = [engine.tokenizer.encode_pair(QUERY, d) for d in DOCS]
    logits = engine.classify(pairs, activation=False)
    assert all(x.shape == (1,) for x in logits)
    assert np.abs(1 / (1 + np.exp(-np.array([x[0] for x in logits]))) - np.array(want)).max() < TOL


def test_bert_token_types_are_the_pair_templates(models):
    """Dropping the pair's token types moves transformers' scores well past the tolerance: the test above fails
    without them (ours derives them from the first [SEP])."""
    import transformers
    from tokenizers import Tokenizer

    path = models["bert-cross"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = transformers.BertForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    enc = tok.encode(QUERY, DOCS[0])
    assert 0 < enc.type_ids.count(1) < len(enc.ids)
    with torch.no_grad():
        typed = model(torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits
        untyped = model(torch.tensor([enc.ids])).logits
    assert (typed - untyped).abs().max() > 1e-2
    from pdcluster.engine.models.bert import BertModel

    ours = BertModel.load(path, torch.float32, 64)
    ids = torch.tensor(enc.ids)
    spans = [(0, len(enc.ids))]
    assert ours._token_types(ids, spans).tolist() == enc.type_ids


def test_prompts_are_never_split_and_nothing_is_cached(models):
    """A step of 64 tokens holds one 40-token prompt at a time: every prompt is computed whole, in its own step, and the
    embeddings equal the big-step engine's. A step too small for the model's context is refused at load."""
    path = models["bert"]
    texts = [" ".join(["paris is the capital of france ."] * 5) + f" {i}" for i in range(3)]
    want = _engine(path).embed(texts, pooling="mean", normalize=False)
    engine = _engine(path, max_num_batched_tokens=64, enable_prefix_caching=True)
    assert not engine.config.enable_prefix_caching and engine.scheduler.whole_prompts
    lens = [len(engine.tokenize(t)) for t in texts]
    assert all(32 < n < 64 for n in lens)
    steps, schedule = [], engine.scheduler.schedule

    def recording():  # the real scheduler's choices, written down
        out = schedule()
        steps.append([(s.num_computed_tokens, s.num_scheduled_tokens, s.num_prompt_tokens) for s in out.scheduled
                      if s.num_computed_tokens < s.num_prompt_tokens])
        return out

    engine.scheduler.schedule = recording
    got = engine.embed(texts, pooling="mean", normalize=False)
    prompt_rows = [row for step in steps for row in step]
    assert sorted(n for _, n, _ in prompt_rows) == sorted(lens), steps  # one row a prompt, nothing recomputed
    assert all(start == 0 and n == total for start, n, total in prompt_rows), steps
    assert all(len(step) <= 1 for step in steps), steps  # two prompts never fit one 64-token step
    for g, w in zip(got, want):
        assert np.abs(g - w).max() < TOL
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    with pytest.raises(ValueError, match="raise --max-num-batched-tokens"):
        _engine(path, max_num_batched_tokens=32)


def test_async_scheduling_keeps_the_vectors(models):
    """Async scheduling (the next step scheduled while this one runs) in 64-token steps: the same vectors as the
    synchronous engine, every block free after."""
    path = models["bert"]
    texts = TEXTS * 4
    want = _engine(path).embed(texts, pooling="cls")
    engine = _engine(path, async_scheduling=True, max_num_batched_tokens=64)
    assert engine.config.async_scheduling
    for got, w in zip(engine.embed(texts, pooling="cls"), want):
        assert np.array_equal(got, w)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


def test_a_bare_encoder_saved_under_its_model_prefix_loads(models, tmp_path):
    """Some BertModel checkpoints keep the encoder's tensors under ``bert.`` (saved from a task model): the same
    vectors."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(models["bert"], tmp_path / "prefixed")
    weights = load_file(str(tmp_path / "prefixed" / "model.safetensors"))
    save_file({f"bert.{k}": v for k, v in weights.items()}, str(tmp_path / "prefixed" / "model.safetensors"))
    want = _engine(models["bert"]).embed(TEXTS, pooling="cls")
    for got, w in zip(_engine(tmp_path / "prefixed").embed(TEXTS, pooling="cls"), want):
        assert np.array_equal(got, w)


@pytest.mark.parametrize("change, needle", [({"position_embedding_type": "relative_key"}, "position_embedding_type"),
                                            ({"is_decoder": True}, "only encoders"),
                                            ({"hidden_act": "swish"}, "hidden_act 'swish' is not supported")])
def test_what_is_not_served_is_refused_in_one_line(models, tmp_path, change, needle):
    import shutil

    from pdcluster.engine.models.bert import BertArch

    path = shutil.copytree(models["bert"], tmp_path / "changed")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=needle):
        BertArch.from_dir(path)


def test_an_encoder_does_not_generate(models):
    engine = _engine(models["bert"])
    with pytest.raises(InvalidRequestError, match="encoder-only: it does not generate"):
        engine.generate(["the quick brown fox"], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="no classification head"):
        engine.classify(["a fox"])
    for flag, needle in (({"spec_method": "ngram", "num_spec_tokens": 2}, "speculative decoding"),
                         ({"tensor_parallel_size": 2}, "tensor parallelism")):
        with pytest.raises(ValueError, match=needle):
            _engine(models["bert"], **flag)


def test_bf16_embedding_is_the_same_alone_and_in_a_batch(models):
    """bf16 (what a CPU with AMX / avx512_bf16 serves by default): each prompt's vector does not depend on the others
    in its step; and it stays near the float32 one."""
    path = models["xlm-roberta"]
    engine = _engine(path, dtype="bfloat16")
    batch = engine.embed(TEXTS, pooling="cls")
    alone = [engine.embed([t], pooling="cls")[0] for t in TEXTS]
    for a, b in zip(batch, alone):
        assert np.array_equal(a, b)
    fp32 = _engine(path).embed(TEXTS, pooling="cls")
    assert max(np.abs(a - b).max() for a, b in zip(batch, fp32)) < 0.05


def test_sentence_transformers_pooling_and_the_encoder_default(models, tmp_path):
    """The pooler an API server uses: a sentence-transformers directory's Pooling mode (cls / mean), else [CLS] for an
    encoder (vLLM's default for BERT-like models), the last token for a decoder; an encoder is marked not to
    generate."""
    from pdcluster.cluster.api.embeddings import pooler_config

    for mode in ("cls", "mean"):
        path = build_tiny_bert(tmp_path / mode, "bert", pooling=mode)
        pooler = pooler_config(path)
        assert pooler.pooling_type == mode and pooler.normalize and pooler.encoder_only
    pooler = pooler_config(models["bert"])
    assert pooler.pooling_type == "cls" and pooler.encoder_only and pooler.classifier is None
    assert pooler_config(models["xlm-roberta-cross"]).classifier.num_labels == 1


# ---- served ---------------------------------------------------------------------------------------------------------

def _post(url: str, path: str, body: dict):
    import httpx

    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_served_embeddings_scores_and_a_clear_400_for_generation(models):
    """The real HTTP app over a local router: /v1/embeddings (through the openai client) answers the engine's
    normalised [CLS] vectors; the cross-encoder's /score and /rerank answer transformers' scores; completions and chat
    answer 400 naming what the model serves."""
    from openai import OpenAI

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    path = models["bert"]
    want = _engine(path).embed(TEXTS, pooling="cls")
    router = LocalRouter(engine_config(str(path), max_model_len=0, num_kv_blocks=0), request_timeout_s=60)
    try:
        with serving(build_app(router, "emb")) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            got = client.embeddings.create(model="emb", input=TEXTS)
            for item, w in zip(got.data, want):
                assert np.abs(np.array(item.embedding) - w).max() < 1e-5
            assert got.usage.prompt_tokens == sum(len(router.tokenizer.encode(t, add_special_tokens=True))
                                                  for t in TEXTS)
            # truncate_prompt_tokens keeps [CLS] (what is pooled) and the last k - 1 tokens, [SEP] among them.
            ids = router.tokenizer.encode(TEXTS[1], add_special_tokens=True)
            r = _post(url, "/v1/embeddings", {"model": "emb", "input": TEXTS[1], "truncate_prompt_tokens": 6})
            assert r.status_code == 200, r.text
            cut = _engine(path).embed([ids[:1] + ids[-5:]], pooling="cls")[0]
            assert r.json()["usage"]["prompt_tokens"] == 6
            assert np.abs(np.array(r.json()["data"][0]["embedding"]) - cut).max() < 1e-5
            # truncation_side "right": [CLS], the first k - 2 text tokens and [SEP].
            r = _post(url, "/v1/embeddings", {"model": "emb", "input": TEXTS[1], "truncate_prompt_tokens": 6,
                                              "truncation_side": "right"})
            first = _engine(path).embed([ids[:5] + ids[-1:]], pooling="cls")[0]
            assert r.status_code == 200 and np.abs(np.array(r.json()["data"][0]["embedding"]) - first).max() < 1e-5
            assert np.abs(first - cut).max() > 1e-3  # the two sides keep different tokens
            for route, body in (("/v1/completions", {"prompt": "the fox", "max_tokens": 3}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                r = _post(url, route, {"model": "emb", **body})
                assert r.status_code == 400 and "encoder-only embedding model" in r.text, r.text
            r = _post(url, "/score", {"text_1": QUERY, "text_2": DOCS[:2]})  # an embedding model: the cosine
            assert r.status_code == 200, r.text
            vectors = _engine(path).embed([QUERY] + DOCS[:2], pooling="cls")
            cos = [float(np.dot(vectors[0], v)) for v in vectors[1:]]
            assert np.abs(np.array([item["score"] for item in r.json()["data"]]) - np.array(cos)).max() < 1e-5
    finally:
        router.close()
    path = models["bert-cross"]
    want = [float(torch.sigmoid(x)[0]) for x in transformers_outputs(path, [(QUERY, d) for d in DOCS])]
    router = LocalRouter(engine_config(str(path), max_model_len=0, num_kv_blocks=0), request_timeout_s=60)
    try:
        with serving(build_app(router, "ce")) as url:
            r = _post(url, "/score", {"text_1": QUERY, "text_2": DOCS})
            assert r.status_code == 200, r.text
            got = [item["score"] for item in r.json()["data"]]
            assert np.abs(np.array(got) - np.array(want)).max() < 1e-5
            r = _post(url, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
            assert r.status_code == 200, r.text
            order = [x["index"] for x in r.json()["results"]]
            assert order == list(np.argsort(want)[::-1][:2])
            r = _post(url, "/v1/completions", {"model": "ce", "prompt": "the fox", "max_tokens": 3})
            assert r.status_code == 400 and "sequence classifier" in r.text, r.text
    finally:
        router.close()


# ---- disaggregated ------------------------------------------------------------------------------------------------

def test_the_prefill_worker_embeds_and_no_kv_moves(models):
    """A real prefill and decode worker over tcp: the decode worker asks the prefill worker for the vector alone; it
    equals the single engine's, no byte of KV is sent and every block is free after."""
    from disagg_pooling import pooled_over_tcp

    path = models["xlm-roberta"]
    engine = _engine(path)
    prompts = [engine.tokenize(t) for t in TEXTS]
    want = engine.embed(prompts, pooling="cls", normalize=False)
    got = pooled_over_tcp(engine_config(str(path), max_model_len=0, num_kv_blocks=0), prompts,
                          SamplingParams(max_tokens=1, pooling="cls"))
    for i, (vec, w) in enumerate(zip(got, want)):
        assert np.abs(vec - w).max() < 1e-5, i


# ---- on a GPU -----------------------------------------------------------------------------------------------------

@on_cuda
def test_on_cuda_embeddings_and_scores_equal_transformers(models):
    """float32 on the GPU: [CLS] and mean embeddings of prompts of four lengths, and a cross-encoder's scores."""
    assert_equal_to_transformers_on_cuda(_engine, models["bert"], models["bert-cross"], TEXTS, QUERY, DOCS)
