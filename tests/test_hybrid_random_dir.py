"""A NemotronH directory made by transformers (random weights, not the built-in tiny-hybrid) served by
LLMEngine from its path: greedy tokens equal transformers' alone, in a batch of 16 mixed-length
prompts, with chunked prefill and under preemption.

The model is test_hybrid_model.py's ``random_dir``: another shape than tiny-hybrid ("*M-M*M":
attention first, n_groups 1, conv kernel 3 without bias, state size 12, scan chunk 8, untied head),
weights redrawn so the logits are O(10), and transformers' dt_bias init, so its time_step_limit clamp
(0.001) fires on some tokens.

The oracle is repeated full forwards (no cache): for every new token, the argmax of
``model(prompt + tokens so far).logits[0, -1]``. Not ``generate()``: transformers' cached one-token
Mamba path does not clamp dt to time_step_limit while its chunked (prefill) path does, so on this model
its own generate() drifts from its own full forward. Our engine clamps on every path, so it must
equal the full forward.
"""

from __future__ import annotations

import pytest
import torch

from test_hybrid_engine import NUM_NEW, _engine, _expected, _prompts, _run
from test_hybrid_model import _hf_logits, _hf_model, random_dir, tiny_hybrid_dir  # noqa: F401 - fixtures

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

# test_hybrid_engine's 16 mixed-length prompts (3..70 tokens), mapped into this model's 512-token vocab.
PROMPTS = [[3 + t % 509 for t in p] for p in _prompts(16, seed=1)]


def _full_forward_greedy(hf, prompt: list[int], num_new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_new):
        ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def reference(random_dir) -> dict[tuple[int, ...], list[int]]:
    hf = _hf_model(random_dir)
    with torch.inference_mode():
        return {tuple(p): _full_forward_greedy(hf, p, NUM_NEW) for p in PROMPTS}


def _random_engine(random_dir, **overrides):
    return _engine(model=str(random_dir), **overrides)


def test_reference_is_not_degenerate(reference):
    # Different prompts continue differently, and a continuation is not one token repeated: equality
    # with it below means something.
    outs = list(reference.values())
    assert len({tuple(o) for o in outs}) > len(outs) // 2
    assert sum(len(set(o)) > 2 for o in outs) > len(outs) // 2


def test_greedy_alone_and_batched_equals_transformers(random_dir, reference):
    engine = _random_engine(random_dir)
    arch = engine.arch
    assert engine.is_hybrid and arch.layer_types == tuple("*M-M*M")
    assert (arch.n_groups, arch.conv_kernel, arch.tie_word_embeddings) == (1, 3, False)
    assert _run(engine, PROMPTS[:1]) == _expected(reference, PROMPTS[:1])
    assert _run(engine, PROMPTS) == _expected(reference, PROMPTS)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


def test_chunked_prefill_and_preemption_equal_transformers(random_dir, reference):
    # Chunks of 5 tokens end inside and across the scan's 8-token chunks, the state carried between
    # them; 24 blocks of 16 for 16 requests of up to 82 tokens force preemption (recompute from token 0).
    engine = _random_engine(random_dir, prefill_chunk_size=5, max_num_batched_tokens=40, num_kv_blocks=24)
    assert _run(engine, PROMPTS) == _expected(reference, PROMPTS)
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
