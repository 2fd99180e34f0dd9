"""Prompts given as embeddings (vLLM's prompt_embeds, engine/prompt_embeds.py): the rows stand where transformers
takes ``inputs_embeds`` (Llama, Granite's multiplier after them, Gemma 3's scale before them), through chunked
prefill, preemption, the prefix cache, bf16, a tensor-parallel split and a prefill/decode pair; served on
/v1/completions under --enable-prompt-embeds; refused with reasons otherwise."""

from __future__ import annotations

import base64
import dataclasses
import io
import re
import shutil

import httpx
import msgpack
import openai
import pytest
import torch

from conftest import engine_config
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.media_policy import MediaPolicy
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.beam_search import BeamSearchParams
from pdcluster.engine.block_manager import StoredRun, block_keys, chained_block_hashes
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import InvalidRequestError, LLMEngine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.random_weights import redraw_nemotron_h
from pdcluster.engine.prompt_embeds import PromptEmbeds, prompt_embeds_from_pieces, prompt_embeds_from_tensor
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.kv_event_publisher import extra_keys
from test_api import serving
from test_kv_transfer_e2e import Events, _collect_tokens, _wait_free, connected_pair

transformers = pytest.importorskip("transformers")
# One torch thread, models and references included: on the 2-core CI box a second thread starves the other xdist
# worker's timing-sensitive tests (a transfer's peer timeout ran out beside this file's transformers references).
pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

NUM_NEW = 8
PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far"]


def _random_rows(table: torch.Tensor, num_tokens: int, seed: int) -> torch.Tensor:
    """Rows no token id gives, at the embedding table's scale (float32)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, table.shape[1], generator=g) * table.float().std()


def hf_greedy_from_embeds(model, embeds: torch.Tensor, num_new: int) -> list[int]:
    """transformers' greedy tokens after ``inputs_embeds`` (each new token's row from its own input embeddings:
    the whole sequence recomputed a step, so no model's cache layout matters)."""
    table = model.get_input_embeddings()
    rows, out = embeds.float(), []
    with torch.no_grad():
        for _ in range(num_new):
            token = int(model(inputs_embeds=rows[None]).logits[0, -1].argmax())
            out.append(token)
            rows = torch.cat([rows, table(torch.tensor([token])).float()])
    return out


def _b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


# ================================================================================== the engine


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32", num_kv_blocks=128,
                                              max_model_len=512, enable_prompt_embeds=True), progress=False)


@pytest.fixture(scope="module")
def random_cases(smollm2, hf_model) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Two prompts of random rows for SmolLM2 (11 and 23 rows) and transformers' greedy tokens after each."""
    given = [_random_rows(smollm2.model.embed_tokens, 11, 1), _random_rows(smollm2.model.embed_tokens, 23, 2)]
    return given, [hf_greedy_from_embeds(hf_model, rows, NUM_NEW) for rows in given]


def test_rows_no_token_gives_equal_transformers_inputs_embeds(smollm2, random_cases):
    """Random rows (no token's embedding): transformers' greedy tokens from the same inputs_embeds, alone and batched
    beside a text prompt; the table's rows of a prompt's ids give that prompt's tokens."""
    table = smollm2.model.embed_tokens
    given, want = random_cases
    assert want[0] != want[1]
    alone = [smollm2.generate([{"prompt_embeds": rows}], PARAMS)[0] for rows in given]
    assert [o.token_ids for o in alone] == want
    assert alone[0].prompt_token_ids == [0] * 11  # placeholders, as vLLM's
    ids = smollm2.tokenize(TEXTS[0])
    text_tokens = smollm2.generate([ids], PARAMS)[0].token_ids
    batch = smollm2.generate([{"prompt_embeds": given[0]}, ids, {"prompt_embeds": table[ids].clone()},
                              {"prompt_embeds": given[1][None]}], PARAMS)  # [1, n, hidden] too
    assert [o.token_ids for o in batch] == [want[0], text_tokens, text_tokens, want[1]]


