"""LoRA adapters on a mixture-of-experts layer's routed experts (engine/lora/experts.py) and on the shared expert,
in PEFT's per-expert names (``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1``, NemotronH's
``mixer.experts.{e}.up_proj``).

The models are transformers-made Qwen3-MoE, Qwen2-MoE, Mixtral and NemotronH (plain and latent MoE) directories (random weights, test_qwen3.py's and
test_model_families.py's shapes); the adapters are written here in PEFT's layout (random A and B, ranks that differ
by module, some experts left alone, attention projections too). The oracle is transformers on the base checkpoint
with each adapter's update merged into the weights (W + alpha / r * B @ A: what PEFT's merge_and_unload gives):
- float32: an adapter request's greedy tokens equal the merged model's, the base model's equal the base's, in one
  batch that mixes both adapters and the base model, both ways of running the updates (CPU grouped, CUDA's stacked);
- deterministic bf16: every request of such a batch is bit for bit what it is alone (a row that got another row's
  expert update, or none, would differ);
- an adapter loaded while serving is the start-up one; what cannot run is refused with the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import test_model_families
import test_qwen3
from conftest import make_engine
from pdcluster.engine.lora import LoraAdapterError
from pdcluster.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

NUM_NEW = 10
PROMPTS = [p[:24] for p in test_qwen3.PROMPTS[:5]]
CONFIGS = {"qwen3-moe": test_qwen3.CONFIGS["qwen3-moe"], "mixtral": test_model_families.CONFIGS["mixtral"],
           "qwen2-moe": test_model_families.CONFIGS["qwen2-moe"]}
# Per family: the MoE block's name, the experts' gate / up / down names.
FAMILY = {"qwen3-moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
          "qwen2-moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return test_qwen3.save_random_models(tmp_path_factory, CONFIGS)


def _write_adapter(path: Path, model_dir: Path, name: str, seed: int, shared: bool, attention: bool) -> Path:
    """A PEFT adapter directory on ``name``'s experts: every sparse layer, experts 0 .. E-2 (the last left alone),
    gate / up / down of ranks 4 / 8 / 6 (rank_pattern), lora_alpha 16; q_proj and v_proj (rank 8) with
    ``attention``; Qwen2-MoE's shared expert with ``shared``."""
    block, names = FAMILY[name]
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(model_dir / "model.safetensors")
    expert_keys = [k.split(".") for k in weights if f".{block}.experts." in k and k.endswith(f"{names[0]}.weight")]
    layers = sorted({int(k[2]) for k in expert_keys})  # model.layers.{L}.{block}.experts.{e}.{gate}.weight
    num_experts = 1 + max(int(k[5]) for k in expert_keys)
    tensors = {}

    def add(module_path: str, rank: int) -> None:
        _add_pair(tensors, weights, f"model.layers.{module_path}", rank, gen)

    for layer in layers:
        for e in range(num_experts - 1):
            for module, rank in zip(names, (4, 8, 6)):
                add(f"{layer}.{block}.experts.{e}.{module}", rank)
        if shared:
            for module in ("gate_proj", "up_proj", "down_proj"):
                add(f"{layer}.mlp.shared_expert.{module}", 4)
        if attention:
            for module in ("q_proj", "v_proj"):
                add(f"{layer}.self_attn.{module}", 8)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(names) + ["q_proj", "v_proj"],
              "rank_pattern": {names[0]: 4, names[2]: 6}, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _add_pair(tensors: dict, weights: dict, module: str, rank: int, gen: torch.Generator) -> None:
    """A random lora_A / lora_B pair of ``rank`` for the checkpoint's ``module`` (its weight's key less
    ``.weight``), under PEFT's name for it."""
    out_features, in_features = weights[f"{module}.weight"].shape
    tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
    tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.6 / rank


