"""NemotronH MoE layers (engine/models/nemotron_moe.py on the fused core of engine/models/moe.py) against
transformers' NemotronHForCausalLM (fp32, eager attention) as the oracle, and the grouped matmul kernels under
them (kernels/cpu_grouped_mm.py + kernels/csrc/grouped_gemm_bi.c, kernels/triton_grouped_mm.py) against torch
(issue 26 items 1-3).

Two directories made by transformers with random weights, saved by ``save_pretrained`` (experts one by one:
``mixer.experts.{e}.up_proj.weight``), tiny-random's tokenizer beside them:
- "moe": pattern "ME*E-", 8 experts of width 32 in the hidden size, top 2 among the best 2 of 4 groups,
  renormalised;
- "latent": pattern "E*MEM", moe_latent_size 24, 8 experts, top 3 among 1 of 2 groups, not renormalised, scaled
  by 2.5, mlp_bias on (latent projections and shared expert biased).
Weights are redrawn at a scale where every block matters (test_hybrid_model.py's reasoning), the router's and
its correction bias included, so the experts a token picks change its output.

Oracle for greedy tokens: the engine's continuation o of prompt p is transformers' greedy continuation iff each
o[j] is the argmax of transformers' logits at position len(p) + j - 1 of one full forward over p + o (causal:
those are the logits of the forward over the prefix), so one forward per sequence checks it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.models.architectures import arch_from_dir, load_model
from pdcluster.engine.models.nemotron_moe import NemotronMoeArch
from pdcluster.engine.models.random_weights import pin_dt_limit, redraw_nemotron_h
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kernels import cpu_gemm, cpu_grouped_mm
from pdcluster.kernels.triton_grouped_mm import grouped_mm_triton, tile_table
from test_hybrid_engine import _prompts
from test_hybrid_model import Steps

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

NUM_NEW = 10
VOCAB = 512
PROMPTS = [[3 + t % (VOCAB - 3) for t in p] for p in _prompts(16, seed=2)]  # 16 prompts of 3..70 tokens

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8,
              layer_norm_epsilon=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              intermediate_size=48, n_routed_experts=8, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=40)
CONFIGS = {
    "moe": dict(COMMON, hybrid_override_pattern="ME*E-", num_experts_per_tok=2, n_group=4, topk_group=2,
                norm_topk_prob=True),
    "latent": dict(COMMON, hybrid_override_pattern="E*MEM", moe_latent_size=24, num_experts_per_tok=3, n_group=2,
                   topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.5, mlp_bias=True),
}
NAMES = list(CONFIGS)


def save_nemotron_h(d: Path, kwargs: dict) -> Path:
    """A transformers NemotronH of config ``kwargs`` with the module docstring's weights, saved in ``d`` with
    tiny-random's tokenizer."""
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**kwargs))
    redraw_nemotron_h(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "moe":  # a buffer (not redrawn): big enough to change some choices
                layer.mixer.gate.e_score_correction_bias.copy_(0.2 * torch.randn(8, generator=gen))
    model.save_pretrained(str(d))
    shutil.copy(resolve_model("tiny-random", progress=False) / "tokenizer.json", d / "tokenizer.json")
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: save_nemotron_h(tmp_path_factory.mktemp(name), kwargs) for name, kwargs in CONFIGS.items()}


def _hf_model(model_dir: Path):
    return pin_dt_limit(transformers.NemotronHForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                         attn_implementation="eager").eval())


@pytest.fixture(scope="module")
def hf_models(dirs):
    return {name: _hf_model(d) for name, d in dirs.items()}


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    # No cache: a full forward needs none, and transformers 5.25's cache fails where the first block has no state
    # (DummyLayer has no get_seq_length).
    with torch.inference_mode():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0]