def test_chunked_preempted_and_kept_apart_in_the_prefix_cache(tiny_dir):
    """Prefill chunks of 5 rows and a pool too small for all at once (preemption recomputes from the rows the request
    carries): each prompt's tokens alone. In the prefix cache each block is keyed by its rows: the same rows again are
    a hit, a prompt sharing its first 20 rows hits the two whole blocks of them, other rows of the same length (the
    same placeholder ids) hit nothing; each gets its own tokens."""
    roomy = LLMEngine.from_config(engine_config(enable_prompt_embeds=True), progress=False)
    table = roomy.model.embed_tokens
    given = [_random_rows(table, n, seed) for seed, n in enumerate((37, 41, 37, 29))]
    given.append(torch.cat([given[0][:20], given[1][20:]]))  # 41 rows, the first 20 of given[0]
    alone = [roomy.generate([{"prompt_embeds": rows}], PARAMS)[0].token_ids for rows in given]
    assert alone[0] != alone[2] and alone[0] != alone[4]
    tight = LLMEngine.from_config(engine_config(enable_prompt_embeds=True, num_kv_blocks=9, block_size=8, max_num_seqs=4,
                                                max_num_batched_tokens=5, enable_prefix_caching=False), progress=False)
    assert [o.token_ids for o in tight.generate([{"prompt_embeds": r} for r in given], PARAMS)] == alone
    assert tight.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    cached = LLMEngine.from_config(engine_config(enable_prompt_embeds=True, block_size=8), progress=False)
    first = cached.generate([{"prompt_embeds": given[0]}], PARAMS)[0]
    other = cached.generate([{"prompt_embeds": given[2]}], PARAMS)[0]  # same length, other rows
    again = cached.generate([{"prompt_embeds": given[0]}], PARAMS)[0]
    shared = cached.generate([{"prompt_embeds": given[4]}], PARAMS)[0]
    assert [o.token_ids for o in (first, other, again, shared)] == [alone[0], alone[2], alone[0], alone[4]]
    assert (other.num_cached_tokens, again.num_cached_tokens, shared.num_cached_tokens) == (0, 32, 16)
    hashes = [chained_block_hashes([0] * 37, 8, None, block_keys(SamplingParams(prompt_embeds=prompt_embeds_from_tensor(
        r)), 8)) for r in (given[0], given[2], given[4])]
    assert not set(hashes[0]) & set(hashes[1]) and hashes[2][:2] == hashes[0][:2] and hashes[2][2] != hashes[0][2]
    # KV events tag those blocks as vLLM's do: ("prompt_embeds", the block's rows' digest).
    keys = block_keys(SamplingParams(prompt_embeds=prompt_embeds_from_tensor(given[3])), 8)  # 29 rows: 4 blocks
    run = StoredRun(hashes[0][:4], None, [0] * 32, 0, prompt_embeds_keys=tuple(keys))
    assert extra_keys(run, 8) == [(("prompt_embeds", k.hex()),) for k in keys]


def test_resumed_as_a_recovery_resumes_it(tiny_dir):
    """A recovery re-prefills the prompt with the tokens streamed so far after it (output_position_offset, as the
    router sends it to another worker): the rows cover the prompt, the outputs are ids, and the rest of the answer is
    the uninterrupted one's; with repetition_penalty too (the outputs count, the placeholders do not)."""
    eng = LLMEngine.from_config(engine_config(enable_prompt_embeds=True), progress=False)
    rows = _random_rows(eng.model.embed_tokens, 21, 11)
    for params in (PARAMS, dataclasses.replace(PARAMS, repetition_penalty=1.5)):
        full = eng.generate([{"prompt_embeds": rows}], params)[0].token_ids
        ids, given = eng.with_prompt_embeds({"prompt_embeds": rows}, params)
        rest = eng.generate([ids + full[:3]], dataclasses.replace(given, max_tokens=NUM_NEW - 3,
                                                                  output_position_offset=3))[0].token_ids
        assert full[:3] + rest == full


