"""Phi-3.5-mini and Phi-4-mini: ``longrope`` RoPE and (Phi-4-mini) partial rotary, made by transformers with random
weights in their checkpoints' config forms and served by LLMEngine, transformers (fp32, eager attention, repeated
full forwards) the oracle.

longrope divides each frequency by a factor from a short list while a sequence fits the original context and a
long list past it, and scales cos / sin by an attention factor. A paged cache cannot follow transformers' switch
of tables mid-sequence, so the engine picks one table from its max_model_len (vLLM's rule): the short one when
max_model_len fits the original context, where every answer is transformers', else the long one, where every
prompt past the original context gets transformers' answer. Partial rotary (0.75 of each head) is served by
permuting q and k head dimensions at load (engine/models/rope.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import engine_config
from test_kv_transfer_e2e import run_on_pair
from test_model_families import NUM_NEW, VOCAB, _edit_config, _engine, _hf_greedy, _hf_model, _run
from test_qwen3 import _redraw_weights
from pdcluster.engine.models.architectures import arch_from_dir
from pdcluster.engine.models.llama import RotaryEmbedding
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.rope import for_context, inv_freq_and_scale, partial_rotary_order, rope_from_config
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

ORIGINAL = 64  # original_max_position_embeddings; max_position_embeddings is 256 (factor 4)
HEAD_DIM = 16
# Within the original context (prompt + NUM_NEW <= 64): the short table, at max_model_len 64.
SHORT_PROMPTS = [[3 + (7 * i + 13 * j) % (VOCAB - 3) for j in range(6 + 5 * i)] for i in range(8)]  # 6..41 tokens
# Past it from the prompt on: the long table, at max_model_len 256.
LONG_PROMPTS = [[3 + (11 * i + 5 * j) % (VOCAB - 3) for j in range(66 + 9 * i)] for i in range(6)]  # 66..111
SHAPES = {"phi4-mini": 0.75, "phi3.5-mini": 1.0}  # partial_rotary_factor


def _factors(partial: float, seed: int) -> tuple[list[float], list[float]]:
    """Short factors near 1, long ones up to 9 (Phi-3.5's run 1.0 .. 1.03 and 1.03 .. 64.8)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(HEAD_DIM * partial) // 2
    return (1 + 0.05 * torch.rand(n, generator=gen)).tolist(), (1 + 8 * torch.rand(n, generator=gen)).tolist()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Each shape saved by transformers, then its config.json rewritten in the shipped checkpoints' form
    (transformers 4: ``rope_scaling`` beside ``rope_theta``, the original context and Phi-4-mini's
    ``partial_rotary_factor`` at the top level)."""
    tokenizer = resolve_model("tiny-random", progress=False) / "tokenizer.json"
    out = {}
    for seed, (name, partial) in enumerate(SHAPES.items()):
        short, long = _factors(partial, seed)
        d = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=256,
            original_max_position_embeddings=ORIGINAL, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=partial < 1, partial_rotary_factor=partial,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                             "long_factor": long, "original_max_position_embeddings": ORIGINAL,
                             "partial_rotary_factor": partial}))
        _redraw_weights(model)
        model.save_pretrained(str(d))
        shutil.copy(tokenizer, d / "tokenizer.json")
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("rope_parameters")
        cfg.update(rope_theta=10000.0, original_max_position_embeddings=ORIGINAL, partial_rotary_factor=partial,
                   rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = d
    return out


@pytest.fixture(scope="module")
def reference(dirs) -> dict[tuple[str, str], list[list[int]]]:
    out = {}
    for name in SHAPES:
        hf = _hf_model(dirs[name])
        out[name, "short"] = _hf_greedy(hf, SHORT_PROMPTS)
        out[name, "long"] = _hf_greedy(hf, LONG_PROMPTS)
    return out


CASES = {"short": (ORIGINAL, SHORT_PROMPTS), "long": (256, LONG_PROMPTS)}  # table -> (max_model_len, prompts)


def test_configs_read(dirs):
    phi4, phi35 = arch_from_dir(dirs["phi4-mini"]), arch_from_dir(dirs["phi3.5-mini"])
    assert phi4.rotary_dim == 12 and phi35.rotary_dim == 0  # 0: the whole head
    for arch in (phi4, phi35):
        s = arch.rope_scaling
        assert s.rope_type == "longrope" and s.original_max_position_embeddings == ORIGINAL and s.factor == 4.0
        assert len(s.short_factor) == len(s.long_factor) == (arch.rotary_dim or HEAD_DIM) // 2
        assert not s.use_long and not arch.for_context(64).rope_scaling.use_long
        assert arch.for_context(65).rope_scaling.use_long
    # Phi-3's legacy "su" (and "yarn") are longrope to Phi3Config; only Phi-3 takes longrope and partial rotary.
    cfg = json.loads((dirs["phi4-mini"] / "config.json").read_text())
    assert rope_from_config({**cfg, "rope_scaling": {**cfg["rope_scaling"], "type": "su"}}, "x", phi3=True) == \
        rope_from_config(cfg, "x", phi3=True)
    with pytest.raises(ValueError, match="'longrope' is served for Phi3ForCausalLM only"):
        rope_from_config({**cfg, "partial_rotary_factor": 1.0}, "x")
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 is not supported"):
        rope_from_config({**cfg, "rope_scaling": None}, "x")


@pytest.mark.parametrize("change,words", [
    ({"partial_rotary_factor": 0.5}, "short_factor has 6 entries; the 8 rotated dimensions need 4"),
    ({"partial_rotary_factor": 0.7}, "gives 11 rotated dimensions"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6}}, "needs 'long_factor'"),
])
def test_unservable_phi_configs_refused_in_one_line(dirs, tmp_path, change, words):
    with pytest.raises(ValueError) as err:
        arch_from_dir(_edit_config(dirs["phi4-mini"], tmp_path / "bad", **change))
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("partial", [0.75, 1.0])
@pytest.mark.parametrize("params", [{}, {"factor": 8.0}, {"attention_factor": 1.3}])
def test_longrope_tables_equal_transformers(partial, params):
    """Both tables' frequencies and the attention factor (from max / original, or the config's factor or
    attention_factor) are transformers' own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short, long = _factors(partial, 7)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": partial, **params}
    cfg = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_parameters": rope}
    hf_cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=partial, **cfg)
    theta, s = rope_from_config(cfg, "x", phi3=True)
    dim = int(HEAD_DIM * partial)
    for seq_len, max_model_len in ((None, 4096), (4097, 4097)):
        hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=seq_len)
        ours, scale = inv_freq_and_scale(dim, theta, for_context(s, max_model_len))
        torch.testing.assert_close(ours, hf_inv, rtol=0, atol=0)
        assert scale == pytest.approx(hf_scale, rel=1e-12) and scale != 1.0


