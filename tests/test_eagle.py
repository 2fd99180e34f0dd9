"""EAGLE drafts (engine/models/eagle.py) behind ``--spec mtp --mtp-checkpoint DIR``.

The head on the paged cache equals a reference built from transformers' own LlamaDecoderLayer (the input norm
removed, as EAGLE's cnets.py and vLLM's llama_eagle.py do), for EAGLE-1 and HASS; a checkpoint in EAGLE's own
format (pytorch_model.bin, ``model.`` prefixes) loads as its safetensors form does; generation with an EAGLE draft
is lossless (greedy output equals no speculation, synchronous and async, drafts proposed); and checkpoints that
cannot draft for the target (EAGLE-3, two layers, another model's shapes) are refused with a clear message.
"""

import json

import pytest
import torch

from conftest import make_engine, paged_in_chunks
from pdcluster.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The capital of France is", "one two three one two three one two", "def add(a, b):\n    return a + b\n"]
MAX_TOKENS = [24, 31, 17]


def _save(directory, weights: dict, arch, num_layers: int = 1, fmt: str = "safetensors", prefix: str = ""):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": arch.hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads}))
    named = {prefix + n: t.contiguous() for n, t in weights.items()}
    if fmt == "safetensors":
        save_file(named, str(directory / "model.safetensors"))
    else:
        torch.save(named, str(directory / "pytorch_model.bin"))
    return directory


@pytest.fixture(scope="module")
def target():
    return make_engine("tiny-random", num_kv_blocks=64).model


