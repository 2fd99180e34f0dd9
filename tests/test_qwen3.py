"""Qwen3 and Qwen3-MoE directories made by transformers (random weights) served by LLMEngine, with
transformers (fp32, eager attention) as the oracle (issue 26 item 4).

Two models, each saved by ``save_pretrained`` with the tokenizer of tiny-random copied beside it:
- Qwen3 (dense): q_norm / k_norm on every head before RoPE, head_dim 24 while hidden / heads is 16, GQA
  4/2, tied embeddings;
- Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense through ``mlp_only_layers``, head_dim 32,
  untied head (the checkpoint stores experts one by one: ``mlp.experts.{e}.gate_proj.weight``).
Weights are redrawn at a scale where every block matters (transformers' std-0.02 init gives near-flat
logits), the router's included so the experts a token picks change its output.

The oracle for greedy tokens is repeated full forwards (as in test_hybrid_random_dir.py): for every new
token, the argmax of ``model(prompt + tokens so far).logits[0, -1]``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pdcluster.engine.models.architectures import arch_from_dir, load_model
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.moe import MoeArch, SparseMoe
from pdcluster.engine.sampling_params import SamplingParams
from conftest import forward_from_scratch
from test_hybrid_engine import _prompts

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

NUM_NEW = 12
VOCAB = 512
# 16 mixed-length prompts (3..70 tokens) with ids below the vocabulary.
PROMPTS = [[3 + t % (VOCAB - 3) for t in p] for p in _prompts(16, seed=1)]

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(COMMON, num_hidden_layers=3, head_dim=24, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, num_hidden_layers=4, head_dim=32, tie_word_embeddings=False, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
}
NAMES = list(CONFIGS)


def _redraw_weights(model, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight") or name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:  # [out, in] or an expert stack [E, out, in]
                gain = 3.0 if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else 1.5
                p.copy_(torch.randn(p.shape, generator=gen) * gain / p.shape[-1] ** 0.5)


def _hf_model(model_dir: Path, cls: str):
    return getattr(transformers, cls).from_pretrained(str(model_dir), dtype=torch.float32,
                                                      attn_implementation="eager").eval()


def save_random_models(tmp_path_factory, configs: dict, tweak=None) -> dict[str, Path]:
    """Each ``configs`` entry (config class, model class, kwargs, ...) made by transformers with seeded weights,
    redrawn (``tweak(name, model)`` after that), saved with tiny-random's tokenizer: {name: directory}."""
    tokenizer = resolve_model("tiny-random", progress=False) / "tokenizer.json"
    out = {}
    for name, (config_cls, model_cls, kwargs, *_) in configs.items():
        d = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
        _redraw_weights(model)
        if tweak is not None:
            tweak(name, model)
        model.save_pretrained(str(d))
        shutil.copy(tokenizer, d / "tokenizer.json")
        out[name] = d
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return save_random_models(tmp_path_factory, CONFIGS)


@pytest.fixture(scope="module")
def hf_models(dirs):
    return {name: _hf_model(dirs[name], CONFIGS[name][1]) for name in NAMES}


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.fixture(scope="module")
def reference(hf_models) -> dict[str, dict[tuple[int, ...], list[int]]]:
    """name -> prompt -> transformers' greedy continuation (repeated full forwards)."""
    out = {}
    for name, hf in hf_models.items():
        out[name] = {}
        for p in PROMPTS:
            ids = list(p)
            for _ in range(NUM_NEW):
                ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
            out[name][tuple(p)] = ids[len(p):]
    return out


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=16,
               max_num_seqs=16)
    cfg.update(overrides)
    return LLMEngine.from_config(EngineConfig(**cfg), progress=False)