@pytest.mark.parametrize("spec_method", ["ngram", "mtp", "draft_model", "async"])
def test_speculation_stays_lossless(tiny_dir, spec_method):
    """Drafts made from placeholder ids (n-gram), from the target's hidden states (MTP) or by a draft model that
    reads the ids, and async scheduling (the next step prepared while this one runs): the tokens of a plain run."""
    plain = LLMEngine.from_config(engine_config(enable_prompt_embeds=True), progress=False)
    given = [_random_rows(plain.model.embed_tokens, n, n) for n in (13, 26)]
    want = [o.token_ids for o in plain.generate([{"prompt_embeds": r} for r in given], PARAMS)]
    how = dict(async_scheduling=True) if spec_method == "async" else dict(spec_method=spec_method, num_spec_tokens=3)
    spec = LLMEngine.from_config(engine_config(enable_prompt_embeds=True, **how), progress=False)
    assert [o.token_ids for o in spec.generate([{"prompt_embeds": r} for r in given], PARAMS)] == want


def test_beam_search_steps_carry_the_rows(tiny_dir):
    """vLLM's beam search (one engine call a step: the beam's tokens after the prompt's rows): the table's rows of a
    prompt give that prompt's beams; random rows give beams of their own."""
    eng = LLMEngine.from_config(engine_config(enable_prompt_embeds=True), progress=False)
    ids = eng.tokenize(TEXTS[2])
    beam = BeamSearchParams(beam_width=3, max_tokens=6)

    def beams(prompt, request=None):
        return [(b.output_token_ids, round(b.cum_logprob, 4)) for b in eng.beam_search([prompt], beam, request)[0]]

    rows = eng.model.embed_tokens[ids].clone()
    by_ids = beams(ids)
    assert beams([0] * len(ids), dataclasses.replace(PARAMS, prompt_embeds=prompt_embeds_from_tensor(rows))) == by_ids
    other = _random_rows(eng.model.embed_tokens, len(ids), 3)
    assert beams([0] * len(ids), dataclasses.replace(PARAMS, prompt_embeds=prompt_embeds_from_tensor(other))) != by_ids


def test_bf16_rows_of_the_ids_and_batch_invariant(smollm2_dir):
    """bf16 (the CPU default where it has avx512_bf16), deterministic: the table's rows of a prompt give its tokens,
    and a prompt given as rows gets the same tokens alone and in a batch."""
    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="bfloat16", num_kv_blocks=128,
                                             max_model_len=512, enable_prompt_embeds=True, deterministic=True),
                                progress=False)
    table = eng.model.embed_tokens
    ids = [eng.tokenize(t) for t in TEXTS]
    by_ids = [o.token_ids for o in eng.generate(ids, PARAMS)]
    by_rows = [eng.generate([{"prompt_embeds": table[i].float()}], PARAMS)[0].token_ids for i in ids]
    assert by_rows == by_ids
    rows = _random_rows(table, 19, 5)
    alone = eng.generate([{"prompt_embeds": rows}], PARAMS)[0].token_ids
    mixed = eng.generate([ids[1], {"prompt_embeds": rows}, ids[2]], PARAMS)[1].token_ids
    assert mixed == alone


def test_repetition_penalty_leaves_the_placeholders_alone(tiny_dir):
    """The placeholder ids are no prompt tokens: repetition_penalty does not penalise token 0 for them (vLLM's
    does). Token 0 is set 0.5 above token a; a penalty of 2 on token 0 would make a the greedy choice."""
    eng = LLMEngine.from_config(engine_config(enable_prompt_embeds=True), progress=False)
    rows = _random_rows(eng.model.embed_tokens, 13, 7)
    top = eng.generate([{"prompt_embeds": rows}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1))[0]
    a = top.token_ids[0]
    assert a != 0

    def logprob_of(token: int) -> float:
        out = eng.generate([{"prompt_embeds": rows}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                                                                     allowed_token_ids=[token]))[0]
        assert out.token_ids == [token]
        return out.logprobs[0].logprob  # raw: before the mask

    bias = [[a, 50.0], [0, 50.0 + logprob_of(a) - logprob_of(0) + 0.5]]
    params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=[0, a], logit_bias=bias,
                            repetition_penalty=2.0)
    assert eng.generate([{"prompt_embeds": rows}], params)[0].token_ids == [0]


