"""Granite 4.0 (transformers ``GraniteMoeHybridForCausalLM``) on NemotronH's blocks (engine/models/granite_hybrid.py),
made by transformers with random weights and served by LLMEngine, transformers (fp32, eager attention, repeated full
forwards) the oracle:

- "h": granite-4.0-h's shape: Mamba2 and attention layers without positional encoding, each followed by Granite's
  sparse MoE (softmax over the top-k logits) plus a shared SwiGLU MLP, and Granite's four multipliers;
- "rope": the same with RoPE on the attention layers (``position_embedding_type`` "rope");
- "dense": no routed experts (``num_local_experts`` 0), the shared MLP alone;
- "micro": granite-4.0-micro's shape: attention layers only, RoPE, dense (a hybrid class with no Mamba layer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import engine_config
from test_kv_transfer_e2e import run_on_pair
from test_model_families import NUM_NEW, _engine, _hf_greedy, _run
from pdcluster.engine.models.architectures import arch_from_dir, load_model
from pdcluster.engine.models.random_weights import redraw_nemotron_h
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

PROMPTS = [[3 + (7 * i + 13 * j) % 500 for j in range(5 + 7 * i)] for i in range(7)]  # 5..47 tokens
BASE = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
            num_hidden_layers=4, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16,
            mamba_d_state=12, mamba_n_groups=2, mamba_d_conv=3, mamba_chunk_size=8, mamba_expand=2,
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40, embedding_multiplier=12.0,
            attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=16.0)
SHAPES = {
    "h": {},
    "rope": dict(position_embedding_type="rope"),
    "dense": dict(num_local_experts=0),
    "micro": dict(layer_types=["attention"] * 3, num_hidden_layers=3, position_embedding_type="rope",
                  num_local_experts=0),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    tokenizer = resolve_model("tiny-random", progress=False) / "tokenizer.json"
    out = {}
    for name, change in SHAPES.items():
        d = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**{**BASE, **change}))
        redraw_nemotron_h(model)  # weights at a scale where every block matters (A_log and dt_bias as initialised)
        model.save_pretrained(str(d))
        shutil.copy(tokenizer, d / "tokenizer.json")
        out[name] = d
    return out


def _hf_model(model_dir: Path):
    return transformers.GraniteMoeHybridForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                    attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str, list[list[int]]]:
    return {name: _hf_greedy(_hf_model(d), PROMPTS) for name, d in dirs.items()}


def test_configs_read(dirs, tmp_path):
    h = arch_from_dir(dirs["h"])
    assert h.layer_types == ("M", "G", "*", "G", "M", "G", "M", "G") and h.num_layers == 1
    assert h.num_mamba_layers == 3 and h.mamba_head_dim == 16 and h.n_groups == 2 and h.dt_min == 0.0
    g = h.granite
    assert (g.embedding_multiplier, g.attention_multiplier, g.residual_multiplier, g.logits_scaling) == \
        (12.0, 0.0625, 0.22, 16.0)
    assert g.moe.layout == "granitemoe" and g.moe.num_experts == 4 and g.moe.intermediate_size == 48 and not g.rope
    assert arch_from_dir(dirs["rope"]).granite.rope and arch_from_dir(dirs["dense"]).granite.moe is None
    assert arch_from_dir(dirs["micro"]).num_mamba_layers == 0
    # The published checkpoints' form: layers_block_type "mamba" / "attention", "nope", infinity as a JSON literal.
    cfg = json.loads((dirs["h"] / "config.json").read_text())
    cfg.pop("layer_types")
    cfg.update(layers_block_type=["mamba", "attention", "mamba", "mamba"], position_embedding_type="nope")
    (tmp_path / "config.json").write_text(json.dumps(cfg).replace('{"__float__": "Infinity"}', "Infinity"))
    shutil.copy(dirs["h"] / "tokenizer.json", tmp_path / "tokenizer.json")
    assert arch_from_dir(tmp_path) == h


@pytest.mark.parametrize("change,words", [
    ({"time_step_limit": [0.0, 10.0]}, "time_step_limit"),
    ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "layer_types"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unservable_configs_refused_in_one_line(dirs, tmp_path, change, words):
    shutil.copytree(dirs["h"], tmp_path / "bad")
    cfg = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError) as err:
        arch_from_dir(tmp_path / "bad")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_reference_is_not_degenerate_and_the_multipliers_matter(dirs, reference, tmp_path):
    for outs in reference.values():
        assert len({tuple(o) for o in outs}) > len(outs) // 2
    shutil.copytree(dirs["h"], tmp_path / "plain")
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**cfg, "residual_multiplier": 1.0,
                                                                "embedding_multiplier": 1.0}))
    plain = _hf_greedy(_hf_model(tmp_path / "plain"), PROMPTS)
    assert sum(a != b for a, b in zip(plain, reference["h"])) >= 3


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_batched_and_alone_equal_transformers(dirs, reference, name):
    engine = _engine(dirs[name], num_kv_blocks=64)
    assert _run(engine, PROMPTS) == reference[name]
    assert _run(engine, PROMPTS[:1]) == reference[name][:1]
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


def test_logits_are_divided_by_logits_scaling(dirs):
    model = load_model(dirs["h"], torch.float32, 64)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        raw = model.lm_head_proj(hidden).float()
        assert torch.equal(model.compute_logits(hidden), raw / 16.0)


def test_chunked_prefill_preemption_and_ngram_are_exact(dirs, reference):
    engine = _engine(dirs["h"], prefill_chunk_size=5, max_num_batched_tokens=24, num_kv_blocks=12)
    assert _run(engine, PROMPTS) == reference["h"]
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    ngram = _engine(dirs["rope"], spec_method="ngram", num_spec_tokens=3, num_kv_blocks=64)
    assert _run(ngram, PROMPTS) == reference["rope"]


@pytest.mark.parametrize("name", ["h", "rope", "micro"])
def test_split_over_two_ranks_equals_transformers(dirs, reference, name):
    """engine/tensor_parallel/shard_hybrid.py on Granite's names: each rank's Mamba heads and group, attention heads
    (RoPE per head), SwiGLU experts' and shared MLP's gate and up rows; one sum for the MoE plus the shared MLP,
    the residual multiplier after it."""
    engine = _engine(dirs[name], tensor_parallel_size=2, prefill_chunk_size=16, max_num_batched_tokens=48)
    try:
        assert engine.model.arch.granite.shared_intermediate_size == 20  # half of 40 on each rank
        assert _run(engine, PROMPTS) == reference[name]
        assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    finally:
        engine.close()


def test_bf16_deterministic_batch_invariant(dirs):
    engine = _engine(dirs["h"], dtype="bfloat16", deterministic=True, num_kv_blocks=64)
    batched = _run(engine, PROMPTS)
    assert [_run(engine, [p])[0] for p in PROMPTS[:4]] == batched[:4]


def test_disagg_equals_transformers(dirs, reference):
    """A prefill and a decode worker over tcp: the attention KV and every Mamba layer's state travel, and the
    decode worker's tokens are transformers'."""
    cfg = engine_config(str(dirs["h"]), dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=16,
                        prefill_chunk_size=16)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    run = run_on_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), PROMPTS, params, 64)
    assert run.tokens == reference["h"]


# What peft adapts in a Granite hybrid: attention, the Mamba mixer's in_proj and out_proj, and the shared MLP (its
# name also matches the experts' stacked input_linear / output_linear, which peft leaves alone).
GRANITE_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear", "output_linear"]


def save_granite_adapter(model_dir: Path, out: Path) -> Path:
    """A random rank-4 peft adapter on every projection peft adapts in the Granite model at ``model_dir``."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    model = peft.get_peft_model(_hf_model(model_dir), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=GRANITE_LORA_MODULES)).eval()
    model.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("shape,ranks", [("h", 1), ("rope", 1), ("h", 2)])
