"""Pipeline parallelism (engine/pipeline_parallel.py, vLLM's --pipeline-parallel-size): the model's layers cut into
consecutive stages, a rank each (rank 0 in the engine's process, the others spawned), hidden states handed from stage
to stage and the final ones back to rank 0.

- Exact: every layer runs the kernels it runs whole, so tokens and logprobs equal the whole model's, for 2 and 3
  stages (an uneven cut), through chunked prefill with preemption, async scheduling and n-gram speculation, and in the
  default dtype on SmolLM2.
- Each rank holds its stage: rank 0's layers and KV cache are its stage's only.
- What does not combine is refused by name before anything loads (tensor parallelism, draft layers, LoRA, the offload
  tiers, KV transfer, disagg serving, hybrids); a weight update and sleep are refused on a split engine.
- Served: `serve -pp 2` (colocated: a Ray worker whose engine spawns its stage) answers as one whole engine.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from conftest import engine_config
from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.causal_lm import stage_keeps
from pdcluster.engine.pipeline_parallel import stage_of
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.tools.server_process import ServeProcess

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "one two three four five six seven " * 12]


def _run(engine: LLMEngine, max_tokens: int = 16):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = engine.generate(PROMPTS, params)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _engine(**kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("max_model_len", 512)
    return LLMEngine.from_config(engine_config(**kw))


def _split_run(**kw):
    """(the split engine's outputs, its rank 0's layers, its cache's layers, its preemptions)."""
    engine = _engine(**kw)
    try:
        out = _run(engine)
        return out, len(engine.model.layers), engine.kv_cache.shape[0], engine.scheduler.num_preemptions_total
    finally:
        engine.close()


def test_stages_cover_the_layers_in_order():
    for num_layers, num_stages in ((4, 2), (4, 3), (30, 4), (7, 7), (32, 5)):
        stages = [stage_of(i, num_stages, num_layers) for i in range(num_stages)]
        assert [layer for s in stages for layer in s.layers] == list(range(num_layers))
        sizes = [len(s.layers) for s in stages]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)  # the remainder to the later stages
        assert [s.is_last for s in stages] == [False] * (num_stages - 1) + [True]
    keep = stage_keeps(stage_of(1, 2, 4).layers)
    assert keep("model.layers.2.mlp.down_proj.weight") and keep("model.layers.3.self_attn.q_proj.weight")
    assert not keep("model.layers.1.mlp.down_proj.weight") and not keep("model.layers.21.mlp.down_proj.weight")
    assert keep("model.embed_tokens.weight") and keep("model.norm.weight") and keep("lm_head.weight")
    # A multimodal checkpoint's language model, named as transformers 4 and 5 save it; its tower is not read.
    assert keep("language_model.model.layers.2.mlp.down_proj.weight")
    assert not keep("model.language_model.layers.0.mlp.down_proj.weight")
    assert not keep("vision_tower.encoder.layers.2.mlp.fc1.weight")


@pytest.fixture(scope="module")
def whole():
    return _run(_engine())


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_split_model_answers_as_the_whole_one(whole, num_stages):
    """tiny-random's 4 layers as 2 + 2 and 1 + 1 + 2: rank 0 holds its stage's layers and their KV alone."""
    out, layers, cache_layers, _ = _split_run(pipeline_parallel_size=num_stages)
    assert out == whole
    assert layers == cache_layers == len(stage_of(0, num_stages, 4).layers)


@pytest.mark.parametrize("kw", [
    {"num_kv_blocks": 8, "max_num_batched_tokens": 32},  # chunked prefill, preempted for want of blocks
    {"async_scheduling": True},
    {"spec_method": "ngram", "num_spec_tokens": 3},
], ids=["chunked+preemption", "async", "ngram"])
def test_the_split_keeps_scheduling_exact(whole, kw):
    reference = _run(_engine(**kw))
    out, _, _, preemptions = _split_run(pipeline_parallel_size=2, **kw)
    assert out == reference
    if "num_kv_blocks" in kw:
        assert reference == whole and preemptions > 0


