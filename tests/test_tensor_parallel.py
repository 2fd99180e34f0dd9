"""Tensor parallelism (engine/tensor_parallel/): one engine's model split over ranks that are real processes meeting
over gloo on loopback, each with its slice of every layer and of the KV cache.

The split model must compute what the whole one does: in float32 its greedy tokens equal the unsplit engine's on the
real SmolLM2 (3 ranks: its 9 heads and 3 KV heads) and on tiny-random (2 ranks) with n-gram speculation, async
scheduling, chunked prefill, preemption and pooling requests; tests/test_model_families.py checks the Llama family's
variants against transformers. What does not split is refused in one line before any rank starts; a rank that dies
fails the step with its story instead of hanging the engine, and close() leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from conftest import engine_config, make_engine
from pdcluster.engine.config import ConfigError
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.llama_arch import ModelArch
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tensor_parallel.driver import check_engine_config, check_shared_caches
from pdcluster.engine.tensor_parallel.shard import Shard, check_shardable, shard_arch, shard_weights

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived"]


def _greedy(engine: LLMEngine, prompts, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def _ranks_of(engine: LLMEngine) -> list:
    return list(engine.model.tp_driver.processes)


def test_smollm2_on_three_ranks_equals_the_whole_model_in_fp32():
    whole = make_engine("smollm2")
    expected = _greedy(whole, PROMPTS)
    split = make_engine("smollm2", tensor_parallel_size=3)
    try:
        assert split.model.arch.num_heads == 3 and split.model.arch.num_kv_heads == 1  # a third of 9 and 3
        assert split.kv_cache.shape[-2] == 1  # each rank caches its own KV head
        assert len(_ranks_of(split)) == 2 and all(p.is_alive() for p in _ranks_of(split))
        assert _greedy(split, PROMPTS) == expected
    finally:
        split.close()


def test_tiny_on_two_ranks_equals_the_whole_model_through_the_engine_paths():
    """Chunked prefill over a small step budget, preemption in a small pool, n-gram speculation (1 + k verification
    rows), a pooling request's hidden state and prompt logprobs past a chunk: all on rank 0's side of the split."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(30 + 20 * i)] for i in range(4)]
    common = dict(max_num_batched_tokens=64, prefill_chunk_size=32, num_kv_blocks=24, spec_method="ngram",
                  num_spec_tokens=3)
    whole, split = make_engine(**common), make_engine(tensor_parallel_size=2, **common)
    try:
        assert _greedy(split, prompts, 40) == _greedy(whole, prompts, 40)
        embed = SamplingParams(max_tokens=1, pooling="mean")
        a, b = whole.generate(prompts[:2], embed), split.generate(prompts[:2], embed)
        for x, y in zip(a, b):
            assert torch.allclose(torch.from_numpy(x.pooled), torch.from_numpy(y.pooled), atol=1e-5)
        lp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
        a, b = whole.generate(prompts[2:3], lp)[0], split.generate(prompts[2:3], lp)[0]
        assert len(b.prompt_logprobs) == len(prompts[2]) - 1  # every position past the first, over 3 chunks
        assert [r.top_token_ids for r in b.prompt_logprobs] == [r.top_token_ids for r in a.prompt_logprobs]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs)) < 1e-4
    finally:
        split.close()


def test_async_scheduling_on_two_ranks_equals_the_whole_model():
    prompts = [[(11 * i + j) % 400 + 5 for j in range(12 + 9 * i)] for i in range(3)]
    expected = _greedy(make_engine(), prompts, 30)
    split = make_engine(tensor_parallel_size=2, async_scheduling=True)
    try:
        assert _greedy(split, prompts, 30) == expected
    finally:
        split.close()


def test_bf16_deterministic_mode_stays_batch_invariant_on_two_ranks():
    """Deterministic mode (the CPU default) over a split model: each rank's partial sums are batch-invariant and two
    ranks' sum is one addition, so a request's bf16 tokens alone equal its tokens in a batch."""
    prompts = [[(13 * i + 5 * j) % 450 + 4 for j in range(10 + 11 * i)] for i in range(5)]
    engine = make_engine(tensor_parallel_size=2, dtype="bfloat16", deterministic=True)
    try:
        assert engine.deterministic
        batched = _greedy(engine, prompts, 24)
        assert [_greedy(engine, [p], 24)[0] for p in prompts] == batched
    finally:
        engine.close()


