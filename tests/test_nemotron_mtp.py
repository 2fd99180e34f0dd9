"""A NemotronH checkpoint's own MTP layers as the MTP proposer (engine/models/nemotron_mtp.py, issue 26 item 2).

- the config fields (``num_nextn_predict_layers``, ``mtp_layers_block_type``, the legacy pattern) read as
  transformers' NemotronHConfig reads them;
- one MTP step over the paged cache equals the same step built from transformers' own NemotronH blocks
  (``NemotronHBlock``: attention, latent MoE) around vLLM's fusion (``eh_proj([enorm(embed); hnorm(hidden)])``) and
  final norm, on tiny-hybrid-moe's MTP weights, in two chunks; the draft layer's KV is what the reference writes;
- ``--spec mtp`` on tiny-hybrid-moe drafts with those layers: greedy output == greedy without speculation, async
  scheduling on and off, and the drafts are mostly accepted (asserted > 0.5, printed);
- disaggregated (the draft layer's KV and the Mamba state sent from post_forward, S2) == colocated, tokens and
  accepted drafts, on every transport usable here (async too on tcp); the bytes sent are exactly the target's
  KV, the MTP layer's KV and the state blocks; a prompt near max_model_len, whose state blocks push its block
  count past max_model_len's, goes through too;
- a directory that cannot draft this way is refused in one line naming the field.
S2 and S4 in this setting: tests/test_invariant_s2_connector_order.py, tests/test_invariant_s4_async.py.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import engine_config, make_engine, usable_transports
from test_kv_transfer_e2e import Events, _collect_tokens, connected_pair, run_on_pair
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.config import ConfigError
from pdcluster.engine.models.architectures import load_model
from pdcluster.engine.models.mtp import MTPHeadMissing, find_mtp_checkpoint
from pdcluster.engine.models.nemotron_h import HybridArch
from pdcluster.engine.models.nemotron_mtp import NemotronMTP, load_own_mtp_weights
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.tiny_hybrid import TINY_HYBRID_CONFIG
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.events import Tokens

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

MODEL = "tiny-hybrid-moe"
NATIVE = dict(spec_method="mtp", num_spec_tokens=2, mtp_checkpoint="")  # "": the model's own MTP layers
NUM_BLOCKS = 128
_gen = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(100, 49000, (n,), generator=_gen).tolist() for n in (3, 16, 17, 45, 70, 9)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

_config = functools.partial(engine_config, MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512, prefill_chunk_size=16)


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def greedy_reference():
    """Plain greedy, no speculation: speculation must not change it."""
    return _tokens(make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512).generate(PROMPTS, GREEDY))


# ---------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("extra, pattern", [
    ({}, ""),
    ({"num_nextn_predict_layers": 1}, "*E"),  # transformers' default: attention + moe
    ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "mlp"]}, "*-"),  # legacy names
    ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "-*"}, "-*"),  # the legacy pattern key
    ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["moe"], "mtp_hybrid_override_pattern": "*"}, "E"),
])
def test_arch_reads_the_mtp_fields_as_transformers(extra, pattern):
    cfg = {**TINY_HYBRID_CONFIG, "n_routed_experts": 8, "n_group": 1, "topk_group": 1, **extra}
    arch = HybridArch.from_config(cfg)
    assert "".join(arch.mtp_layer_types) == pattern
    assert arch.num_nextn_predict_layers == extra.get("num_nextn_predict_layers", 0)
    assert (arch.routed_experts is not None) == ("E" in pattern)  # an MoE MTP block on an MoE-less model
    if pattern:
        hf_cfg = {k: v for k, v in cfg.items() if k != "num_hidden_layers"}
        assert _transformers().NemotronHConfig(**hf_cfg).mtp_hybrid_override_pattern == pattern


def test_unknown_mtp_block_type_is_one_line():
    with pytest.raises(ValueError, match=r"^config: mtp_layers_block_type has unknown layer types \['conv'\]"):
        HybridArch.from_config({**TINY_HYBRID_CONFIG, "num_nextn_predict_layers": 1, "mtp_layers_block_type": ["conv"]})


def _transformers():
    return pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------------
# One MTP step against transformers' blocks


def _hf_mtp_step(model_dir: Path, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
                 next_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's NemotronHMTP step (nemotron_mtp.py's docstring) on transformers' NemotronHBlock and NemotronHRMSNorm,
    causal attention over the whole sequence."""
    tf = _transformers()
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    cfg = json.loads((model_dir / "config.json").read_text())
    kinds = cfg["mtp_layers_block_type"]
    cfg = {k: v for k, v in cfg.items() if k != "num_hidden_layers"} | {"layers_block_type": kinds}
    config = tf.NemotronHConfig(**cfg)
    config._attn_implementation = "eager"
    h, eps = config.hidden_size, config.layer_norm_epsilon

    def norm(name: str) -> torch.nn.Module:
        module = hf.NemotronHRMSNorm(h, eps)
        module.weight.data.copy_(weights[name])
        return module

    blocks = []
    for j, _ in enumerate(kinds):
        block = hf.NemotronHBlock(config, j).eval()
        prefix = f"mtp.layers.{j}."
        state = {n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}
        for proj in ("up_proj", "down_proj"):  # the checkpoint's experts one by one -> transformers' stacked
            names = [f"mixer.experts.{e}.{proj}.weight" for e in range(config.n_routed_experts)]
            if names[0] in state:
                state[f"mixer.experts.{proj}"] = torch.stack([state.pop(n) for n in names])
        for extra in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
            state.pop(extra, None)
        block.load_state_dict(state, strict=True)
        blocks.append(block)
    embed = load_model(model_dir, torch.float32, 64).embed_tokens
    with torch.inference_mode():
        x = torch.cat([norm("mtp.layers.0.enorm.weight")(embed[next_ids]), norm("mtp.layers.0.hnorm.weight")(hidden)], -1)
        x = torch.nn.functional.linear(x, weights["mtp.layers.0.eh_proj.weight"])[None]
        n = x.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        for block in blocks:
            x = block(x, attention_mask=causal)
        return norm(f"mtp.layers.{len(kinds) - 1}.final_layernorm.weight")(x)[0]