def _merged(model_dir: Path, adapter: Path, out: Path) -> Path:
    """``model_dir`` with ``adapter``'s updates merged into its weights (alpha / r by each module's own rank)."""
    shutil.copytree(model_dir, out)
    weights = load_file(model_dir / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + (16 / a.shape[0]) * b @ a
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _hf_greedy(model_dir: Path, cls: str) -> list[list[int]]:
    hf = test_qwen3._hf_model(model_dir, cls)
    outs = []
    for p in PROMPTS:
        ids = list(p)
        for _ in range(NUM_NEW):
            ids.append(int(test_qwen3._hf_logits(hf, ids)[-1].argmax()))
        outs.append(ids[len(p):])
    return outs


@pytest.fixture(scope="module")
def adapters(dirs, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """family -> {"e1": experts + attention (+ shared expert on Qwen2-MoE), "e2": experts only, another seed}."""
    root = tmp_path_factory.mktemp("expert_lora")
    return {name: {"e1": _write_adapter(root / name / "e1", d, name, 1, shared=name == "qwen2-moe", attention=True),
                   "e2": _write_adapter(root / name / "e2", d, name, 2, shared=False, attention=False)}
            for name, d in dirs.items()}


@pytest.fixture(scope="module")
def references(dirs, adapters, tmp_path_factory) -> dict[str, dict[str | None, list[list[int]]]]:
    """family -> adapter name (None: the base model) -> transformers' greedy tokens per prompt, float32."""
    root = tmp_path_factory.mktemp("merged")
    out = {}
    for name, d in dirs.items():
        cls = CONFIGS[name][1]
        out[name] = {None: _hf_greedy(d, cls)}
        for adapter, path in adapters[name].items():
            out[name][adapter] = _hf_greedy(_merged(d, path, root / f"{name}-{adapter}"), cls)
    return out


def _params(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, lora_name=adapter)


def _engine(model_dir: Path, adapters: dict[str, Path], **kw):
    kw = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 16, **kw}
    return make_engine(str(model_dir), lora_modules=tuple(f"{n}={p}" for n, p in adapters.items()), **kw)


def test_references_differ_by_adapter(references):
    """Each adapter changes what each model says (else the equalities below prove nothing)."""
    for name, refs in references.items():
        assert refs["e1"] != refs[None] and refs["e2"] != refs[None] and refs["e1"] != refs["e2"], name


@pytest.mark.parametrize("way", ["grouped", "stacked"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_expert_adapters_match_the_merged_model_in_one_batch_float32(dirs, adapters, references, name, way,
                                                                     monkeypatch):
    from pdcluster.engine.lora import layers

    if way == "stacked":
        monkeypatch.setattr(layers.cpu_lora, "available", lambda: False)
    engine = _engine(dirs[name], adapters[name], prefill_chunk_size=16)
    assert engine.model.lora.grouped == (way == "grouped")
    experts = [layer.moe.experts for layer in engine.model.layers if layer.moe is not None]
    assert experts and all(e.lora is not None and set(e.lora.grouped) == {0, 1} for e in experts)
    jobs = [(adapter, i) for i in range(len(PROMPTS)) for adapter in (None, "e1", "e2")]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(adapter) for adapter, _ in jobs])
    assert [o.token_ids for o in outs] == [references[name][adapter][i] for adapter, i in jobs]
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("way", ["grouped", "stacked"])
def test_mixed_batch_is_bitwise_each_request_alone_bf16(dirs, adapters, way, monkeypatch):
    """Deterministic bf16, prefix caching off: a batch of base, e1 and e2 requests (chunked prefills beside decodes)
    gives each request exactly its tokens alone, with each adapter over its own rows (CPU) or every slot masked."""
    from pdcluster.engine.lora import layers

    if way == "stacked":
        monkeypatch.setattr(layers.cpu_lora, "available", lambda: False)
    engine = _engine(dirs["qwen3-moe"], adapters["qwen3-moe"], dtype="bfloat16", deterministic=True,
                     enable_prefix_caching=False, prefill_chunk_size=16)
    jobs = [(PROMPTS[i % 3], _params(a)) for i, a in enumerate(["e1", None, "e2", "e1", "e2", None, "e1"])]
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in jobs]
    together = [o.token_ids for o in engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])]
    assert together == alone
    first = {sp.lora_name: toks for (p, sp), toks in zip(jobs, alone) if p is PROMPTS[0]}
    assert len({tuple(t) for t in first.values()}) == len(first), "an adapter changed nothing"


def test_expert_adapter_rows_replay_through_the_graphs(dirs, adapters, references, monkeypatch):
    """The masked way inside the CUDA graphs (emulated here): every slot's expert update is captured over the static
    token slots, so decode steps mixing e1, e2 and base rows replay with each request's own tokens; the graphs are
    captured again when an adapter comes."""
    from pdcluster.engine.lora import layers

    monkeypatch.setattr(layers.cpu_lora, "available", lambda: False)
    engine = _engine(dirs["qwen3-moe"], adapters["qwen3-moe"], max_num_seqs=12)
    engine.runner.use_decode_graphs(emulate=True)
    graphs = engine.runner.graphs
    jobs = [(adapter, i) for i in range(3) for adapter in ("e1", None, "e2")]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(adapter) for adapter, _ in jobs])
    assert [o.token_ids for o in outs] == [references["qwen3-moe"][adapter][i] for adapter, i in jobs]
    assert graphs.num_replays >= NUM_NEW - 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_expert_adapter_rows_in_real_cuda_graphs_match_the_merged_model(dirs, adapters, references):
    """On a GPU (fp32, Triton grouped matmuls): the same batch through captured graphs, the merged model's tokens."""
    engine = _engine(dirs["qwen3-moe"], adapters["qwen3-moe"], device="cuda")
    jobs = [(adapter, i) for i in range(3) for adapter in ("e1", None, "e2")]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(adapter) for adapter, _ in jobs])
    assert [o.token_ids for o in outs] == [references["qwen3-moe"][adapter][i] for adapter, i in jobs]
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0