def _tiny_granite(out, tokenizer_dir, hybrid: bool):
    """A Granite (dense: our Llama path) or Granite hybrid (attention layers only: our NemotronH path), weights
    redrawn so that the blocks outweigh the embeddings (else the rows' scale, the multiplier's, would not show)."""
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0, embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22,
                 logits_scaling=16.0)
    torch.manual_seed(0)
    if hybrid:
        model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
            **shape, layer_types=["attention"] * 3, position_embedding_type="rope", num_local_experts=0))
    else:
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**shape))
    redraw_nemotron_h(model)
    model.save_pretrained(str(out))
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.mark.parametrize("family", ["granite", "granite_hybrid", "gemma3"])
def test_rows_stand_where_transformers_takes_them(family, tmp_path):
    """Granite multiplies its embeddings after transformers' inputs_embeds (ours too); Gemma 3's input embeddings
    are scaled already (the scale is not applied again): random rows give transformers' greedy tokens."""
    tiny = resolve_model("tiny-random", progress=False)
    if family.startswith("granite"):
        model_dir = _tiny_granite(tmp_path / family, tiny, hybrid=family == "granite_hybrid")
        hf = (transformers.GraniteMoeHybridForCausalLM if family == "granite_hybrid"
              else transformers.GraniteForCausalLM).from_pretrained(str(model_dir), dtype=torch.float32)
    else:
        from pdcluster.engine.multimodal.tiny_gemma3 import build_tiny_gemma3

        model_dir = build_tiny_gemma3(tmp_path / "gemma3", tiny)
        hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    hf = hf.eval()
    eng = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                                             max_model_len=256, enable_prompt_embeds=True), progress=False)
    table = hf.get_input_embeddings().weight.detach()
    for seed in (1, 2):
        rows = _random_rows(table, 17, seed)
        assert eng.generate([{"prompt_embeds": rows}], PARAMS)[0].token_ids == hf_greedy_from_embeds(hf, rows, NUM_NEW)


def test_refused_with_reasons(tiny_dir):
    """Off by default (vLLM's flag named); rows of another width, integers, NaNs, no rows, prompt_logprobs and
    images beside them are refused by name, and nothing is queued. The rows cross msgpack as bytes, checked by
    their digest, and a copied SamplingParams keeps the checked object."""
    off = LLMEngine.from_config(engine_config(), progress=False)
    with pytest.raises(InvalidRequestError, match="enable_prompt_embeds"):
        off.add_request({"prompt_embeds": torch.zeros(3, off.arch.hidden_size)}, PARAMS)
    embeds = prompt_embeds_from_tensor(torch.ones(3, off.arch.hidden_size))
    with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds"):  # a worker of a server without the flag
        off.add_remote_request("r", [0, 0, 0], dataclasses.replace(PARAMS, prompt_embeds=embeds))
    eng = LLMEngine.from_config(engine_config(enable_prompt_embeds=True), progress=False)
    hidden = eng.arch.hidden_size
    for bad, says in ((torch.zeros(4, hidden + 1), f"hidden size {hidden + 1} does not match the model's hidden "
                                                   f"size {hidden}"),
                      (torch.zeros(4, hidden, dtype=torch.int32), "floating-point"),
                      (torch.full((4, hidden), float("nan")), "NaN"),
                      (torch.zeros(0, hidden), "non-empty 2D"),
                      (torch.zeros(2, 2, hidden), "non-empty 2D"),
                      ([[0.0] * hidden], "must be a tensor")):
        with pytest.raises(InvalidRequestError, match=says):
            eng.add_request({"prompt_embeds": bad}, PARAMS)
    with pytest.raises(InvalidRequestError, match="alone"):
        eng.add_request({"prompt_embeds": torch.zeros(3, hidden), "prompt": "x"}, PARAMS)
    with pytest.raises(ValueError, match="prompt_logprobs is not compatible"):
        eng.add_request({"prompt_embeds": torch.zeros(3, hidden)}, SamplingParams(prompt_logprobs=1))
    with pytest.raises(InvalidRequestError, match="rows up to position 3 in a prompt of 2 tokens"):
        eng.add_remote_request("r", [0, 0], dataclasses.replace(PARAMS, prompt_embeds=embeds))
    assert not eng.has_unfinished() and not off.has_unfinished()
    params = dataclasses.replace(PARAMS, prompt_embeds=embeds)
    assert dataclasses.replace(params, seed=3).prompt_embeds is params.prompt_embeds  # checked once
    wired = msgpack.unpackb(msgpack.packb(dataclasses.asdict(params), use_bin_type=True), raw=False)
    assert SamplingParams(**wired).prompt_embeds == embeds
    with pytest.raises(ValueError, match="digest does not match"):
        SamplingParams(prompt_embeds={**wired["prompt_embeds"], "digest": "0" * 32})
    assert isinstance(SamplingParams(**wired).prompt_embeds, PromptEmbeds)