def _run(engine: LLMEngine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def _prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    """Our model alone over a fresh paged cache: logits of every prompt token."""
    with torch.inference_mode():
        return model.compute_logits(forward_from_scratch(model, tokens))


# ---------------------------------------------------------------------------------------------------


def test_arch_reads_the_configs(dirs):
    dense, moe = arch_from_dir(dirs["qwen3"]), arch_from_dir(dirs["qwen3-moe"])
    assert dense.qk_norm and dense.moe is None and dense.head_dim == 24 and dense.tie_word_embeddings
    assert dense.rope_theta == 100000.0  # from transformers 5's rope_parameters
    assert moe.qk_norm and not moe.tie_word_embeddings
    assert moe.moe == MoeArch(num_experts=8, top_k=2, intermediate_size=48, norm_topk_prob=True,
                              sparse_layers=(True, False, True, True))


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_equal_transformers(dirs, hf_models, name):
    ours = load_model(dirs[name], torch.float32, 256)
    tokens = PROMPTS[3]
    expected = _hf_logits(hf_models[name], tokens)
    assert expected.abs().max() > 5  # logits large enough for the tolerance to be a real test
    torch.testing.assert_close(_prefill_logits(ours, tokens), expected, rtol=0, atol=1e-4)


def test_reference_is_not_degenerate(reference):
    for outs in reference.values():
        outs = list(outs.values())
        assert len({tuple(o) for o in outs}) > len(outs) // 2
        assert sum(len(set(o)) > 2 for o in outs) > len(outs) // 2


@pytest.mark.parametrize("name", NAMES)
def test_greedy_alone_and_batched_equal_transformers(dirs, reference, name):
    engine = _engine(dirs[name])
    expected = [reference[name][tuple(p)] for p in PROMPTS]
    assert _run(engine, PROMPTS[:1]) == expected[:1]
    assert _run(engine, PROMPTS) == expected
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_and_preemption_equal_transformers(dirs, reference, name):
    # Chunks of 5 tokens; 24 blocks of 16 for 16 requests of up to 82 tokens force preemption.
    engine = _engine(dirs[name], prefill_chunk_size=5, max_num_batched_tokens=40, num_kv_blocks=24)
    assert _run(engine, PROMPTS) == [reference[name][tuple(p)] for p in PROMPTS]
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


# ---------------------------------------------------------------------------------------------------
# MoE routing


def _moe_block(hf_models):
    """transformers' first sparse block and ours with the same weights (taken from its state dict)."""
    hf_block = hf_models["qwen3-moe"].model.layers[0].mlp
    sd = {k: v.detach().clone() for k, v in hf_block.state_dict().items()}
    arch = MoeArch(num_experts=8, top_k=2, intermediate_size=48, norm_topk_prob=True, sparse_layers=(True,))
    return hf_block, arch, sd


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["c_grouped_gemm", "torch_grouped_mm"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_every_token_routed_to_different_experts(hf_models, backend, norm_topk_prob):
    """Four tokens whose top-2 sets are disjoint ({0,1}, {2,3}, {4,5}, {6,7}: the router weight is set so),
    and random tokens besides: our block's output equals transformers' Qwen3MoeSparseMoeBlock's."""
    hf_block, arch, sd = _moe_block(hf_models)
    arch = MoeArch(**{**arch.__dict__, "norm_topk_prob": norm_topk_prob})
    hf_block.gate.norm_topk_prob = norm_topk_prob
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    router = torch.zeros(8, 64)
    for t in range(4):  # token t scores high on experts 2t and 2t + 1 only (different scores for each)
        router[2 * t] = 3.0 * x[t] / x[t].norm() ** 2
        router[2 * t + 1] = 2.0 * x[t] / x[t].norm() ** 2
    router += 0.01 * torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    original = hf_block.gate.weight.detach().clone()
    try:
        with torch.no_grad():
            hf_block.gate.weight.copy_(router)
        ours = SparseMoe(arch, router, sd["experts.gate_up_proj"], sd["experts.down_proj"], backend=backend)
        assert ours.experts.up.backend == ("c" if backend == "auto" else "torch")
        _, experts = ours.route(x)
        assert sorted(experts.sort(dim=-1).values.reshape(-1).tolist()) == list(range(8))
        mixed = torch.cat([x, torch.randn(13, 64, generator=torch.Generator().manual_seed(7))])
        with torch.inference_mode():
            expected = hf_block(mixed[None])[0]
            got = ours(mixed)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        # Each token's output is its own: alone it is the same (no mixing across tokens or experts).
        torch.testing.assert_close(ours(x[2:3]), got[2:3], rtol=0, atol=1e-5)
    finally:
        with torch.no_grad():
            hf_block.gate.weight.copy_(original)
        hf_block.gate.norm_topk_prob = True


def test_unsupported_configs_refused_in_one_line(dirs, tmp_path):
    import json

    cases = {"use_sliding_window": True, "mlp_bias": True, "shared_expert_intermediate_size": 64,
             "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
             "partial_rotary_factor": 0.5}
    for key, value in cases.items():
        d = tmp_path / key
        d.mkdir()
        cfg = json.loads((dirs["qwen3-moe"] / "config.json").read_text())
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
        shutil.copy(dirs["qwen3-moe"] / "tokenizer.json", d / "tokenizer.json")
        with pytest.raises(ValueError) as err:
            arch_from_dir(d)
        assert key in str(err.value) and "\n" not in str(err.value)


def test_deterministic_mode_moe_is_batch_invariant(dirs, hf_models):
    """EngineConfig.deterministic (issue 24) on Qwen3-MoE: the router through the batch-invariant GEMM, the
    experts through the batch-invariant grouped GEMM (kernels/csrc/grouped_gemm_bi.c), so a token's MoE output is
    bit for bit the same alone or among 32 others; logits still match."""
    det = load_model(dirs["qwen3-moe"], torch.float32, 256, deterministic=True)
    moe = det.layers[0].moe
    assert moe.router.deterministic and moe.experts.up.backend == moe.experts.down.backend == "c"
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        assert torch.equal(moe(x), torch.cat([moe(x[i : i + 1]) for i in range(33)]))
    tokens = PROMPTS[3]
    torch.testing.assert_close(_prefill_logits(det, tokens), _hf_logits(hf_models["qwen3-moe"], tokens),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_speculative_decoding_is_lossless(dirs, reference, name):
    """A random MTP head (its own dense layer, no q/k norm) and n-gram drafts: tokens stay transformers'."""
    prompts = PROMPTS[:6]
    expected = [reference[name][tuple(p)] for p in prompts]
    for spec in (dict(spec_method="mtp", mtp_checkpoint="random", num_spec_tokens=2),
                 dict(spec_method="ngram", num_spec_tokens=3)):
        assert _run(_engine(dirs[name], **spec), prompts) == expected, spec


@pytest.mark.parametrize("name", NAMES)
def test_lora_adapter_equals_peft(dirs, name, tmp_path):
    """A peft LoRA adapter (engine/lora/) on Qwen3 (q/k/v/o, whose q and k heads are normed after it, and the
    MLP) and on Qwen3-MoE (attention, the dense layer's MLP and the experts, which peft on transformers 5 adapts as
    the experts' stacked parameters: target_parameters, the fused gate/up with twice the rank and alpha): peft's
    greedy, beside base-model requests in one batch."""
    from safetensors.torch import load_file

    peft = pytest.importorskip("peft")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    mlp = ["gate_proj", "up_proj", "down_proj"]

    def make(modules: list[str], out: Path):
        torch.manual_seed(1)
        adapted = peft.get_peft_model(_hf_model(dirs[name], CONFIGS[name][1]), peft.LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_modules=modules)).eval()
        adapted.save_pretrained(out)
        return adapted

    model = make(attention + mlp, tmp_path / "adapter")
    if name == "qwen3-moe":  # the form this test is about
        keys = list(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
        assert any(k.endswith("mlp.experts.base_layer.lora_A.weight") for k in keys), keys
    prompts = PROMPTS[:3]

    def greedy(p: list[int]) -> list[int]:
        ids = list(p)
        for _ in range(NUM_NEW):
            ids.append(int(_hf_logits(model, ids)[-1].argmax()))
        return ids[len(p):]

    want = [greedy(p) for p in prompts]
    with model.disable_adapter():
        assert [greedy(p) for p in prompts] != want  # the adapter changes the answers
    engine = _engine(dirs[name], lora_modules=(f"a={tmp_path / 'adapter'}",))
    params = [SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, lora_name=n) for n in ("a", None)]
    outs = engine.generate([p for p in prompts for _ in params], [sp for _ in prompts for sp in params])
    assert [o.token_ids for o in outs[::2]] == want