def assert_greedy_of(hf, prompts: list[list[int]], outputs: list[list[int]], num_new: int = NUM_NEW) -> None:
    """Each output is transformers' greedy continuation of its prompt (module docstring)."""
    for p, o in zip(prompts, outputs):
        assert len(o) == num_new
        expected = _hf_logits(hf, p + o)[len(p) - 1 : len(p) + len(o) - 1].argmax(-1).tolist()
        assert o == expected, (p, o, expected)


def _engine(model: str | Path, **overrides):
    cfg = dict(dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=16, max_num_seqs=16)
    return make_engine(str(model), **{**cfg, **overrides})


def _run(engine, prompts, num_new: int = NUM_NEW) -> list[list[int]]:
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


# ---------------------------------------------------------------------------------------------------
# Loading


def test_arch_reads_the_moe_fields(dirs):
    moe, latent = arch_from_dir(dirs["moe"]), arch_from_dir(dirs["latent"])
    assert moe.layer_types == tuple("ME*E-") and latent.layer_types == tuple("E*MEM")
    assert moe.routed_experts == NemotronMoeArch(num_experts=8, top_k=2, intermediate_size=32,
                                                 shared_intermediate_size=40, latent_size=None, n_group=4,
                                                 topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert latent.routed_experts.latent_size == 24 and latent.routed_experts.routed_scaling_factor == 2.5
    assert not hasattr(moe, "moe")  # DecoderLayer (llama.py) reads .moe as Qwen3-MoE's


REFUSED = {  # config change -> what the one-line refusal must name
    "n_group": ({"n_group": 3}, "n_group 3"),
    "mlp_hidden_act": ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act 'gelu'"),
    "topk_group": ({"topk_group": 5}, "topk_group 5"),
    "num_experts_per_tok": ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
    "one expert per group": ({"n_group": 8, "topk_group": 2}, "n_group 8"),
    "moe_latent_size": ({"moe_latent_size": 0}, "moe_latent_size 0"),
    "n_routed_experts": ({"n_routed_experts": 0}, "n_routed_experts 0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_config_is_refused_in_one_line_naming_the_field(dirs, tmp_path, case):
    change, needle = REFUSED[case]
    cfg = {**json.loads((dirs["moe"] / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(dirs["moe"] / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError) as err:
        arch_from_dir(tmp_path)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------------
# The model against transformers


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_equal_transformers_whole_and_in_chunks(dirs, hf_models, name):
    tokens = max(PROMPTS, key=len)
    model = load_model(dirs[name], torch.float32, 256)
    want = _hf_logits(hf_models[name], tokens)
    assert want.abs().max() > 5  # logits large enough for the tolerance to be a real test
    for chunks in (None, [7, 20, len(tokens) - 27]):  # chunks end inside and across the scan's 8-token chunks
        torch.testing.assert_close(Steps(model).prefill(0, tokens, chunks), want, rtol=1e-5, atol=1e-4)


def test_moe_block_equals_transformers_and_is_batch_invariant(dirs, hf_models):
    """The latent MoE block alone against transformers' NemotronHMoE on 64 tokens, which between them route to
    every expert; deterministic mode: a token alone gives bit for bit its row among the 64 (fp32 and bf16)."""
    hf_block = hf_models["latent"].model.layers[0].mixer
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = hf_block(x[None])[0]
        assert hf_block.gate(x)[2].unique().numel() == 8
    for dtype in (torch.float32, torch.bfloat16):
        block = load_model(dirs["latent"], dtype, 256, deterministic=True).layers[0].mixer.mixer
        assert block.experts.up.backend == "c" and block.router.proj.deterministic
        xd = x.to(dtype)
        with torch.inference_mode():
            got = block(xd)
            assert torch.equal(torch.cat([block(xd[i : i + 1]) for i in range(64)]), got)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)  # outputs reach ~100


def test_decoding_one_token_reads_only_its_routed_experts(dirs):
    """The experts one token is not routed to are NaN in the packed weights: its output stays finite and equal."""
    block = load_model(dirs["moe"], torch.float32, 256).layers[1].mixer.mixer  # "ME*E-": layer 1
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = block(x)
        routed = set(block.router(x)[1].reshape(-1).tolist())
        assert len(routed) == 2
        for grouped in (block.experts.up, block.experts.down):
            for e in set(range(8)) - routed:
                grouped._packed.data[e] = float("nan")
        assert torch.equal(block(x), expected)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_alone_and_batched_equal_transformers(dirs, hf_models, name):
    engine = _engine(dirs[name])
    alone = _run(engine, PROMPTS[:1])
    batched = _run(engine, PROMPTS)
    assert batched[0] == alone[0]
    assert len({tuple(o) for o in batched}) > 8 and sum(len(set(o)) > 2 for o in batched) > 8  # not degenerate
    assert_greedy_of(hf_models[name], PROMPTS, batched)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_and_preemption_equal_transformers(dirs, hf_models, name):
    # Chunks of 5 tokens; 24 blocks of 16 for 16 requests of up to 80 tokens force preemption.
    engine = _engine(dirs[name], prefill_chunk_size=5, max_num_batched_tokens=40, num_kv_blocks=24)
    outputs = _run(engine, PROMPTS)
    assert engine.scheduler.num_preemptions_total > 0
    assert_greedy_of(hf_models[name], PROMPTS, outputs)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("model", ["tiny-hybrid-moe", "tiny-hybrid-moe-plain"])
def test_tiny_hybrid_moe_serves_through_the_engine(model):
    model_dir = resolve_model(model, progress=False)
    arch = arch_from_dir(model_dir)
    assert set(arch.layer_types) == set("M*-E") and arch.routed_experts.n_group == 4
    assert (arch.routed_experts.latent_size is None) == model.endswith("plain")
    prompts = PROMPTS[:4]
    outputs = _run(_engine(model), [[100 + t for t in p] for p in prompts])
    assert_greedy_of(_hf_model(model_dir), [[100 + t for t in p] for p in prompts], outputs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-hybrid-moe", "tiny-hybrid-moe-plain"])
def test_tiny_hybrid_moe_long_greedy_chunked_and_preempted_equals_transformers(model):
    """The longer variant: 16 prompts x 48 new tokens, prefill in 7-token chunks, a pool small enough to preempt."""
    prompts = [[100 + t for t in p] for p in PROMPTS]
    engine = _engine(model, prefill_chunk_size=7, max_num_batched_tokens=56, num_kv_blocks=40)
    outputs = _run(engine, prompts, num_new=48)
    assert engine.scheduler.num_preemptions_total > 0
    assert_greedy_of(_hf_model(resolve_model(model, progress=False)), prompts, outputs, num_new=48)


def test_bf16_deterministic_request_alone_equals_it_in_a_batch():
    """Deterministic mode (the default where it can run) in bf16 on tiny-hybrid-moe: every matmul, the grouped
    ones included, is batch-invariant, so a request's greedy tokens alone are those it gets among 15 others."""
    engine = _engine("tiny-hybrid-moe", dtype="bfloat16", deterministic=True)
    prompts = [[100 + t for t in p] for p in PROMPTS]
    batched = _run(engine, prompts)
    assert [_run(engine, [p])[0] for p in prompts[:4]] == batched[:4]


# ---------------------------------------------------------------------------------------------------
# Grouped matmul kernels

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
COUNTS = [3, 0, 17, 1, 0, 0, 40, 2]  # rows per expert: empty experts, a single row, several tiles


def _problem(dtype: torch.dtype, n: int = 70, k: int = 45, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(len(COUNTS), n, k, generator=gen).to(dtype)
    offs = torch.tensor([0, *torch.tensor(COUNTS).cumsum(0).tolist()])
    rows = torch.randn(int(offs[-1]), k, generator=gen).to(dtype)
    expected = torch.cat([rows[offs[e] : offs[e + 1]].double() @ weight[e].double().T for e in range(len(COUNTS))])
    return rows, weight, offs, expected


def _assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, bf16_ulps: float = 0.5) -> None:
    """fp32: summation order only; bf16 out: products exact in fp32, one rounding of the sum to bf16 (half an
    ulp, 2**-8 relative; the Triton interpreter truncates where a GPU rounds: a whole ulp)."""
    tol = dict(rtol=1e-5, atol=1e-4) if got.dtype == torch.float32 else dict(rtol=bf16_ulps * 2**-7, atol=1e-2)
    torch.testing.assert_close(got.double(), expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_c_grouped_matmul_equals_torch_and_is_batch_invariant(dtype):
    rows, weight, offs, expected = _problem(dtype)
    packed = cpu_grouped_mm.pack_experts(weight)
    out = cpu_grouped_mm.grouped_linear_bi(rows, packed, offs)
    _assert_matches(out, expected, dtype)
    _assert_matches(cpu_grouped_mm.grouped_linear_bi(rows, packed, offs, out_dtype=torch.float32), expected, dtype)
    # Bit for bit: a row alone in its expert == the same row among 40 (expert 6), == the plain batch-invariant
    # GEMM on that expert, whatever the thread count.
    e, r = 6, int(offs[6]) + 11
    alone_offs = torch.tensor([0] * (e + 1) + [1] * (len(COUNTS) - e))
    assert torch.equal(cpu_grouped_mm.grouped_linear_bi(rows[r : r + 1], packed, alone_offs), out[r : r + 1])
    assert torch.equal(cpu_gemm.linear_bi(rows[r : r + 1], packed.expert(e)), out[r : r + 1])
    for threads in (1, 2, 3):
        assert torch.equal(cpu_grouped_mm.grouped_linear_bi(rows, packed, offs, num_threads=threads), out)


def test_c_grouped_matmul_reads_only_experts_with_rows():
    rows, weight, offs, expected = _problem(torch.float32)
    poisoned = weight.clone()
    for e, count in enumerate(COUNTS):
        if count == 0:
            poisoned[e] = float("nan")
    out = cpu_grouped_mm.grouped_linear_bi(rows, cpu_grouped_mm.pack_experts(poisoned), offs)
    assert not out.isnan().any()
    _assert_matches(out, expected, torch.float32)


def test_triton_tile_table():
    expert, first_row = tile_table(torch.tensor([0, 3, 3, 40, 41]), 41, block_m=32)
    assert expert.tolist() == [0, 2, 2, 3] + [-1] * (len(expert) - 4)  # 3 rows, none, 37 rows (2 tiles), 1 row
    assert first_row.tolist()[:4] == [0, 3, 35, 40]


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_grouped_matmul_equals_torch_interpreted(dtype):
    """Under TRITON_INTERPRET=1 (conftest): the kernel on CPU tensors, small shapes."""
    rows, weight, offs, expected = _problem(dtype, n=70, k=40)
    _assert_matches(grouped_mm_triton(rows, weight, offs), expected, dtype, bf16_ulps=1)
    # A transposed weight layout (strides as a checkpoint's fused [E, in, out] tensor viewed [E, out, in]).
    strided = weight.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(grouped_mm_triton(rows, strided, offs), grouped_mm_triton(rows, weight, offs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device and compiled Triton")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_grouped_matmul_on_cuda_equals_torch_and_is_batch_invariant(dtype):
    rows, weight, offs, expected = _problem(dtype, n=384, k=256)
    rows, weight, offs = rows.cuda(), weight.cuda(), offs.cuda()
    out = grouped_mm_triton(rows, weight, offs)
    _assert_matches(out.cpu(), expected, dtype)
    e, r = 6, int(offs[6]) + 11
    alone_offs = torch.tensor([0] * (e + 1) + [1] * (len(COUNTS) - e), device="cuda")
    assert torch.equal(grouped_mm_triton(rows[r : r + 1], weight, alone_offs), out[r : r + 1])
