"""DeepSeek-V2 and DeepSeek-V3 (engine/models/deepseek.py), made by transformers with random weights and served by
LLMEngine from their directories, with transformers (fp32, eager attention, repeated full forwards) as the oracle:

- V3 (DeepSeek-V3 / R1, Kimi K2): q through a low-rank q_a / q_b with its norm, the latent KV with its norm and a
  shared rotated key part, interleaved RoPE, YaRN with mscale (cos / sin and the attention scale), a dense first
  layer, then MoE with the sigmoid group router (correction bias, 2 of 4 groups) and a shared expert;
- V3 without ``rope_interleave`` and with default RoPE (Moonlight's shape), every group kept;
- V2 (DeepSeek-V2 / V2-Lite): q_proj straight from the hidden state, complex-multiply (interleaved) RoPE, the
  softmax router limited to the best group (``group_limited_greedy``: both experts from it), two shared experts.
Served absorbed: every head attends to one cached latent vector per token, so the cache holds one KV head of
kv_lora_rank + qk_rope_head_dim.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import engine_config
from test_kv_transfer_e2e import run_on_pair
from test_model_families import COMMON, NUM_NEW, PROMPTS, _edit_config, _engine, _hf_greedy, _hf_model, _run
from test_qwen3 import save_random_models
from pdcluster.engine.models.architectures import arch_from_dir, load_model
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.lora import LoraAdapterError, install
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels import ops
from pdcluster.kv_transfer.config import TransferConfig

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
           pad_token_id=0, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2)
YARN_MSCALE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
               "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}
CONFIGS = {
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(COMMON, **MLA, q_lora_rank=48, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, rope_parameters=YARN_MSCALE)),
    "v3-neox": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                dict(COMMON, **MLA, q_lora_rank=48, n_group=1, topk_group=1, n_shared_experts=1,
                     routed_scaling_factor=1.5, norm_topk_prob=True, rope_interleave=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
           dict(COMMON, **MLA, q_lora_rank=None, n_group=4, topk_group=1, topk_method="group_limited_greedy",
                n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False, rope_parameters=YARN_MSCALE)),
    # The published latent width (512 + 64: the C kernel's widest head; on CUDA the latent kernel's tile width).
    "v2-wide": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                dict(COMMON, **dict(MLA, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32),
                     q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
NAMES = list(CONFIGS)
WIDTH = {"v3": 40, "v3-neox": 40, "v2": 40, "v2-wide": 576}  # the cached latent's width a token and layer


def _redraw_correction_bias(name: str, model) -> None:
    """V3's router correction bias is a buffer (not redrawn): big enough to matter."""
    if isinstance(model, transformers.DeepseekV3ForCausalLM):
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return save_random_models(tmp_path_factory, CONFIGS, _redraw_correction_bias)


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str, list[list[int]]]:
    return {name: _hf_greedy(_hf_model(dirs[name]), PROMPTS) for name in NAMES}


def test_configs_read(dirs):
    v3, v2 = arch_from_dir(dirs["v3"]), arch_from_dir(dirs["v2"])
    # The cache's shape: one KV head of latent + rope (32 + 8), whatever the query heads.
    assert (v3.num_kv_heads, v3.head_dim, v3.num_heads) == (1, 40, 4)
    assert v3.mla.q_lora_rank == 48 and v2.mla.q_lora_rank == 0
    assert v3.mla.rope_interleaved and v2.mla.rope_interleaved and not arch_from_dir(dirs["v3-neox"]).mla.rope_interleaved
    # (nope + rope)^-0.5 times mscale(4, 0.707)^2, as transformers' yarn_apply_mscale.
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert v3.attention_scale == pytest.approx(24**-0.5 * mscale**2)
    assert arch_from_dir(dirs["v3-neox"]).attention_scale == pytest.approx(24**-0.5)
    assert v3.moe.sparse_layers == (False, True, True) and not v3.softmax_router and v2.softmax_router
    assert (v3.group_router.n_group, v3.group_router.topk_group, v3.group_router.routed_scaling_factor) == (4, 2, 2.5)


def test_reference_is_not_degenerate(reference):
    for name in NAMES:
        assert len({tuple(t) for t in reference[name]}) == len(PROMPTS), name