def test_mtp_step_equals_transformers_blocks_in_chunks():
    model_dir = resolve_model(MODEL, progress=False)
    model = load_model(model_dir, torch.float32, 256, deterministic=True)
    weights = load_own_mtp_weights(model_dir)
    assert sorted({n.split(".")[2] for n in weights}) == ["0", "1"] and len(weights) == 48
    head = NemotronMTP(model, weights)
    assert head.num_draft_layers == 1 and [b.kind for b in head.blocks] == ["*", "E"]
    length, bs, a = 37, 16, model.arch
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(length, a.hidden_size, generator=gen) * 3
    next_ids = torch.randint(0, a.vocab_size, (length,), generator=gen)
    expected = _hf_mtp_step(model_dir, weights, hidden, next_ids)

    cache = torch.zeros((2, 2, 8, bs, a.num_kv_heads, a.head_dim))  # a target layer, then the draft layer
    draft = head.draft_cache(cache, 1)
    table = torch.tensor([[3, 1, 5, 0, 2, 4, 6, 7]], dtype=torch.int32)
    pos = torch.arange(length)
    outs = []
    with torch.inference_mode():
        for lo, hi in ((0, 20), (20, length)):  # two chunks, like a chunked prefill
            p = pos[lo:hi]
            slots = table[0, p // bs].long() * bs + p % bs
            meta = AttentionMetadata(slots, table, torch.tensor([hi], dtype=torch.int32),
                                     torch.tensor([0, hi - lo], dtype=torch.int32), None, model.scale)
            outs.append(head.forward(hidden[lo:hi], next_ids[lo:hi], p, draft, meta))
        k_ref, v_ref = head.reference_kv(hidden, next_ids, pos)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-4)
    assert cache[0].abs().sum() == 0, "the MTP step wrote into the target's layer"
    slots = table[0, pos // bs].long() * bs + pos % bs
    flat = cache[1].view(2, -1, a.num_kv_heads, a.head_dim)
    torch.testing.assert_close(flat[0, slots], k_ref)
    torch.testing.assert_close(flat[1, slots], v_ref)


# ---------------------------------------------------------------------------------------------------
# Through the engine


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_native_mtp_is_lossless_and_mostly_accepted(greedy_reference, use_async):
    engine = make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512, async_scheduling=use_async, **NATIVE)
    assert "its own MTP layers" in engine.mtp_source and engine.kv_spec.num_draft_layers == 1
    outs = engine.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == greedy_reference
    drafted, accepted = sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)
    print(f"\ntiny-hybrid-moe native MTP k=2 {'async' if use_async else 'sync'}: {accepted}/{drafted} drafts "
          f"accepted = {accepted / drafted:.3f}")
    assert accepted / drafted > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_native_mtp_long_chunked_preempted_is_lossless(use_async):
    """16 prompts x 48 tokens, 7-token prefill chunks, a pool small enough to preempt; k = 3."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(100, 49000, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 70, (16,), generator=gen)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    cfg = dict(prefill_chunk_size=7, max_num_batched_tokens=64, num_kv_blocks=40, max_model_len=256)
    expected = _tokens(make_engine(MODEL, **cfg).generate(prompts, params))
    engine = make_engine(MODEL, async_scheduling=use_async, **{**NATIVE, "num_spec_tokens": 3}, **cfg)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions_total > 0
    assert _tokens(outs) == expected
    assert sum(o.num_accepted_tokens for o in outs) / sum(o.num_draft_tokens for o in outs) > 0.5


# ---------------------------------------------------------------------------------------------------
# Disaggregated


def _disagg(transport: str, params: SamplingParams, **overrides):
    """(tokens, (drafted, accepted) per request, bytes sent, the prefill worker's engine) through a real pair."""
    run = run_on_pair(_config(**overrides), TransferConfig(transport=transport, secret="s3cret"), PROMPTS, params,
                      NUM_BLOCKS)
    for stats in run.stats:  # every block back on both sides
        assert stats["num_free_blocks"] == NUM_BLOCKS
    with run.events.lock:  # the decode worker's counts ride on its Tokens events (S1: after acceptance)
        last = {e.request_id: e for e in run.events.items if isinstance(e, Tokens)}
    counts = [(last[rid].num_draft_tokens, last[rid].num_accepted_tokens) for rid in run.request_ids]
    return run.tokens, counts, run.stats[0]["bytes_sent"], run.prefill_engine


class NoDraftsWithTheFirstToken:
    """The proposer as a prefill worker runs it: the request there has max_tokens 1 (prefill_node/worker.py), so
    the step that samples the first token writes the draft layer's KV for the prompt but drafts nothing."""

    def __init__(self, inner):
        self.inner = inner
        self.num_draft_layers = inner.num_draft_layers

    def propose(self, batch):
        drafts, st = self.inner.propose(batch), batch.states
        return [[] if st.num_tokens_np[i] == st.prefill_len_np[i] + 1 else d
                for i, d in zip(batch.idx_mapping_np, drafts)]


@pytest.fixture(scope="module")
def colocated_native():
    """Colocated with native MTP, drafting from the second token on as disagg does: per request (drafted,
    accepted). Equal counts after a transfer mean the decode worker drafted from the same draft-layer KV (S2)."""
    engine = make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512, prefill_chunk_size=16, **NATIVE)
    engine.runner.proposer = NoDraftsWithTheFirstToken(engine.runner.proposer)
    outs = engine.generate(PROMPTS, GREEDY)
    return _tokens(outs), [(o.num_draft_tokens, o.num_accepted_tokens) for o in outs]


