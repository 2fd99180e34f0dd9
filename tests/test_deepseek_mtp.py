"""DeepSeek-V3's own MTP layer as the ``--spec mtp`` draft model (engine/models/deepseek_mtp.py).

transformers drops the MTP layer's weights at load, so the layer is checked against transformers' own DeepSeek-V3
decoder layer run on the MTP inputs (vLLM's definition: eh_proj over the normed embedding of the next token, zero at
position 0, and the normed hidden state; the block; shared_head's norm and head). Through the engine: speculation
changes no token (sync and async, chunked with preemption), and in disaggregated serving the MTP layer's latents
travel with the target's (S2), so the decode worker drafts and accepts exactly what a colocated engine does.

The test model makes drafts worth accepting: its blocks are weak and its LM head is the embedding of each token's
fixed successor (a permutation), so its next token mostly follows that successor; the MTP layer is built to predict
the successor of the token it is given. A random MTP layer would be rejected always, and equal counts after a
transfer would then prove nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import engine_config, usable_transports
from test_deepseek import CONFIGS, _engine
from test_kv_transfer_e2e import run_on_pair
from test_model_families import PROMPTS, _hf_greedy, _hf_model
from test_nemotron_mtp import NoDraftsWithTheFirstToken
from test_qwen3 import _redraw_weights
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.config import ConfigError
from pdcluster.engine.models.architectures import arch_from_dir, load_model
from pdcluster.engine.models.deepseek_mtp import DeepseekMTP, load_own_mtp_weights
from pdcluster.engine.models.mtp import MTPHeadMissing, find_mtp_checkpoint
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.events import Tokens

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

OWN = dict(spec_method="mtp", num_spec_tokens=2, mtp_checkpoint="")  # "": the model's own MTP layer
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 128


def _build(out: Path) -> Path:
    """The module docstring's model: V3's test shape (tests/test_deepseek.py), weak blocks, a successor LM head, and
    an MTP layer (model.layers.3.*, in a file of its own as transformers would not write it) that follows it."""
    _, model_cls, kwargs = CONFIGS["v3"]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(transformers.DeepseekV3Config(**kwargs))
    _redraw_weights(model)
    cfg, gen = model.config, torch.Generator().manual_seed(3)
    succ = torch.randperm(cfg.vocab_size, generator=gen)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every block's writes into the residual stream, weak
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(0.15)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
        model.model.embed_tokens.weight.mul_(2.0)  # the token itself dominates the residual stream (norms: same blocks)
        model.lm_head.weight[succ] = model.model.embed_tokens.weight.clone()  # token t votes for succ[t]
    model.save_pretrained(str(out))
    (out / "tokenizer.json").write_bytes((resolve_model("tiny-random", progress=False) / "tokenizer.json").read_bytes())

    n, hidden = cfg.num_hidden_layers, cfg.hidden_size
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(cfg, layer_idx=n)
    _redraw_weights(block, seed=4)
    with torch.no_grad():  # its MLP weak (the successor prior carries the drafts), its attention not (the drafts
        for name, p in block.named_parameters():  # depend on the cached latents)
            if name.endswith(("down_proj.weight", "experts.down_proj")):
                p.mul_(0.15)
    prefix = f"model.layers.{n}"
    extra = {f"{prefix}.{k}": v.detach().clone().contiguous() for k, v in block.state_dict().items()}
    eh_proj = torch.randn(hidden, 2 * hidden, generator=gen) * 0.05 / math.sqrt(2 * hidden)
    eh_proj[:, :hidden] += torch.eye(hidden) * 2.0  # mostly the next token's embedding
    extra.update({
        f"{prefix}.enorm.weight": torch.ones(hidden), f"{prefix}.hnorm.weight": torch.ones(hidden),
        f"{prefix}.eh_proj.weight": eh_proj, f"{prefix}.shared_head.norm.weight": torch.ones(hidden),
        f"{prefix}.shared_head.head.weight": model.lm_head.weight.detach().clone(),
        f"{prefix}.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
    })
    save_file(extra, str(out / "model-mtp.safetensors"))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("v3-mtp"))


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    return _hf_greedy(_hf_model(model_dir), PROMPTS)


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_layer_equals_transformers_block(model_dir):
    """Our MTP step over a prompt's positions (two chunks, through the paged draft layer) equals the same step
    computed with transformers' DeepseekV3DecoderLayer, logits within 1e-4."""
    hf = _hf_model(model_dir)
    arch = arch_from_dir(model_dir)
    weights = load_own_mtp_weights(model_dir, arch)
    prefix, eps = f"model.layers.{arch.num_layers}.", arch.rms_norm_eps
    w = {k[len(prefix):]: v for k, v in weights.items()}
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(hf.config, arch.num_layers)
    block.load_state_dict({k: v for k, v in w.items() if k.split(".")[0] in
                           ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")})
    prompt = torch.tensor(max(PROMPTS, key=len))  # 63 tokens
    num = len(prompt) - 1
    positions, next_ids = torch.arange(num), prompt[1:]
    with torch.inference_mode():
        hidden = hf.model(prompt[None]).last_hidden_state[0, :num]  # after the final norm
        emb = hf.model.embed_tokens(next_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = F.linear(torch.cat([_rms(emb, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], -1),
                     w["eh_proj.weight"])
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        x = block(x[None], attention_mask=mask, position_ids=positions[None],
                  position_embeddings=hf.model.rotary_emb(x[None], positions[None]))
        x = x[0] if isinstance(x, tuple) else x
        expected = F.linear(_rms(x[0], w["shared_head.norm.weight"], eps), w["shared_head.head.weight"])

        target = load_model(model_dir, torch.float32, 256)
        mtp = DeepseekMTP(target, weights)
        bs, num_blocks = 16, -(-num // 16)
        cache = torch.zeros(1, 1, num_blocks, bs, 1, arch.head_dim)
        table = torch.arange(num_blocks, dtype=torch.int32)[None]
        outs = []
        for lo, hi in ((0, 20), (20, num)):  # two chunks, like a chunked prefill
            meta = AttentionMetadata(positions[lo:hi].clone(), table, torch.tensor([hi], dtype=torch.int32),
                                     torch.tensor([0, hi - lo], dtype=torch.int32), None, target.scale)
            outs.append(mtp.compute_logits(mtp.forward(hidden[lo:hi], next_ids[lo:hi], positions[lo:hi], cache,
                                                       meta)))
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-4, atol=1e-4)
    assert cache.abs().sum() > 0  # the latents went into the draft layer


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_own_mtp_is_lossless_and_mostly_accepted(model_dir, reference, use_async):
    engine = _engine(model_dir, async_scheduling=use_async, **OWN)
    assert "its own MTP layers" in engine.mtp_source
    assert (engine.kv_spec.num_draft_layers, engine.kv_spec.num_planes) == (1, 1)
    outs = engine.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == reference
    drafted, accepted = sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)
    print(f"\nDeepSeek-V3 test model, own MTP k=2 {'async' if use_async else 'sync'}: {accepted}/{drafted} drafts "
          f"accepted = {accepted / drafted:.3f}")
    assert accepted / drafted > 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_own_mtp_on_cuda_is_lossless_with_graphs(model_dir, reference):
    """On CUDA in fp32: the target's and the MTP layer's latents through the latent kernel, verification steps
    (1 + k tokens a request) replayed in CUDA graphs, async by default: transformers' greedy, drafts accepted."""
    engine = _engine(model_dir, device="cuda", **OWN)
    outs = engine.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == reference
    assert sum(o.num_accepted_tokens for o in outs) / sum(o.num_draft_tokens for o in outs) > 0.5
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0


def test_own_mtp_split_over_two_ranks_drafts_as_the_whole(model_dir, reference):
    """engine/tensor_parallel/draft.py: each rank holds half the MTP layer's heads and every expert's half, runs each
    MTP forward on its own rows of its own hidden states and caches the whole latent in its draft layer; the split
    engine drafts and accepts exactly what the whole one does, and its tokens are transformers'."""
    whole = _engine(model_dir, **OWN).generate(PROMPTS, GREEDY)
    split = _engine(model_dir, tensor_parallel_size=2, prefill_chunk_size=16, max_num_batched_tokens=48, **OWN)
    try:
        outs = split.generate(PROMPTS, GREEDY)
        assert _tokens(outs) == reference
        assert [o.num_accepted_tokens for o in outs] == [o.num_accepted_tokens for o in whole]
        assert sum(o.num_accepted_tokens for o in outs) > 0
    finally:
        split.close()


def test_own_mtp_chunked_preempted_is_lossless(model_dir, reference):
    engine = _engine(model_dir, prefill_chunk_size=5, max_num_batched_tokens=40, num_kv_blocks=24, **OWN)
    outs = engine.generate(PROMPTS, GREEDY)
    assert engine.scheduler.num_preemptions_total > 0
    assert _tokens(outs) == reference
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


@pytest.fixture(scope="module")
def colocated(model_dir):
    """Colocated, drafting from the second token on as disagg does: per request (drafted, accepted)."""
    engine = _engine(model_dir, num_kv_blocks=NUM_BLOCKS, prefill_chunk_size=16, **OWN)
    engine.runner.proposer = NoDraftsWithTheFirstToken(engine.runner.proposer)
    outs = engine.generate(PROMPTS, GREEDY)
    return _tokens(outs), [(o.num_draft_tokens, o.num_accepted_tokens) for o in outs]


@pytest.mark.parametrize("transport", [t for t in usable_transports() if t in ("tcp", "shm", "ucx")])
def test_own_mtp_disagg_equals_colocated(model_dir, reference, colocated, transport):
    """Equal (drafted, accepted) per request: the decode worker drafted from the transferred MTP latents (S2)."""
    cfg = engine_config(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=NUM_BLOCKS, block_size=16,
                        prefill_chunk_size=16, **OWN)
    run = run_on_pair(cfg, TransferConfig(transport=transport, secret="s3cret"), PROMPTS, GREEDY, NUM_BLOCKS)
    with run.events.lock:
        last = {e.request_id: e for e in run.events.items if isinstance(e, Tokens)}
    counts = [(last[rid].num_draft_tokens, last[rid].num_accepted_tokens) for rid in run.request_ids]
    assert run.tokens == reference == colocated[0]
    assert counts == colocated[1] and sum(a for _, a in counts) > 0, (counts, colocated[1])
    # Every byte accounted for: the target's latents (full blocks layer by layer, then the tail block, or the last
    # full block again) and the MTP layer's for every prompt block; one plane a layer.
    spec, bs = run.prefill_engine.kv_spec, 16
    assert (spec.num_draft_layers, spec.num_planes) == (1, 1)
    per_layer_block = spec.bytes_per_block // spec.num_layers
    assert per_layer_block == bs * 1 * arch_from_dir(model_dir).head_dim * 4
    expected = 0
    for n in (len(p) for p in PROMPTS):
        full, blocks = n // bs, -(-n // bs)
        expected += (full + blocks - min(full, blocks - 1)) * (spec.num_layers - 1) * per_layer_block
        expected += blocks * per_layer_block
    assert run.stats[0]["bytes_sent"] == expected


def test_own_mtp_of_an_fp8_release_is_lossless(model_dir, tmp_path):
    """DeepSeek's FP8 release quantizes the MTP layer too: its loader dequantizes it (no scale left, the dequantized
    values), and speculation with it gives transformers' tokens on the dequantized target."""
    from test_deepseek import fp8_release

    release, plain = fp8_release(model_dir, tmp_path)
    arch = arch_from_dir(release)
    weights = load_own_mtp_weights(release, arch)
    assert weights and not any(name.endswith("_scale_inv") for name in weights)
    torch.testing.assert_close(weights[f"model.layers.{arch.num_layers}.eh_proj.weight"],
                               load_own_mtp_weights(plain, arch)[f"model.layers.{arch.num_layers}.eh_proj.weight"],
                               rtol=0, atol=0)
    outs = _engine(release, **OWN).generate(PROMPTS[:6], GREEDY)
    assert _tokens(outs) == _hf_greedy(_hf_model(plain), PROMPTS[:6])
    assert sum(o.num_accepted_tokens for o in outs) > 0


def test_refusals_are_one_line(model_dir, tmp_path):
    """V2 has no MTP layer; our Llama-shaped head does not fit latent attention; a V3 whose weights lack the layer
    (transformers' save_pretrained drops it) says where it looked."""
    v2 = _build_plain(tmp_path / "v2", "v2")
    with pytest.raises(ConfigError, match="without MTP layers of its own: DeepSeek models .* own MTP layer only") as e:
        _engine(v2, **OWN)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="with --mtp-checkpoint 'random': DeepSeek models"):
        _engine(model_dir, **{**OWN, "mtp_checkpoint": "random"})
    with pytest.raises(ConfigError, match="with --mtp-checkpoint 'random': DeepSeek models"):  # split: before any rank
        _engine(model_dir, tensor_parallel_size=2, **{**OWN, "mtp_checkpoint": "random"})
    # serve's start-up check (before any worker) says the same, not "train a head with bench/train_mtp.py"
    for checkpoint, model in (("", v2), ("random", model_dir)):
        with pytest.raises(ConfigError, match="DeepSeek models .* use --spec ngram"):
            find_mtp_checkpoint(checkpoint, tmp_path / "cache", str(model))
    assert find_mtp_checkpoint("", tmp_path / "cache", str(model_dir)).kind == "own"
    v3 = _build_plain(tmp_path / "v3", "v3")
    with pytest.raises(MTPHeadMissing, match=r"no model\.layers\.3\.\* tensors") as e:
        _engine(v3, **OWN)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)


def _build_plain(out: Path, name: str) -> Path:
    config_cls, model_cls, kwargs = CONFIGS[name]
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).save_pretrained(str(out))
    (out / "tokenizer.json").write_bytes((resolve_model("tiny-random", progress=False) / "tokenizer.json").read_bytes())
    return out

