"""NemotronH hybrids split over ranks (engine/tensor_parallel/shard_hybrid.py): each rank holds its share of every
Mamba layer's heads and groups (and their conv and SSM state), of the attention heads, of the MLP and of every expert.

In float32 a split hybrid computes what the whole one does: greedy tokens equal transformers' for a transformers-made
NemotronH with every bias a split could add twice (Mamba's in_proj/out_proj, the MLP's, the shared expert's, the latent
projections'), and equal the unsplit engine's on tiny-hybrid-moe through chunked prefill, preemption and n-gram
speculation, whose accepted drafts pick each rank's own per-position Mamba state (KeepStates). What does not split is
refused in one line.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import OracleProposer, engine_config, make_engine, usable_transports
from test_kv_transfer_e2e import Events, _collect_tokens, _wait_free, connected_pair, split_pair_equals_split_engine
from test_nemotron_moe import save_nemotron_h
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.mamba_state import MambaMetadata, MambaStatePool, MambaStateShape
from pdcluster.engine.models.architectures import arch_from_dir
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.random_weights import pin_dt_limit
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tensor_parallel.messages import Forward, KeepStates, decode, encode
from pdcluster.engine.tensor_parallel.shard import Shard, check_shardable, shard_arch, shard_tensor
from pdcluster.kv_transfer.config import TransferConfig

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

VOCAB = 512
# Two Mamba groups (a rank's heads are one whole group), every kind of block, every bias.
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8,
              layer_norm_epsilon=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              intermediate_size=48, n_routed_experts=8, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=40, hybrid_override_pattern="ME*-ME", moe_latent_size=24,
              num_experts_per_tok=3, n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.5,
              mlp_bias=True, use_bias=True)
PROMPTS = [[3 + (7 * i + 3 * j) % (VOCAB - 3) for j in range(6 + 11 * i)] for i in range(6)]


def _greedy(engine, prompts, num_new: int):
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, params)


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory) -> Path:
    return save_nemotron_h(tmp_path_factory.mktemp("nemotron-tp"), CONFIG)


def test_split_nemotron_h_with_every_bias_equals_transformers(nemotron_dir):
    split = make_engine(str(nemotron_dir), dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16,
                        tensor_parallel_size=2)
    try:
        a = split.model.arch
        assert (a.mamba_num_heads, a.n_groups, a.num_heads, a.num_kv_heads) == (2, 1, 2, 1)  # half of each
        assert (a.intermediate_size, a.routed_experts.intermediate_size) == (24, 16)
        outputs = [o.token_ids for o in _greedy(split, PROMPTS, 10)]
        assert split.scheduler.block_manager.num_free_blocks == split.kv_spec.num_blocks
    finally:
        split.close()
    hf = pin_dt_limit(transformers.NemotronHForCausalLM.from_pretrained(str(nemotron_dir), dtype=torch.float32,
                                                                        attn_implementation="eager").eval())
    assert len({tuple(o) for o in outputs}) > 3  # not degenerate
    for p, o in zip(PROMPTS, outputs):  # o is transformers' greedy continuation of p (test_nemotron_moe.py's oracle)
        with torch.inference_mode():
            logits = hf(torch.tensor([p + o])).logits[0]
        assert o == logits[len(p) - 1 : len(p) + len(o) - 1].argmax(-1).tolist(), p


def test_split_hybrid_moe_equals_the_whole_through_chunks_preemption_and_speculation():
    """Speculation drafting the known continuation with a quarter of the drafts corrupted (OracleProposer): drafts are
    accepted and rejected, so each rank must keep the state of its own heads after the last accepted position
    (KeepStates), not after the last position."""
    prompts = [[100 + (5 * i + 7 * j) % 300 for j in range(10 + 9 * i)] for i in range(4)]
    common = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=48, prefill_chunk_size=16,
                  num_kv_blocks=14, block_size=16, spec_method="ngram", num_spec_tokens=3)
    whole = make_engine("tiny-hybrid-moe", **common)
    expected = [o.token_ids for o in _greedy(whole, prompts, 40)]
    split = make_engine("tiny-hybrid-moe", tensor_parallel_size=2, **common)
    try:
        split.runner.proposer = OracleProposer(split.runner.proposer, [p + o for p, o in zip(prompts, expected)])
        outputs = _greedy(split, prompts, 40)
        assert [o.token_ids for o in outputs] == expected
        drafted = sum(o.num_draft_tokens for o in outputs)
        accepted = sum(o.num_accepted_tokens for o in outputs)
        assert 0 < accepted < drafted  # some drafts kept, some rejected: KeepStates chose positions
        assert split.scheduler.num_preemptions_total > 0
        assert split.scheduler.block_manager.num_free_blocks == split.kv_spec.num_blocks
    finally:
        split.close()


@pytest.fixture(scope="module")
def hidden_driven_mtp_dir(tmp_path_factory) -> Path:
    """tiny-hybrid-moe with its MTP step's fusion turned round: tiny-hybrid-moe's step drafts mostly from the next
    token (its eh_proj is a gain times identity on the token half), so rows of the wrong hidden states would hardly
    change a draft. Here the hidden half carries more of the draft (x3) and the token half less (x0.3): a rank that
    took the wrong rows of its hidden states would change drafts, and so the accepted counts."""
    from safetensors.torch import load_file, save_file

    source = resolve_model("tiny-hybrid-moe", progress=False)
    d = tmp_path_factory.mktemp("hidden-driven-mtp")
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    weights = load_file(str(source / "model.safetensors"))
    eh = weights["mtp.layers.0.eh_proj.weight"].clone()
    hidden = eh.shape[0]
    eh[:, :hidden] *= 0.3
    eh[:, hidden:] *= 3.0
    weights["mtp.layers.0.eh_proj.weight"] = eh
    save_file(weights, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_split_hybrid_drafts_with_its_own_mtp_layers_split_too(hidden_driven_mtp_dir, async_scheduling):
    """A NemotronH's own MTP step (attention + latent MoE) on two ranks: each rank runs its slice of every MTP
    forward (DraftForward) on its own rows of its own hidden states and writes its KV heads into its draft layer; the
    drafts, and so the accepted counts, equal the unsplit engine's, and the tokens too (speculation is lossless)."""
    prompts = [[100 + (5 * i + 7 * j) % 300 for j in range(10 + 9 * i)] for i in range(4)]
    common = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=48, prefill_chunk_size=16,
                  num_kv_blocks=64, block_size=16, spec_method="mtp", num_spec_tokens=3, mtp_checkpoint="",
                  async_scheduling=async_scheduling)
    whole = make_engine(str(hidden_driven_mtp_dir), **common)
    expected = _greedy(whole, prompts, 30)
    split = make_engine(str(hidden_driven_mtp_dir), tensor_parallel_size=2, **common)
    try:
        assert split.kv_cache.shape[0] == 2 + 1  # two attention layers and the MTP step's one, a KV head each
        assert split.kv_cache.shape[-2] == 1
        outputs = _greedy(split, prompts, 30)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        accepted = [o.num_accepted_tokens for o in outputs]
        assert accepted == [o.num_accepted_tokens for o in expected]
        assert 0 < sum(accepted) < sum(o.num_draft_tokens for o in outputs)  # drafts kept and drafts rejected
        assert split.scheduler.block_manager.num_free_blocks == split.kv_spec.num_blocks
    finally:
        split.close()


