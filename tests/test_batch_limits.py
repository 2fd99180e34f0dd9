"""max_num_seqs and max_num_batched_tokens default per device (engine/batch_limits.py): 0 in the config means the
device's default, resolved where the engine loads; given values are kept. A GPU's are vLLM's serving defaults (an
H200 runs 1,024 requests and 8,192 tokens a step, where we capped it at 64 and 2,048); a CPU 128 and 2,048, as vLLM's
CPU serving default; a hybrid's cap stays 64."""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.batch_limits import GIB, BatchLimits, device_batch_limits
from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.scheduler import Scheduler


@pytest.mark.parametrize("device, memory_gib, name, expected", [
    ("cpu", 0, "", (2048, 128)),
    ("cuda", 139.8, "NVIDIA H200", (8192, 1024)),
    ("cuda", 79.1, "NVIDIA H100 80GB HBM3", (8192, 1024)),
    ("cuda", 79.1, "NVIDIA A100-SXM4-80GB", (2048, 256)),  # a larger budget measured slower there (vLLM #17885)
    ("cuda", 22.0, "NVIDIA L4", (2048, 256)),
    ("cuda", 178.0, "NVIDIA B200", (16384, 1024)),
])
def test_device_defaults(device, memory_gib, name, expected):
    assert device_batch_limits(device, int(memory_gib * GIB), name) == BatchLimits(*expected)


def _as_h200(monkeypatch):
    import pdcluster.engine.batch_limits as batch_limits

    monkeypatch.setattr(batch_limits, "cuda_batch_limits",
                        lambda device: device_batch_limits("cuda", int(139.8 * GIB), "NVIDIA H200"))


def test_resolution_fills_only_what_is_zero(monkeypatch):
    _as_h200(monkeypatch)
    auto = EngineConfig(model="x")
    assert (auto.max_num_seqs, auto.max_num_batched_tokens) == (0, 0)
    gpu = auto.resolve_batch_limits("cuda")
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (1024, 8192)
    cpu = auto.resolve_batch_limits("cpu")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (128, 2048)
    # A hybrid's requests each hold a Mamba state slot outside the KV budget: its cap stays 64 on any device.
    hybrid = auto.resolve_batch_limits("cuda:0", hybrid=True)
    assert (hybrid.max_num_seqs, hybrid.max_num_batched_tokens) == (64, 8192)
    mixed = EngineConfig(model="x", max_num_seqs=8).resolve_batch_limits("cuda")
    assert (mixed.max_num_seqs, mixed.max_num_batched_tokens) == (8, 8192)
    given = EngineConfig(model="x", max_num_seqs=300, max_num_batched_tokens=100)
    assert given.resolve_batch_limits("cuda", hybrid=True) is given


def test_unresolved_limits_are_refused_where_they_are_needed():
    with pytest.raises(ConfigError, match="resolve them for a device first"):
        Scheduler(EngineConfig(model="x"), num_blocks=16, max_model_len=64, eos_token_ids={0})
    with pytest.raises(ConfigError, match="resolve them for a device first"):
        EngineConfig(model="x").prefill_chunk_tokens
    engine = make_engine("tiny-random", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ConfigError, match="resolve them for a device first"):
        ModelRunner(EngineConfig(model="tiny-random"), engine.model, engine.kv_cache, engine.max_model_len)
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        with pytest.raises(ConfigError, match=f"{name}: must be a non-negative integer"):
            EngineConfig(model="x", **{name: -1})


@pytest.mark.parametrize("model, max_num_seqs", [("tiny-random", 128), ("tiny-hybrid", 64)])
def test_an_engine_on_a_cpu_runs_with_the_cpu_defaults(model, max_num_seqs):
    engine = make_engine(model, num_kv_blocks=64, max_model_len=256)
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (max_num_seqs, 2048)
    assert engine.scheduler.config.max_num_batched_tokens == 2048
    # the runner's request slots (and a hybrid's Mamba state slots, one spare) follow the cap
    assert engine.runner.states.block_table_np.shape[0] == max_num_seqs
    if engine.runner.mamba_pool is not None:
        assert engine.runner.mamba_pool.num_slots == max_num_seqs + 1
    given = make_engine(model, num_kv_blocks=64, max_model_len=256, max_num_seqs=5, max_num_batched_tokens=96)
    assert (given.config.max_num_seqs, given.config.max_num_batched_tokens) == (5, 96)


def test_cli_flags_default_to_the_device(tmp_path):
    import argparse

    from pdcluster.cluster.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--model", "tiny-random"]))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (0, 0)
    cfg = engine_config_from_args(parser.parse_args(["--model", "tiny-random", "--max-num-seqs", "7",
                                                     "--max-num-batched-tokens", "512"]))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (7, 512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_engine_on_a_gpu_takes_that_gpus_defaults():
    props = torch.cuda.get_device_properties(0)
    expected = device_batch_limits("cuda", props.total_memory, props.name)
    engine = make_engine("tiny-random", device="cuda", num_kv_blocks=256, max_model_len=256)
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (expected.max_num_seqs,
                                                                                  expected.max_num_batched_tokens)
    assert engine.runner.graphs is None or engine.runner.graphs.buckets[-1] == min(expected.max_num_seqs, 512)
