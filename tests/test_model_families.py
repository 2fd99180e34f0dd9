"""The checkpoint shapes most served today, made by transformers (random weights) and served by LLMEngine from
their directories, with transformers (fp32, eager attention, repeated full forwards) as the oracle:

- Llama 3.1 / 3.2 / 3.3: RoPE ``llama3`` (low frequencies divided by the factor, a ramp to the high ones);
- Qwen2 / Qwen2.5: biases on q, k and v; here with YaRN RoPE (Qwen2.5's long-context setting: interpolated
  frequencies and cos / sin scaled by the attention factor);
- Mistral: a sliding window on every layer (prompts run past it), here with ``linear`` RoPE in transformers 4's
  ``rope_scaling`` form; Qwen2 with ``use_sliding_window`` on the layers from ``max_window_layers`` on;
- Llama with ``attention_bias`` (q, k, v and o biases);
- Mixtral: Mistral with a sparse MoE in every layer (the fused MoE core);
- Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's biased attention, sparse layers whose MoE adds a shared expert
  scaled by its sigmoid gate to the routed experts' output, a dense layer (``mlp_only_layers``), sliding layers;
- Phi-3 / Phi-4: q/k/v and gate/up stored fused (``qkv_proj``, ``gate_up_proj``), and LoRA adapters on them;
- Ministral 3: YaRN and queries scaled by position past the original context; Seed-OSS: q/k/v and o biases;
- EXAONE 4.0: post-norms, per-head q/k norms, sliding layers beside NoPE full ones;
- Cohere / Cohere2: LayerNorm, attention and the MLP in parallel, interleaved RoPE, per-head q/k LayerNorms, scaled
  logits; Cohere2's sliding layers beside NoPE full ones;
- multimodal checkpoints served for text: Mistral Small 3.x, Qwen2.5-VL, Qwen3-VL (M-RoPE is plain RoPE for text);
- GLM-4: four norms a layer, half of each head rotated in interleaved pairs, q/k/v biases, gate/up fused; GLM-4.5:
  DeepSeek-V3-routed MoE (sigmoid scores, a correction bias, group-limited top-k, scaled) with a shared expert;
- SmolLM3: every fourth layer without RoPE; OLMoE: OLMo 2's q/k norms and Qwen3-MoE's MoE in every layer;
- OLMo 2 / OLMo 3: norms after attention and the MLP (none before), q/k norms over all heads at once; OLMo 3's sliding
  layers (three of four) with their own RoPE table beside the full layers' YaRN;
- Granite 3.x: the embedding, attention scores and each residual branch multiplied, the logits divided; GraniteMoe:
  and a sparse MoE in every layer whose router softmaxes the top-k logits;
- Gemma 2: soft-capped attention scores (in the attention kernels) and logits, every other layer sliding;
- Gemma 3 (text): (1 + w) norms, four a layer, q/k head norms, GeGLU, a scaled embedding, its own attention
  scale, local sliding layers with their own RoPE beside global ones, final logit soft-capping.
Each variant matters: transformers' own greedy with the variant turned off differs (test_each_variant_matters),
so equality below fails if the engine drops it. Prompts run past each config's original context.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import engine_config
from test_hybrid_engine import _prompts
from test_qwen3 import _redraw_weights  # weights at a scale where every block (and bias) matters
from test_kv_transfer_e2e import run_on_pair
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.architectures import arch_from_dir, max_model_len_for
from pdcluster.engine.models.llama import RotaryEmbedding
from pdcluster.engine.models.moe import MoeArch
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.rope import RopeScaling, inv_freq_and_scale, rope_from_config
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

NUM_NEW = 12
VOCAB = 512
PROMPTS = [[3 + t % (VOCAB - 3) for t in p] for p in _prompts(16, seed=3)]  # 3..70 tokens

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
# name -> (config class, model class, config kwargs, the config.json keys that undo the variant)
CONFIGS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
               {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(COMMON, rope_parameters=YARN_ROPE),
                   {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "mistral-linear": ("MistralConfig", "MistralForCausalLM", dict(COMMON, sliding_window=24, head_dim=32),
                       {"rope_scaling": None, "rope_parameters": None}),
    "qwen2-swa": ("Qwen2Config", "Qwen2ForCausalLM",
                  dict(COMMON, use_sliding_window=True, sliding_window=20, max_window_layers=1),
                  {"use_sliding_window": False, "layer_types": None}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, attention_bias=True), None),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(COMMON, pad_token_id=0), None),
    # Granite 3.x: Llama with its four multipliers (granite-3.x-8b's values but the attention scale, 1 / head_dim).
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(COMMON, embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22,
                     logits_scaling=16.0),
                dict.fromkeys(("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                               "logits_scaling"))),
    # GLM-4: sandwich norms, half of each head rotated in interleaved pairs, q/k/v biases, gate/up fused.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(COMMON, pad_token_id=0, head_dim=32), None),
    # Cohere (Command R): LayerNorm, parallel attention and MLP, interleaved RoPE, per-head q/k LayerNorms (R+),
    # logits times logit_scale; Cohere2 (Command R7B, Command A): three sliding layers of four, the full one NoPE.
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(COMMON, pad_token_id=0, use_qk_norm=True, logit_scale=0.5),
               None),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                dict(COMMON, pad_token_id=0, num_hidden_layers=4, sliding_window=20, logit_scale=0.5),
                {"layer_types": ["full_attention"] * 4}),
    # EXAONE 4.0: post-norms, per-head q/k norms, two sliding layers then a full one without RoPE.
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM",
                dict(COMMON, pad_token_id=0, sliding_window=20, sliding_window_pattern=3),
                {"sliding_window": None, "layer_types": ["full_attention"] * 3}),
    # Ministral 3: YaRN and queries scaled past the original context (32 here: every prompt runs past it).
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM",
                   dict(COMMON, pad_token_id=0, rope_parameters={
                       "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 32, "max_position_embeddings": 256, "beta_fast": 32.0,
                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}), None),
    # Seed-OSS: q/k/v biases and o_proj's own.
    "seed-oss": ("SeedOssConfig", "SeedOssForCausalLM",
                 dict(COMMON, pad_token_id=0, attention_bias=True, attention_out_bias=True), None),
    # gpt-oss: attention sinks, layers 0 and 2 sliding, q/k/v and o biases, YaRN (truncate false), 4 experts of width
    # 96, top 2 (softmax over the top-2 biased logits), expert biases, the clamped SwiGLU (limit 1.0 here, so the
    # clamp bites on these weights; the release's 7.0 rarely would).
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(COMMON, head_dim=16, pad_token_id=0, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=20, swiglu_limit=1.0,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}),
                {"layer_types": ["full_attention"] * 3}),
    # Llama 4: layers 0 and 2 chunked (16 positions: every prompt runs past a chunk) with interleaved RoPE and q/k
    # L2 norms, layers 1 and 3 NoPE and full with the query temperature (floor_scale 8: it bites from position 7),
    # layers 1 and 3 MoE (4 experts of width 32, top 1, sigmoid-scaled inputs, a shared expert), 0 and 2 dense (96).
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(COMMON, head_dim=16, pad_token_id=0, num_hidden_layers=4, intermediate_size=32,
                    intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                    no_rope_layer_interval=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.1),
               {"layer_types": ["full_attention"] * 4}),
    # Multimodal checkpoints served for text (their language model; the vision tower and projector are not loaded):
    # Mistral Small 3.x (Mistral3ForConditionalGeneration, weights under language_model.*), Qwen2.5-VL (text at the
    # top level, M-RoPE) and Qwen3-VL (model.language_model.*, interleaved M-RoPE). Their towers are tiny.
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                 dict(text_config=dict(COMMON, model_type="mistral", sliding_window=None), tie_word_embeddings=False,
                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, head_dim=16, image_size=32, patch_size=16)), None),
    "qwen2.5-vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(text_config=dict(COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "mrope_section": [2, 3, 3]}),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64)), None),
    "qwen3-vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(text_config=dict(COMMON, head_dim=16, rope_parameters={
                     "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                     "mrope_interleaved": True}),
                      vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                         out_hidden_size=64, deepstack_visual_indexes=[])), None),
    # GLM-4.5: 8 experts of width 32 in 4 groups (the best 2 kept), top 2, renormalised and scaled by 2.5, one shared
    # expert, layer 0 dense (first_k_dense_replace), q/k/v biases, per-head q/k norms, half of each head rotated.
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(COMMON, pad_token_id=0, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                      topk_group=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True), None),
    # OLMoE: q/k norms over all heads, 4 experts of width 96 (intermediate_size), top 2 not renormalised.
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(COMMON, pad_token_id=0, num_experts=4, num_experts_per_tok=2),
              None),
    # SmolLM3: no RoPE on every fourth layer (here layer 1 of 3: no_rope_layer_interval 2).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(COMMON, pad_token_id=0, no_rope_layer_interval=2),
                {"no_rope_layers": [1, 1, 1]}),
    # OLMo 2: norms after each sublayer, q/k norms over all heads; OLMo 3: and three sliding layers of four (the
    # last layer full), the full layers on YaRN, the sliding ones on default RoPE.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(COMMON, pad_token_id=0), None),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(COMMON, pad_token_id=0, num_hidden_layers=4, sliding_window=20,
                   rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                       "original_max_position_embeddings": 32},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
              {"layer_types": ["full_attention"] * 4}),
    # GraniteMoe (granite-3.x-1b-a400m, 3b-a800m): Granite with 4 experts, top 2 (softmax over the top-k logits), in
    # the checkpoint layout (block_sparse_moe.router.layer, input_linear / output_linear stacked).
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(COMMON, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                        attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=16.0), None),
    # Gemma 2: soft-capped attention scores and logits, every other layer sliding.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(COMMON, head_dim=32, pad_token_id=0, sliding_window=20, query_pre_attn_scalar=24,
                    tie_word_embeddings=False, attn_logit_softcapping=2.0, final_logit_softcapping=30.0),
               {"attn_logit_softcapping": None}),
    # Mixtral: 4 experts, top 2 renormalised, in the checkpoint layout transformers writes
    # (block_sparse_moe.experts.{e}.w1 / w3 / w2), with a sliding window.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=40), None),
    # Qwen2-MoE: 4 experts of width 48, top 2 not renormalised (its default), a shared expert of width 80, layer 1
    # dense (mlp_only_layers: width 96), q/k/v biases, layers 1 and 2 sliding (layer_types, as transformers 5 saves).
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       shared_expert_intermediate_size=80, mlp_only_layers=[1], use_sliding_window=True,
                       sliding_window=20, layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
                  {"use_sliding_window": False, "layer_types": None}),
    # Gemma 3: a local (sliding, default RoPE) layer around a global one (linear-scaled RoPE of another theta).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(COMMON, head_dim=32, pad_token_id=0, sliding_window=20, query_pre_attn_scalar=24,
                    tie_word_embeddings=False, final_logit_softcapping=30.0,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
               {"layer_types": ["full_attention"] * 3}),
}
NAMES = list(CONFIGS)


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    tokenizer = resolve_model("tiny-random", progress=False) / "tokenizer.json"
    out = {}
    for name, (config_cls, model_cls, kwargs, _) in CONFIGS.items():
        d = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
        _redraw_weights(model)
        if name == "gpt-oss":  # sinks at the scores' scale, so they take a real share of each softmax
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.copy_(2.0 * torch.randn(4, generator=torch.Generator().manual_seed(2)))
        if name == "glm4-moe":  # the router's correction bias is a buffer (not redrawn): big enough to matter
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for layer in model.model.layers[1:]:
                    layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
        model.save_pretrained(str(d))
        shutil.copy(tokenizer, d / "tokenizer.json")
        out[name] = d
    # Mistral's RoPE in transformers 4's form (rope_scaling {"type": ...} beside rope_theta), as older
    # checkpoints carry it: transformers 5 reads it too.
    cfg = json.loads((out["mistral-linear"] / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (out["mistral-linear"] / "config.json").write_text(json.dumps(cfg))
    return out


def _hf_model(model_dir: Path):
    cls = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    return getattr(transformers, cls).from_pretrained(str(model_dir), dtype=torch.float32,
                                                      attn_implementation="eager").eval()


def _hf_greedy(hf, prompts) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(NUM_NEW):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str, list[list[int]]]:
    return {name: _hf_greedy(_hf_model(dirs[name]), PROMPTS) for name in NAMES}


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=256, block_size=16,
               max_num_seqs=16)
    cfg.update(overrides)
    return LLMEngine.from_config(EngineConfig(**cfg), progress=False)


def _run(engine: LLMEngine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_configs_read(dirs):
    llama3 = arch_from_dir(dirs["llama3"])
    assert llama3.rope_scaling == RopeScaling("llama3", 8.0, 32, 1.0, 4.0)
    assert not llama3.qkv_bias and llama3.sliding_window is None
    qwen2 = arch_from_dir(dirs["qwen2-yarn"])
    assert qwen2.rope_scaling.rope_type == "yarn" and qwen2.qkv_bias and not qwen2.o_bias
    mistral = arch_from_dir(dirs["mistral-linear"])
    assert mistral.rope_scaling.rope_type == "linear" and mistral.rope_scaling.factor == 2.0
    assert mistral.sliding_window == 24 and mistral.window_of(0) == mistral.window_of(2) == 24
    swa = arch_from_dir(dirs["qwen2-swa"])
    assert swa.sliding_layers == (False, True, True) and [swa.window_of(i) for i in range(3)] == [0, 20, 20]
    bias = arch_from_dir(dirs["llama-bias"])
    assert bias.qkv_bias and bias.o_bias and bias.rope_scaling is None
    mixtral = arch_from_dir(dirs["mixtral"])
    assert mixtral.moe.layout == "mixtral" and mixtral.moe.sparse_layers == (True,) * 3 and mixtral.moe.top_k == 2
    assert mixtral.moe.intermediate_size == 96 and mixtral.sliding_window == 40
    phi3 = arch_from_dir(dirs["phi3"])
    assert phi3.fused_checkpoint and not llama3.fused_checkpoint and phi3.sliding_window is None
    glm4_moe = arch_from_dir(dirs["glm4-moe"])
    assert glm4_moe.moe.layout == "glm4_moe" and glm4_moe.moe.sparse_layers == (False, True, True)
    assert glm4_moe.group_router.n_group == 4 and glm4_moe.group_router.routed_scaling_factor == 2.5
    assert glm4_moe.rotary_dim == 16 and not glm4_moe.rope_interleaved and glm4_moe.qk_norm and not glm4_moe.o_bias
    glm4 = arch_from_dir(dirs["glm4"])
    assert glm4.norm_layout == "sandwich" and glm4.rope_interleaved and glm4.rotary_dim == 16  # Glm4Config: 0.5
    assert glm4.qkv_bias and not glm4.o_bias and glm4.fused_gate_up and not glm4.fused_checkpoint
    assert arch_from_dir(dirs["smollm3"]).nope_layers == (False, True, False)
    olmoe = arch_from_dir(dirs["olmoe"])
    assert olmoe.qk_norm and olmoe.moe == MoeArch(num_experts=4, top_k=2, intermediate_size=96, norm_topk_prob=False,
                                                  sparse_layers=(True,) * 3)
    olmo2, olmo3 = arch_from_dir(dirs["olmo2"]), arch_from_dir(dirs["olmo3"])
    assert olmo2.norm_layout == "post" and olmo2.qk_norm and olmo2.sliding_window is None and olmo2.sliding_rope is None
    assert olmo3.sliding_layers == (True, True, True, False) and olmo3.sliding_window == 20
    assert olmo3.rope_scaling.rope_type == "yarn" and olmo3.sliding_rope == (10000.0, None)
    granitemoe = arch_from_dir(dirs["granitemoe"])
    assert granitemoe.moe == MoeArch(num_experts=4, top_k=2, intermediate_size=96, norm_topk_prob=True,
                                     sparse_layers=(True,) * 3, layout="granitemoe")
    assert granitemoe.moe.block == "block_sparse_moe" and granitemoe.residual_multiplier == 0.22


def test_qwen2_moe_reads_its_config(dirs, tmp_path):
    arch = arch_from_dir(dirs["qwen2-moe"])
    assert arch.moe == MoeArch(num_experts=4, top_k=2, intermediate_size=48, norm_topk_prob=False,
                               sparse_layers=(True, False, True), layout="qwen2_moe",
                               shared_expert_intermediate_size=80)
    assert arch.moe.block == "mlp" and arch.intermediate_size == 96  # layer 1's dense MLP
    assert arch.qkv_bias and not arch.o_bias and not arch.qk_norm
    assert arch.sliding_layers == (False, True, True) and [arch.window_of(i) for i in range(3)] == [0, 20, 20]
    # Keys a config.json may omit (Qwen1.5-MoE's predates qkv_bias) read as transformers' defaults.
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias")
    bare = arch_from_dir(_edit_config(dirs["qwen2-moe"], tmp_path / "bare", **dict.fromkeys(moe_keys)))
    hf = transformers.Qwen2MoeConfig(num_hidden_layers=3)
    assert bare.moe == MoeArch(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                               intermediate_size=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
                               sparse_layers=(True,) * 3, layout="qwen2_moe",
                               shared_expert_intermediate_size=hf.shared_expert_intermediate_size)
    assert bare.qkv_bias == hf.qkv_bias is True
    unbiased = arch_from_dir(_edit_config(dirs["qwen2-moe"], tmp_path / "unbiased", qkv_bias=False))
    assert not unbiased.qkv_bias
    every_other = arch_from_dir(_edit_config(dirs["qwen2-moe"], tmp_path / "step", mlp_only_layers=[],
                                             decoder_sparse_step=2))
    assert every_other.moe.sparse_layers == (False, True, False)


@pytest.mark.parametrize("change,words", [
    ({"n_group": 2, "topk_group": 1}, "n_group"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"layer_types": None}, "layer_types"),  # use_sliding_window alone: which layers slide is ambiguous
])
def test_qwen2_moe_unsupported_configs_refused_in_one_line(dirs, tmp_path, change, words):
    with pytest.raises(ValueError) as err:
        arch_from_dir(_edit_config(dirs["qwen2-moe"], tmp_path / "bad", **change))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_phi3_window_is_live(dirs, tmp_path):
    """Phi-3 mini's sliding_window (2047 of 4096) slides every layer, as Mistral's."""
    windowed = arch_from_dir(_edit_config(dirs["phi3"], tmp_path / "w", sliding_window=64))
    assert windowed.sliding_window == 64 and windowed.window_of(0) == 64 and max_model_len_for(windowed) == 256


@pytest.mark.parametrize("change,words", [
    ({"layer_types": ["chunked_attention"] * 3}, "chunked_attention"),
    ({"use_sliding_window": True, "sliding_window": None}, "needs a sliding_window"),
    ({"layer_types": ["full_attention"] * 2}, "2 entries for 3 layers"),
])
def test_bad_window_configs_refused(dirs, tmp_path, change, words):
    with pytest.raises(ValueError, match=words):
        arch_from_dir(_edit_config(dirs["qwen2-swa"], tmp_path / "bad", **change))


def test_reference_is_not_degenerate(reference):
    for outs in reference.values():
        assert len({tuple(o) for o in outs}) > len(outs) // 2
        assert sum(len(set(o)) > 2 for o in outs) > len(outs) // 2


@pytest.mark.parametrize("name", NAMES)
def test_greedy_batched_and_alone_equal_transformers(dirs, reference, name):
    engine = _engine(dirs[name])
    assert _run(engine, PROMPTS) == reference[name]
    assert _run(engine, PROMPTS[:1]) == reference[name][:1]
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("name", ["llama3", "qwen2-yarn", "mistral-linear", "qwen2-swa", "gemma3", "gemma2",
                                  "qwen2-moe", "granite", "olmo3", "smollm3", "cohere2", "exaone4", "gpt-oss",
                                  "llama4"])
def test_each_variant_matters(dirs, reference, name, tmp_path):
    """transformers' greedy with the RoPE variant (or the sliding window) undone differs from the reference,
    so the equality above holds only if the engine computes the variant."""
    undone = _edit_config(dirs[name], tmp_path / "undone", **CONFIGS[name][3])
    assert arch_from_dir(undone) != arch_from_dir(dirs[name])
    plain = _hf_greedy(_hf_model(undone), PROMPTS[:6])
    assert sum(a != b for a, b in zip(plain, reference[name][:6])) >= 3


def test_qwen2_moe_shared_expert_matters(dirs, reference):
    """transformers' greedy without the shared expert, or with its gate stuck at sigmoid(0) = 0.5, differs from the
    reference: the equality above holds only if the engine runs the shared expert behind its gate."""
    for undo in ("shared_expert.down_proj", "shared_expert_gate"):
        hf = _hf_model(dirs["qwen2-moe"])
        with torch.no_grad():
            for i in (0, 2):  # the sparse layers
                hf.model.layers[i].mlp.get_submodule(undo).weight.zero_()
        undone = _hf_greedy(hf, PROMPTS[:6])
        assert sum(a != b for a, b in zip(undone, reference["qwen2-moe"][:6])) >= 3, undo


def test_granitemoe_router_softmaxes_the_top_k_logits(dirs, reference):
    """GraniteMoe's routing weights are a softmax over the top-k logits, in the model dtype: transformers' greedy
    with the router's rows scrambled differs from the reference, and the engine's route equals transformers'."""
    from pdcluster.engine.models.architectures import load_model

    hf = _hf_model(dirs["granitemoe"])
    model = load_model(dirs["granitemoe"], torch.float32, 256)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _, want_weights, want_experts = hf.model.layers[0].block_sparse_moe.router(x)
        weights, experts = model.layers[0].moe.route(x)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-6)
    with torch.no_grad():
        for layer in hf.model.layers:
            router = layer.block_sparse_moe.router
            router.weight.copy_(router.weight.flip(0))
    scrambled = _hf_greedy(hf, PROMPTS[:6])
    assert sum(a != b for a, b in zip(scrambled, reference["granitemoe"][:6])) >= 3


