"""Logprobs and penalties on the offline engine (real SmolLM2, float32).

Logprobs (sampled, top alternatives and prompt) equal a transformers fp32 forward pass's log_softmax
within 1e-4: alone, with chunked prefill, behind a prefix-cache hit and under n-gram speculation.
Penalties (presence, frequency, repetition, logit bias, min_tokens) give the tokens of a reference
implementation written here from vLLM's definitions, with and without speculation (greedy: lossless
means token-exact).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 4, 5, 6, 7,"]
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine("smollm2", dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def spec_engine(smollm2_dir):
    return make_engine("smollm2", dtype="float32", num_kv_blocks=256, spec_method="ngram", num_spec_tokens=3)


def _hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row p = log_softmax of the logits at position p (it scores token p + 1)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check_records(records, ref_rows: torch.Tensor, token_ids: list[int], k: int) -> None:
    assert len(records) == len(token_ids) == ref_rows.shape[0]
    for rec, row, token_id in zip(records, ref_rows, token_ids):
        assert rec.token_id == token_id
        assert abs(rec.logprob - float(row[token_id])) < TOL, (rec.logprob, float(row[token_id]))
        assert rec.rank == int((row > row[token_id]).sum()) + 1
        ref_values, ref_ids = torch.topk(row, k)
        assert len(rec.top_token_ids) == k
        assert torch.allclose(torch.tensor(rec.top_logprobs), ref_values, atol=TOL)
        if k:  # ties aside, the same tokens in the same order
            assert rec.top_token_ids[0] == int(ref_ids[0])


def _check_against_hf(hf_model, out, k: int, prompt_k: int | None) -> None:
    full = out.prompt_token_ids + out.token_ids
    ref = _hf_logprobs(hf_model, full)
    n_prompt = len(out.prompt_token_ids)
    _check_records(out.logprobs, ref[n_prompt - 1 :], out.token_ids, k)
    if prompt_k is not None:
        _check_records(out.prompt_logprobs, ref[: n_prompt - 1], out.prompt_token_ids[1:], prompt_k)


def test_sampled_and_prompt_logprobs_equal_transformers(engine, hf_model):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=7, logprobs=5, prompt_logprobs=3)
    for out in engine.generate(PROMPTS, params):
        _check_against_hf(hf_model, out, 5, 3)
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


def test_logprobs_without_top_alternatives_and_greedy(engine, hf_model):
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, logprobs=0))[0]
    _check_against_hf(hf_model, out, 0, None)
    assert all(rec.rank == 1 for rec in out.logprobs)  # greedy takes the most likely token
    assert out.prompt_logprobs is None


def test_prompt_logprobs_across_chunks_and_behind_a_prefix_cache_hit(smollm2_dir, hf_model):
    engine = make_engine("smollm2", dtype="float32", num_kv_blocks=256, prefill_chunk_size=7,
                         enable_prefix_caching=True)
    prompt = PROMPTS[1] + " fib(n - 1) + fib(n - 2)\n\nprint(fib(10))"
    first = engine.generate([prompt], SamplingParams(max_tokens=2))[0]  # fills the prefix cache
    assert engine.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens > 0
    out = engine.generate([prompt], SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=4))[0]
    assert out.token_ids[:2] == first.token_ids
    _check_against_hf(hf_model, out, 2, 4)


def test_logprobs_under_ngram_speculation_equal_plain(engine, spec_engine, hf_model):
    params = SamplingParams(max_tokens=16, logprobs=3)
    spec = spec_engine
    for a, b in zip(engine.generate(PROMPTS, params), spec.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
        assert [r.token_id for r in b.logprobs] == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < TOL and x.top_token_ids == y.top_token_ids
        _check_against_hf(hf_model, b, 3, None)
    assert sum(o.num_accepted_tokens for o in spec.generate(PROMPTS, params)) > 0  # drafts were accepted


# ====================================================================================== penalties


def _reference_penalised(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                         stop_ids: set[int]) -> torch.Tensor:
    """vLLM's definitions, one token at a time, written without the engine's code."""
    logits = logits.clone()
    for token_id, bias in p.logit_bias:
        logits[int(token_id)] += bias
    if len(output) < p.min_tokens:
        for t in stop_ids:
            logits[t] = float("-inf")
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
    for t, n in Counter(output).items():
        logits[t] -= p.frequency_penalty * n + p.presence_penalty
    return logits


def _reference_greedy(hf_model, prompt: list[int], p: SamplingParams, stop_ids: set[int]) -> list[int]:
    output: list[int] = []
    past, inputs = None, prompt
    with torch.no_grad():
        for _ in range(p.max_tokens):
            result = hf_model(torch.tensor([inputs]), past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[0, -1].float()
            token = int(_reference_penalised(logits, p, prompt, output, stop_ids).argmax())
            output.append(token)
            inputs = [token]
            if token in stop_ids:
                break
    return output


PENALTIES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=1.2),
    dict(repetition_penalty=1.4),
    dict(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=1.2, logit_bias=[[28, 2.5], [330, -5.0]]),
]


@pytest.mark.parametrize("penalty", [pytest.param(p, marks=pytest.mark.slow) for p in PENALTIES[:3]] + PENALTIES[3:],
                         ids=lambda d: "+".join(d))
def test_penalties_equal_the_reference(engine, hf_model, penalty):
    params = SamplingParams(max_tokens=16, **penalty)
    stop_ids = set(engine.runner.eos_token_ids)
    outs = engine.generate(PROMPTS, params)
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=16))
    for out, base in zip(outs, plain):
        ref = _reference_greedy(hf_model, out.prompt_token_ids, params, stop_ids)
        assert out.token_ids == ref
    assert any(o.token_ids != b.token_ids for o, b in zip(outs, plain)), "the penalty changed nothing"


def _penalties_lossless(spec, engine) -> None:
    for penalty in PENALTIES:
        params = SamplingParams(max_tokens=24, **penalty)
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == \
            [o.token_ids for o in engine.generate(PROMPTS, params)], penalty


def test_penalties_under_ngram_speculation_are_lossless(engine, spec_engine):
    _penalties_lossless(spec_engine, engine)


@pytest.mark.slow
def test_penalties_under_async_ngram_speculation_are_lossless(smollm2_dir, engine):
    _penalties_lossless(make_engine("smollm2", dtype="float32", num_kv_blocks=256, spec_method="ngram",
                                    num_spec_tokens=3, async_scheduling=True), engine)


def test_min_tokens_holds_back_eos_and_logit_bias_pushes_a_token(engine):
    eos = min(engine.runner.eos_token_ids)
    eager = SamplingParams(max_tokens=12, logit_bias=[[eos, 100.0]])
    assert engine.generate([PROMPTS[0]], eager)[0].token_ids == [eos]
    held = SamplingParams(max_tokens=12, logit_bias=[[eos, 100.0]], min_tokens=5)
    out = engine.generate([PROMPTS[0]], held)[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    pushed = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=5, logit_bias=[[1234, 100.0]]))[0]
    assert pushed.token_ids == [1234] * 5


def test_bad_penalty_values_are_refused():
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)