@pytest.mark.usefixtures("one_torch_thread")
def test_tensor_parallel_split(tiny_dir):
    """On a tensor-parallel split (2 CPU ranks) the other rank gets the rows with each forward: the whole model's
    tokens."""
    whole = LLMEngine.from_config(engine_config(enable_prompt_embeds=True), progress=False)
    given = [_random_rows(whole.model.embed_tokens, n, n) for n in (9, 30)]
    want = [o.token_ids for o in whole.generate([{"prompt_embeds": r} for r in given], PARAMS)]
    split = LLMEngine.from_config(engine_config(enable_prompt_embeds=True, tensor_parallel_size=2, max_num_seqs=8),
                                  progress=False)
    try:
        assert split.model.tp_driver is not None
        assert [o.token_ids for o in split.generate([{"prompt_embeds": r} for r in given], PARAMS)] == want
    finally:
        split.close()


def test_disaggregated_over_tcp(tiny_dir):
    """The prefill worker computes the prompt from the rows the request carries (over the workers' msgpack
    messages) and sends its KV; the decode worker decodes: the tokens of one engine, every block free after."""
    cfg = engine_config(enable_prompt_embeds=True, num_kv_blocks=64)
    eng = LLMEngine.from_config(cfg, progress=False)
    given = [_random_rows(eng.model.embed_tokens, n, n) for n in (9, 30)]
    want = [o.token_ids for o in eng.generate([{"prompt_embeds": r} for r in given], PARAMS)]
    events, ids = Events(), ["r0", "r1"]
    with connected_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        for rid, rows in zip(ids, given):
            d.submit(rid, *eng.with_prompt_embeds({"prompt_embeds": rows}, PARAMS), "p0")
        tokens = _collect_tokens(events, ids, timeout_s=120)
        for worker in (p, d):
            _wait_free(worker, cfg.num_kv_blocks, 5)
    assert [tokens[rid] for rid in ids] == want


# ================================================================================== served


@dataclasses.dataclass
class Served:
    client: openai.OpenAI
    http: httpx.Client

    @property
    def completions(self):
        return self.client.completions


@pytest.fixture(scope="module")
def served(smollm2_dir, smollm2):
    router = LocalRouter(EngineConfig(model=str(smollm2_dir), dtype="float32", num_kv_blocks=128, max_model_len=512,
                                      enable_prompt_embeds=True), request_timeout_s=60)
    app = build_app(router, "smollm2", media=MediaPolicy(enable_prompt_embeds=True))
    try:
        with serving(app) as base_url:
            yield Served(openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60),
                         httpx.Client(base_url=base_url, timeout=60))
    finally:
        router.close()


