"""vLLM's ``--load-format dummy`` (engine/models/dummy_weights.py): the model's shapes with random weights, no weight
file read, for benchmarks of a model whose checkpoint is not at hand.

- The drawn tensors are exactly the checkpoint's names and shapes (Llama, NemotronH hybrids, a transformers 5 MoE
  saved in its per-expert layout), each uniform in [LOW, HIGH), the same whatever process draws it (a split
  model's ranks cut their slices of the same tensor; a level-2 sleep's wake draws the same weights again).
- A directory of configs and tokenizer alone is served (generate, serve with Ray workers); a quantized config's
  weights are drawn dense; without the flag such a directory is still one line saying it has no weights.
A Hub repository without weights: tests/test_hub_models.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors import safe_open

from conftest import engine_config
from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.dummy_weights import (DUMMY_MARKER, HIGH, LOW, checkpoint_shapes, dummy_tensors,
                                                   dummy_weights, is_dummy)
from pdcluster.engine.models.registry import UnknownModelError, resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.tools.server_process import ServeProcess

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The quick brown fox", "one two three four five six"]


def _saved_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[name] = tuple(tensors.get_slice(name).get_shape())
    return out


def _drawn_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for name, (shape, _) in checkpoint_shapes(str(model_dir)).items()}


@pytest.mark.parametrize("name", ["tiny-random", "tiny-hybrid", "tiny-hybrid-moe-plain"])
def test_the_drawn_tensors_are_the_checkpoints(name):
    model_dir = resolve_model(name, progress=False)
    assert _drawn_shapes(model_dir) == _saved_shapes(model_dir)


def test_a_transformers_moe_is_drawn_in_its_saved_layout(tmp_path):
    """transformers >= 5 keeps a Qwen3-MoE's experts fused in memory and saves them one by one: the draw is what is
    saved (a fused name would match nothing the loader reads)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=4, num_experts_per_tok=2, vocab_size=128, head_dim=16)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    saved = _saved_shapes(tmp_path)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved
    assert _drawn_shapes(tmp_path) == saved


def test_a_model_that_takes_images_draws_its_tower_too(tmp_path, tiny_dir):
    """A LLaVA made by transformers: its tower's and projector's tensors are drawn under their saved names (the image
    encoder reads them: engine/multimodal/llava.py), and a prompt with an image is answered."""
    from pdcluster.engine.multimodal.tiny_llava import build_tiny_llava, png

    model_dir = build_tiny_llava(tmp_path / "llava", tiny_dir)
    # The builder names the tower as the Hub's llava-hf checkpoints do (vision_tower.vision_model.*); transformers
    # >= 5.2x saves it without vision_model., and the encoder reads either.
    saved = {name.replace("vision_tower.vision_model.", "vision_tower."): shape
             for name, shape in _saved_shapes(model_dir).items()}
    assert _drawn_shapes(model_dir) == saved and any(name.startswith("vision_tower.") for name in saved)
    only = tmp_path / "llava-configs"
    shutil.copytree(model_dir, only, ignore=shutil.ignore_patterns("*.safetensors"))
    engine = LLMEngine.from_config(engine_config(str(only), dtype="float32", load_format="dummy", max_model_len=512))
    assert engine.model.image_encoder is not None
    prompt = {"prompt": "USER: <image>\nWhat is in this picture? ASSISTANT:",
              "multi_modal_data": {"image": [png(1, 16, 16)]}}
    out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and len(out.prompt_token_ids) > 20  # the image's placeholder rows