def test_an_adapter_equals_peft_beside_base_requests(dirs, reference, shape, ranks, tmp_path):
    """Granite's layer i is blocks 2i and 2i + 1 here: the adapter's names are the checkpoint's (``mamba.``,
    ``self_attn.``, ``shared_mlp.``); fp32 greedy equals peft's in one batch with base requests, chunked prefill. On two
    ranks each holds its slice of the adapter (in_proj's B by z | x | B | C | dt, input_linear's by gate | up halves,
    out_proj's and output_linear's A by columns: engine/tensor_parallel/shard_lora.py)."""
    from safetensors.torch import load_file

    peft = pytest.importorskip("peft")
    adapter = save_granite_adapter(dirs[shape], tmp_path / "a")
    weights = load_file(adapter / "adapter_model.safetensors")
    saved = {k.split(".lora_")[0].split(".layers.")[1].split(".", 1)[1] for k in weights}
    assert saved == {"mamba.in_proj", "mamba.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "shared_mlp.input_linear", "shared_mlp.output_linear"}
    want = _hf_greedy(peft.PeftModel.from_pretrained(_hf_model(dirs[shape]), str(adapter)).eval(), PROMPTS[:3])
    assert want != reference[shape][:3]
    engine = _engine(dirs[shape], prefill_chunk_size=16, lora_modules=(f"a={adapter}",), tensor_parallel_size=ranks)
    params = [SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, lora_name=n) for n in ("a", None)]
    try:
        outs = engine.generate([p for p in PROMPTS[:3] for _ in params], [sp for _ in PROMPTS[:3] for sp in params])
    finally:
        engine.close()
    assert [o.token_ids for o in outs[::2]] == want
    assert [o.token_ids for o in outs[1::2]] == reference[shape][:3]


def test_an_adapter_on_the_experts_is_refused_by_name(dirs, tmp_path):
    """A Granite MoE layer's experts (block_sparse_moe.input_linear) take no adapter: refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    from pdcluster.engine.lora import LoraAdapterError

    adapter = save_granite_adapter(dirs["h"], tmp_path / "a")
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    key = next(k for k in weights if "shared_mlp.input_linear.lora_A" in k)
    weights[key.replace("shared_mlp", "block_sparse_moe")] = weights[key].clone()
    save_file(weights, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match=r"block_sparse_moe\.input_linear\.lora_A\.weight' is not a LoRA"):
        _engine(dirs["h"], lora_modules=(f"a={adapter}",))


