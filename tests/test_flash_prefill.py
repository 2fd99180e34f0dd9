"""Prompts without context go to FlashAttention in the fast mode on CUDA (kernels/flash_prefill.py).

On CPU: the step's metadata says when no request has context (prepare_inputs), attend() hands exactly
those steps to the flash path with the right arguments and falls back when it refuses, deterministic
mode never takes it, and the path refuses CPU and fp32 tensors. The stand-in for FlashAttention here is
plain causal attention (torch SDPA per request, query heads grouped onto their KV head): what the op is
specified to compute. On a GPU (``gpu`` marker) the real op against the torch reference.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_engine
from pdcluster.engine.attention import AttentionMetadata, attend
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels import flash_prefill, reference

HEAD_DIM, BLOCK_SIZE = 16, 4


def causal_per_request(query, key, value, query_start_loc, max_query_len, scale):
    """What FlashAttention's varlen causal call computes, in torch on any device."""
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    bounds = query_start_loc.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_query_len
    for lo, hi in zip(bounds, bounds[1:]):
        q = query[lo:hi].transpose(0, 1).float()
        k = key[lo:hi].repeat_interleave(group, dim=1).transpose(0, 1).float()
        v = value[lo:hi].repeat_interleave(group, dim=1).transpose(0, 1).float()
        out[lo:hi] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1).to(out.dtype)
    return out