@pytest.mark.parametrize("name", NAMES)
def test_greedy_batched_and_alone_equal_transformers(dirs, reference, name):
    engine = _engine(dirs[name])
    assert _run(engine, PROMPTS) == reference[name]
    assert [_run(engine, [p])[0] for p in PROMPTS[:3]] == reference[name][:3]
    spec = engine.kv_spec  # the latent cache: one plane of one head per token and layer
    assert (spec.num_planes, spec.num_kv_heads, spec.head_dim) == (1, 1, WIDTH[name])
    assert spec.bytes_per_token == 3 * 1 * WIDTH[name] * 4 and engine.kv_cache.shape[1] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["v3", "v2-wide"])
def test_greedy_on_cuda_equals_transformers(dirs, reference, name):
    """On CUDA in fp32: the latents (40 and the published 576 wide) through the latent-attention kernel
    (kernels/triton_mla_attention.py), decode steps replayed in CUDA graphs."""
    engine = _engine(dirs[name], device="cuda")
    assert _run(engine, PROMPTS) == reference[name]
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_deterministic_batch_invariant_on_cuda(dirs):
    """bf16 on CUDA in deterministic mode: the latent kernel's fixed tiles and the grouped matmul's, so a request's
    tokens in a batch are its tokens alone, graphs or not."""
    engine = _engine(dirs["v2-wide"], device="cuda", dtype="bfloat16", deterministic=True)
    batched = _run(engine, PROMPTS)
    assert [_run(engine, [p])[0] for p in PROMPTS[:5]] == batched[:5]
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_the_latent_kernel_serves_the_model(dirs, reference, monkeypatch):
    """The engine with every MLA layer's attention on the Triton latent kernel (interpreted on these CPU tensors, as
    CUDA runs it compiled), decode steps through the CUDA graphs' static-buffer path (emulated): transformers'
    greedy, for the published latent width. The query layout, the latent slice, the scale and the graph buffers
    the GPU path hands the kernel are the engine's own."""
    from pdcluster.kernels.triton_mla_attention import mla_attention_triton

    calls = []

    def on_the_kernel(*args, **kwargs):
        calls.append(args[0].shape[0])
        return mla_attention_triton(*args, **kwargs)

    monkeypatch.setattr(ops, "latent_attention", on_the_kernel)
    engine = _engine(dirs["v2-wide"])
    engine.runner.use_decode_graphs(emulate=True)
    assert _run(engine, PROMPTS[:2]) == reference["v2-wide"][:2]
    assert engine.runner.graphs.num_replays > 0 and len(calls) > 0


def test_per_head_products_batched_equal_grouped():
    """The fast mode's batched GEMM for the per-head products (CUDA; forced here) computes what the grouped matmul
    with one group a head does, for strided inputs as MlaAttention hands them."""
    from pdcluster.engine.models.deepseek import PerHeadLinear

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 24, 16, generator=gen)
    x = torch.randn(7, 4, 20, generator=gen)[:, :, 2:18].transpose(0, 1)  # [heads, tokens, in], not contiguous
    batched, grouped = PerHeadLinear(weight, False, batched=True), PerHeadLinear(weight, True)
    assert batched.batched and not grouped.batched
    expected = torch.einsum("hti,hoi->hto", x, weight)
    torch.testing.assert_close(batched(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,change", [
    ("v3", {"rope_interleave": False}),  # the loader's reordering of the rotated rows
    ("v3", {"rope_parameters": dict(YARN_MSCALE, mscale_all_dim=0.0)}),  # the attention scale's mscale^2
])
def test_each_variant_matters(dirs, reference, name, change, tmp_path):
    """transformers' own greedy with the variant changed differs, so equality above fails if the engine drops it."""
    changed = _edit_config(dirs[name], tmp_path / "changed", **change)
    assert _hf_greedy(_hf_model(changed), PROMPTS[:8]) != reference[name][:8]


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_chunked_prefill_and_preemption(dirs, reference, name):
    engine = _engine(dirs[name], prefill_chunk_size=5, max_num_batched_tokens=40, num_kv_blocks=24)
    assert _run(engine, PROMPTS) == reference[name]
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