def test_mamba_rows_and_kept_states_travel_to_the_ranks():
    shape = MambaStateShape(num_mamba_layers=1, conv_dim=8, conv_width=3, num_heads=2, head_dim=2, state_size=2)
    pool = MambaStatePool(shape, num_slots=5, max_positions_per_step=4)
    rows = MambaMetadata(pool, np.array([0, 3, 4]), np.array([2, 0]), np.array([False, True]),
                         np.array([False, True]))
    meta = AttentionMetadata(slot_mapping=torch.arange(4), block_tables=torch.zeros(2, 1, dtype=torch.int32),
                             seq_lens=torch.tensor([3, 9], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32), uniform_q_len=None,
                             scale=0.5, mamba=rows)
    got = decode(encode(Forward(torch.arange(4), torch.arange(4), meta)))
    assert got.mamba_pool_size == (5, 4)
    assert got.meta.mamba.pool is None  # the rank runs the rows on its own pool
    for name in ("query_start_loc_np", "state_slots_np", "has_initial_state_np", "keep_positions_np"):
        assert np.array_equal(getattr(got.meta.mamba, name), getattr(rows, name))
    keep = decode(encode(KeepStates(np.array([2, 0]), np.array([1, 3]))))
    assert keep.slots_np.tolist() == [2, 0] and keep.position_index_np.tolist() == [1, 3]


