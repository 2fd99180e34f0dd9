"""The KV pool's size (engine/kv_budget.py): vLLM's gpu_memory_utilization arithmetic, the profile forward that
measures a step's activation peak (run here on the CPU through the real models with a scripted meter; on a GPU
with torch.cuda's), the automatic CPU budget, and workers sharing a GPU splitting the utilization."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.kv_budget import GIB, KVBudgetError, MemorySnapshot, kv_pool_bytes, profile_activation_peak
from pdcluster.engine.models.architectures import load_model
from pdcluster.engine.models.registry import resolve_model

pytestmark = pytest.mark.timeout(120)


def test_pool_is_what_the_utilization_leaves():
    snap = MemorySnapshot(total=80 * GIB, free=70 * GIB, allocated=6 * GIB, reserved=8 * GIB)
    assert snap.non_torch == 2 * GIB  # 10 GiB used, 8 of them torch's
    assert kv_pool_bytes(snap, activation_peak=3 * GIB, utilization=0.9) == int(0.9 * 80 * GIB) - 11 * GIB
    with pytest.raises(KVBudgetError, match=r"gpu_memory_utilization 0.1 gives 8.00 GiB .* weights and other tensors "
                                            r"take 6.00 GiB, a step's activations 3.00 GiB"):
        kv_pool_bytes(snap, activation_peak=3 * GIB, utilization=0.1)


@pytest.mark.parametrize("model", ["tiny-random", "smollm2"])
def test_profile_forward_runs_a_full_step(model):
    """The profile step runs the real model over a scratch cache of its tokens and reports the meter's peak
    over what was allocated before (here a scripted meter: the CPU has no allocator statistics)."""
    m = load_model(resolve_model(model, progress=False), torch.float32, 600)
    calls = []
    meter = (lambda: calls.append("reset"), lambda: 5_000, lambda: calls.append("before") or 1_000)
    assert profile_activation_peak(m, 512, 64, 16, torch.device("cpu"), measure=meter) == 4_000
    assert calls == ["before", "reset"]


def test_profile_step_stays_inside_the_context():
    """A step's budget larger than the context (an H100's 8,192 tokens, the context capped at 4,096) is profiled as
    several requests of at most the context each, every one from position 0 in blocks of its own: no position past
    the rotary table (the kernels read it unchecked), no slot outside the scratch cache, logits of the rows asked."""
    from pdcluster.engine.kv_budget import profile_seq_lens

    assert profile_seq_lens(8192, 4096) == [4096, 4096]
    assert profile_seq_lens(2048, 600) == [600, 600, 600, 248]
    assert profile_seq_lens(512, 600) == profile_seq_lens(512, 0) == [512]
    m = load_model(resolve_model("tiny-random", progress=False), torch.float32, 601)
    seen = {}
    forward, logits = m.forward, m.compute_logits

    def recording_forward(input_ids, positions, cache, meta, *rest):
        seen.update(positions=positions.clone(), slots=meta.slot_mapping.clone(), seq_lens=meta.seq_lens.tolist(),
                    starts=meta.query_start_loc.tolist(), tables=meta.block_tables.clone(), cache_shape=cache.shape)
        return forward(input_ids, positions, cache, meta, *rest)

    m.forward = recording_forward
    m.compute_logits = lambda hidden: seen.update(logit_rows=hidden.shape[0]) or logits(hidden)
    meter = (lambda: None, lambda: 5_000, lambda: 1_000)
    assert profile_activation_peak(m, 2048, 64, 16, torch.device("cpu"), measure=meter, max_seq_len=600) == 4_000
    assert seen["seq_lens"] == [600, 600, 600, 248] and seen["starts"] == [0, 600, 1200, 1800, 2048]
    assert int(seen["positions"].max()) == 599
    for i, (lo, hi) in enumerate(zip(seen["starts"], seen["starts"][1:])):
        assert seen["positions"][lo:hi].tolist() == list(range(hi - lo))
        # the request's slots are its own blocks', in order
        table = seen["tables"][i]
        expected = [int(table[p // 16]) * 16 + p % 16 for p in range(hi - lo)]
        assert seen["slots"][lo:hi].tolist() == expected
    assert len(set(seen["slots"].tolist())) == 2048
    assert int(seen["slots"].max()) < seen["cache_shape"][2] * 16  # inside the scratch cache's blocks
    assert seen["logit_rows"] == 64


def test_cpu_auto_budget_is_one_gib():
    engine = make_engine("tiny-random", num_kv_blocks=0)  # kv_cache_memory_gib 0: automatic
    assert engine.kv_spec.num_blocks == GIB // engine.kv_spec.bytes_per_block
    half = make_engine("tiny-random", num_kv_blocks=0, kv_cache_memory_gib=0.5)
    assert half.kv_spec.num_blocks == GIB // 2 // half.kv_spec.bytes_per_block


def test_config_checks():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="kv_cache_memory_gib"):
        EngineConfig(kv_cache_memory_gib=-1)


def test_workers_sharing_a_gpu_split_the_utilization():
    pytest.importorskip("fastapi")  # the launcher's module serves HTTP; the GPU machine collects this file without it
    from pdcluster.cluster.launcher import engine_for_gpu_share

    engine = EngineConfig(gpu_memory_utilization=0.9)
    assert engine_for_gpu_share(engine, 0.5).gpu_memory_utilization == pytest.approx(0.45)
    assert engine_for_gpu_share(engine, 1.0) is engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_fills_the_utilization():
    """On a GPU the automatic pool takes what gpu_memory_utilization leaves: the process then uses about that
    share of the GPU (within the activation reserve), and a tighter utilization gets a smaller pool."""
    free, total = torch.cuda.mem_get_info()
    engine = make_engine("tiny-random", device="cuda", num_kv_blocks=0, gpu_memory_utilization=0.5)
    pool = engine.kv_spec.num_blocks * engine.kv_spec.bytes_per_block
    assert 0.3 * total < pool < 0.5 * total
    assert torch.cuda.memory_reserved() <= 0.5 * total + 64 * (1 << 20)
    del engine
    gc.collect()  # the engine's parts refer to each other: its pool goes back on a collection, not at del
    torch.cuda.empty_cache()
    smaller = make_engine("tiny-random", device="cuda", num_kv_blocks=0, gpu_memory_utilization=0.3)
    assert smaller.kv_spec.num_blocks * smaller.kv_spec.bytes_per_block < pool