def test_close_stops_every_rank_and_refuses_later_steps():
    engine = make_engine(tensor_parallel_size=2)
    ranks = _ranks_of(engine)
    engine.close()
    assert not any(p.is_alive() for p in ranks)
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="stopped"):
        _greedy(engine, ["hello"], 2)


def test_a_rank_that_dies_fails_the_step_with_its_story_and_no_hang():
    engine = make_engine(tensor_parallel_size=2)
    try:
        assert _greedy(engine, ["hello there"], 4)
        (rank,) = _ranks_of(engine)
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 (is gone|exited)"):
            _greedy(engine, ["hello again"], 4)
        assert time.monotonic() - start < 30
    finally:
        engine.close()


@pytest.mark.parametrize("model,size,words", [
    ("smollm2", 2, "9 attention heads do not split 2 ways"),
    ("tiny-random", 3, "4 attention heads do not split 3 ways"),
    ("tiny-hybrid", 4, "2 Mamba groups \\(n_groups"),  # 8 Mamba heads and 4 attention heads would split
])
def test_models_that_do_not_split_are_refused_before_any_rank_starts(model, size, words):
    children = set(_children())
    with pytest.raises(ValueError, match=words):
        make_engine(model, tensor_parallel_size=size)
    assert set(_children()) <= children


def test_a_model_class_not_known_to_split_is_refused_by_its_class():
    """Exact classes: a subclass of a family may compute across heads."""
    from pdcluster.engine.models.llama import LlamaModel

    class Custom(LlamaModel):
        pass

    with pytest.raises(ValueError, match="Custom runs with --tensor-parallel-size 1"):
        check_shardable(Custom, None, 2)


@pytest.mark.parametrize("change,words", [
    (dict(kv_offload_host_gib=0.1, device="cuda"), "offload tiers reach a split model's rank caches on CPUs only"),
    (dict(device="cuda:1"), "rank r runs on cuda:r"),
])
def test_settings_that_do_not_combine_are_refused_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words):
        check_engine_config(engine_config(tensor_parallel_size=2, **change))


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-hybrid-moe"])
def test_our_mtp_head_on_a_split_hybrid_drafts_what_the_whole_head_drafts(model):
    """Our MTP head (a Llama layer of the hybrid's attention heads and MLP width) on a NemotronH target split over two
    ranks, cut by the Llama rules whatever the target's blocks are: every draft of every step equals the unsplit
    engine's, and so do the tokens (tiny-hybrid-moe has MTP layers of its own; --mtp-checkpoint picks the head)."""
    _split_drafts_as_whole(model, spec_method="mtp", num_spec_tokens=3, mtp_checkpoint="random")


def test_draft_heads_that_do_not_split_are_refused_in_one_line():
    """A head whose heads do not divide (a DeepSeek target, which drafts with its own MTP layer only whether split or
    not: tests/test_deepseek_mtp.py)."""
    from pdcluster.engine.models.mtp import declared_arch
    from pdcluster.engine.tensor_parallel.driver import check_speculation

    hybrid = declared_arch("tiny-hybrid")
    config = engine_config("tiny-hybrid", tensor_parallel_size=3, spec_method="mtp", num_spec_tokens=1,
                           mtp_checkpoint="random")
    with pytest.raises(ConfigError, match="the MTP draft head's 4 attention heads \\(the model's\\) do not split 3"):
        check_speculation(config, hybrid)
    assert check_speculation(replace(config, tensor_parallel_size=2), hybrid) == "head"


class _Recording:
    """The engine's proposer, its drafts recorded (what the split head must draft exactly as the whole one)."""

    def __init__(self, inner):
        self.inner, self.num_draft_layers, self.drafts = inner, inner.num_draft_layers, []

    def propose(self, batch):
        drafts = self.inner.propose(batch)
        self.drafts.append([list(d) for d in drafts])
        return drafts


