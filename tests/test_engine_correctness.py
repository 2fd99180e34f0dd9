"""Token-exactness of the engine: against Hugging Face transformers, and batch invariance under
batching, preemption, chunked prefill and prefix-cache hits (greedy, float32, real SmolLM2)."""

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Translate to French: Good morning, my friend.",
    "The quick brown fox",
    "Q: What is 12 times 7?\nA:",
    "In 1969, the first humans landed on",
]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine("smollm2", num_kv_blocks=1024)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_greedy_equals_transformers(engine, hf_model):
    outs = engine.generate(PROMPTS, _greedy(32))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids))
        ref_tokens = ref[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref_tokens, f"prompt {prompt!r}: engine {out.token_ids} != transformers {ref_tokens}"
    assert outs[0].text.startswith(" Paris")
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


def _mixed_prompts(n=16):
    base = "Write a short note about the history of computing and the people who built it. "
    return [PROMPTS[i % len(PROMPTS)] + " " + base * (i % 4) for i in range(n)]


@pytest.fixture(scope="module")
def alone_outputs(engine):
    return [engine.generate([p], _greedy(12))[0].token_ids for p in _mixed_prompts()]


def test_batch_of_16_equals_alone(engine, alone_outputs):
    batched = engine.generate(_mixed_prompts(), _greedy(12))
    assert [o.token_ids for o in batched] == alone_outputs


def test_preemption_keeps_tokens(alone_outputs):
    # 16 prompts of 8..70 tokens + 12 new tokens need ~50 blocks of 16; 20 forces preemption.
    small = make_engine("smollm2", num_kv_blocks=20, max_model_len=256)
    batched = small.generate(_mixed_prompts(), _greedy(12))
    assert small.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert [o.token_ids for o in batched] == alone_outputs
    assert small.scheduler.num_free_blocks == 20


def test_chunked_prefill_of_long_prompt(engine):
    long_prompt = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(90))
    assert len(engine.tokenize(long_prompt)) > 500
    whole = engine.generate([long_prompt], _greedy(8))[0].token_ids
    chunked_engine = make_engine("smollm2", num_kv_blocks=256, prefill_chunk_size=32, max_num_batched_tokens=64)
    chunked = chunked_engine.generate([long_prompt], _greedy(8))[0].token_ids
    assert chunked == whole


def test_prefix_cache_hit_gives_same_tokens(engine):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    first = engine.generate([shared + "What is the boiling point of water?"], _greedy(10))[0]
    second = engine.generate([shared + "What is the boiling point of water?"], _greedy(10))[0]
    assert second.num_cached_tokens >= 48, "the shared prefix should come from the cache"
    assert second.token_ids == first.token_ids
    no_cache = make_engine("smollm2", num_kv_blocks=256, enable_prefix_caching=False)
    assert no_cache.generate([shared + "What is the boiling point of water?"], _greedy(10))[0].token_ids == first.token_ids


def test_streaming_outputs_carry_new_tokens_and_counts(engine):
    """cumulative_outputs False (the workers): each step's output has the new tokens and the output count,
    the whole output only once finished; the tokens stream to the same sequence as a cumulative run."""
    prompts = [engine.tokenize(p) for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(prompts, params)]
    engine.cumulative_outputs = False
    try:
        ids = [engine.add_request(p, params) for p in prompts]
        streamed = {i: [] for i in ids}
        final = {}
        for _ in range(200):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                streamed[out.request_id] += out.new_token_ids
                assert out.num_output_tokens == len(streamed[out.request_id])
                if out.finished:
                    final[out.request_id] = out.token_ids
                else:
                    assert out.token_ids == [], "a running request's output is not copied each step"
    finally:
        engine.cumulative_outputs = True
    assert [streamed[i] for i in ids] == want and [final[i] for i in ids] == want


def test_generate_stop_string_ends_the_output_there(engine):
    """generate() reads each step's new tokens (not the whole output copied each step): a stop string
    still ends a request at the step its text appeared, with that step's tokens, the text cut before it,
    and every output token once finished; the engine's own setting is left as it was."""
    prompt = PROMPTS[2]
    full = engine.generate([prompt], _greedy(24))[0]
    stop = full.text[len(full.text) // 2:][:6]
    assert stop and stop in full.text
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert 0 < len(out.token_ids) < len(full.token_ids) and out.token_ids == full.token_ids[: len(out.token_ids)]
    assert out.num_output_tokens == len(out.token_ids)
    assert stop in engine.tokenizer.decode(out.token_ids) and stop not in engine.tokenizer.decode(out.token_ids[:-1])
    assert engine.cumulative_outputs is True
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


def test_an_output_carries_each_count_in_its_own_field(tiny_dir):
    """LLMEngine._output builds RequestOutput positionally (per request per step): every field gets its own value."""
    from pdcluster.engine.llm_engine import RequestOutput
    from pdcluster.engine.request import Request, RequestStatus
    from pdcluster.wire.logprobs import TokenLogprobs

    engine = make_engine("tiny-random")
    request = Request("r-7", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5], num_computed_tokens=11,
                      status=RequestStatus.FINISHED_LENGTH, num_cached_tokens=13, num_offloaded_tokens=17,
                      num_draft_tokens=19, num_accepted_tokens=23)
    record, prompt_record = TokenLogprobs(5, -0.5, 1, [], []), [TokenLogprobs(2, -1.5, 1, [], [])]
    got = engine._output(request, True, [5], [record], prompt_record)
    assert got == RequestOutput(
        request_id="r-7", prompt_token_ids=[1, 2, 3], token_ids=[4, 5], finished=True, finish_reason="length",
        new_token_ids=[5], num_draft_tokens=19, num_accepted_tokens=23, num_cached_tokens=13,
        num_offloaded_tokens=17, num_computed_tokens=11, num_output_tokens=2, new_logprobs=[record],
        prompt_logprobs=prompt_record)