def test_expert_adapter_loaded_while_serving_is_the_start_up_one(dirs, adapters, references):
    engine = _engine(dirs["qwen3-moe"], {}, enable_lora=True, max_loras=2)
    engine.load_lora("e2", str(adapters["qwen3-moe"]["e2"]))
    outs = engine.generate(PROMPTS, [_params("e2")] * len(PROMPTS))
    assert [o.token_ids for o in outs] == references["qwen3-moe"]["e2"]
    engine.unload_lora("e2")
    outs = engine.generate(PROMPTS[:2], [_params(None)] * 2)
    assert [o.token_ids for o in outs] == references["qwen3-moe"][None][:2]


def _copy_with(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    tensors = change(load_file(src / "adapter_model.safetensors"))
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def _renamed(old: str, new: str):
    return lambda w: {k.replace(old, new): v for k, v in w.items()}


REFUSED = {
    # An expert past the layer's 8.
    "expert_index": (_renamed(".experts.0.", ".experts.8."), r"layer 0 experts\.8\.\w+: this layer has no such"),
    # Layer 1 is dense (mlp_only_layers): it has no experts.
    "dense_layer": (_renamed("layers.0.mlp.experts", "layers.1.mlp.experts"), r"layer 1 experts\.0\.\w+: this layer has no such"),
    "shape": (lambda w: {**w, f"{PREFIX}.0.mlp.experts.1.down_proj.lora_A.weight": torch.zeros(6, 7)},
              r"experts.1.down_proj: lora_A \(6, 7\) / lora_B .* do not fit"),
    # PEFT's target_parameters form (one parameter for every expert; served: tests/test_qwen3.py), broken three ways.
    "stacked_unpaired": (lambda w: {**w, f"{PREFIX}.0.mlp.experts.lora_A.weight": torch.zeros(8, 64)},
                         "layer 0 experts: a stacked parameter's lora_A / lora_B are not a"),
    "stacked_shape": (lambda w: {**w, f"{PREFIX}.0.mlp.experts.lora_A.weight": torch.zeros(16, 64),
                                 f"{PREFIX}.0.mlp.experts.lora_B.weight": torch.zeros(50, 16)},
                      r"layer 0 experts: lora_A \(16, 64\) / lora_B \(50, 16\) fit neither expert projection"),
    "stacked_rank": (lambda w: {**w, f"{PREFIX}.0.mlp.experts.lora_A.weight": torch.zeros(12, 64),
                                f"{PREFIX}.0.mlp.experts.lora_B.weight": torch.zeros(96, 12)},
                     "lora_A's 12 rows are not a rank for each of 8 experts"),
    "stacked_over_rank": (lambda w: {**{k: v for k, v in w.items() if ".experts." not in k},
                                     f"{PREFIX}.0.mlp.experts.lora_A.weight": torch.zeros(8 * 80, 64),
                                     f"{PREFIX}.0.mlp.experts.lora_B.weight": torch.zeros(96, 80 * 8)},
                          "layer 0 experts: gate_up_proj: rank 80 exceeds max_lora_rank 64"),
    "stacked_twice": (lambda w: {**w, f"{PREFIX}.0.mlp.experts.lora_A.weight": torch.zeros(16, 64),
                                 f"{PREFIX}.0.mlp.experts.lora_B.weight": torch.zeros(96, 16)},
                      "expert 0 gate_proj is adapted twice"),
    # A shared expert on a model that has none.
    "shared_expert": (lambda w: {**w, f"{PREFIX}.0.mlp.shared_expert.up_proj.lora_A.weight": torch.zeros(4, 64),
                                 f"{PREFIX}.0.mlp.shared_expert.up_proj.lora_B.weight": torch.zeros(48, 4)},
                      "layer 0 shared_expert.up_proj: this layer has no such"),
    "router": (lambda w: {**w, f"{PREFIX}.0.mlp.gate.lora_A.weight": torch.zeros(4, 64)},
               "mlp.gate.lora_A.weight' is not a LoRA A/B weight"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_expert_adapters_we_cannot_run_are_refused_with_the_reason(dirs, adapters, tmp_path, case):
    change, message = REFUSED[case]
    path = _copy_with(adapters["qwen3-moe"]["e2"], tmp_path / case, change)
    with pytest.raises(LoraAdapterError, match=message):
        _engine(dirs["qwen3-moe"], {"x": path})


def test_expert_adapters_on_a_split_model_are_refused(dirs, adapters):
    """A rank holds a slice of every expert: adapters on experts are served on a whole model only, said so."""
    with pytest.raises(LoraAdapterError, match="served on a whole model only, not split 2 ways"):
        _engine(dirs["qwen3-moe"], {"e2": adapters["qwen3-moe"]["e2"]}, tensor_parallel_size=2)


# ---------------------------------------------------------------------------------------------------
# NemotronH (the source reports' model shape): routed experts on the hidden or the latent width, the shared expert


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory) -> dict[str, tuple[Path, Path, object]]:
    """name -> (model directory, adapter on every MoE layer's experts 0-6 (up rank 4, down rank 8), its shared
    experts and its Mamba in_proj, transformers on the merged weights)."""
    import test_nemotron_moe

    out = {}
    for name, kwargs in test_nemotron_moe.CONFIGS.items():
        d = test_nemotron_moe.save_nemotron_h(tmp_path_factory.mktemp(f"nemotron-{name}"), kwargs)
        weights = load_file(d / "model.safetensors")
        gen = torch.Generator().manual_seed(3)
        tensors = {}
        for key in sorted(weights):
            module = key.removesuffix(".weight")
            expert = ".mixer.experts." in key and int(key.split(".experts.")[1].split(".")[0]) < 7
            if (expert or ".mixer.shared_experts." in key or key.endswith("mixer.in_proj.weight")) and key.endswith(
                    ("up_proj.weight", "down_proj.weight", "in_proj.weight")):
                _add_pair(tensors, weights, module, 8 if key.endswith("down_proj.weight") else 4, gen)
        assert any(".experts.6.up_proj" in k for k in tensors) and any(".shared_experts." in k for k in tensors)
        adapter = tmp_path_factory.mktemp(f"nemotron-{name}-lora") / "n1"
        adapter.mkdir()
        save_file(tensors, adapter / "adapter_model.safetensors")
        (adapter / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "rank_pattern": {"down_proj": 8}, "bias": "none",
             "target_modules": ["up_proj", "down_proj", "in_proj"]}))
        merged = _merged(d, adapter, tmp_path_factory.mktemp(f"nemotron-{name}-merged") / "m")
        out[name] = (d, adapter, test_nemotron_moe._hf_model(merged))
    return out


