"""EAGLE-3 drafts (engine/models/eagle3.py) behind ``--spec mtp --mtp-checkpoint DIR``.

The target's aux hidden states equal transformers' hidden states before the chosen layers; the head on the paged
cache equals a reference built from transformers' own LlamaAttention (q/k/v over the 2H input), LlamaMLP and
LlamaRMSNorm; generation with an EAGLE-3 draft is lossless, synchronous, async and through (emulated) decode graphs;
checkpoints that cannot draft for the target are refused by name.
"""

import json

import pytest
import torch

from conftest import forward_from_scratch, make_engine, paged_in_chunks
from pdcluster.engine.sampling_params import SamplingParams
from test_eagle import MAX_TOKENS, PROMPTS, reference_tokens  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DRAFT_VOCAB = 4096


def _save(directory, weights: dict, config: dict | None = None):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                       "num_hidden_layers": 1, **(config or {})}))
    save_file({n: t.contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def target():
    return make_engine("tiny-random", num_kv_blocks=64).model


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, tiny_dir):
    from pdcluster.engine.models.eagle3 import random_eagle3_weights
    from pdcluster.engine.models.llama_arch import ModelArch

    arch = ModelArch.from_dir(tiny_dir)
    # tiny-random has 4 layers: the default (2, 2, 1) repeats one, so the checkpoint names three.
    return str(_save(tmp_path_factory.mktemp("eagle3"), random_eagle3_weights(arch, DRAFT_VOCAB, seed=3),
                     {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))


def test_aux_hidden_states_are_the_stream_before_each_chosen_layer(tiny_dir):
    """What the target copies out equals transformers' hidden_states[i] (the input of layer i), whichever of the
    engine's two layer loops runs."""
    from transformers import AutoModelForCausalLM

    engine = make_engine("tiny-random", num_kv_blocks=64)
    model = engine.model
    ids = engine.tokenize("one two three four five six seven eight nine ten")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    layers = (1, 3, 2)
    want = torch.cat([states[i][0] for i in layers], dim=-1)
    model.capture_aux_hidden(layers, max_tokens=64)
    try:
        assert model._fuses_norms()
        forward_from_scratch(model, ids)
        torch.testing.assert_close(model.aux_hidden[: len(ids)], want, atol=1e-4, rtol=1e-4)
        model.aux_hidden.zero_()
        model._fuses_norms_known = False  # the other loop (blocks with residual pairs)
        forward_from_scratch(model, ids)
        torch.testing.assert_close(model.aux_hidden[: len(ids)], want, atol=1e-4, rtol=1e-4)
    finally:
        model._fuses_norms_known = True
    with pytest.raises(RuntimeError, match="holds 64"):
        forward_from_scratch(model, list(range(1, 70)))
    with pytest.raises(ValueError, match="outside 1..3"):
        model.capture_aux_hidden((0, 1, 2), 8)


def test_eagle3_head_equals_transformers_attention_over_both_halves(target, tiny_dir, eagle3_dir):
    """The paged head, run in two chunks, equals: h = fc(aux); x = [input_norm(embed(t)); hidden_norm(h)]; g = h +
    attn(x) (transformers' LlamaAttention with q/k/v over 2H) + mlp(post_norm(...)); drafts = d2t(argmax(lm_head(
    norm(g))))."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding

    from pdcluster.engine.models.eagle3 import Eagle3Head, load_eagle3_weights
    from pdcluster.engine.models.llama import rms_norm

    arch = target.arch
    weights = load_eagle3_weights(eagle3_dir, arch, arch.num_layers)
    head = Eagle3Head(target, dict(weights), max_tokens=64)
    try:
        length, h = 37, arch.hidden_size
        gen = torch.Generator().manual_seed(1)
        aux = torch.randn(length, 3 * h, generator=gen)
        target.aux_hidden[:length] = aux
        next_ids = torch.randint(0, arch.vocab_size, (length,), generator=gen)
        pos = torch.arange(length)
        paged, _, _ = paged_in_chunks(lambda rows, p, cache, meta: head.forward(
            head.target_hidden(None, p), next_ids[rows], p, cache, meta), arch, target.scale, length)
    finally:
        target.aux_layers, target.aux_hidden = (), None

    w = {n[len("eagle3."):]: t for n, t in weights.items()}
    config = LlamaConfig.from_pretrained(str(tiny_dir))
    config._attn_implementation = "sdpa"
    attn = LlamaAttention(config, layer_idx=0).float().eval()
    for name in ("q", "k", "v"):
        proj = torch.nn.Linear(2 * h, w[f"layer.self_attn.{name}_proj.weight"].shape[0], bias=False)
        proj.weight.data = w[f"layer.self_attn.{name}_proj.weight"]
        setattr(attn, f"{name}_proj", proj)
    attn.o_proj.weight.data = w["layer.self_attn.o_proj.weight"]
    mlp = LlamaMLP(config).float().eval()
    for name in ("gate", "up", "down"):
        getattr(mlp, f"{name}_proj").weight.data = w[f"layer.mlp.{name}_proj.weight"]
    eps = arch.rms_norm_eps
    with torch.no_grad():
        hidden = torch.nn.functional.linear(aux, w["fc.weight"])
        emb = rms_norm(torch.nn.functional.embedding(next_ids, target.embed_tokens), w["layer.input_layernorm.weight"],
                       eps)
        x = torch.cat([emb, rms_norm(hidden, w["layer.hidden_norm.weight"], eps)], -1)[None]
        o, _ = attn(x, position_embeddings=LlamaRotaryEmbedding(config)(x, pos[None]), attention_mask=None)
        residual = hidden + o[0]
        reference = residual + mlp(rms_norm(residual, w["layer.post_attention_layernorm.weight"], eps))
    torch.testing.assert_close(paged, reference, atol=2e-4, rtol=1e-4)
    drafts = head.draft_tokens(paged)
    logits = torch.nn.functional.linear(rms_norm(reference, w["norm.weight"], eps), w["lm_head.weight"])
    assert torch.equal(drafts, w["draft_to_target"][logits.argmax(-1)])
    assert (drafts % 2 == 0).all()  # the test draft vocabulary: even target ids only


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_generation_with_an_eagle3_draft_is_lossless(reference_tokens, eagle3_dir, use_async):
    from pdcluster.engine.models.eagle3 import Eagle3Head

    engine = make_engine("tiny-random", num_kv_blocks=256, prefill_chunk_size=32, spec_method="mtp",
                         num_spec_tokens=3, mtp_checkpoint=eagle3_dir, async_scheduling=use_async)
    assert isinstance(engine.runner.proposer.head, Eagle3Head) and "EAGLE-3" in engine.mtp_source
    assert engine.model.aux_layers == (1, 2, 3)
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                     for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == reference_tokens
    assert sum(o.num_draft_tokens for o in outs) > 0


def test_an_eagle3_draft_through_emulated_decode_graphs_gives_the_eager_tokens(eagle3_dir):
    """Decode graphs write the aux hidden states where eager steps do (one buffer for the engine's life)."""
    cfg = dict(max_num_seqs=10, num_kv_blocks=128, spec_method="mtp", num_spec_tokens=2, mtp_checkpoint=eagle3_dir)
    params = [SamplingParams(max_tokens=8 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    eager = make_engine("tiny-random", **cfg)
    expected = eager.generate(prompts, params)
    engine = make_engine("tiny-random", **cfg)
    engine.runner.use_decode_graphs(emulate=True)
    outs = engine.generate(prompts, params)
    assert engine.runner.graphs.num_replays > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [o.num_accepted_tokens for o in outs] == [o.num_accepted_tokens for o in expected]


def test_eagle3_checkpoints_that_cannot_draft_are_refused_by_name(target, tmp_path):
    from pdcluster.engine.models.eagle import EagleCheckpointError
    from pdcluster.engine.models.eagle3 import draft_kind, load_eagle3_weights, random_eagle3_weights

    arch = target.arch
    raw = random_eagle3_weights(arch, DRAFT_VOCAB, seed=1)
    ok = _save(tmp_path / "ok", raw, {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    assert draft_kind(ok) == "eagle3"
    # speculators' form: the block as layers.0, the aux layers under eagle_config
    renamed = {n.replace("midlayer.", "layers.0."): t for n, t in raw.items()}
    spec = _save(tmp_path / "spec", renamed, {"architectures": ["Eagle3Speculator"],
                                              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})
    a, b = load_eagle3_weights(ok, arch, 4), load_eagle3_weights(spec, arch, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    cases = (({**raw, "d2t": torch.full((DRAFT_VOCAB,), arch.vocab_size)}, {}, "maps past the target's vocabulary"),
             ({n: t for n, t in raw.items() if n != "norm.weight"}, {}, "lacks norm.weight"),
             ({**raw, "fc.weight": torch.zeros(arch.hidden_size, 2 * arch.hidden_size)}, {}, "does not fit"),
             (raw, {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, "not three of the target's 1..3"),
             (raw, {"eagle_aux_hidden_state_layer_ids": [1, 2]}, "not three of the target's 1..3"),
             (raw, {"num_hidden_layers": 2}, "drafts of one layer"))
    for i, (weights, config, why) in enumerate(cases):
        path = _save(tmp_path / f"bad{i}", weights, config)
        with pytest.raises(EagleCheckpointError, match=why):
            load_eagle3_weights(path, arch, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_eagle3_draft_on_cuda_through_decode_graphs_is_lossless(tiny_dir, eagle3_dir):
    """On CUDA (deterministic mode: bitwise the tokens of no speculation), decode steps replayed from CUDA graphs
    write the aux hidden states pass 1 reads."""
    cfg = dict(device="cuda", deterministic=True, num_kv_blocks=256, prefill_chunk_size=32)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    expected = [o.token_ids for o in make_engine("tiny-random", **cfg).generate(PROMPTS, params)]
    engine = make_engine("tiny-random", spec_method="mtp", num_spec_tokens=3, mtp_checkpoint=eagle3_dir, **cfg)
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    assert sum(o.num_draft_tokens for o in outs) > 0