def test_served_on_completions(served, smollm2, random_cases, hf_model):
    """vLLM's prompt_embeds on /v1/completions with the openai client: transformers' tokens for the rows; with a
    text prompt too, the rows' choices first; streamed the same; usage counts the rows; return_token_ids shows the
    placeholders; truncate_prompt_tokens keeps the last rows."""
    rows, want = random_cases
    extra = {"prompt_embeds": _b64(rows[0]), "ignore_eos": True, "return_token_ids": True}
    one = served.completions.create(model="smollm2", prompt=None, max_tokens=NUM_NEW, temperature=0.0,
                                    extra_body=extra)
    assert one.choices[0].token_ids == want[0] and one.usage.prompt_tokens == 11
    assert one.choices[0].prompt_token_ids == [0] * 11
    text_tokens = smollm2.generate([TEXTS[1]], PARAMS)[0].token_ids
    both = served.completions.create(model="smollm2", prompt=TEXTS[1], max_tokens=NUM_NEW, temperature=0.0,
                                     extra_body={**extra, "prompt_embeds": [_b64(r) for r in rows]})
    assert [c.token_ids for c in sorted(both.choices, key=lambda c: c.index)] == [*want, text_tokens]
    assert both.usage.prompt_tokens == 11 + 23 + len(smollm2.tokenize(TEXTS[1]))
    stream = served.completions.create(model="smollm2", prompt=None, max_tokens=NUM_NEW, temperature=0.0,
                                       stream=True, extra_body={"prompt_embeds": _b64(rows[1]), "ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == smollm2.tokenizer.decode(want[1])
    cut = served.completions.create(model="smollm2", prompt=None, max_tokens=NUM_NEW, temperature=0.0,
                                    extra_body={**extra, "truncate_prompt_tokens": 5})  # vLLM's: the last 5 rows
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].token_ids == hf_greedy_from_embeds(hf_model, rows[0][-5:],
                                                                                                NUM_NEW)


def test_served_on_sglang_generate(served, smollm2, random_cases):
    """SGLang's input_embeds on /generate: one prompt's rows, or a batch of them, as JSON numbers: transformers'
    tokens."""
    rows, want = random_cases
    sampling = {"max_new_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True}
    one = served.http.post("/generate", json={"input_embeds": rows[0].tolist(), "sampling_params": sampling})
    assert one.status_code == 200, one.text
    assert one.json()["output_ids"] == want[0] and one.json()["meta_info"]["prompt_tokens"] == 11
    batch = served.http.post("/generate", json={"input_embeds": [r.tolist() for r in rows],
                                                "sampling_params": sampling})
    assert batch.status_code == 200, batch.text
    assert [answer["output_ids"] for answer in batch.json()] == want


def test_served_chat_prompt_embeds_parts(served, smollm2, hf_model):
    """vLLM's chat prompt_embeds parts: the rows stand where the part is among the chat template's tokens. The
    table's rows of a message's text answer as that text does; random rows answer as transformers does from the
    template's token embeddings with the rows between them; two parts in two messages each stand in their own."""
    table = smollm2.model.embed_tokens
    text = "What is the capital of France?"
    plain = served.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}], max_tokens=NUM_NEW, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    rows = table[smollm2.tokenizer.encode(text)].clone()
    as_rows = served.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": [{"type": "prompt_embeds", "data": _b64(rows)}]}],
        max_tokens=NUM_NEW, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert as_rows.choices[0].token_ids == plain.choices[0].token_ids
    head, tail = (len(smollm2.tokenizer.encode(t)) for t in ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"))
    assert as_rows.prompt_token_ids == plain.prompt_token_ids[:-len(rows) - tail] + [0] * len(rows) + \
        plain.prompt_token_ids[-tail:]
    assert plain.prompt_token_ids[-len(rows) - tail - head:-len(rows) - tail] == smollm2.tokenizer.encode(
        "<|im_start|>user\n")
    first, second = _random_rows(table, 6, 8), _random_rows(table, 9, 9)
    messages = [{"role": "user", "content": [{"type": "prompt_embeds", "data": _b64(first)}, {"type": "text",
                                                                                        "text": "and"}]},
                {"role": "assistant", "content": "Yes."},
                {"role": "user", "content": [{"type": "prompt_embeds", "data": _b64(second)}]}]
    answer = served.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=NUM_NEW,
                                                   temperature=0.0, extra_body={"ignore_eos": True,
                                                                                "return_token_ids": True})
    ids = answer.prompt_token_ids
    runs = [i for i, t in enumerate(ids) if t == 0]
    assert len(runs) == 15 and runs[:6] == list(range(runs[0], runs[0] + 6))
    embeds = table[torch.tensor(ids)].clone().float()
    embeds[runs[:6]], embeds[runs[6:]] = first, second
    assert answer.choices[0].token_ids == hf_greedy_from_embeds(hf_model, embeds, NUM_NEW)
    refusals = [([{"role": "user", "content": [{"type": "prompt_embeds", "data": _b64(torch.zeros(3, 5))}]}],
                 "hidden size 5"),
                ([{"role": "user", "content": [{"type": "prompt_embeds", "data": _b64(first)},
                                               {"type": "text", "text": "say <|pdcluster_prompt_embeds_0|>"}]}],
                 "text may not hold it"),
                ([{"role": "user", "content": [{"type": "prompt_embeds", "data": "@@"}]}], "base64 does not decode")]
    for bad, says in refusals:
        with pytest.raises(openai.BadRequestError, match=re.escape(says)):
            served.client.chat.completions.create(model="smollm2", messages=bad, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        served.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2,
                                              extra_body={"prompt_logprobs": 1})
    r = served.http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 400 and "served on /v1/chat/completions" in r.json()["error"]["message"]