def test_speculative_ngram_is_lossless(dirs, reference):
    engine = _engine(dirs["v3"], spec_method="ngram", num_spec_tokens=3)
    assert _run(engine, PROMPTS) == reference["v3"]


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_bf16_deterministic_batch_invariant(dirs, name):
    """bf16 in deterministic mode: the per-head absorption runs on the batch-invariant grouped matmul, so a
    request's tokens in a batch are its tokens alone."""
    engine = _engine(dirs[name], dtype="bfloat16", deterministic=True)
    batched = _run(engine, PROMPTS)
    assert [_run(engine, [p])[0] for p in PROMPTS[:5]] == batched[:5]


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_split_over_two_ranks_equals_transformers(dirs, reference, name):
    """engine/tensor_parallel/shard.py's MLA split (vLLM's): each rank holds half the heads (q_b / q_proj and kv_b rows,
    o_proj columns), the latent path whole, so each rank caches the whole latent its heads read; the dense MLP's and
    every expert's rows split (shared experts too) under the router, whole on every rank."""
    engine = _engine(dirs[name], tensor_parallel_size=2, prefill_chunk_size=16, max_num_batched_tokens=48)
    try:
        assert engine.model.arch.num_heads == 2 and engine.kv_spec.num_kv_heads == 1
        assert engine.kv_spec.head_dim == WIDTH[name]  # the whole latent on each rank
        assert _run(engine, PROMPTS) == reference[name]
        assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    finally:
        engine.close()


def test_split_disagg_pair_equals_transformers(dirs, reference):
    """Both workers split over two ranks: each rank's cache holds the whole latent, and rank r's goes to rank r."""
    cfg = engine_config(str(dirs["v3"]), dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=16,
                        tensor_parallel_size=2)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    run = run_on_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), PROMPTS[:6], params, 128)
    assert run.tokens == reference["v3"][:6]


@pytest.mark.parametrize("prefill_ranks, decode_ranks", [(2, 1), (1, 2)])
def test_pair_split_different_ways_equals_transformers(dirs, reference, prefill_ranks, decode_ranks):
    """Workers splitting the model different ways (kv_transfer/transports/resplit.py): every rank's cache holds the
    whole latent, so each decode rank gets the prefill worker's rank 0 latent, whatever the two splits."""
    cfg = functools.partial(engine_config, str(dirs["v3"]), dtype="float32", max_model_len=128, num_kv_blocks=128,
                            block_size=16)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    run = run_on_pair(cfg(tensor_parallel_size=prefill_ranks), TransferConfig(transport="tcp", secret="s3cret"),
                      PROMPTS[:6], params, 128, decode_cfg=cfg(tensor_parallel_size=decode_ranks))
    assert run.tokens == reference["v3"][:6]


@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx"])
def test_disagg_equals_colocated(dirs, reference, transport):
    """The latent KV made by a prefill worker decodes to the same tokens on a decode worker: one plane a layer moved
    (tcp and ucx: rows; shm: copied straight into the decode worker's mapped cache)."""
    if transport == "ucx":
        pytest.importorskip("ucxx")
    cfg = engine_config(str(dirs["v3"]), dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=16)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    run = run_on_pair(cfg, TransferConfig(transport=transport, secret="s3cret"), PROMPTS[:6], params, 128)
    assert run.tokens == reference["v3"][:6]
    assert run.prefill_engine.kv_cache.shape[1] == 1 and run.decode_engine.kv_cache.shape[1] == 1


def test_evicted_prefix_comes_back_from_the_offload_tiers(dirs, tmp_path):
    """Prefix caching with host and disk tiers: a prompt whose latent blocks the device pool evicted loads them back
    (one plane a block) and answers the tokens of an engine that recomputed it."""
    gen = torch.Generator().manual_seed(5)
    a, b, c = ([3 + int(t) for t in torch.randint(0, 500, (100,), generator=gen)] for _ in range(3))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(engine):
        return [engine.generate([p], params)[0] for p in (a, b, c, a)]

    # 10 blocks of 16: two 100-token prompts (7 blocks each) do not fit together, so a's blocks are evicted.
    expected = [o.token_ids for o in run(_engine(dirs["v3"], num_kv_blocks=10, enable_prefix_caching=True))]
    engine = _engine(dirs["v3"], num_kv_blocks=10, enable_prefix_caching=True, kv_offload_host_gib=0.0001,
                     kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gib=0.01)
    outputs = run(engine)
    assert [o.token_ids for o in outputs] == expected
    assert outputs[3].num_offloaded_tokens >= 2 * 16, outputs[3]
    assert engine.scheduler.num_free_blocks == 10
    engine.offload.close()