@pytest.mark.parametrize("hass", [False, True], ids=["eagle", "hass"])
def test_eagle_head_equals_a_transformers_layer_without_its_input_norm(target, tiny_dir, tmp_path, hass):
    """The paged head, run in two chunks as a chunked prefill runs it, equals fc([embed(t); h]) (each half normed
    first for HASS) through transformers' LlamaDecoderLayer with its input norm an identity, causal over the whole
    sequence; its K and V land in the draft layer's cache slots."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from pdcluster.engine.models.eagle import EagleHead, EagleTrainModule, load_eagle_weights, random_eagle_weights
    from pdcluster.engine.models.llama import rms_norm

    arch = target.arch
    raw = random_eagle_weights(arch, seed=5, hass=hass)
    head = EagleHead(target, load_eagle_weights(_save(tmp_path / "eagle", raw, arch), arch), draft_vocab_size=10**9)
    length = 37
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(length, arch.hidden_size, generator=gen)
    next_ids = torch.randint(0, arch.vocab_size, (length,), generator=gen)
    pos = torch.arange(length)
    paged, cache, slots = paged_in_chunks(lambda rows, p, cache, meta: head.forward(
        hidden[rows], next_ids[rows], p, cache, meta), arch, target.scale, length)

    config = LlamaConfig.from_pretrained(str(tiny_dir))
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).float().eval()
    layer.load_state_dict({n[len("layers.0."):]: t for n, t in raw.items() if n.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    emb = torch.nn.functional.embedding(next_ids, target.embed_tokens.float())
    h = hidden
    if hass:
        eps = arch.rms_norm_eps
        emb = rms_norm(emb, raw["embedding_layernorm.weight"], eps)
        h = rms_norm(h, raw["hidden_states_layernorm.weight"], eps)
    x = torch.nn.functional.linear(torch.cat([emb, h], -1), raw["fc.weight"], raw["fc.bias"])[None]
    rotary = LlamaRotaryEmbedding(config)
    with torch.no_grad():
        out = layer(x, attention_mask=None, position_ids=pos[None], position_embeddings=rotary(x, pos[None]))
    reference = (out[0] if isinstance(out, tuple) else out)[0]
    torch.testing.assert_close(paged, reference, atol=2e-4, rtol=1e-4)
    # The training form (bench/train_mtp.py --head eagle) computes the same, densely.
    dense = EagleTrainModule(target, raw)(hidden[None], next_ids[None])[0]
    torch.testing.assert_close(dense, reference, atol=2e-4, rtol=1e-4)
    written = cache.view(2, -1, arch.num_kv_heads, arch.head_dim)[0, slots]
    assert written.abs().sum() > 0  # the draft layer's keys are in its cache layer


@pytest.fixture(scope="module")
def reference_tokens():
    engine = make_engine("tiny-random", num_kv_blocks=256, prefill_chunk_size=32)
    return [o.token_ids for o in engine.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0.0,
                                                                         ignore_eos=True) for n in MAX_TOKENS])]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_generation_with_an_eagle_draft_is_lossless(target, reference_tokens, tmp_path, use_async):
    """``--spec mtp --mtp-checkpoint DIR`` with an EAGLE directory drafts with the EAGLE head (chunked prefill, k 3):
    the greedy tokens equal those without speculation, and drafts were proposed and counted."""
    from pdcluster.engine.models.eagle import EagleHead, random_eagle_weights

    directory = _save(tmp_path / "eagle", random_eagle_weights(target.arch, seed=2), target.arch)
    engine = make_engine("tiny-random", num_kv_blocks=256, prefill_chunk_size=32, spec_method="mtp",
                         num_spec_tokens=3, mtp_checkpoint=str(directory), async_scheduling=use_async)
    assert isinstance(engine.runner.proposer.head, EagleHead)
    assert "EAGLE" in engine.mtp_source
    assert engine.runner.proposer.head.draft_lm_head.out_features == 16384  # on a CPU: DRAFT_VOCAB_SIZE
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                     for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == reference_tokens
    assert sum(o.num_draft_tokens for o in outs) > 0
    assert all(0 <= o.num_accepted_tokens <= o.num_draft_tokens for o in outs)


def test_eagles_own_format_loads_as_its_safetensors_form(target, tmp_path):
    """EAGLE's releases: pytorch_model.bin, possibly with ``model.`` prefixes and a copy of the embedding (not read)."""
    from pdcluster.engine.models.eagle import load_eagle_weights, random_eagle_weights
    from pdcluster.engine.models.eagle3 import draft_kind

    arch = target.arch
    raw = random_eagle_weights(arch, seed=7)
    plain = load_eagle_weights(_save(tmp_path / "st", raw, arch), arch)
    with_embedding = {**raw, "embed_tokens.weight": torch.zeros(arch.vocab_size, arch.hidden_size)}
    own = _save(tmp_path / "bin", with_embedding, arch, fmt="bin", prefix="model.")
    assert draft_kind(own) == draft_kind(own / "pytorch_model.bin") == "eagle"
    loaded = load_eagle_weights(own, arch)
    assert loaded.keys() == plain.keys() and all(torch.equal(loaded[n], plain[n]) for n in plain)
    assert "eagle.embed_tokens.weight" not in loaded