def test_mixed_rows_and_ids_equal_transformers(smollm2, hf_model):
    """Rows standing between token ids (a chat's parts: spans), offline: transformers' greedy tokens from the same
    inputs_embeds, also with prefill chunks cutting through the runs."""
    table = smollm2.model.embed_tokens
    ids = smollm2.tokenize("Here is a thing: and here another one: so what are they?")
    pieces = [_random_rows(table, 5, 21), _random_rows(table, 7, 22)]
    offsets = [3, 12]
    prompt = list(ids)
    prompt[3:3] = [0] * 5
    prompt[12:12] = [0] * 7
    embeds = table[torch.tensor(prompt)].clone().float()
    embeds[3:8], embeds[12:19] = pieces
    want = hf_greedy_from_embeds(hf_model, embeds, NUM_NEW)
    params = dataclasses.replace(PARAMS, prompt_embeds=prompt_embeds_from_pieces(pieces, offsets, ["a", "b"]))
    assert smollm2.generate([prompt], params)[0].token_ids == want
    chunked = LLMEngine.from_config(EngineConfig(model=str(smollm2.model_dir), dtype="float32", num_kv_blocks=64,
                                                 max_model_len=256, enable_prompt_embeds=True,
                                                 max_num_batched_tokens=4), progress=False)
    assert chunked.generate([prompt], params)[0].token_ids == want
    with pytest.raises(ValueError, match="overlap"):
        prompt_embeds_from_pieces(pieces, [3, 5], ["a", "b"])


def test_served_refusals(served, smollm2, smollm2_dir):
    """400s naming what is wrong, nothing queued: rows of another width, echo, prompt_logprobs, bad base64, a sparse
    tensor, no prompt at all; a server without --enable-prompt-embeds refuses them by the flag's name."""
    hidden = smollm2.arch.hidden_size
    ok = _b64(torch.zeros(4, hidden))
    cases = [({"prompt_embeds": _b64(torch.zeros(4, hidden - 1))}, f"hidden size {hidden - 1}"),
             ({"prompt_embeds": ok, "echo": True}, "echo is not supported"),
             ({"prompt_embeds": ok, "prompt_logprobs": 1}, "prompt_logprobs is not compatible"),
             ({"prompt_embeds": "@@"}, "base64 does not decode"),
             ({"prompt_embeds": _b64(torch.zeros(4, hidden).to_sparse())}, "one dense tensor"),
             ({"prompt_embeds": []}, "empty list"),
             ({}, "prompt: field required: give prompt")]
    for body, says in cases:
        with pytest.raises(openai.BadRequestError, match=says):
            served.completions.create(model="smollm2", prompt=None, max_tokens=4, extra_body=body)
    router = LocalRouter(EngineConfig(model=str(smollm2_dir), dtype="float32", num_kv_blocks=32, max_model_len=256),
                         request_timeout_s=60)
    try:
        with serving(build_app(router, "smollm2")) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            with pytest.raises(openai.BadRequestError, match="--enable-prompt-embeds"):
                client.completions.create(model="smollm2", prompt=None, max_tokens=4, extra_body={"prompt_embeds": ok})
    finally:
        router.close()