@pytest.mark.parametrize("transport,use_async", [(t, False) for t in usable_transports()] + [("tcp", True)])
def test_native_mtp_disagg_equals_colocated(greedy_reference, colocated_native, transport, use_async):
    tokens, counts, bytes_sent, engine = _disagg(transport, GREEDY, async_scheduling=use_async, **NATIVE)
    assert tokens == greedy_reference
    assert colocated_native[0] == greedy_reference
    if not use_async:  # the decode worker drafts from the transferred draft-layer KV exactly as colocated does
        assert counts == colocated_native[1], (counts, colocated_native[1])
    # Every byte accounted for: the target's KV (full blocks layer by layer, then the tail block, or the last full
    # block again), the draft layer of every prompt block, and the Mamba state's blocks (all layers).
    spec, bs = engine.kv_spec, engine.kv_spec.block_size
    per_layer_block = spec.bytes_per_block // spec.num_layers
    assert spec.num_draft_layers == 1 and engine.num_state_blocks >= 1
    expected = 0
    for n in (len(p) for p in PROMPTS):
        full, blocks = n // bs, -(-n // bs)
        kv = (full + blocks - min(full, blocks - 1)) * (spec.num_layers - 1) * per_layer_block
        expected += kv + blocks * per_layer_block + engine.num_state_blocks * spec.bytes_per_block
    assert bytes_sent == expected