def test_smollm2_in_the_default_dtype_splits_exactly():
    """What users get: SmolLM2 (30 layers: 15 + 15) in the default dtype (bf16 on CPUs with AMX / AVX512-BF16)."""
    kw = {"model": "smollm2", "dtype": "auto"}
    whole_out = _run(_engine(**kw), max_tokens=12)
    engine = _engine(pipeline_parallel_size=2, **kw)
    try:
        assert _run(engine, max_tokens=12) == whole_out
        assert len(engine.model.layers) == 15
    finally:
        engine.close()


@pytest.mark.parametrize("kw, message", [
    ({"tensor_parallel_size": 2}, "split a model one way"),
    ({"spec_method": "mtp", "num_spec_tokens": 2}, "spec_method .mtp.: a draft.s layers read the target.s last "
                                                   "hidden states"),
    ({"enable_lora": True}, "LoRA adapters: not with pipeline parallelism yet"),
    ({"kv_offload_host_gib": 1.0}, "the KV offload tiers"),
])
def test_what_does_not_combine_is_refused_before_loading(kw, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model="tiny-random", pipeline_parallel_size=2, **kw)


def test_a_model_that_does_not_split_is_one_line():
    with pytest.raises(ValueError, match="pipeline_parallel_size 2: NemotronHModel models are not cut into stages"):
        _engine(model="tiny-hybrid", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="the model has 4 layers, fewer than the stages"):
        _engine(pipeline_parallel_size=5)


def test_weight_updates_and_sleep_are_refused_on_a_split(tiny_dir):
    from pdcluster.engine.sleep import SleepError
    from pdcluster.engine.weight_update import WeightUpdateError

    engine = _engine(pipeline_parallel_size=2)
    try:
        with pytest.raises(WeightUpdateError, match="weight updates are not served on a pipeline split yet"):
            engine.prepare_weights(str(tiny_dir))
        with pytest.raises(SleepError, match="tensor or pipeline parallelism"):
            engine.sleep(level=1)
        assert _run(engine)  # still serving
    finally:
        engine.close()


def test_serve_splits_a_workers_model(whole):
    """`serve -pp 2`: mode auto serves colocated (a disagg pair would move rank 0's half of the KV); the worker's
    engine spawns its second stage; the answers are the whole engine's. --mode disagg is one line."""
    flags = ["--model", "tiny-random", "-pp", "2", "--num-kv-blocks", "128", "--max-model-len", "512",
             "--dtype", "float32"]
    with ServeProcess(flags) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        for prompt, (tokens, _) in zip(PROMPTS, whole):
            r = http.post("/v1/completions", json={"model": "tiny-random", "prompt": prompt, "max_tokens": 16,
                                                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens
        assert "--mode auto -> colocated (--pipeline-parallel-size)" in server.output()


def test_serve_refuses_a_disaggregated_split(capsys):
    from pdcluster.cli.main import main

    assert main(["serve", "--model", "tiny-random", "-pp", "2", "--mode", "disagg", "--port", "0"]) == 2
    assert "--pipeline-parallel-size 2: --mode disagg moves KV from rank 0's cache" in capsys.readouterr().err


def test_cuda_stages_need_a_gpu_each():
    from pdcluster.engine.tensor_parallel.driver import check_engine_config

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ConfigError, match="pipeline_parallel_size 2 needs 2 GPUs"):
        check_engine_config(engine_config(pipeline_parallel_size=2, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                    or os.environ.get("TRITON_INTERPRET") == "1", reason="needs two CUDA devices")
def test_on_two_gpus_the_stages_hand_over_through_nccl():
    whole_out = _run(_engine(device="cuda", async_scheduling=True))
    engine = _engine(device="cuda", async_scheduling=True, pipeline_parallel_size=2)
    try:
        assert engine.kv_cache.device == torch.device("cuda:0") and engine.kv_cache.shape[0] == 2
        assert [tokens for tokens, _ in _run(engine)] == [tokens for tokens, _ in whole_out]
    finally:
        engine.close()
