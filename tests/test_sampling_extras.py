"""vLLM's sampling extensions in the engine: min_p, allowed_token_ids, bad words, cache_salt, and the
detokenization switches (skip_special_tokens, include_stop_str_in_output).

Each logits rule runs where the token is chosen, so it holds on every path: speculative verification sees
the processed distribution (lossless: the tokens of the same request without speculation, seed for seed),
a prefill worker samples the first token with it, and the parameters cross the wire to the decode worker.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import engine_config, make_engine
from test_kv_transfer_e2e import run_on_pair
from pdcluster.engine.block_manager import block_hash_root, chained_block_hashes
from pdcluster.engine.logits_processors import RowContext, apply_penalties
from pdcluster.engine.sampler import batch_probs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Detokenizer
from pdcluster.kv_transfer.config import TransferConfig

pytestmark = pytest.mark.timeout(300)

GEN = torch.Generator().manual_seed(0)
# Repetitive prompts: n-gram drafts find matches, so verification rows carry drafts.
PROMPTS = [(torch.randint(3, 500, (6,), generator=GEN).tolist() * 6)[:30] for _ in range(6)]
ALLOWED = [7, 11, 13, 17, 19]
CASES = {
    "min_p": SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, min_p=0.3, seed=5),
    "allowed": SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, allowed_token_ids=ALLOWED, seed=6),
    "bad_words": SamplingParams(max_tokens=24, ignore_eos=True, bad_words_token_ids=[[0]]),  # filled per prompt
}


@pytest.fixture(scope="module")
def plain():
    return make_engine("tiny-random", num_kv_blocks=512)


def _params(name: str, plain_engine) -> SamplingParams:
    params = CASES[name]
    if name == "bad_words":
        # Ban what greedy decoding makes: two-token sequences and one single token of its output.
        greedy = plain_engine.generate(PROMPTS[:1], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
        params = dataclasses.replace(params, bad_words_token_ids=[greedy[2:4], greedy[8:10], [greedy[5]]])
    return params


def _no_bad_word(tokens, bad):
    return not any(tokens[i : i + len(seq)] == seq for seq in bad for i in range(len(tokens)))


@pytest.mark.parametrize("name", list(CASES))
def test_rules_hold_and_speculation_is_lossless(plain, name):
    params = _params(name, plain)
    base = [o.token_ids for o in plain.generate(PROMPTS, params)]
    if name == "allowed":
        assert all(set(t) <= set(ALLOWED) for t in base)
    if name == "bad_words":
        assert all(_no_bad_word(t, params.bad_words_token_ids) for t in base)
        greedy = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
        assert base[0] != greedy  # the ban changed something
    for use_async in (False, True):
        spec = make_engine("tiny-random", num_kv_blocks=512, spec_method="ngram", num_spec_tokens=3,
                           async_scheduling=use_async)
        outs = spec.generate(PROMPTS, params)
        # Async pads every decode row's drafts (each verified); in sync mode only n-gram matches draft.
        assert sum(o.num_draft_tokens for o in outs) > (20 if use_async else 0)
        assert [o.token_ids for o in outs] == base


def test_min_p_masks_below_the_fraction_of_the_best():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    probs = batch_probs(logits, [SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=1.0, min_p=0.3)])
    p0 = logits[0].softmax(-1)
    expected = torch.where(p0 >= 0.3 * p0.max(), p0, torch.zeros(()))
    torch.testing.assert_close(probs[0], expected / expected.sum())
    torch.testing.assert_close(probs[1], torch.full((4,), 0.25))  # a flat row keeps everything
    only_best = batch_probs(logits[:1], [SamplingParams(temperature=1.0, min_p=1.0)])[0]
    assert only_best.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_bad_word_masks_its_last_token_only_after_its_prefix():
    logits = torch.zeros(3, 10)
    params = SamplingParams(bad_words_token_ids=[[4, 5, 6], [9]])
    rows = [RowContext(params, [1, 2], out) for out in ([3, 4, 5], [4, 5, 1], [])]
    masked = apply_penalties(logits, rows, set()).isinf()
    assert masked[0].nonzero().flatten().tolist() == [6, 9]  # prefix 4, 5 just made: 6 is banned
    assert masked[1].nonzero().flatten().tolist() == [9]
    assert masked[2].nonzero().flatten().tolist() == [9]  # a one-token word is always banned


def test_allowed_token_ids_out_of_vocab_ignored_in_mask():
    params = SamplingParams(allowed_token_ids=[2, 3, 10**6])
    out = apply_penalties(torch.zeros(1, 6), [RowContext(params, [1], [])], set())
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2, 3]


def test_disagg_carries_the_rules():
    """The prefill worker samples the first token with the request's rules, the decode worker the rest: the
    tokens of the colocated engine."""
    cfg = engine_config("tiny-random", num_kv_blocks=128)
    plain_engine = make_engine("tiny-random", num_kv_blocks=512)
    for name in CASES:
        params = _params(name, plain_engine)
        expected = [o.token_ids for o in plain_engine.generate(PROMPTS[:3], params)]
        run = run_on_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), PROMPTS[:3], params, 128)
        assert run.tokens == expected, name


def test_cache_salt_roots():
    base = SamplingParams()
    salted = SamplingParams(cache_salt="a")
    assert block_hash_root(base) is None
    roots = {block_hash_root(p) for p in (salted, SamplingParams(cache_salt="b"), SamplingParams(lora_name="a"),
                                          SamplingParams(lora_name="a", cache_salt="a"))}
    assert len(roots) == 4 and None not in roots
    tokens = list(range(64))
    assert chained_block_hashes(tokens, 16, block_hash_root(salted)) != chained_block_hashes(tokens, 16)


def test_cache_salt_separates_the_engine_prefix_cache():
    engine = make_engine("tiny-random", num_kv_blocks=256)
    prompt = list(range(3, 70))

    def cached(salt):
        params = SamplingParams(max_tokens=2, cache_salt=salt)
        return engine.generate([prompt], params)[0].num_cached_tokens

    assert cached("a") == 0 and cached("a") == 64 and cached("b") == 0 and cached(None) == 0 and cached(None) == 64


def test_detokenizer_switches(tiny_dir):
    from pdcluster.engine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir)
    ids = tok.encode("Hello world, this is it") + [tok.eos_token_id]
    shown = Detokenizer(tok, [", this"])
    shown.add(ids, final=True)
    kept = Detokenizer(tok, [", this"], include_stop=True)
    kept.add(ids, final=True)
    assert shown.text == "Hello world" and kept.text == "Hello world, this"
    special = Detokenizer(tok, skip_special_tokens=False)
    special.add(ids, final=True)
    assert special.text == "Hello world, this is it" + tok.id_to_token(tok.eos_token_id)
    # Streamed token by token: the same text.
    streamed = Detokenizer(tok, [", this"], include_stop=True)
    text = "".join(streamed.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == "Hello world, this"


def test_generate_honours_the_switches():
    engine = make_engine("tiny-random", num_kv_blocks=256)
    prompt = [5, 6, 7, 8]
    full = engine.generate([prompt], SamplingParams(max_tokens=16))[0].text
    stop = full[4:7]
    assert stop and full.find(stop) == 4
    cut = engine.generate([prompt], SamplingParams(max_tokens=16, stop=[stop]))[0]
    kept = engine.generate([prompt], SamplingParams(max_tokens=16, stop=[stop], include_stop_str_in_output=True))[0]
    assert cut.text == full[:4] and kept.text == full[:7] and kept.finish_reason == "stop"
    eos = engine.tokenizer.eos_token_id
    special = SamplingParams(max_tokens=2, allowed_token_ids=[eos], ignore_eos=True, skip_special_tokens=False)
    assert engine.generate([prompt], special)[0].text == engine.tokenizer.id_to_token(eos) * 2


@pytest.mark.parametrize("kwargs,words", [
    ({"min_p": 1.5}, "min_p"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"), ({"cache_salt": ""}, "cache_salt")])
def test_bad_values_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)