def test_checkpoints_that_cannot_draft_are_refused_by_name(target, tmp_path):
    from pdcluster.engine.config import ConfigError
    from pdcluster.engine.models.eagle import EagleCheckpointError, load_eagle_weights, random_eagle_weights
    from pdcluster.engine.models.mtp import find_mtp_checkpoint

    arch = target.arch
    raw = random_eagle_weights(arch, seed=1)
    eagle3 = {"midlayer.self_attn.q_proj.weight": torch.zeros(4, 4), "fc.weight": raw["fc.weight"],
              "d2t": torch.zeros(4, dtype=torch.int64)}
    with pytest.raises(EagleCheckpointError, match="EAGLE-3"):
        load_eagle_weights(_save(tmp_path / "e3", eagle3, arch), arch)
    two = {**raw, **{n.replace("layers.0.", "layers.1."): t.clone() for n, t in raw.items()
                     if n.startswith("layers.0.")}}
    with pytest.raises(EagleCheckpointError, match="2 layers"):
        load_eagle_weights(_save(tmp_path / "two", two, arch, num_layers=2), arch)
    wide = {**raw, "fc.weight": torch.zeros(arch.hidden_size + 8, 2 * arch.hidden_size)}
    with pytest.raises(EagleCheckpointError, match="another model.*fc.weight"):
        load_eagle_weights(_save(tmp_path / "wide", wide, arch), arch)
    missing = {n: t for n, t in raw.items() if n != "layers.0.mlp.down_proj.weight"}
    with pytest.raises(EagleCheckpointError, match="lacks layers.0.mlp.down_proj.weight"):
        load_eagle_weights(_save(tmp_path / "missing", missing, arch), arch)
    # A path that is neither an EAGLE draft nor a file: the MTP loader's own refusal, before any engine starts.
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="does not exist"):
        find_mtp_checkpoint(str(tmp_path / "empty"), tmp_path, "tiny-random", arch)
    assert find_mtp_checkpoint(str(_save(tmp_path / "ok", raw, arch)), tmp_path, "tiny-random", arch).kind == "eagle"