def test_mamba_in_proj_rows_are_each_ranks_heads_and_groups(nemotron_dir):
    """in_proj is z | x | B | C | dt: rank r takes its heads' z, x and dt rows and its group's B and C rows."""
    arch = arch_from_dir(nemotron_dir)
    inner, gn, heads = 4 * 16, 2 * 8, 4
    t = torch.arange(2 * inner + 2 * gn + heads, dtype=torch.float32)[:, None].expand(-1, 3)
    z, x, B, C, dt = torch.arange(len(t)).split([inner, inner, gn, gn, heads])
    for rank in range(2):
        cut = shard_tensor("backbone.layers.0.mixer.in_proj.weight", t, arch, Shard(rank, 2))
        half, g = slice(rank * 32, rank * 32 + 32), slice(rank * 8, rank * 8 + 8)
        expected = torch.cat([z[half], x[half], B[g], C[g], dt[rank * 2 : rank * 2 + 2]])
        assert cut[:, 0].long().tolist() == expected.tolist()
    norm = torch.ones(64)  # the block's own RMSNorm over the hidden size stays whole; the gated norm's is cut
    assert shard_tensor("backbone.layers.0.norm.weight", norm, arch, Shard(1, 2)).shape == (64,)
    assert shard_tensor("backbone.layers.0.mixer.norm.weight", norm, arch, Shard(1, 2)).shape == (32,)
    bias = torch.ones(64)  # inside the MoE's one sum: rank 0 alone adds it
    for leaf in ("mixer.fc2_latent_proj.bias", "mixer.shared_experts.down_proj.bias"):
        assert shard_tensor(f"backbone.layers.1.{leaf}", bias, arch, Shard(0, 2)).sum() == 64
        assert shard_tensor(f"backbone.layers.1.{leaf}", bias, arch, Shard(1, 2)).sum() == 0
    assert shard_arch(arch, 2).mamba_state_shape().num_heads == 2


@pytest.mark.parametrize("changes, words", [
    (dict(n_groups=1), "1 Mamba groups (n_groups; each rank's heads must be whole groups"),
    (dict(mamba_num_heads=3, n_groups=1), "3 Mamba heads"),
    (dict(moe_intermediate_size=33), "33 experts' moe_intermediate_size"),
])
def test_what_does_not_split_is_refused_naming_the_count(changes, words):
    from pdcluster.engine.models.nemotron_h import HybridArch, NemotronHModel

    arch = HybridArch.from_config(dict(CONFIG, architectures=["NemotronHForCausalLM"], **changes))
    with pytest.raises(ValueError, match=re.escape(f"tensor_parallel_size 2: the model's {words}")):
        check_shardable(NemotronHModel, arch, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", [t for t in ("tcp", "shm") if t in usable_transports()])
def test_split_hybrid_workers_move_each_ranks_state_and_mtp_kv(hidden_driven_mtp_dir, transport):
    """A prefill and a decode worker, each tiny-hybrid-moe split over two ranks with its own MTP step: each rank packs
    its heads' Mamba state into its own cache's state blocks (MoveStates, rank 0 waiting for all before post_forward
    sends), the transport moves every rank's attention, MTP-layer and state blocks to the same rank, and each decode
    rank unpacks its heads' state. Tokens equal the unsplit colocated engine's."""
    prompts = [[100 + (5 * i + 7 * j) % 300 for j in range(n)] for i, n in enumerate([4, 17, 40, 70])]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    common = dict(dtype="float32", max_model_len=256, num_kv_blocks=96, block_size=16, prefill_chunk_size=16,
                  spec_method="mtp", num_spec_tokens=2, mtp_checkpoint="")
    expected = [o.token_ids for o in make_engine(str(hidden_driven_mtp_dir), **common).generate(prompts, params)]
    events = Events()
    cfg = engine_config(str(hidden_driven_mtp_dir), tensor_parallel_size=2, **common)
    with connected_pair(cfg, TransferConfig(transport=transport, secret="s3cret"), events) as (p, d):
        assert d.engine.runner.num_state_blocks > 0
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            d.submit(rid, prompt, params, "p0")
        tokens = _collect_tokens(events, ids)
        assert [tokens[rid] for rid in ids] == expected
        for worker in (p, d):
            _wait_free(worker, 96, 5)


@pytest.mark.timeout(240)
def test_split_hybrid_workers_in_bf16_equal_the_split_engine():
    """bf16 in deterministic mode (the CPU default): the disaggregated tiny-hybrid-moe pair split over two ranks (shm)
    gives the tokens of one colocated engine split the same way. Each rank's Mamba state travels as the bf16 bytes the
    decode rank resumes from, and the prefill side's batches differ from the colocated engine's: a difference in
    either shows here (two ranks' partial sums round apart from one rank's sum, so the reference is split too)."""
    def has_state_blocks(p, d) -> None:
        assert d.engine.runner.num_state_blocks > 0

    split_pair_equals_split_engine(engine_config("tiny-hybrid-moe", tensor_parallel_size=2, dtype="bfloat16",
                                                 deterministic=True, max_model_len=256, num_kv_blocks=96,
                                                 prefill_chunk_size=16), 96, has_state_blocks)