def test_each_tensor_is_drawn_in_range_by_its_name(tiny_dir):
    first = dummy_weights(tiny_dir, torch.float32)
    again = dict(dummy_tensors(tiny_dir, torch.float32, keep=lambda n: n.endswith("q_proj.weight")))
    assert again and all(torch.equal(first[name], t) for name, t in again.items())  # whatever else is drawn
    for name, t in first.items():
        assert LOW <= t.min().item() and t.max().item() < HIGH, name
        assert t.std().item() > (HIGH - LOW) / 8, name  # drawn, not a constant
    q0, q1 = first["model.layers.0.self_attn.q_proj.weight"], first["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)
    # A split model's rank cuts its slice of the whole tensor every rank draws alike.
    halves = dummy_weights(tiny_dir, torch.float32, cut=lambda name, t: t[: t.shape[0] // 2])
    assert all(torch.equal(halves[n], t[: t.shape[0] // 2]) for n, t in first.items())
    assert dummy_weights(tiny_dir, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


@pytest.fixture
def configs_only(tmp_path, tiny_dir):
    """tiny-random's configs and tokenizer without its weights: a checkpoint not at hand."""
    out = tmp_path / "configs-only"
    shutil.copytree(tiny_dir, out, ignore=shutil.ignore_patterns("*.safetensors", ".pdcluster*"))
    return out


def _generate(engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


def test_a_directory_without_weights_is_served_with_dummy_weights(configs_only):
    with pytest.raises(UnknownModelError, match="directory lacks \\*.safetensors; .*--load-format dummy: no"):
        LLMEngine.from_config(engine_config(str(configs_only), dtype="float32"))
    engine = LLMEngine.from_config(engine_config(str(configs_only), dtype="float32", load_format="dummy"))
    assert is_dummy(engine.model_dir) and not list(engine.model_dir.glob("*.safetensors"))
    assert 0 < engine.model.embed_tokens.abs().max().item() <= HIGH  # drawn, in vLLM's range
    first = _generate(engine)
    assert all(len(t) == 8 for t in first) and _generate(engine) == first
    # Another engine on the same flags draws the same model: the same tokens.
    assert _generate(LLMEngine.from_config(engine_config(str(configs_only), dtype="float32",
                                                         load_format="dummy"))) == first
    with pytest.raises(ConfigError, match="load_format 'pt': give one of auto, dummy"):
        EngineConfig(model=str(configs_only), load_format="pt")


def test_a_split_models_ranks_draw_their_slices(configs_only):
    """Tensor parallel: rank 0's process and the other rank's each resolve the overlay and cut their slices of the
    same drawn tensors (their equality: test_each_tensor_is_drawn_in_range_by_its_name); the split model generates."""
    engine = LLMEngine.from_config(engine_config(str(configs_only), dtype="float32", load_format="dummy",
                                                 tensor_parallel_size=2))
    try:
        assert engine.model.tp_shard.world_size == 2 and all(len(t) == 8 for t in _generate(engine))
    finally:
        engine.model.tp_driver.close()


def test_a_quantized_config_is_drawn_dense(configs_only):
    config = json.loads((configs_only / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (configs_only / "config.json").write_text(json.dumps(config))
    model_dir = resolve_model(str(configs_only), load_format="dummy")
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    assert json.loads((model_dir / DUMMY_MARKER).read_text())["source"] == str(configs_only.resolve())
    engine = LLMEngine.from_config(engine_config(str(configs_only), dtype="float32", load_format="dummy"))
    assert all(len(t) == 8 for t in _generate(engine))


def test_a_level_2_sleep_wakes_with_the_same_dummy_weights(configs_only):
    engine = LLMEngine.from_config(engine_config(str(configs_only), dtype="float32", load_format="dummy"))
    before = _generate(engine)
    engine.sleep(level=2)
    engine.wake_up()
    assert engine.sleep_state.num_reloads == 1 and _generate(engine) == before


def test_generate_and_serve_take_the_flag(configs_only):
    """The CLI's `generate`, and `serve` with a Ray worker (which resolves the model itself: the overlay with the
    marker), on the directory without weights."""
    r = subprocess.run([sys.executable, "-m", "pdcluster.cli", "generate", "--model", str(configs_only),
                        "--load-format", "dummy", "--num-kv-blocks", "64", "--max-tokens", "4", "--json",
                        "--prompt", "hello"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 4
    flags = ["--model", str(configs_only), "--load-format", "dummy", "--mode", "colocated", "--num-kv-blocks", "64",
             "--max-model-len", "256"]
    with ServeProcess(flags) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": str(configs_only), "prompt": "hello", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