def test_partial_rotary_in_the_permuted_layout_is_transformers_rotation():
    """The kernels rotate pairs (j, j + head_dim / 2): on heads permuted by partial_rotary_order, with the table's
    passed-through pairs at cos 1 / sin 0, they give transformers' partial rotation (first rotary_dim dimensions
    in pairs (j, j + rotary_dim / 2), the rest untouched), permuted the same way."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    head_dim, rotary_dim, theta = 32, 24, 10000.0
    order = partial_rotary_order(head_dim, rotary_dim)
    assert sorted(order.tolist()) == list(range(head_dim))
    positions = torch.tensor([0, 1, 5, 77, 200])
    q = torch.randn(len(positions), 3, head_dim, generator=torch.Generator().manual_seed(0))
    inv_freq, _ = inv_freq_and_scale(rotary_dim, theta, None)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1), q.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    ours = q[:, :, order].contiguous()
    RotaryEmbedding(head_dim, theta, 256, torch.float32, rotary_dim=rotary_dim).rotate_(ours, positions)
    torch.testing.assert_close(ours, want.transpose(0, 1)[:, :, order], rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., 12:16], q[..., 24:28]) and torch.equal(ours[..., 28:], q[..., 28:])  # untouched


def test_reference_is_not_degenerate_and_the_variants_matter(dirs, reference, tmp_path):
    for outs in reference.values():
        assert len({tuple(o) for o in outs}) > len(outs) // 2
    # Whole-head rotation (the last quarter rotated too, by frequencies of 1) answers otherwise than partial rotary.
    short, long = _factors(0.75, 0)
    whole = _edit_config(dirs["phi4-mini"], tmp_path / "whole", partial_rotary_factor=1.0,
                         rope_scaling={"type": "longrope", "short_factor": short + [1.0, 1.0],
                                       "long_factor": long + [1.0, 1.0]})
    undone = _hf_greedy(_hf_model(whole), LONG_PROMPTS)
    assert sum(a != b for a, b in zip(undone, reference["phi4-mini", "long"])) >= 3
    # The long table answers short prompts otherwise than the short one: which table serves matters.
    for name in SHAPES:
        long_table = _run(_engine(dirs[name], max_model_len=256), SHORT_PROMPTS)
        assert sum(a != b for a, b in zip(long_table, reference[name, "short"])) >= 3


@pytest.mark.parametrize("table", list(CASES))
@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_batched_and_alone_equal_transformers(dirs, reference, name, table):
    max_model_len, prompts = CASES[table]
    engine = _engine(dirs[name], max_model_len=max_model_len)
    assert engine.model.arch.rope_scaling.use_long == (table == "long")
    assert _run(engine, prompts) == reference[name, table]
    assert _run(engine, prompts[:1]) == reference[name, table][:1]
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


def test_chunked_prefill_preemption_and_ngram_are_exact(dirs, reference):
    want = reference["phi4-mini", "long"]
    engine = _engine(dirs["phi4-mini"], max_model_len=256, prefill_chunk_size=5, max_num_batched_tokens=40,
                     num_kv_blocks=20)
    assert _run(engine, LONG_PROMPTS) == want
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    ngram = _engine(dirs["phi4-mini"], max_model_len=256, spec_method="ngram", num_spec_tokens=3)
    assert _run(ngram, LONG_PROMPTS) == want


def test_bf16_deterministic_batch_invariant(dirs):
    engine = _engine(dirs["phi4-mini"], max_model_len=256, dtype="bfloat16", deterministic=True)
    batched = _run(engine, LONG_PROMPTS)
    assert [_run(engine, [p])[0] for p in LONG_PROMPTS[:3]] == batched[:3]


def test_disagg_equals_colocated(dirs, reference):
    """KV written in the permuted layout with the long table travels to a decode worker and decodes to
    transformers' tokens."""
    cfg = engine_config(str(dirs["phi4-mini"]), dtype="float32", max_model_len=256, num_kv_blocks=128,
                        block_size=16)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    run = run_on_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), LONG_PROMPTS[:4], params, 128)
    assert run.tokens == reference["phi4-mini", "long"][:4]


