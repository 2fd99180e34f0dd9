"""The paged attention kernel's uniform steps (every request with the same number of query tokens: decode,
verification): one program per request, no search for its tokens, the same bits as the varlen launch; and the
sm_90 build of the fast decode keeps FAST_DECODE_STAGES' key tiles in flight (kernels/triton_paged_attention.py)."""

from __future__ import annotations

import json

import pytest
import torch

from pdcluster.kernels import reference
from pdcluster.kernels import triton_paged_attention as pa
from test_kernels import make_batch
from triton_compile_helpers import compile_for_cuda

SCALE = 0.125


@pytest.mark.parametrize("batch_invariant", [True, False])
@pytest.mark.parametrize("q_len,num_q_heads,num_kv_heads", [(1, 8, 1), (2, 8, 1), (1, 4, 4), (3, 8, 2)])
def test_a_uniform_step_gives_the_varlen_launchs_bits(batch_invariant, q_len, num_q_heads, num_kv_heads):
    """Five requests of q_len tokens over contexts of 1 to 70 positions (more than one key tile, scattered blocks,
    NaN past each context): the uniform launch equals the varlen one bit for bit, and both the reference."""
    seq_lens = [q_len + 69, q_len, q_len + 3, q_len + 30, q_len + 40]
    batch = make_batch([q_len] * 5, seq_lens, num_q_heads, num_kv_heads, seed=q_len)
    args = (batch.query, batch.layer_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    varlen = pa.paged_attention_triton(*args, batch_invariant=batch_invariant)
    uniform = pa.paged_attention_triton(*args, batch_invariant=batch_invariant, uniform_q_len=q_len)
    assert torch.equal(uniform, varlen)
    torch.testing.assert_close(uniform, reference.paged_attention(*args), rtol=1e-5, atol=1e-5)


def test_the_uniform_launch_runs_one_program_a_request(monkeypatch):
    grids = []
    kernel = pa._paged_attention_kernel
    monkeypatch.setattr(pa, "_paged_attention_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    batch = make_batch([1] * 6, [5, 9, 1, 33, 2, 7], 8, 1)
    args = (batch.query, batch.layer_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    pa.launch(*args, torch.empty_like(batch.query), block_q=2, block_n=32, uniform_q=1, split=False)
    pa.launch(*args, torch.empty_like(batch.query), block_q=2, block_n=32, split=False)
    assert grids == [(6, 1, 1), (6 // 2 + 6, 1, 1)]  # the varlen grid has a gap program for every request


def test_a_step_that_is_not_uniform_is_refused_or_left_to_the_varlen_launch():
    batch = make_batch([1, 2, 1], [5, 9, 3], 8, 1)
    args = (batch.query, batch.layer_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
    with pytest.raises(ValueError, match="uniform_q=1: 4 tokens for 3 requests"):
        pa.launch(*args, torch.empty_like(batch.query), block_q=2, block_n=32, uniform_q=1)
    with pytest.raises(ValueError, match="query tiles of 2"):
        pa.launch(*args, torch.empty_like(batch.query), block_q=2, block_n=32, uniform_q=3)
    # paged_attention_triton checks before it asks: a wrong or too long uniform_q_len runs the varlen launch
    expected = pa.paged_attention_triton(*args)
    assert torch.equal(pa.paged_attention_triton(*args, uniform_q_len=1), expected)
    long = make_batch([4] * 3, [9, 5, 4], 8, 1)
    largs = (long.query, long.layer_cache, long.block_tables, long.seq_lens, long.query_start_loc, SCALE)
    assert torch.equal(pa.paged_attention_triton(*largs, uniform_q_len=4), pa.paged_attention_triton(*largs))


def test_the_engine_passes_its_uniform_decode_steps(monkeypatch, tiny_dir):
    """AttentionMetadata.uniform_q_len reaches the kernel's entry (decode steps 1, prefill steps None)."""
    from conftest import make_engine
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.kernels import ops

    seen = []
    real = ops.paged_attention

    def spy(*args, uniform_q_len=None, **kwargs):
        seen.append(uniform_q_len)
        return real(*args, uniform_q_len=uniform_q_len, **kwargs)

    monkeypatch.setattr(ops, "paged_attention", spy)
    engine = make_engine("tiny-random", max_num_seqs=4, dtype="float32")
    engine.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert None in seen and 1 in seen


# ---- the sm_90 build of the fast decode -----------------------------------------------------------------------

_BUILD = r"""
import json, re, sys
from sm90_build import build
from pdcluster.kernels import triton_paged_attention as pa

ptrs = {"out_ptr": "*bf16", "query_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
        "part_acc_ptr": "*fp32", "sinks_ptr": "*fp32", "qk_scale_log2": "fp32", "softcap": "fp32"}
# TinyLlama's attention (32 query / 4 KV heads of 64), a decode step of many requests, as the fast mode launches it.
group_pad = 8
c = dict(stride_q_dim=1, stride_cache_dim=1, GROUP=8, GROUP_PAD=group_pad, BLOCK_Q=pa.block_q_for(group_pad),
         BLOCK_M=pa.block_q_for(group_pad) * group_pad, BLOCK_N=pa.FAST_KV_TILE_TOKENS, HEAD_DIM_PAD=64,
         DOT_PRECISION="tf32", PARTITION_SIZE=4096, SPLIT=False, NATIVE_DOT=True, UNIFORM_Q=1)
# Such a model's shapes and strides are multiples of 16, as a launch specialises them.
aligned = ("stride_cache_kv", "stride_cache_block", "stride_cache_slot", "stride_cache_head", "stride_q_token",
           "stride_q_head", "stride_out_token", "stride_out_head", "stride_table_req", "head_dim", "block_size",
           "num_q_heads")
out = {}
for stages in json.loads(sys.argv[1]):
    k = build(pa._paged_attention_kernel, ptrs, c, aligned=aligned, num_stages=stages)
    # The key and value tiles' shared-memory buffers: [depth x] 64 x BLOCK_N or BLOCK_N x 64 bf16.
    tiles = re.findall(r"ttg\.local_alloc[^\n]*?!ttg\.memdesc<(?:(\d+)x)?(\d+)x(\d+)xbf16", k["ttgir"])
    kv = [int(d or 1) for d, a, b in tiles if {int(a), int(b)} == {64, pa.FAST_KV_TILE_TOKENS}]
    out[stages] = {"kv_buffers": kv, "shared": k["shared_bytes"], "async_copies": k["ptx"].count("cp.async.cg")}
print(json.dumps(out))
"""


def test_the_fast_decode_keeps_two_key_tiles_in_flight(tmp_path):
    """Compiled for sm_90 as launched: K and V each come through shared memory FAST_DECODE_STAGES' (stages - 1) // 2
    tiles ahead (3 stages kept one: the block-table load takes the other stages), within four programs an SM."""
    stages = [3, pa.FAST_DECODE_STAGES]
    got = json.loads(compile_for_cuda(_BUILD, tmp_path, [json.dumps(stages)]).strip().splitlines()[-1])
    assert got["3"]["kv_buffers"] == [1, 1], got  # what 3 stages gave: one tile of each in flight
    prod = got[str(pa.FAST_DECODE_STAGES)]
    assert prod["kv_buffers"] == [2, 2] and prod["async_copies"] > 0, prod
    assert 4 * prod["shared"] <= 227 * 1024, prod