@pytest.mark.parametrize("name", ["moe", "latent"])
def test_nemotron_h_expert_adapter_matches_the_merged_model(nemotron, name):
    import test_nemotron_moe

    model_dir, adapter, hf_merged = nemotron[name]
    engine = _engine(model_dir, {"n1": adapter}, prefill_chunk_size=16)
    experts = engine.model.lora_expert_targets()
    assert experts and all(t.experts.lora is not None and set(t.experts.lora.grouped) == {0} for t in experts)
    jobs = [(p, adapter_name) for p in PROMPTS for adapter_name in ("n1", None)]
    outs = [o.token_ids for o in engine.generate([p for p, _ in jobs], [_params(a) for _, a in jobs])]
    test_nemotron_moe.assert_greedy_of(hf_merged, PROMPTS, outs[::2])
    base = [o.token_ids for o in _engine(model_dir, {}).generate(PROMPTS, _params(None))]
    assert outs[1::2] == base and outs[::2] != base


@pytest.mark.parametrize("name", ["moe", "latent"])
def test_nemotron_h_peft_adapter_on_stacked_experts_matches_peft(nemotron, name, tmp_path):
    """An adapter made by peft on transformers' NemotronH: its routed experts through target_parameters (the stacked
    form), the shared experts and the Mamba in_proj as modules; greedy tokens equal peft's, beside base requests."""
    import test_nemotron_moe

    peft = pytest.importorskip("peft")
    model_dir = nemotron[name][0]
    torch.manual_seed(4)
    adapted = peft.get_peft_model(test_nemotron_moe._hf_model(model_dir), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["up_proj", "down_proj", "in_proj"],
        target_parameters=["experts.up_proj", "experts.down_proj"])).eval()
    adapted.save_pretrained(tmp_path / "p")
    keys = list(load_file(tmp_path / "p" / "adapter_model.safetensors"))
    assert any(k.endswith("mixer.experts.base_layer.lora_A.weight") for k in keys), keys
    engine = _engine(model_dir, {"p": tmp_path / "p"}, prefill_chunk_size=16)
    outs = [o.token_ids for o in engine.generate([p for p in PROMPTS for _ in (0, 1)],
                                                 [_params(a) for _ in PROMPTS for a in ("p", None)])]
    test_nemotron_moe.assert_greedy_of(adapted, PROMPTS, outs[::2])
    with adapted.disable_adapter():
        test_nemotron_moe.assert_greedy_of(adapted, PROMPTS, outs[1::2])
    assert outs[::2] != outs[1::2]