def test_cohere_reads_its_config_and_its_logits_equal_transformers(dirs):
    """Command R's prompt logits (times logit_scale, which greedy tokens cannot see) equal transformers' in fp32:
    LayerNorms, per-head q/k LayerNorms, the parallel block, interleaved RoPE."""
    cohere, cohere2 = arch_from_dir(dirs["cohere"]), arch_from_dir(dirs["cohere2"])
    assert cohere.norm_layout == "parallel" and cohere.layer_norm and cohere.rope_interleaved and cohere.qk_norm
    assert cohere.logit_scale == 0.5 and cohere.sliding_window is None and cohere.rms_norm_eps == 1e-5
    assert cohere2.sliding_layers == (True, True, True, False) and cohere2.nope_layers == (False, False, False, True)
    exaone4 = arch_from_dir(dirs["exaone4"])
    assert exaone4.sliding_layers == (True, True, False) and exaone4.nope_layers == (False, False, True)
    assert exaone4.norm_layout == "post" and exaone4.qk_norm
    ministral3, seed = arch_from_dir(dirs["ministral3"]), arch_from_dir(dirs["seed-oss"])
    assert (ministral3.query_scale_beta, ministral3.query_scale_context) == (0.5, 32)
    assert ministral3.rope_scaling.rope_type == "yarn" and seed.qkv_bias and seed.o_bias
    # The published configs' string pattern ("LLLG": three sliding layers, then a full one), without layer_types.
    cfg = {**json.loads((dirs["exaone4"] / "config.json").read_text()), "num_hidden_layers": 8,
           "sliding_window_pattern": "LLLG"}
    from pdcluster.engine.models.llama_arch import _exaone4_layer_types

    assert _exaone4_layer_types({**cfg, "layer_types": None}) == (["sliding_attention"] * 3 + ["full_attention"]) * 2
    ours, expected, unscaled = _logits_and_transformers(dirs, "cohere")
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    assert (unscaled - expected).abs().max() > 0.5  # the scale matters