def _split_drafts_as_whole(model: str, **common) -> None:
    """``model`` with the draft ``common`` names, whole and split over two ranks: every draft of every step equal (and
    some drafted), and so are the tokens."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(12 + 15 * i)] for i in range(3)]
    whole, split = make_engine(model, **common), make_engine(model, tensor_parallel_size=2, **common)
    try:
        whole.runner.proposer, split.runner.proposer = _Recording(whole.runner.proposer), _Recording(
            split.runner.proposer)
        assert _greedy(split, prompts, 20) == _greedy(whole, prompts, 20)
        assert split.runner.proposer.drafts == whole.runner.proposer.drafts
        assert sum(len(d) for step in split.runner.proposer.drafts for d in step) > 0
    finally:
        split.close()


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory) -> dict[str, str]:
    """An EAGLE and an EAGLE-3 draft for tiny-random, seeded (tests/test_eagle.py's and test_eagle3.py's)."""
    from pdcluster.engine.models.eagle import random_eagle_weights
    from pdcluster.engine.models.eagle3 import random_eagle3_weights
    from test_eagle import _save as save_eagle
    from test_eagle3 import _save as save_eagle3

    arch = ModelArch.from_dir(resolve_model("tiny-random", progress=False))
    return {"random": "random",
            "eagle": str(save_eagle(tmp_path_factory.mktemp("eagle"), random_eagle_weights(arch, seed=2), arch)),
            "eagle3": str(save_eagle3(tmp_path_factory.mktemp("eagle3"), random_eagle3_weights(arch, 4096, seed=3),
                                      {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))}


@pytest.mark.parametrize("draft,async_scheduling", [("random", False), ("random", True), ("eagle", False),
                                                    ("eagle3", False), ("eagle3", True)])
def test_a_draft_head_split_over_two_ranks_drafts_what_the_whole_head_drafts(draft_dirs, draft, async_scheduling):
    """Our MTP head (the seeded random one, drawn at the whole model's shapes on every rank), an EAGLE and an EAGLE-3
    draft (each rank fusing its own aux hidden states) split like a layer of the model: every draft of every step
    equals the unsplit engine's, and so do the tokens."""
    _split_drafts_as_whole("tiny-random", spec_method="mtp", num_spec_tokens=3, mtp_checkpoint=draft_dirs[draft],
                           async_scheduling=async_scheduling)


def test_a_kv_transfer_connector_without_shared_rank_caches_is_refused_and_the_ranks_stop():
    from pdcluster.engine.loaded_model import LoadedModel
    from pdcluster.wire.kv_connector import KVConnector

    class Producer(KVConnector):
        pass

    loaded = LoadedModel.load(engine_config(tensor_parallel_size=2), progress=False)
    assert loaded.rank_kv_caches == ()
    ranks = list(loaded.model.tp_driver.processes)
    with pytest.raises(ValueError, match="every rank's cache in reach.*share_rank_caches=True"):
        LLMEngine(loaded, Producer())
    assert not any(p.is_alive() for p in ranks)


def test_kv_transfer_between_split_caches_on_gpus_is_refused_in_one_line():
    check_shared_caches(engine_config(tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="KV transfer between split caches runs on CPUs; on cuda each rank's cache"):
        check_shared_caches(engine_config(tensor_parallel_size=2, device="cuda"))


def test_shared_rank_caches_hold_each_ranks_heads_of_what_the_whole_model_caches():
    """For a KV transport rank 0 holds every rank's cache (shared memory, tensor_parallel/shared_cache.py): after the
    same prompts, rank r's cache holds KV heads [r * h, (r + 1) * h) of the whole model's cache, block for block."""
    from pdcluster.engine.loaded_model import LoadedModel

    prompts = [[(5 * i + 3 * j) % 400 + 7 for j in range(20 + 17 * i)] for i in range(3)]
    whole = make_engine(num_kv_blocks=32)
    _greedy(whole, prompts, 6)
    loaded = LoadedModel.load(engine_config(tensor_parallel_size=2, num_kv_blocks=32), progress=False,
                              share_rank_caches=True)
    split = LLMEngine(loaded)
    try:
        assert len(loaded.rank_kv_caches) == 2 and loaded.rank_kv_caches[0] is loaded.kv_cache
        assert _greedy(split, prompts, 6) == _greedy(make_engine(num_kv_blocks=32), prompts, 6)
        h = loaded.kv_spec.num_kv_heads
        assert whole.kv_cache.shape[-2] == 2 * h
        for r, cache in enumerate(loaded.rank_kv_caches):
            want = whole.kv_cache[..., r * h:(r + 1) * h, :]
            assert cache.shape == want.shape
            assert want.abs().sum() > 0  # the prompts wrote this rank's heads: the comparison is not of zeros
            assert torch.allclose(cache, want, atol=1e-4), (r, (cache - want).abs().max())
    finally:
        split.close()


def test_cpu_ranks_share_the_cores_and_cuda_graphs_are_off():
    config = check_engine_config(engine_config(tensor_parallel_size=2))
    assert config.num_threads == max(1, len(os.sched_getaffinity(0)) // 2)
    assert check_engine_config(engine_config(tensor_parallel_size=2, num_threads=3)).num_threads == 3
    assert check_engine_config(engine_config()) == engine_config()


def test_the_slices_of_each_rank_put_back_together_are_the_checkpoint():
    """Every cut tensor, its ranks' slices concatenated along the cut, is the checkpoint's (q/k/v rows by head,
    fused q/k/v and gate/up by part, o_proj and down_proj columns, per-head norms by head); others stay whole."""
    arch = ModelArch.from_dir(resolve_model("tiny-random", progress=False))
    h, kv, d, inter, hidden = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size, arch.hidden_size
    gen = torch.Generator().manual_seed(0)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(h * d, hidden, generator=gen),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(h * d, generator=gen),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv * d, hidden, generator=gen),
        "model.layers.0.self_attn.v_proj.bias": torch.randn(kv * d, generator=gen),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, h * d, generator=gen),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(hidden, generator=gen),
        "model.layers.0.self_attn.q_norm.weight": torch.randn(h, d, generator=gen),  # Cohere's per head
        "model.layers.0.self_attn.k_norm.weight": torch.randn(d, generator=gen),  # Qwen3's, shared
        "model.layers.1.self_attn.qkv_proj.weight": torch.randn((h + 2 * kv) * d, hidden, generator=gen),
        "model.layers.1.mlp.gate_up_proj.weight": torch.randn(2 * inter, hidden, generator=gen),
        "model.layers.1.mlp.down_proj.weight": torch.randn(hidden, inter, generator=gen),
        "model.layers.1.input_layernorm.weight": torch.randn(hidden, generator=gen),
        "model.embed_tokens.weight": torch.randn(10, hidden, generator=gen),
    }
    parts = []
    for rank in range(2):
        w = dict(full)
        shard_weights(w, arch, Shard(rank, 2))
        parts.append(w)
    cat = lambda name, dim=0: torch.cat([p[name] for p in parts], dim)  # noqa: E731
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.bias", "q_norm.weight"):
        assert torch.equal(cat(f"model.layers.0.self_attn.{name}"), full[f"model.layers.0.self_attn.{name}"])
    assert torch.equal(cat("model.layers.0.self_attn.o_proj.weight", 1), full["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(cat("model.layers.1.mlp.down_proj.weight", 1), full["model.layers.1.mlp.down_proj.weight"])
    for name in ("model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.k_norm.weight",
                 "model.layers.1.input_layernorm.weight", "model.embed_tokens.weight"):
        assert all(torch.equal(p[name], full[name]) for p in parts)  # whole on every rank (o's bias: after the sum)
    q, k, v = full["model.layers.1.self_attn.qkv_proj.weight"].split([h * d, kv * d, kv * d])
    for rank, p in enumerate(parts):
        rq, rk, rv = p["model.layers.1.self_attn.qkv_proj.weight"].split([h // 2 * d, kv // 2 * d, kv // 2 * d])
        assert torch.equal(rq, q.chunk(2)[rank]) and torch.equal(rk, k.chunk(2)[rank]) and torch.equal(rv, v.chunk(2)[rank])
        gate, up = p["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
        full_gate, full_up = full["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
        assert torch.equal(gate, full_gate.chunk(2)[rank]) and torch.equal(up, full_up.chunk(2)[rank])
    ranked = shard_arch(arch, 2)
    assert (ranked.num_heads, ranked.num_kv_heads, ranked.intermediate_size) == (h // 2, kv // 2, inter // 2)
    with pytest.raises(ValueError, match="OLMo 2"):  # a norm over all heads at once
        shard_weights({"model.layers.0.self_attn.q_norm.weight": torch.ones(h * d)}, arch, Shard(0, 2))
    check_shardable(type(None), arch, 1)  # one rank: anything goes


def _children() -> list[int]:
    """This process's child pids (Linux /proc)."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _shm_rank(path: str, rank: int, world_size: int, dtype_name: str, numel: int, rounds: int, queue) -> None:
    from pdcluster.engine.tensor_parallel.shm_allreduce import ShmAllReduce

    reducer = ShmAllReduce(path, rank, world_size, timeout_s=60)
    results = []
    for i in range(rounds):
        x = _shm_input(rank, i, numel, getattr(torch, dtype_name))
        reducer.all_reduce_(x)
        results.append(x.view(torch.uint8).numpy().tobytes())  # bytes: a tensor's pickle would outlive no process
    queue.put((rank, results))


def _shm_input(rank: int, round_index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * round_index + rank)
    return torch.randn(numel, generator=gen).to(dtype)


@pytest.mark.parametrize("world_size,dtype_name,numel", [
    (2, "float32", 7 * 576), (3, "bfloat16", 5 * 576),
    (2, "float32", (8 << 20) // 4 + 1000),  # past one slot: two chunks
])
def test_shared_memory_all_reduce_is_the_rank_order_float32_sum_on_every_rank(world_size, dtype_name, numel):
    """Every rank gets the same bits: the float32 sum of the ranks' inputs in rank order, rounded once to the dtype,
    round after round (a slot is not overwritten before every rank has read it)."""
    import multiprocessing

    from pdcluster.engine.tensor_parallel.shm_allreduce import create_segment, remove_segment

    path = create_segment(world_size)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    rounds = 6
    procs = [ctx.Process(target=_shm_rank, args=(path, r, world_size, dtype_name, numel, rounds, queue))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
        remove_segment(path)
    dtype = getattr(torch, dtype_name)
    for i in range(rounds):
        want = sum((_shm_input(r, i, numel, dtype).float() for r in range(1, world_size)),
                   _shm_input(0, i, numel, dtype).float()).to(dtype)
        for r in range(world_size):
            assert got[r][i] == want.view(torch.uint8).numpy().tobytes(), (r, i)


# ---- on GPUs: rank r on cuda:r, the all-reduce over NCCL ---------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs two CUDA devices")


@pytest.mark.gpu
@needs_two_gpus
def test_on_two_gpus_greedy_equals_one_gpu_in_fp32():
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(20 + 15 * i)] for i in range(4)]
    whole = make_engine(device="cuda", async_scheduling=True)
    expected = _greedy(whole, prompts, 32)
    split = make_engine(device="cuda", tensor_parallel_size=2, async_scheduling=True)
    try:
        assert split.kv_cache.device == torch.device("cuda:0") and split.kv_cache.shape[-2] == 1
        assert _greedy(split, prompts, 32) == expected
    finally:
        split.close()


def test_cuda_ranks_need_a_gpu_each():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        check_engine_config(engine_config(tensor_parallel_size=2, device="cuda"))


def test_rank_messages_round_trip_as_msgpack_and_garbage_is_refused():
    """What crosses a rank's pipe is msgpack (tests/test_no_pickle.py): a forward's tensors (views of larger buffers
    included), host arrays and plain values come back equal; a KV spec keeps its dtype; anything else is a ValueError."""
    import numpy as np

    from pdcluster.engine.attention import AttentionMetadata
    from pdcluster.engine.kv_cache import KVCacheSpec
    from pdcluster.engine.tensor_parallel.messages import (AllocateCache, Forward, Stop, decode, decode_status, encode,
                                                           encode_status)

    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    meta = AttentionMetadata(torch.arange(7), table[:2, :3], torch.tensor([5, 2], dtype=torch.int32),
                             torch.tensor([0, 5, 7], dtype=torch.int32), None, 0.125, None, 5,
                             np.array([5, 2], dtype=np.int64))
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    got = decode(encode(Forward(ids, torch.arange(7), meta)))
    assert torch.equal(got.input_ids, ids) and torch.equal(got.meta.block_tables, table[:2, :3])
    assert got.meta.block_tables.is_contiguous() and got.meta.scale == 0.125 and got.meta.uniform_q_len is None
    assert np.array_equal(got.meta.no_context_query_lens_np, meta.no_context_query_lens_np)
    assert torch.equal(got.meta.seq_lens, meta.seq_lens) and got.meta.seq_lens.dtype == torch.int32
    rows, embeds = torch.tensor([2, 3, 4]), torch.randn(3, 8).to(torch.bfloat16)  # a step's image rows (LLaVA)
    got = decode(encode(Forward(ids, torch.arange(7), meta, image_rows=(rows, embeds))))
    assert torch.equal(got.image_rows[0], rows) and torch.equal(got.image_rows[1], embeds)
    assert got.image_rows[1].dtype == torch.bfloat16 and decode(encode(Forward(ids, ids, meta))).image_rows is None
    with pytest.raises(ValueError, match="do not pair"):
        decode(encode(Forward(ids, torch.arange(7), meta, image_rows=(rows, embeds[:2]))))
    spec = KVCacheSpec(4, 0, 64, 16, 1, 32, torch.bfloat16)
    assert decode(encode(AllocateCache(spec))) == AllocateCache(spec)
    assert isinstance(decode(encode(Stop())), Stop)
    assert decode_status(encode_status("error", "boom")) == ("error", "boom")
    for garbage in (b"\x00\x01", encode_status("ready"), b"\x81\xa4kind\xa4exec"):
        with pytest.raises(ValueError, match="rank message"):
            decode(garbage)