def fresh_prompts(q_lens, num_q_heads=4, num_kv_heads=2, seed=0):
    """q, k, v of prompts starting at position 0, their empty cache, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    n = sum(q_lens)
    query = torch.randn(n, num_q_heads, HEAD_DIM, generator=g)
    key = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g)
    value = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g)
    blocks_per_req = [-(-q // BLOCK_SIZE) for q in q_lens]
    cache = torch.zeros(2, sum(blocks_per_req) + 1, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    tables = torch.zeros(len(q_lens), max(blocks_per_req), dtype=torch.int32)
    slots, first = [], 0
    for r, (q, nb) in enumerate(zip(q_lens, blocks_per_req)):
        tables[r, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        slots += [first * BLOCK_SIZE + i for i in range(q)]
        first += nb
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(torch.tensor(slots), tables, torch.tensor(q_lens, dtype=torch.int32), qsl, None,
                             HEAD_DIM**-0.5, no_context_max_query_len=max(q_lens),
                             no_context_query_lens_np=np.array(q_lens, dtype=np.int64))
    return query, key, value, cache, meta


def test_attend_hands_prompts_without_context_to_flash_attention(monkeypatch):
    calls = []

    def stand_in(*args):
        calls.append(args[4])
        assert list(args[6]) == [7, 1, 12]  # the lengths on the host too (the cuDNN path's)
        return causal_per_request(*args[:6])

    monkeypatch.setattr(flash_prefill, "usable", lambda query, num_kv_heads: True)
    monkeypatch.setattr(flash_prefill, "flash_prefill", stand_in)
    query, key, value, cache, meta = fresh_prompts([7, 1, 12])
    got = attend(query, key, value, cache, meta, batch_invariant=False)
    assert calls == [12], "the fast mode's prompt step went to FlashAttention with the longest prompt's length"
    want = reference.paged_attention(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The KV still lands in the cache (decode steps read it from there).
    ref_cache = torch.zeros_like(cache)
    reference.write_kv(key, value, ref_cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    # Deterministic mode, or a step with context, never takes it.
    attend(query, key, value, cache, meta, batch_invariant=True)
    meta.no_context_max_query_len = None
    attend(query, key, value, cache, meta, batch_invariant=False)
    assert calls == [12]


def test_attend_falls_back_when_flash_attention_refuses(monkeypatch):
    monkeypatch.setattr(flash_prefill, "usable", lambda query, num_kv_heads: True)
    monkeypatch.setattr(flash_prefill, "flash_prefill", lambda *args: None)
    query, key, value, cache, meta = fresh_prompts([5, 9])
    got = attend(query, key, value, cache, meta, batch_invariant=False)
    want = reference.paged_attention(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flash_attention_is_not_for_cpu_or_fp32_tensors():
    query = torch.zeros(3, 4, HEAD_DIM)
    assert not flash_prefill.usable(query, 2)
    assert not flash_prefill.usable(query.bfloat16(), 2)  # on the CPU


@pytest.mark.parametrize("q_lens", [[768, 768, 768], [512], [600, 600], [512, 768], [513, 1, 40]],
                         ids=["equal", "one", "equal-not-multiple", "unequal", "short-ones"])
def test_prompts_of_one_long_length_go_to_cudnn_with_the_same_result(monkeypatch, q_lens):
    """cudnn_prefill's arithmetic (one call over views of the packed rows) on the CPU: SDPA's own math
    backend stands in for cuDNN. Only prompts of one length, a multiple of 256 and at least 512, go there:
    the rest stay on FlashAttention (which refuses CPU tensors here: None)."""
    import contextlib

    monkeypatch.setattr(flash_prefill, "sdpa_kernel", lambda backends: contextlib.nullcontext())
    for name, value in (("num_cudnn_calls", 0), ("_disabled_why", None), ("_cudnn_disabled_why", None)):
        monkeypatch.setattr(flash_prefill, name, value)  # and back after the test (a refusal is sticky)
    g = torch.Generator().manual_seed(2)
    n = sum(q_lens)
    qkv = torch.randn(n, 4 + 2 * 1, 32, generator=g)
    query, key, value = qkv[:, :4], qkv[:, 4:5], qkv[:, 5:]  # strided views, as the model passes them
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    got = flash_prefill.flash_prefill(query, key, value, qsl, max(q_lens), 32**-0.5, np.array(q_lens))
    if len(set(q_lens)) > 1 or q_lens[0] % 256 or q_lens[0] < 512:
        assert got is None and flash_prefill.num_cudnn_calls == 0
        return
    assert flash_prefill.num_cudnn_calls == 1 and flash_prefill.cudnn_disabled_reason() is None
    want = causal_per_request(query, key, value, qsl, max(q_lens), 32**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_steps_say_when_no_request_has_context(monkeypatch):
    """prepare_inputs: a step of prompts starting at 0 carries its longest prompt's length; a step with
    any context (decode, a later chunk, a prefix-cache hit) carries None."""
    engine = make_engine("tiny-random", num_kv_blocks=64, prefill_chunk_size=16, max_num_batched_tokens=64)
    seen = []
    real_forward = engine.runner.model.forward

    def recording(ids, positions, kv_cache, meta, *args, **kwargs):
        seen.append(meta.no_context_max_query_len)
        return real_forward(ids, positions, kv_cache, meta, *args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", recording)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(100, 105)), params)
    engine.add_request(list(range(200, 209)), params)
    engine.step()
    assert seen == [9]
    while engine.has_unfinished():
        engine.step()
    assert seen[1:] and all(v is None for v in seen[1:]), seen  # decode steps
    seen.clear()
    engine.add_request(list(range(300, 340)), params)  # 40 tokens in chunks of 16
    engine.step()
    engine.step()
    assert seen == [16, None], seen  # the second chunk has the first as context
    while engine.has_unfinished():
        engine.step()
    seen.clear()
    engine.add_request(list(range(300, 340)) + [7], params)  # its first 32 tokens hit the prefix cache
    engine.step()
    assert seen[0] is None, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device")
def test_flash_prefill_on_cuda_equals_the_reference():
    """The real op: prompts of 1 to 100 tokens, 8 query heads on 2 KV heads, head 64, bf16."""
    q_lens = [37, 1, 100, 16]
    g = torch.Generator().manual_seed(1)
    n = sum(q_lens)
    qkv = torch.randn(n, 8 + 2 * 2, 64, generator=g).to(torch.bfloat16).cuda()
    query, key, value = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]  # strided views, as the model passes them
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    assert flash_prefill.usable(query, 2)
    got = flash_prefill.flash_prefill(query, key, value, qsl, max(q_lens), 64**-0.5)
    assert got is not None, flash_prefill.disabled_reason()
    want = causal_per_request(query.cpu().float(), key.cpu().float(), value.cpu().float(), qsl.cpu(), max(q_lens),
                              64**-0.5)
    torch.testing.assert_close(got.cpu().float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device")
@pytest.mark.parametrize("q_lens", [[512, 512, 512], [1024]], ids=["three", "one"])
def test_cudnn_prefill_on_cuda_equals_the_reference(q_lens):
    """The real cuDNN path: prompts of one length (a multiple of 256), 8 query heads on 2 KV heads, head
    64, bf16; prompts of several lengths go to FlashAttention."""
    g = torch.Generator().manual_seed(3)
    n = sum(q_lens)
    qkv = torch.randn(n, 8 + 2 * 2, 64, generator=g).to(torch.bfloat16).cuda()
    query, key, value = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    before = flash_prefill.num_cudnn_calls
    got = flash_prefill.flash_prefill(query, key, value, qsl, max(q_lens), 64**-0.5, np.array(q_lens))
    assert got is not None and flash_prefill.num_cudnn_calls == before + 1, flash_prefill.cudnn_disabled_reason()
    want = causal_per_request(query.cpu().float(), key.cpu().float(), value.cpu().float(), qsl.cpu(), max(q_lens),
                              64**-0.5)
    torch.testing.assert_close(got.cpu().float(), want, rtol=2e-2, atol=2e-2)
    unequal = np.array([512, n - 512]) if n > 1024 else np.array([256, n - 256])
    qsl2 = torch.tensor([0, *np.cumsum(unequal)], dtype=torch.int32).cuda()
    assert flash_prefill.flash_prefill(query, key, value, qsl2, int(unequal.max()), 64**-0.5, unequal) is not None
    assert flash_prefill.num_cudnn_calls == before + 1  # FlashAttention served it