def test_multimodal_checkpoints_read_their_language_model(dirs, tmp_path):
    """A multimodal checkpoint is read as its text model; an older Qwen2.5-VL config (the text fields at the top level,
    ``rope_scaling`` {"type": "mrope"}) reads the same arch as transformers 5's."""
    mistral3, qwen25 = arch_from_dir(dirs["mistral3"]), arch_from_dir(dirs["qwen2.5-vl"])
    assert mistral3.num_layers == 3 and mistral3.sliding_window is None and not mistral3.tie_word_embeddings
    assert qwen25.qkv_bias and qwen25.rope_scaling is None and arch_from_dir(dirs["qwen3-vl"]).qk_norm
    cfg = json.loads((dirs["qwen2.5-vl"] / "config.json").read_text())
    text = cfg.pop("text_config")
    text.pop("rope_parameters")
    legacy = {**cfg, **text, "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    shutil.copytree(dirs["qwen2.5-vl"], tmp_path / "legacy")
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    assert arch_from_dir(tmp_path / "legacy") == qwen25
    # Mistral3's language model by its model_type: one not served is refused in one line, not read as Mistral.
    cfg = json.loads((dirs["mistral3"] / "config.json").read_text())
    cfg["text_config"]["model_type"] = "ministral"
    shutil.copytree(dirs["mistral3"], tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="text model is 'ministral' is not supported"):
        arch_from_dir(tmp_path / "other")


def test_smollm3_sliding_layers_are_its_nope_layers(dirs, tmp_path):
    """SmolLM3 with use_sliding_window and no layer_types slides the layers without RoPE, as SmolLM3Config does."""
    windowed = _edit_config(dirs["smollm3"], tmp_path / "w", use_sliding_window=True, sliding_window=20,
                            layer_types=None)
    hf = transformers.SmolLM3Config(**{**CONFIGS["smollm3"][2], "use_sliding_window": True, "sliding_window": 20})
    arch = arch_from_dir(windowed)
    assert arch.sliding_layers == tuple(t == "sliding_attention" for t in hf.layer_types) == (False, True, False)
    assert [arch.window_of(i) for i in range(3)] == [0, 20, 0]


def test_olmo3_legacy_config_reads_its_ropes(dirs, tmp_path):
    """OLMo 3's published configs (transformers 4) carry one ``rope_scaling`` beside ``rope_theta``: it is the full
    layers' (Olmo3Config), the sliding layers keep default RoPE at that theta. Without a window a config that names
    sliding layers is refused."""
    legacy = _edit_config(dirs["olmo3"], tmp_path / "legacy", rope_parameters=None, rope_theta=10000.0,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    assert arch_from_dir(legacy) == arch_from_dir(dirs["olmo3"])
    plain = _edit_config(dirs["olmo3"], tmp_path / "plain", rope_parameters=None, rope_theta=10000.0)
    assert arch_from_dir(plain).sliding_rope is None and arch_from_dir(plain).rope_scaling is None
    with pytest.raises(ValueError, match="sliding_window is not set"):
        arch_from_dir(_edit_config(dirs["olmo3"], tmp_path / "bad", sliding_window=None))


def test_qwen2_moe_block_is_batch_invariant(dirs):
    """Deterministic mode: a token's MoE output (router, experts, shared expert and its sigmoid gate) is bit for bit
    the same alone as among 64 others. torch.sigmoid would break it on CPU: its vector and tail paths round apart."""
    from pdcluster.engine.models.architectures import load_model

    model = load_model(dirs["qwen2-moe"], torch.float32, 256, deterministic=True)
    moe = model.layers[0].moe
    assert moe.shared is not None and model.layers[1].moe is None
    x = torch.randn(65, 64, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        assert torch.equal(moe(x), torch.cat([moe(x[i : i + 1]) for i in range(len(x))]))


def _each_part_matters(dirs, reference, name: str, undo: dict) -> None:
    """For each part, transformers' greedy with ``undo[part](layer)`` done to every layer differs from the reference
    in at least 3 of 6 prompts."""
    for part, undo_it in undo.items():
        hf = _hf_model(dirs[name])
        with torch.no_grad():
            for layer in hf.model.layers:
                undo_it(layer)
        without = _hf_greedy(hf, PROMPTS[:6])
        assert sum(a != b for a, b in zip(without, reference[name][:6])) >= 3, part


def test_gpt_oss_reads_its_config_and_each_of_its_parts_matters(dirs, reference):
    """gpt-oss's config as read, and transformers' greedy without each of its own parts (the attention sinks, the
    SwiGLU clamp, the expert and router biases) differs from the reference the engine equals."""
    arch = arch_from_dir(dirs["gpt-oss"])
    assert arch.attention_sinks and arch.qkv_bias and arch.o_bias
    assert arch.sliding_window == 20 and arch.sliding_layers == (True, False, True)
    assert arch.rope_scaling.rope_type == "yarn" and arch.rope_scaling.truncate is False
    assert arch.moe == MoeArch(num_experts=4, top_k=2, intermediate_size=96, norm_topk_prob=True,
                               sparse_layers=(True,) * 3, layout="gpt_oss", swiglu_alpha=1.702, swiglu_limit=1.0)
    undo = {"sinks": lambda layer: layer.self_attn.sinks.fill_(-1e4),  # a sink no softmax weighs
            "clamp": lambda layer: setattr(layer.mlp.experts, "limit", 1e4),
            "expert biases": lambda layer: (layer.mlp.experts.gate_up_proj_bias.zero_(),
                                            layer.mlp.experts.down_proj_bias.zero_()),
            "router bias": lambda layer: layer.mlp.router.bias.zero_()}
    _each_part_matters(dirs, reference, "gpt-oss", undo)


def test_llama4_reads_its_config_and_each_of_its_parts_matters(dirs, reference, tmp_path):
    """Llama 4's config as read; transformers' greedy without each of its own parts (the chunks, the q/k L2 norms,
    the NoPE layers' query temperature, the shared expert) differs from the reference the engine equals; its
    multimodal checkpoint's language model is read as the text model."""
    arch = arch_from_dir(dirs["llama4"])
    assert arch.attention_chunk_size == 16 and arch.chunked_layers == (True, False, True, False)
    assert arch.nope_layers == (False, True, False, True) and arch.rope_interleaved and arch.qk_l2_norm
    assert arch.query_temperature == (0.1, 8.0) and arch.intermediate_size == 96 and arch.sliding_window is None
    assert arch.moe == MoeArch(num_experts=4, top_k=1, intermediate_size=32, norm_topk_prob=True,
                               sparse_layers=(False, True, False, True), layout="llama4",
                               shared_expert_intermediate_size=32)
    undo = {"qk norm": lambda layer: delattr(layer.self_attn, "qk_norm") if hasattr(layer.self_attn, "qk_norm")
            else None,
            "temperature": lambda layer: setattr(layer.self_attn, "attn_temperature_tuning", False),
            "shared expert": lambda layer: layer.feed_forward.shared_expert.down_proj.weight.zero_()
            if layer.is_moe_layer else None}
    _each_part_matters(dirs, reference, "llama4", undo)
    cfg = json.loads((dirs["llama4"] / "config.json").read_text())
    multimodal = _edit_config(dirs["llama4"], tmp_path / "multimodal", architectures=["Llama4ForConditionalGeneration"],
                              text_config=cfg, vision_config={"hidden_size": 32})
    assert arch_from_dir(multimodal) == arch
    # Scout's own config keys: llama3 RoPE with equal low / high factors, an empty no_rope_layers (the default
    # interval), attn_temperature_tuning 4 (truthy), no layer_types.
    scout = arch_from_dir(_edit_config(dirs["llama4"], tmp_path / "scout", no_rope_layers=[], layer_types=None,
                                       attn_temperature_tuning=4, rope_parameters={
                                           "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                           "original_max_position_embeddings": 8192}))
    assert scout.rope_scaling.rope_type == "llama3" and scout.rope_scaling.factor == 16.0
    assert scout.nope_layers == arch.nope_layers and scout.chunked_layers == arch.chunked_layers
    assert scout.query_temperature == arch.query_temperature


def test_gpt_oss_mxfp4_release_equals_transformers_on_its_dequantized_weights(dirs, tmp_path):
    """A gpt-oss directory as OpenAI releases it (experts as MXFP4 blocks and scales, quantization_config mxfp4)
    serves the tokens transformers computes from those experts dequantized; MXFP4 on another architecture, and
    4-bit methods other than its own on gpt-oss, are still refused in one line."""
    from safetensors.torch import load_file, save_file

    from pdcluster.engine.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    hf = _hf_model(dirs["gpt-oss"])
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(layer.mlp.experts, name)  # [E, in, out]
                blocks, scales = quantize_mxfp4(weight.transpose(1, 2).contiguous())  # rows: out, groups of in
                packed[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)
                weight.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
    want = _hf_greedy(hf, PROMPTS[:6])
    assert want != [o[:NUM_NEW] for o in _hf_greedy(_hf_model(dirs["gpt-oss"]), PROMPTS[:6])]  # FP4 changed them
    release = tmp_path / "mxfp4"
    shutil.copytree(dirs["gpt-oss"], release)
    tensors = load_file(str(release / "model.safetensors"))
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(release / "model.safetensors"))
    cfg = json.loads((release / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (release / "config.json").write_text(json.dumps(cfg))
    assert _run(_engine(release), PROMPTS[:6]) == want
    bnb = _edit_config(release, tmp_path / "bnb", quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match=r"quantized weights \(bitsandbytes"):
        _engine(bnb)
    llama = _edit_config(dirs["llama3"], tmp_path / "llama-mxfp4", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match=r"quantized weights \(mxfp4"):
        _engine(llama)


def _ct_config(fmt: str, kind: str, symmetric: bool = True) -> dict:
    """A compressed-tensors quantization_config of 8-bit channel-wise weights (RedHatAI's W8 checkpoints')."""
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": symmetric,
                                           "dynamic": False},
        "input_activations": {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True}}}}


def test_quantized_configs_read():
    """Which quantization_configs the loader dequantizes, with which scales, and which it refuses (None)."""
    from pdcluster.engine.models.quantized import ScaledWeights, scaled_weights_of

    block_group = _ct_config("float-quantized", "float")
    block_group["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])
    assert scaled_weights_of({"quantization_config": block_group}) == ScaledWeights("_scale", (128, 128))
    assert scaled_weights_of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}) == \
        ScaledWeights("_scale_inv", (128, 64))
    assert scaled_weights_of({"quantization_config": {"quant_method": "fp8"}}) == ScaledWeights("_scale")
    four_bit = _ct_config("int-quantized", "int")
    four_bit["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    for config in ({}, {"quantization_config": {"quant_method": "bitsandbytes"}}, {"quantization_config": four_bit},
                   {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}):
        assert scaled_weights_of(config) is None


def _quantized_release(src: Path, out: Path, config: dict, quantize) -> tuple[Path, Path]:
    """``src`` with every linear weight of its layers stored as ``quantize(name, weight)`` gives it ({name: tensor}
    to store, the weight those stand for in float32), under quantization_config ``config``: (that directory, a
    directory of the weights they stand for)."""
    from safetensors.torch import load_file, save_file

    stored, dequantized = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            stored[name] = dequantized[name] = t
            continue
        parts, dequantized[name] = quantize(name, t)
        stored.update(parts)
    plain = _edit_config(src, out / "dequantized")
    save_file(dequantized, str(plain / "model.safetensors"))
    release = _edit_config(src, out / "release", quantization_config=config)
    save_file(stored, str(release / "model.safetensors"))
    return release, plain


@pytest.mark.parametrize("layout", ["fp8-per-tensor", "ct-fp8-channel", "ct-int8-channel-asymmetric"])
def test_8bit_weights_with_scales_equal_transformers_on_their_dequantized_weights(dirs, tmp_path, layout):
    """Per-tensor FP8 (AutoFP8 / vLLM's fp8, with static input scales the engine drops) and compressed-tensors' 8-bit
    channel-wise weights (FP8; INT8 with zero points), every linear weight of the layers quantized: served
    dequantized at load, the tokens transformers computes from the dequantized weights. compressed-tensors' packed
    4-bit weights are refused in one line."""
    from pdcluster.engine.models.quantized import quantize_int8_channel

    def quantize(name: str, t: torch.Tensor):
        parts, zero_point = {}, None
        if layout == "fp8-per-tensor":
            scale = t.abs().amax().reshape(1) / 448
            q = (t / scale).to(torch.float8_e4m3fn)
            parts[name[: -len("weight")] + "input_scale"] = torch.tensor([0.02])
        elif layout == "ct-fp8-channel":
            scale = t.abs().amax(dim=1, keepdim=True) / 448
            q = (t / scale).to(torch.float8_e4m3fn)
        else:
            q, scale = quantize_int8_channel(t)
            zero_point = torch.randint(-3, 4, scale.shape, dtype=torch.int8)
            q = (q.int() + zero_point).clamp(-128, 127).to(torch.int8)
            parts[name + "_zero_point"] = zero_point
        parts[name], parts[name + "_scale"] = q, scale
        # Written out here, not with the loader's function: (weight - zero point) * scale, broadcast over rows.
        return parts, (q.float() - (0 if zero_point is None else zero_point.float())) * scale.float()

    config = {"fp8-per-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
              "ct-fp8-channel": _ct_config("float-quantized", "float"),
              "ct-int8-channel-asymmetric": _ct_config("int-quantized", "int", symmetric=False)}[layout]
    release, plain = _quantized_release(dirs["llama3"], tmp_path, config, quantize)
    assert _run(_engine(release), PROMPTS[:6]) == _hf_greedy(_hf_model(plain), PROMPTS[:6])
    packed = _edit_config(release, tmp_path / "packed", quantization_config={
        **_ct_config("pack-quantized", "int"), "format": "pack-quantized"})
    with pytest.raises(ValueError, match=r"quantized weights \(compressed-tensors"):
        arch_from_dir(packed)


def test_packed_ints_are_the_words_vllm_packs():
    """AWQ's and GPTQ's int32 words for known values equal what vLLM's awq_pack / gptq_pack / pack_cols wrote for
    them (quant_utils, recorded here), and AWQ's dequantized weight is (q - zero) * scale, which vLLM's AWQ
    dequantize kernel (awq_triton) gave for the same words."""
    from pdcluster.engine.models.packed_int import PackedInts, awq_nibbles, dequantize_one, pack

    K, N, G = 64, 16, 32
    k, n = torch.arange(K)[:, None], torch.arange(N)[None, :]
    q = ((k * 5 + n * 3 + k * n) % 16).to(torch.int32)  # [K, N]
    zeros = ((torch.arange(K // G)[:, None] * 3 + n * 7 + 1) % 16).to(torch.int32)
    assert pack(awq_nibbles(q), 4, dim=1)[0].tolist() == [1603480672, -686054168]
    assert pack(awq_nibbles(zeros), 4, dim=1).tolist() == [[610844145, -1394592391], [1469833252, -552376148]]
    assert pack(q, 4, dim=0)[0].tolist() == [1049950800, -686071917, 1888662742, 421075225, -1299153316, 1528288159,
                                             -190957358, -1659527915, 916255320, -552380517, 2023406814, 286331153,
                                             -1164413356, 1394596759, -57265958, -1793223395]
    assert pack(zeros, 4, dim=1).tolist() == [[726495105, -1547311351], [1584435892, -688383428]]
    scales = ((torch.arange(K // G * N, dtype=torch.float16).reshape(K // G, N) + 1) / 64)
    want = ((q - zeros.repeat_interleave(G, 0)).to(torch.float16) * scales.repeat_interleave(G, 0)).float().t()
    got = dequantize_one(pack(awq_nibbles(q), 4, 1), pack(awq_nibbles(zeros), 4, 1), scales, PackedInts("awq", 4, G),
                         torch.float32)
    assert torch.equal(got, want)


def _int_quantize(weight: torch.Tensor, bits: int, groups: torch.Tensor, num_groups: int):
    """(q [K, N], zeros [G, N], scales [G, N] float16) of ``weight`` [N, K]: asymmetric, per input group and output
    column; ``groups`` [K] each input's group."""
    w = weight.t().float()  # [K, N]
    top = (1 << bits) - 1
    lo = torch.stack([w[groups == g].amin(0) for g in range(num_groups)]).clamp(max=0)
    hi = torch.stack([w[groups == g].amax(0) for g in range(num_groups)]).clamp(min=0)
    scales = ((hi - lo) / top).clamp_min(1e-6).to(torch.float16)
    zeros = torch.round(-lo / scales.float()).clamp(1, top).to(torch.int32)  # >= 1: GPTQ v1 stores zero - 1
    q = (torch.round(w / scales.float()[groups]) + zeros[groups]).clamp(0, top).to(torch.int32)
    return q, zeros, scales


@pytest.mark.parametrize("layout", ["awq", "gptq-act-order", "gptq-8bit-v2"])
def test_awq_and_gptq_equal_transformers_on_their_dequantized_weights(dirs, tmp_path, layout):
    """AWQ (GEMM) and GPTQ checkpoints (4-bit with act-order g_idx in AutoGPTQ's original zero-minus-one format;
    8-bit gptq_v2), every linear weight of the layers packed: served dequantized at load, the tokens transformers
    computes from the weights (q - zero) * scale."""
    from pdcluster.engine.models.packed_int import awq_nibbles, pack

    bits, group = (8, 32) if layout == "gptq-8bit-v2" else (4, 32)
    gen = torch.Generator().manual_seed(3)

    def quantize(name: str, t: torch.Tensor):
        num_inputs = t.shape[1]
        groups = torch.arange(num_inputs) // group
        if layout == "gptq-act-order":  # each input's group as its act-order permutation left it
            groups = groups[torch.randperm(num_inputs, generator=gen)]
        q, zeros, scales = _int_quantize(t, bits, groups, num_inputs // group)
        base = name[: -len(".weight")]
        if layout == "awq":
            parts = {base + ".qweight": pack(awq_nibbles(q), 4, 1), base + ".qzeros": pack(awq_nibbles(zeros), 4, 1)}
        else:
            parts = {base + ".qweight": pack(q, bits, 0), base + ".g_idx": groups.to(torch.int32),
                     base + ".qzeros": pack(zeros - (1 if layout == "gptq-act-order" else 0), bits, 1)}
        parts[base + ".scales"] = scales
        return parts, ((q - zeros[groups]).float() * scales.float()[groups]).t().contiguous()

    config = {"awq": {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True},
              "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True,
                                 "sym": False},
              "gptq-8bit-v2": {"quant_method": "gptq", "bits": 8, "group_size": group, "sym": False,
                               "checkpoint_format": "gptq_v2"}}[layout]
    release, plain = _quantized_release(dirs["llama3"], tmp_path, config, quantize)
    assert _run(_engine(release), PROMPTS[:6]) == _hf_greedy(_hf_model(plain), PROMPTS[:6])


def test_biases_matter(dirs, reference):
    hf = _hf_model(dirs["llama-bias"])
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    without_o = _hf_greedy(hf, PROMPTS[:6])
    assert sum(a != b for a, b in zip(without_o, reference["llama-bias"][:6])) >= 3


@pytest.mark.parametrize("name", ["qwen2-yarn", "mistral-linear", "gemma3", "gemma2", "mixtral", "qwen2-moe",
                                  "granite", "granitemoe", "olmo2", "olmo3", "smollm3", "olmoe", "glm4", "glm4-moe",
                                  "qwen3-vl", "cohere", "cohere2", "exaone4", "ministral3", "gpt-oss", "llama4"])
def test_chunked_prefill_and_preemption(dirs, reference, name):
    # Chunks of 5 tokens; 24 blocks of 16 for 16 requests of up to 82 tokens force preemption.
    engine = _engine(dirs[name], prefill_chunk_size=5, max_num_batched_tokens=40, num_kv_blocks=24)
    assert _run(engine, PROMPTS) == reference[name]
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("name", ["llama3", "qwen2-moe", "gpt-oss"])
def test_speculative_ngram_is_lossless(dirs, reference, name):
    engine = _engine(dirs[name], spec_method="ngram", num_spec_tokens=3)
    assert _run(engine, PROMPTS) == reference[name]


@pytest.mark.parametrize("name", ["qwen2-yarn", "gemma3", "mixtral", "qwen2-moe", "granitemoe", "olmo3", "glm4",
                                  "glm4-moe", "cohere", "cohere2", "gpt-oss", "llama4"])
def test_bf16_deterministic_batch_invariant(dirs, name):
    """bf16 in deterministic mode (the CPU default): a request's tokens in a batch are its tokens alone, with
    q/k/v biases and YaRN (the bias add is per row), with Gemma's norms and sliding layers, and with MoE (Qwen2-MoE's
    shared-expert gate: a sigmoid whose bits do not depend on the row's place in the batch)."""
    engine = _engine(dirs[name], dtype="bfloat16", deterministic=True)
    batched = _run(engine, PROMPTS)
    assert [_run(engine, [p])[0] for p in PROMPTS[:5]] == batched[:5]


@pytest.mark.parametrize("name", ["qwen2-yarn", "gemma3", "gpt-oss", "llama4"])
def test_disagg_equals_colocated(dirs, reference, name):
    """A prefill and a decode worker over tcp: the KV made with biases and YaRN, by Gemma's local and global
    layers, or by gpt-oss's layers with sinks, decodes to the same tokens."""
    cfg = engine_config(str(dirs[name]), dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=16)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    run = run_on_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), PROMPTS[:6], params, 128)
    assert run.tokens == reference[name][:6]


def test_sliding_window_served_past_the_window(dirs, reference):
    """Sliding windows no longer cap the context: a decode step far past the window (chunked prefill, a
    prompt over 5x the window) equals transformers."""
    arch = arch_from_dir(dirs["mistral-linear"])
    assert max_model_len_for(arch) == 256 and max_model_len_for(arch, 200) == 200
    with pytest.raises(ValueError, match=r"max_model_len: 300 exceeds the model's max_position_embeddings \(256\)"):
        max_model_len_for(arch, 300)
    long_prompt = [3 + (7 * i) % 500 for i in range(130)]
    for name in ("mistral-linear", "qwen2-swa"):
        want = _hf_greedy(_hf_model(dirs[name]), [long_prompt])
        assert _run(_engine(dirs[name], max_model_len=256, prefill_chunk_size=48), [long_prompt]) == want
        if name == "mistral-linear":  # the window matters: without it transformers answers otherwise
            wide = _edit_config(dirs[name], dirs[name].parent / "wide", sliding_window=4096)
            assert _hf_greedy(_hf_model(wide), [long_prompt]) != want


def test_legacy_and_new_rope_forms_agree():
    new = {"max_position_embeddings": 4096,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    legacy = {"max_position_embeddings": 4096, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert rope_from_config(new, "x") == rope_from_config(legacy, "x")
    theta, s = rope_from_config(legacy, "x")
    assert theta == 500000.0 and s.rope_type == "llama3"
    # transformers' own frequencies for Llama 3.2's config (128-dim heads)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, **new)
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours, scale = inv_freq_and_scale(128, theta, s)
    assert torch.equal(ours, hf_inv) and scale == hf_scale == 1.0


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.2,
     "truncate": False},
    {"rope_type": "linear", "factor": 4.0},
    # Llama 4 Scout's: llama3 with equal low and high frequency factors (a step, no ramp)
    {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
     "original_max_position_embeddings": 8192},
])
def test_rope_tables_equal_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = {"max_position_embeddings": 131072, "rope_parameters": {"rope_theta": 1000000.0, **params}}
    theta, s = rope_from_config(cfg, "x")
    hf_cfg = transformers.Qwen2Config(hidden_size=1024, num_attention_heads=8, **cfg)
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    ours, scale = inv_freq_and_scale(128, theta, s)
    torch.testing.assert_close(ours, hf_inv, rtol=0, atol=0)
    assert scale == pytest.approx(hf_scale, rel=1e-12)
    # The table every kernel reads: cos and sin scaled by the attention factor.
    rope = RotaryEmbedding(128, theta, 64, torch.float32, scaling=s)
    assert rope.cos_sin[5, 0].item() == pytest.approx(scale * float(torch.cos(torch.tensor(5.0) * ours[0])), abs=1e-6)


@pytest.mark.parametrize("change,words", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "'dynamic'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "'longrope'"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_scaling": {"type": "linear"}}, "'factor'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"clip_qkv": 8.0}, "clip_qkv"),
    ({"architectures": ["Qwen3NextForCausalLM"]}, "Qwen3NextForCausalLM"),
])
def test_unsupported_configs_refused_in_one_line(dirs, tmp_path, change, words):
    d = _edit_config(dirs["llama3"], tmp_path / "bad", **{"rope_parameters": None, **change})
    with pytest.raises(ValueError) as err:
        arch_from_dir(d)
    assert words in str(err.value) and "\n" not in str(err.value)


def _lora_equals_peft(dirs, reference, name: str, modules: list[str], tmp_path: Path) -> None:
    """A peft adapter (random, rank 4) on ``modules`` of ``name``: the engine gives peft's greedy for its requests and
    the reference for base-model requests in the same batch."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(_hf_model(dirs[name]), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=modules)).eval()
    model.save_pretrained(tmp_path / "adapter")
    want = _hf_greedy(model, PROMPTS[:3])
    assert want != reference[name][:3]
    engine = _engine(dirs[name], lora_modules=(f"a={tmp_path / 'adapter'}",))
    params = [SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, lora_name=n) for n in ("a", None)]
    outs = engine.generate([p for p in PROMPTS[:3] for _ in params], [sp for _ in PROMPTS[:3] for sp in params])
    assert [o.token_ids for o in outs[::2]] == want
    assert [o.token_ids for o in outs[1::2]] == reference[name][:3]


def test_phi3_lora_on_fused_projections_equals_peft(dirs, reference, tmp_path):
    """peft adapts Phi-3's fused qkv_proj and gate_up_proj as they are: the adapter loads onto them and the
    engine gives peft's greedy, beside base-model requests in one batch."""
    _lora_equals_peft(dirs, reference, "phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], tmp_path)


def test_glm4_rotation_and_lora_equal_transformers(dirs, reference, tmp_path):
    """GLM-4's interleaved partial rotation, served by permuting q/k head dimensions, is Glm4's apply_rotary_pos_emb
    permuted alike; a peft adapter on q/k/v (its B rows permuted the same way), o and the fused gate_up gives peft's
    greedy beside base requests."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    from pdcluster.engine.models.rope import partial_rotary_order

    head_dim, rotary_dim = 32, 16
    order = partial_rotary_order(head_dim, rotary_dim, interleaved=True)
    positions = torch.tensor([0, 3, 50, 200])
    q = torch.randn(len(positions), 2, head_dim, generator=torch.Generator().manual_seed(0))
    inv_freq, _ = inv_freq_and_scale(rotary_dim, 10000.0, None)
    emb = torch.cat([torch.outer(positions.float(), inv_freq)] * 2, dim=-1)
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1), q.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    ours = q[:, :, order].contiguous()
    RotaryEmbedding(head_dim, 10000.0, 256, torch.float32, rotary_dim=rotary_dim).rotate_(ours, positions)
    torch.testing.assert_close(ours, want.transpose(0, 1)[:, :, order], rtol=1e-6, atol=1e-6)
    _lora_equals_peft(dirs, reference, "glm4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj"], tmp_path)


def test_qwen2_moe_lora_on_attention_equals_peft(dirs, reference, tmp_path):
    """peft adapters on Qwen2-MoE's attention, and on its attention and MLPs (peft adapts the dense layer's MLP and the
    shared expert's projections; transformers 5 keeps the routed experts in one parameter, which peft leaves alone):
    peft's greedy, beside base-model requests (routed experts' adapters: tests/test_lora_experts.py)."""
    from safetensors.torch import load_file

    peft = pytest.importorskip("peft")
    attention, mlp = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]

    def make(modules: list[str], out: Path):
        torch.manual_seed(1)
        adapted = peft.get_peft_model(_hf_model(dirs["qwen2-moe"]), peft.LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_modules=modules)).eval()
        adapted.save_pretrained(out)
        return adapted

    want = {"a": _hf_greedy(make(attention, tmp_path / "a"), PROMPTS[:3]),
            "m": _hf_greedy(make(attention + mlp, tmp_path / "m"), PROMPTS[:3])}
    assert want["a"] != reference["qwen2-moe"][:3] and want["m"] != want["a"]
    assert any(".shared_expert." in k for k in load_file(tmp_path / "m" / "adapter_model.safetensors"))
    engine = _engine(dirs["qwen2-moe"], lora_modules=(f"a={tmp_path / 'a'}", f"m={tmp_path / 'm'}"))
    names = ("a", None, "m")
    params = [SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, lora_name=n) for n in names]
    outs = engine.generate([p for p in PROMPTS[:3] for _ in params], [sp for _ in PROMPTS[:3] for sp in params])
    for j, name in enumerate(names):
        assert [o.token_ids for o in outs[j::3]] == (want[name] if name else reference["qwen2-moe"][:3]), name


def test_gemma3_logits_equal_transformers(dirs, tmp_path):
    """Gemma 3's prompt logits (soft-capped) equal transformers' in fp32: every norm, the scaled embedding, both
    RoPE tables and the window; a prompt past the window."""
    from pdcluster.engine.models.architectures import load_model

    model = load_model(dirs["gemma3"], torch.float32, 256)
    assert model.arch.sliding_layers == (True, False, True) and model.arch.local_rope_theta == 10000.0
    tokens = [3 + (11 * i) % 500 for i in range(70)]
    with torch.inference_mode():
        ours = model.compute_logits(_prompt_hidden(model, tokens))
        expected = _hf_model(dirs["gemma3"])(torch.tensor([tokens])).logits[0]
    assert expected.abs().max() > 5 and expected.abs().max() <= 30.0  # capped
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    # The local layers matter: with every layer global (full attention, the global RoPE) the logits move far.
    undone = _edit_config(dirs["gemma3"], tmp_path / "undone", **CONFIGS["gemma3"][3])
    with torch.inference_mode():
        assert (_hf_model(undone)(torch.tensor([tokens])).logits[0] - expected).abs().max() > 1.0


def _prompt_hidden(model, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """The model's final hidden states over one prompt, through a scratch paged cache."""
    from pdcluster.engine.attention import AttentionMetadata

    n, num_blocks = len(tokens), -(-len(tokens) // block_size)
    cache = torch.zeros((model.arch.num_layers, 2, num_blocks, block_size, model.arch.num_kv_heads,
                         model.arch.head_dim))
    pos = torch.arange(n)
    meta = AttentionMetadata(pos.clone(), torch.arange(num_blocks, dtype=torch.int32)[None],
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), None,
                             model.scale)
    return model.forward(torch.tensor(tokens), pos, cache, meta)


def _logits_and_transformers(dirs, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(our logits, transformers', our LM head's output before the model's logit scaling) over one 40-token prompt."""
    from pdcluster.engine.models.architectures import load_model

    model = load_model(dirs[name], torch.float32, 256)
    tokens = [3 + (11 * i) % 500 for i in range(40)]
    with torch.inference_mode():
        hidden = _prompt_hidden(model, tokens)
        return (model.compute_logits(hidden), _hf_model(dirs[name])(torch.tensor([tokens])).logits[0],
                model.lm_head_proj(hidden).float())


def test_granite_reads_its_multipliers_and_its_logits_equal_transformers(dirs, tmp_path):
    """Granite's prompt logits (divided by logits_scaling, which greedy tokens cannot see) equal transformers' in
    fp32; a config without the multipliers reads transformers' defaults (1.0 each, the attention scale too)."""
    arch = arch_from_dir(dirs["granite"])
    assert (arch.embedding_multiplier, arch.attention_multiplier, arch.residual_multiplier, arch.logits_scaling) == \
        (12.0, 0.0625, 0.22, 16.0)
    bare = arch_from_dir(_edit_config(dirs["granite"], tmp_path / "bare", **CONFIGS["granite"][3]))
    hf = transformers.GraniteConfig()
    assert (bare.embedding_multiplier, bare.attention_multiplier, bare.residual_multiplier, bare.logits_scaling) == \
        (hf.embedding_multiplier, hf.attention_multiplier, hf.residual_multiplier, hf.logits_scaling) == (1.0,) * 4
    assert arch_from_dir(dirs["llama3"]).attention_multiplier is None  # Llama: head_dim ** -0.5
    ours, expected, unscaled = _logits_and_transformers(dirs, "granite")
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(unscaled / 16.0, expected, rtol=0, atol=1e-5)
    assert (unscaled - expected).abs().max() > 1.0  # the division matters


def test_gemma2_reads_its_config(dirs):
    arch = arch_from_dir(dirs["gemma2"])
    assert arch.attn_logit_softcapping == 2.0 and arch.final_logit_softcapping == 30.0 and not arch.qk_norm
    assert arch.sliding_layers == (True, False, True) and arch.local_rope_theta == arch.rope_theta


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: its language model (text_config over
    Gemma3TextConfig's defaults, weights under language_model.model.*) serves text with transformers' logits and
    greedy tokens; the processor's chat_template.json is the chat template."""
    text = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                num_hidden_layers=2, head_dim=32, sliding_window=20, query_pre_attn_scalar=24,
                max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=500, boi_token_index=498,
        eoi_token_index=499))
    _redraw_weights(model)
    d = tmp_path / "gemma3-mm"
    model.save_pretrained(str(d))
    shutil.copy(resolve_model("tiny-random", progress=False) / "tokenizer.json", d / "tokenizer.json")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "{% for m in messages %}<{{ m.role }}>"
                                                                        "{{ m.content }}{% endfor %}"}))
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
    want = _hf_greedy(hf, PROMPTS[:4])
    engine = _engine(d)
    assert engine.arch.num_layers == 2 and engine.arch.vocab_size == VOCAB and engine.arch.sliding_layers == (True, False)
    assert _run(engine, PROMPTS[:4]) == want
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"


def test_gemma3_lora_equals_peft(dirs, reference, tmp_path):
    """A peft adapter on Gemma 3's attention and GeGLU projections: peft's greedy, beside base requests."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(_hf_model(dirs["gemma3"]), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).eval()
    model.save_pretrained(tmp_path / "adapter")
    want = _hf_greedy(model, PROMPTS[:3])
    assert want != reference["gemma3"][:3]
    engine = _engine(dirs["gemma3"], lora_modules=(f"a={tmp_path / 'adapter'}",))
    params = [SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, lora_name=n) for n in ("a", None)]
    outs = engine.generate([p for p in PROMPTS[:3] for _ in params], [sp for _ in PROMPTS[:3] for sp in params])
    assert [o.token_ids for o in outs[::2]] == want
    assert [o.token_ids for o in outs[1::2]] == reference["gemma3"][:3]


TP_SPLITS = ["llama3", "qwen2-yarn", "mistral-linear", "qwen2-swa", "llama-bias", "phi3", "granite", "glm4", "cohere",
             "cohere2", "exaone4", "ministral3", "seed-oss", "smollm3", "mistral3", "qwen2.5-vl", "qwen3-vl", "mixtral",
             "qwen2-moe", "granitemoe", "gemma2", "gemma3", "gpt-oss", "llama4", "glm4-moe", "olmo2", "olmo3", "olmoe"]
TP_QUICK = ("llama-bias", "phi3", "glm4", "cohere", "exaone4", "granite", "qwen3-vl", "mixtral", "qwen2-moe",
            "gpt-oss", "llama4", "glm4-moe", "olmo2", "olmoe",
            "granitemoe", "gemma2", "gemma3")


@pytest.mark.parametrize("name", [n if n in TP_QUICK else pytest.param(n, marks=pytest.mark.slow) for n in TP_SPLITS])
def test_tensor_parallel_two_ranks_equal_transformers(dirs, reference, name):
    """The Llama family split over two ranks (engine/tensor_parallel/): o_proj's bias once after the sum (Llama with
    attention_bias, Seed-OSS), Phi-3's fused q/k/v and gate/up cut by part, GLM-4's sandwich norms and half-rotated
    interleaved heads, Cohere's per-head q/k LayerNorms cut by head and its parallel block, EXAONE's post-norms,
    Granite's multipliers around the sums, multimodal checkpoints' language models; MoE layers with each expert's
    rows split (Mixtral's w1/w3/w2, Qwen2-MoE's experts and gated shared expert beside a dense layer, GraniteMoe's
    stacked experts, gpt-oss's [E, in, out] experts with interleaved gate/up columns and their biases (the down bias
    added once) beside per-head sinks, Llama 4's stacked experts and shared expert beside its dense layers,
    GLM-4.5's experts and shared experts under its DeepSeek-V3 router), the router whole on every rank; OLMo 2/3's
    and OLMoE's q/k norms over all heads (each rank's channels, one all-reduce of the squares: SplitWidthNorm); Gemma 2 and 3
    (post-attention and post-feedforward norms on the sums, Gemma 3's per-head q/k norms, Gemma 2's score soft-cap per
    head, the final logit soft-cap)."""
    engine = _engine(dirs[name], tensor_parallel_size=2)
    try:
        assert _run(engine, PROMPTS) == reference[name]
        assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    finally:
        engine.close()