def test_native_mtp_disagg_prompt_near_max_model_len():
    """A prompt whose blocks and the state blocks after them together outnumber max_model_len's blocks (500 tokens
    of 512: 32 blocks + 2 state blocks; the runner's block table once had room for 33 only)."""
    prompt = torch.randint(100, 49000, (500,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512).generate([prompt], params)[0].token_ids
    events = Events()
    with connected_pair(_config(**NATIVE), TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        assert -(-len(prompt) // 16) + p.engine.num_state_blocks > -(-(512 + 3) // 16)
        d.submit("long", prompt, params, "p0")
        assert _collect_tokens(events, ["long"], timeout_s=120)["long"] == expected


# ---------------------------------------------------------------------------------------------------
# Refusals


def _dir_with(tmp_path: Path, source: str, **config) -> Path:
    out = tmp_path / "model"
    shutil.copytree(resolve_model(source, progress=False), out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config}))
    return out


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_nemotron_h_without_mtp_layers_is_one_line(tmp_path):
    with pytest.raises(MTPHeadMissing) as e:
        find_mtp_checkpoint("", tmp_path, "tiny-hybrid")
    line = _one_line(e)
    assert "'tiny-hybrid' has no MTP layers of its own" in line and "num_nextn_predict_layers is 0" in line
    assert "--mtp-checkpoint PATH" in line and "--spec ngram" in line and "train_mtp" not in line
    assert find_mtp_checkpoint("", tmp_path, MODEL).kind == "own"  # a built-in: from its config, before a build


def test_declared_mtp_layers_without_weights_is_one_line(tmp_path):
    """transformers' save_pretrained keeps num_nextn_predict_layers but writes no mtp.* tensors."""
    model_dir = _dir_with(tmp_path, "tiny-hybrid", num_nextn_predict_layers=1, n_routed_experts=8, n_group=1)
    with pytest.raises(MTPHeadMissing) as e:
        find_mtp_checkpoint("", tmp_path, str(model_dir))
    assert "declares num_nextn_predict_layers 1 but its weights have no mtp.* tensors" in _one_line(e)
    with pytest.raises(MTPHeadMissing, match="no mtp.* tensors"):  # the engine says the same
        make_engine(str(model_dir), num_kv_blocks=32, max_model_len=128, **NATIVE)
    assert find_mtp_checkpoint("random", tmp_path, str(model_dir)).kind == "random"  # still asked for by name


@pytest.mark.parametrize("config, field", [
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers 2: only 1 MTP step is supported"),
    ({"mtp_layers_block_type": ["mamba", "moe"]}, "mtp_layers_block_type ['mamba', 'moe']: a mamba MTP block"),
])
def test_unsupported_mtp_config_is_one_line(tmp_path, config, field):
    model_dir = _dir_with(tmp_path, MODEL, **config)
    with pytest.raises(ConfigError) as e:
        find_mtp_checkpoint("", tmp_path, str(model_dir))
    assert field in _one_line(e)