def fp8_release(src: Path, out: Path, block: tuple[int, int] = (16, 32)) -> tuple[Path, Path]:
    """``src`` as DeepSeek releases its weights: every linear weight of the layers (attention, experts, shared
    experts, dense MLP, the MTP layer's) block-wise FP8 with float32 scale_inv, routers, norms, embeddings and the
    LM head as they are. (The FP8 directory, a directory of the dequantized weights in float32.)"""
    from safetensors.torch import load_file, save_file

    from pdcluster.engine.models.quantized import quantize_fp8_block

    tensors = load_file(str(src / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if not (name.startswith("model.layers.") and t.dim() >= 2 and "norm" not in name
                and not name.endswith("mlp.gate.weight")):
            fp8[name] = dequantized[name] = t
            continue
        q, scale_inv = quantize_fp8_block(t, block)
        fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
        # Written out here, not with the loader's function: each block's scale over its rows and columns.
        scale = scale_inv.repeat_interleave(block[0], -2)[..., : t.shape[-2], :].repeat_interleave(block[1], -1)
        dequantized[name] = q.float() * scale[..., : t.shape[-1]]
    assert sum(name.endswith("_scale_inv") for name in fp8) >= 10
    plain = _edit_config(src, out / "dequantized")
    save_file(dequantized, str(plain / "model.safetensors"))
    release = _edit_config(src, out / "fp8", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)})
    save_file(fp8, str(release / "model.safetensors"))
    return release, plain


def test_block_fp8_release_equals_transformers_on_its_dequantized_weights(dirs, tmp_path):
    """DeepSeek-V3 as DeepSeek releases it (fp8_release), served dequantized at load: the tokens transformers
    computes from the dequantized weights (blocks of 16 x 32 here: several a weight, edge blocks cut short). A
    malformed block size is refused in one line."""
    release, plain = fp8_release(dirs["v3"], tmp_path)
    want = _hf_greedy(_hf_model(plain), PROMPTS[:6])
    assert want != _hf_greedy(_hf_model(dirs["v3"]), PROMPTS[:6])  # FP8 changed the weights enough to matter
    assert _run(_engine(release), PROMPTS[:6]) == want
    bad = _edit_config(release, tmp_path / "bad",
                       quantization_config={"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(ValueError, match=r"quantized weights \(fp8"):
        arch_from_dir(bad)


@pytest.mark.parametrize("change,words", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}}, "quantized weights (fp8"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "greedy"}, "topk_method 'greedy'"),
    ({"attention_bias": True}, "attention_bias True"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
])
def test_unsupported_configs_refused_in_one_line(dirs, tmp_path, change, words):
    bad = _edit_config(dirs["v3"], tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=None) as e:
        arch_from_dir(bad)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_lora_refused_in_one_line(dirs):
    model = load_model(dirs["v2"], torch.float32, 64)
    with pytest.raises(LoraAdapterError, match="not served on DeepseekModel"):
        install(model, [])


def test_quantized_checkpoints_refused_for_every_family(tmp_path):
    """Any family: a quantization the loader does not dequantize (bitsandbytes' 4-bit, AWQ's GEMV layout) would be
    cast as it is stored; refused before loading."""
    src = resolve_model("tiny-random", progress=False)
    gemv = _edit_config(src, tmp_path / "gemv", quantization_config={"quant_method": "awq", "bits": 4,
                                                                      "group_size": 128, "version": "gemv"})
    with pytest.raises(ValueError, match=r"quantized weights \(awq"):
        arch_from_dir(gemv)
    bad = _edit_config(src, tmp_path / "q", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match=r"quantized weights \(bitsandbytes"):
        arch_from_dir(bad)
    cfg = json.loads((bad / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