def test_the_training_script_starts_both_heads_from_the_targets_first_layer(target, tiny_dir):
    """bench/train_mtp.py's starting points read the target's first layer from its checkpoint (the engine's packed
    layers keep no plain weights) and run in their training forms; EAGLE's starts as that layer (its input norm
    folded into q, k and v) over the embedding of the next token."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from train_mtp import first_layer_weights, initial_eagle_weights, initial_weights

    from pdcluster.engine.models.eagle import EagleTrainModule
    from pdcluster.engine.models.mtp import MTPTrainModule

    first = first_layer_weights(tiny_dir)
    assert "self_attn.q_proj.weight" in first and "mlp.down_proj.weight" in first
    hidden = torch.randn(2, 9, target.arch.hidden_size)
    next_ids = torch.randint(0, target.arch.vocab_size, (2, 9))
    for module in (MTPTrainModule(target, initial_weights(target, 0, first)),
                   EagleTrainModule(target, initial_eagle_weights(target, 0, first))):
        logits = module.compute_logits(module(hidden, next_ids))
        assert logits.shape == (2, 9, target.arch.vocab_size) and torch.isfinite(logits).all()
    eagle = initial_eagle_weights(target, 0, first)
    torch.testing.assert_close(eagle["layers.0.mlp.down_proj.weight"], first["mlp.down_proj.weight"])
    fc = eagle["fc.weight"][:, : target.arch.hidden_size]
    torch.testing.assert_close(fc, torch.eye(target.arch.hidden_size))  # the embedding passes through


def test_vllms_speculative_config_flag(target, tmp_path, capsys):
    """``--speculative-config`` (vLLM's JSON) sets the same fields as --spec / --num-spec-tokens / --mtp-checkpoint,
    for ``pdcluster generate`` as users run it; what the engine cannot draft with is refused by name (exit 2)."""
    import argparse
    import subprocess
    import sys

    from pdcluster.cluster.engine_args import add_engine_args, engine_config_from_args
    from pdcluster.engine.models.eagle import random_eagle_weights

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ngram = engine_config_from_args(parser.parse_args(["--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})]))
    assert (ngram.spec_method, ngram.num_spec_tokens, ngram.ngram_min, ngram.ngram_max) == ("ngram", 4, 2, 5)
    own = engine_config_from_args(parser.parse_args(["--speculative-config", '{"method": "deepseek_mtp"}']))
    assert (own.spec_method, own.num_spec_tokens, own.mtp_checkpoint) == ("mtp", 3, "")  # k: --spec's default
    eagle3 = engine_config_from_args(parser.parse_args(["--speculative-config", '{"method": "eagle3", "model": "d"}']))
    assert (eagle3.spec_method, eagle3.mtp_checkpoint) == ("mtp", "d")
    for bad, why in (('{"method": "medusa", "model": "x"}', "method 'medusa' is not served"),
                     ('{"method": "draft_model"}', "needs \"model\""),
                     ('{"method": "eagle3"}', "needs \"model\""),
                     ('{"method": "eagle"}', "needs \"model\""),
                     ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "unknown key"),
                     ('{"method": "ngram", "num_speculative_tokens": -1}', "non-negative"),
                     ("eagle", "not JSON")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["--speculative-config", bad])
        assert exit_info.value.code == 2 and why in capsys.readouterr().err

    directory = _save(tmp_path / "eagle", random_eagle_weights(target.arch, seed=3), target.arch)
    spec = json.dumps({"method": "eagle", "model": str(directory), "num_speculative_tokens": 2})
    run = subprocess.run([sys.executable, "-m", "pdcluster.cli.main", "generate", "--model", "tiny-random",
                          "--prompt", "one two three one two three", "--max-tokens", "12", "--temperature", "0",
                          "--speculative-config", spec, "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 12 and out["num_draft_tokens"] > 0


def test_a_qwen2_targets_draft_carries_its_qkv_biases(target, tmp_path):
    """A target whose attention has q/k/v biases (Qwen2) needs them in the draft block; a target of another layout
    (fused checkpoints, sinks, post-norm blocks) is refused by name rather than failing inside the layer."""
    import dataclasses

    from pdcluster.engine.models.eagle import EagleCheckpointError, EagleHead, load_eagle_weights, random_eagle_weights

    arch = dataclasses.replace(target.arch, qkv_bias=True)
    raw = random_eagle_weights(arch, seed=6)
    with pytest.raises(EagleCheckpointError, match="lacks layers.0.self_attn.k_proj.bias"):
        load_eagle_weights(_save(tmp_path / "no-bias", raw, arch), arch)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    biases = {f"layers.0.self_attn.{n}_proj.bias": torch.randn(size) for n, size in (("q", q), ("k", kv), ("v", kv))}
    weights = load_eagle_weights(_save(tmp_path / "bias", {**raw, **biases}, arch), arch)
    assert torch.equal(weights["eagle.layer.self_attn.v_proj.bias"], biases["layers.0.self_attn.v_proj.bias"])
    real_arch = target.arch
    try:
        target.arch = arch  # the head builds its block from the target's arch: with biases, which it takes
        head = EagleHead(target, weights, draft_vocab_size=1000)
    finally:
        target.arch = real_arch
    assert head.layer.qkv_bias is not None and head.layer.qkv_bias.shape == (q + 2 * kv,)
    for field in ("fused_checkpoint", "attention_sinks"):
        with pytest.raises(EagleCheckpointError, match="Llama-layout targets"):
            load_eagle_weights(tmp_path / "bias", dataclasses.replace(target.arch, **{field: True}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_eagle_draft_on_cuda_is_lossless_and_drafts_over_the_whole_vocabulary(tmp_path, tiny_dir):
    """On CUDA (deterministic mode: bitwise the tokens of no speculation) the EAGLE head drafts over every token id."""
    from pdcluster.engine.models.eagle import EagleHead, random_eagle_weights
    from pdcluster.engine.models.llama_arch import ModelArch

    arch = ModelArch.from_dir(tiny_dir)
    directory = _save(tmp_path / "eagle", random_eagle_weights(arch, seed=2), arch)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    cfg = dict(device="cuda", deterministic=True, num_kv_blocks=256, prefill_chunk_size=32)
    expected = [o.token_ids for o in make_engine("tiny-random", **cfg).generate(PROMPTS, params)]
    engine = make_engine("tiny-random", spec_method="mtp", num_spec_tokens=3, mtp_checkpoint=str(directory), **cfg)
    head = engine.runner.proposer.head
    assert isinstance(head, EagleHead) and head.draft_lm_head.out_features == arch.vocab_size
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_draft_tokens for o in outs) > 0