def test_workers_on_either_table_do_not_exchange_kv(dirs):
    """The table is part of the model fingerprint the handshake compares, and of the disk tier's namespace: a
    prefill worker at max_model_len 64 (short table) and a decode worker at 256 (long) do not pair."""
    from pdcluster.engine.kv_offload.events import layout_namespace
    from pdcluster.engine.loaded_model import LoadedModel
    from pdcluster.node.endpoint import endpoint_config

    class NoTransport:
        def local_descriptor(self):
            return {}

    def identity(max_model_len: int) -> tuple[str, str]:
        loaded = LoadedModel.load(engine_config(str(dirs["phi4-mini"]), dtype="float32", num_kv_blocks=8,
                                                max_model_len=max_model_len), progress=False)
        fp = endpoint_config("w", loaded, TransferConfig(), NoTransport()).model_fingerprint
        return fp, layout_namespace(str(loaded.model_dir), loaded.dtype_name, loaded.kv_cache,
                                    loaded.model.kv_fingerprint)

    short, long = identity(64), identity(256)
    assert identity(48) == short and identity(200) == long
    assert short[0] != long[0] and short[1] != long[1]


def test_lora_on_partial_rotary_equals_peft(dirs, reference, tmp_path):
    """An adapter's B rows for q and k follow the permuted head layout: peft's greedy, beside base requests."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(_hf_model(dirs["phi4-mini"]), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["qkv_proj", "o_proj"])).eval()
    model.save_pretrained(tmp_path / "adapter")
    prompts = LONG_PROMPTS[:3]
    want = _hf_greedy(model, prompts)
    assert want != reference["phi4-mini", "long"][:3]
    engine = _engine(dirs["phi4-mini"], max_model_len=256, lora_modules=(f"a={tmp_path / 'adapter'}",))
    params = [SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, lora_name=n) for n in ("a", None)]
    outs = engine.generate([p for p in prompts for _ in params], [sp for _ in prompts for sp in params])
    assert [o.token_ids for o in outs[::2]] == want
    assert [o.token_ids for o in outs[1::2]] == reference["phi4-mini", "long"][:3]
