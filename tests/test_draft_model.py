"""Draft-model speculation (``--spec draft_model``, vLLM's and SGLang's ``draft_model`` method): a separate, smaller
causal LM drafts (engine/draft_model.py loads and checks it, engine/proposers/draft_model.py runs it), its layers' KV
in the paged cache after the target's.

- the model as its own draft accepts every draft (greedy, fp32): the draft's KV, positions and first draft are
  right, across chunked prefill, a prefix-cache hit, preemption and async scheduling; output == no speculation;
- S2: at post_forward every draft layer holds, for every position the scheduler counts computed, what the draft
  computes from scratch (mid-prefill chunks too), and a prefix-cache hit shares every full block (a draft model's
  entry at p reads tokens up to p only: no block is dropped, unlike MTP);
- disaggregated over every transport usable here (and async on tcp) == colocated: tokens, drafted and accepted
  counts (the decode worker drafts from the draft layers' KV the prefill worker sent), every byte accounted for;
- sampled speculation gives the seeded tokens of no speculation;
- what cannot draft is refused at start-up in one line naming what differs; the CLI's flags and vLLM's JSON.
Lossless over the mixed prompt sets and the oracle proposer: tests/test_spec_decode.py; the Ray cluster:
tests/test_cluster.py.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import engine_config, layer_skip_draft_dir, make_engine, paged_from_scratch, usable_transports
from test_invariant_s2_connector_order import RecordingConnector
from test_kv_transfer_e2e import run_on_pair
from test_nemotron_mtp import NoDraftsWithTheFirstToken
from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.events import Tokens

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]

MODEL = "tiny-random"
NUM_BLOCKS = 128
_gen = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(100, 49000, (n,), generator=_gen).tolist() for n in (3, 16, 17, 45, 70, 9)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
CHUNKED = dict(prefill_chunk_size=16, max_num_batched_tokens=48)

_config = functools.partial(engine_config, MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512, **CHUNKED)


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _rate(outs) -> tuple[int, int]:
    return sum(o.num_accepted_tokens for o in outs), sum(o.num_draft_tokens for o in outs)


@pytest.fixture(scope="module")
def self_draft(tiny_dir) -> str:
    return str(tiny_dir)


@pytest.fixture(scope="module")
def first3() -> str:
    """tiny-random's first 3 of 4 layers (engine/models/layer_skip.py): drafts mostly rejected."""
    return layer_skip_draft_dir(MODEL, 3)


@pytest.fixture(scope="module")
def greedy_reference(tiny_dir):
    return _tokens(make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512).generate(PROMPTS, GREEDY))


# ---- the model as its own draft ------------------------------------------------------------------------
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [1, 4])
def test_the_model_as_its_own_draft_accepts_every_draft(greedy_reference, self_draft, k, use_async):
    engine = make_engine(MODEL, spec_method="draft_model", draft_model=self_draft, num_spec_tokens=k,
                         async_scheduling=use_async, num_kv_blocks=NUM_BLOCKS, max_model_len=512, **CHUNKED)
    assert engine.kv_spec.num_draft_layers == engine.arch.num_layers == 4
    assert engine.kv_cache.shape[0] == 8 and engine.scheduler.num_lookahead_tokens == k
    _accepts_every_draft(engine, greedy_reference, k)


def _accepts_every_draft(engine, reference, k: int) -> None:
    """``engine`` gives ``reference`` on PROMPTS with every draft accepted, then again on a prefix-cache hit (draft
    layers shared with the blocks), and holds no block after."""
    outs = engine.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == reference
    accepted, drafted = _rate(outs)
    assert drafted >= len(PROMPTS) * ((GREEDY.max_tokens - 1) // (k + 1)) and accepted == drafted, (accepted, drafted)
    again = engine.generate([p + [7, 8, 9] for p in PROMPTS], GREEDY)
    assert sum(o.num_cached_tokens for o in again) >= 16 * 5
    assert _rate(again)[0] == _rate(again)[1] > 0
    assert engine.scheduler.num_free_blocks == NUM_BLOCKS


def test_the_model_as_its_own_draft_under_preemption(self_draft):
    prompts = [torch.randint(100, 49000, (int(n),), generator=torch.Generator().manual_seed(int(n))).tolist()
               for n in (40, 33, 57, 21, 64, 48, 12, 30)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cfg = dict(num_kv_blocks=24, max_model_len=256, **CHUNKED)  # too small for all at once: recompute
    expected = _tokens(make_engine(MODEL, **cfg).generate(prompts, params))
    engine = make_engine(MODEL, spec_method="draft_model", draft_model=self_draft, num_spec_tokens=3, **cfg)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions_total > 0
    assert _tokens(outs) == expected
    assert _rate(outs)[0] == _rate(outs)[1] > 0
    assert engine.scheduler.num_free_blocks == 24


@pytest.mark.parametrize("model, cfg", [("smollm2", dict(dtype="bfloat16")), (MODEL, dict(kv_cache_dtype="fp8"))],
                         ids=["smollm2-bf16", "fp8-kv-cache"])
def test_the_model_as_its_own_draft_in_bf16_and_over_an_fp8_cache(smollm2_dir, model, cfg):
    """What users run: SmolLM2 in bf16 (the CPU default where avx512_bf16 is) drafts for itself losslessly, every
    draft accepted (deterministic mode: the draft's one-token steps compute what the target's verification does);
    the draft's KV written and read through an fp8 cache as the target's is."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1589, 28265, 30, 94, 1351, 104, 30]] if model == "smollm2" else PROMPTS
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = _tokens(make_engine(model, num_kv_blocks=NUM_BLOCKS, **cfg).generate(prompts, params))
    engine = make_engine(model, num_kv_blocks=NUM_BLOCKS, spec_method="draft_model", draft_model=model,
                         num_spec_tokens=3, **cfg)
    outs = engine.generate(prompts, params)
    assert _tokens(outs) == expected
    assert _rate(outs)[0] == _rate(outs)[1] > 0


def test_sampled_speculation_gives_the_seeded_tokens_of_no_speculation(self_draft):
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11)
    plain = make_engine(MODEL, num_kv_blocks=NUM_BLOCKS).generate(PROMPTS, params)
    spec = make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, spec_method="draft_model", draft_model=self_draft,
                       num_spec_tokens=3).generate(PROMPTS, params)
    assert _tokens(spec) == _tokens(plain)
    assert 0 < _rate(spec)[0] <= _rate(spec)[1]


# ---- a draft whose KV of a token is a fraction of the target's: packed ------------------------------------------
def _twin_pair(out) -> dict[str, str]:
    """tiny-random with its second KV head a copy of its first (the target), and the same model with that one KV head
    (the draft): one function, the draft's KV of a token half the target's (2 of its layers to a cache layer)."""
    from safetensors.torch import load_file, save_file

    src = resolve_model(MODEL, progress=False)
    config = json.loads((src / "config.json").read_text())
    head_dim, kv_heads = config["head_dim"], config["num_key_value_heads"]
    weights = load_file(str(src / "model.safetensors"))
    target, draft = dict(weights), dict(weights)
    for name, w in weights.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            target[name] = w[:head_dim].repeat(kv_heads, 1).contiguous()
            draft[name] = w[:head_dim].clone()
    dirs = {}
    for kind, tensors, heads in (("target", target, kv_heads), ("draft", draft, 1)):
        shutil.copytree(src, out / kind)
        (out / kind / "config.json").write_text(json.dumps(dict(config, num_key_value_heads=heads)))
        save_file(tensors, str(out / kind / "model.safetensors"), metadata={"format": "pt"})
        dirs[kind] = str(out / kind)
    return dirs


def _narrow_draft(out) -> str:
    """A random 3-layer draft over tiny-random's tokenizer whose KV of a token is a quarter of tiny-random's (1 head x
    16 against 2 x 32): its 3 layers take one cache layer, a quarter of it unused. Drafts mostly rejected."""
    from pdcluster.engine.models.tiny_random import write_random_draft

    return str(write_random_draft(resolve_model(MODEL, progress=False), out, 3, 1, 16))


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    return _twin_pair(tmp_path_factory.mktemp("twin"))


@pytest.fixture(scope="module")
def narrow(tmp_path_factory) -> str:
    return _narrow_draft(tmp_path_factory.mktemp("narrow") / "draft")


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [1, 4])
def test_a_draft_of_half_the_kv_packs_two_layers_to_one_and_accepts_every_draft(twin, k, use_async):
    """The twin draft computes what its target does with half its KV: packed 2 layers to a cache layer, it must draft
    exactly the target's tokens (every draft accepted, the output that of no speculation) across chunked prefill, a
    prefix-cache hit and async scheduling; the target's own layers untouched by the draft's writes."""
    reference = _tokens(make_engine(twin["target"], num_kv_blocks=NUM_BLOCKS, max_model_len=512).generate(PROMPTS,
                                                                                                        GREEDY))
    engine = make_engine(twin["target"], spec_method="draft_model", draft_model=twin["draft"], num_spec_tokens=k,
                         async_scheduling=use_async, num_kv_blocks=NUM_BLOCKS, max_model_len=512, **CHUNKED)
    assert engine.runner.proposer.per_slot == 2 and engine.kv_spec.num_draft_layers == 2
    assert engine.kv_cache.shape[0] == 6  # 4 target layers + 4 draft layers in 2
    _accepts_every_draft(engine, reference, k)


@pytest.mark.parametrize("dtype,shape", [("float32", (1, 16)), ("bfloat16", (1, 16)), ("float32", (1, 24))],
                         ids=["quarter-fp32", "quarter-bf16", "odd-fp32"])
def test_a_narrow_draft_is_lossless_under_preemption(narrow, tmp_path, dtype, shape):
    """A quarter of the target's KV a token (3 layers in one cache layer), and 1 x 24 against 2 x 32 (not a whole
    fraction: 2 layers to a cache layer, 16 of its 64 values a token unused)."""
    prompts = [torch.randint(100, 49000, (int(n),), generator=torch.Generator().manual_seed(int(n))).tolist()
               for n in (40, 33, 57, 21, 64, 48, 12, 30)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cfg = dict(num_kv_blocks=24, max_model_len=256, dtype=dtype, **CHUNKED)  # too small for all at once: recompute
    expected = _tokens(make_engine(MODEL, **cfg).generate(prompts, params))
    from pdcluster.engine.models.tiny_random import write_random_draft

    draft = narrow if shape == (1, 16) else str(write_random_draft(resolve_model(MODEL), tmp_path / "odd", 3, *shape))
    engine = make_engine(MODEL, spec_method="draft_model", draft_model=draft, num_spec_tokens=3, **cfg)
    assert (engine.runner.proposer.per_slot, engine.kv_spec.num_draft_layers) == ((4, 1) if shape == (1, 16) else (2, 2))
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions_total > 0
    assert _tokens(outs) == expected
    assert _rate(outs)[1] > 0
    assert engine.scheduler.num_free_blocks == 24


# ---- S2: the draft layers' KV is final at post_forward ---------------------------------------------------
def _draft_kv_from_scratch(draft, token_ids: list[int], block_size: int) -> torch.Tensor:
    """The draft's KV for ``token_ids`` from position 0 in a fresh paged cache: [layers, 2, n, heads, head_dim]."""
    _, cache = paged_from_scratch(draft, token_ids, block_size)
    return cache.flatten(2, 3)[:, :, : len(token_ids)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", ["first3", "narrow"])
def test_S2_every_draft_layer_is_complete_at_post_forward(first3, narrow, which, use_async):
    """``narrow``: its 3 layers packed into one cache layer (a quarter of the target's KV a token each)."""
    connector = RecordingConnector()
    engine = LLMEngine.from_config(_config(spec_method="draft_model", draft_model=first3 if which == "first3" else narrow,
                                           num_spec_tokens=3, async_scheduling=use_async), connector=connector,
                                   progress=False)
    proposer = engine.runner.proposer
    draft = proposer.draft
    assert draft.arch.num_layers == 3
    assert (engine.kv_spec.num_draft_layers, proposer.per_slot) == ((3, 1) if which == "first3" else (1, 4))
    checked = []

    def check(sched, finished_req_ids):
        st, bs = engine.runner.states, engine.config.block_size
        for s in sched.scheduled:
            idx = st.req_id_to_index[s.request_id]
            end = s.num_computed_tokens + s.num_scheduled_tokens
            n = int(st.num_tokens_np[idx]) - 1 if end >= s.num_tokens else end  # the scheduler's num_computed
            expected = _draft_kv_from_scratch(draft, st.token_ids_np[idx, :n].tolist(), bs)
            pos = torch.arange(n)
            blocks = torch.from_numpy(st.block_table_np[idx, (pos // bs).numpy()]).long()
            got = torch.stack([layer[:, blocks, pos % bs] for layer in proposer.layer_cache])
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3,
                                       msg=lambda m: f"{s.request_id}: draft KV of positions < {n}: {m}")
            checked.append((s.request_id, n))

    connector.on_post_forward = check
    outs = engine.generate(PROMPTS, GREEDY)
    assert len(checked) > 40
    assert any(n < len(PROMPTS[4]) - 16 for rid, n in checked)  # mid-prefill chunks were checked too
    # A prefix-cache hit takes every full block of the shared prefix, the draft's KV in them included.
    hit = engine.generate([PROMPTS[4][:48] + [1000 + i for i in range(10)]], GREEDY)[0]
    assert hit.num_cached_tokens == 48
    assert [len(o.token_ids) for o in outs] == [16] * len(PROMPTS)


# ---- disaggregated --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_cases(tiny_dir, first3, narrow):
    """Per draft: (its directory, colocated (drafted, accepted) per request drafting from the second token on, as
    disagg does)."""
    cases = {}
    for name, draft in (("self", str(tiny_dir)), ("first3", first3), ("narrow", narrow)):
        engine = make_engine(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512, prefill_chunk_size=16,
                             spec_method="draft_model", draft_model=draft, num_spec_tokens=3)
        engine.runner.proposer = NoDraftsWithTheFirstToken(engine.runner.proposer)
        outs = engine.generate(PROMPTS, GREEDY)
        cases[name] = (draft, _tokens(outs), [(o.num_draft_tokens, o.num_accepted_tokens) for o in outs])
    return cases


def _disagg_cases() -> list:
    """(draft, transport, async) for every usable transport; the packed draft's on tcp and shm in the default run, on
    the others in the slow one (a transfer moves whole blocks: the packing is the same bytes to each)."""
    cases = []
    for draft in ("self", "first3", "narrow"):
        for transport, use_async in [(t, False) for t in usable_transports()] + [("tcp", True)]:
            slow = draft == "narrow" and (use_async or transport not in ("tcp", "shm"))
            cases.append(pytest.param(draft, transport, use_async, id=f"{transport}-{use_async}-{draft}",
                                      marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize("draft,transport,use_async", _disagg_cases())
def test_disagg_equals_colocated(greedy_reference, draft_cases, draft, transport, use_async):
    directory, colocated_tokens, colocated_counts = draft_cases[draft]
    cfg = engine_config(MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=512, prefill_chunk_size=16,
                        spec_method="draft_model", draft_model=directory, num_spec_tokens=3,
                        async_scheduling=use_async)
    run = run_on_pair(cfg, TransferConfig(transport=transport, secret="s3cret"), PROMPTS, GREEDY, NUM_BLOCKS)
    assert run.tokens == greedy_reference == colocated_tokens
    for stats in run.stats:
        assert stats["num_free_blocks"] == NUM_BLOCKS
    with run.events.lock:  # the decode worker's counts ride on its Tokens events (S1: after acceptance)
        last = {e.request_id: e for e in run.events.items if isinstance(e, Tokens)}
    counts = [(last[rid].num_draft_tokens, last[rid].num_accepted_tokens) for rid in run.request_ids]
    if not use_async:  # the decode worker drafts from the transferred draft KV exactly as colocated does
        assert counts == colocated_counts
    if draft == "self":
        assert all(a == d > 0 for d, a in counts), counts
    # Every byte accounted for: the target's layers (full blocks layer by layer, then the tail block, or the last
    # full block again) and the draft's layers of every prompt block, sent from post_forward (S2).
    spec = run.prefill_engine.kv_spec
    bs, per_layer_block = spec.block_size, spec.bytes_per_block // spec.num_layers
    expected = 0
    for n in (len(p) for p in PROMPTS):
        full, blocks = n // bs, -(-n // bs)
        target = (full + blocks - min(full, blocks - 1)) * (spec.num_layers - spec.num_draft_layers)
        expected += (target + blocks * spec.num_draft_layers) * per_layer_block
    assert run.stats[0]["bytes_sent"] == expected


# ---- what cannot draft ----------------------------------------------------------------------------------
def _copy(src, dst, edit_config=None, edit_tokenizer=None):
    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    if edit_tokenizer:
        tok = json.loads((dst / "tokenizer.json").read_text())
        edit_tokenizer(tok)
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return str(dst)


def _swap_two_tokens(tok):
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]


def test_what_cannot_draft_is_refused_naming_what_differs(tmp_path, first3, smollm2_dir):
    def refused(why, **cfg):
        with pytest.raises(ConfigError, match=why):
            make_engine(cfg.pop("model", MODEL), spec_method="draft_model", num_spec_tokens=2, num_kv_blocks=32, **cfg)

    refused(r"its KV is 3 heads x 64 a token, the target's 2 x 32: a draft keeps its KV in the target's paged cache, "
            r"which holds no more than the target's KV of a token a layer", draft_model=str(smollm2_dir))
    refused(r"its tokenizer differs from the target's \(token '(hello|world)' is id \d+ in the draft's, \d+ in the ",
            draft_model=_copy(resolve_model(first3), tmp_path / "tok", edit_tokenizer=_swap_two_tokens))
    wide = _copy(resolve_model(first3), tmp_path / "wide", edit_config=lambda c: c.update(vocab_size=50000))
    refused(r"its vocabulary \(50000\) is larger than the target's \(49152\)", draft_model=wide)
    refused(r"only attention-only causal LMs \(Llama-family\) draft; this one is HybridArch", draft_model="tiny-hybrid")
    refused(r"a hybrid \(Mamba\) target", model="tiny-hybrid", draft_model=first3)
    refused(r"unknown model", draft_model=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="spec_method 'draft_model' drafts with a separate model: name it"):
        EngineConfig(model=MODEL, spec_method="draft_model", num_spec_tokens=2)
    with pytest.raises(ConfigError, match="draft_model: .* given but spec_method is 'mtp'"):
        EngineConfig(model=MODEL, spec_method="mtp", num_spec_tokens=2, draft_model=first3)
    with pytest.raises(ConfigError, match="a draft model on a tensor-parallel split is not supported"):
        make_engine(MODEL, spec_method="draft_model", draft_model=first3, num_spec_tokens=2,
                    tensor_parallel_size=2, num_kv_blocks=32)


# ---- the CLI ---------------------------------------------------------------------------------------------
def test_cli_flags_and_vllms_json(first3):
    import argparse

    from pdcluster.cluster.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = engine_config_from_args(parser.parse_args(["--spec", "draft_model", "--draft-model", first3]))
    assert (flags.spec_method, flags.draft_model, flags.num_spec_tokens) == ("draft_model", first3, 3)
    for spec in ({"method": "draft_model", "model": first3, "num_speculative_tokens": 5},
                 {"model": first3, "num_speculative_tokens": 5}):  # vLLM's rule: a model alone is a draft model
        config = engine_config_from_args(parser.parse_args(["--speculative-config", json.dumps(spec)]))
        assert (config.spec_method, config.draft_model, config.mtp_checkpoint, config.num_spec_tokens) == \
            ("draft_model", first3, "", 5)

    run = subprocess.run([sys.executable, "-m", "pdcluster.cli.main", "generate", "--model", MODEL, "--prompt",
                          "one two three one two three", "--max-tokens", "12", "--temperature", "0",
                          "--speculative-config", json.dumps({"model": MODEL, "num_speculative_tokens": 3}),
                          "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 12 and out["num_accepted_tokens"] == out["num_draft_tokens"] > 0
    bad = subprocess.run([sys.executable, "-m", "pdcluster.cli.main", "generate", "--model", MODEL, "--prompt", "hi",
                          "--spec", "draft_model", "--draft-model", "smollm2"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "its KV is 3 heads x 64 a token, the target's 2 x 32" in bad.stderr


@pytest.mark.parametrize("mode", ["local", "colocated"])
def test_serve_refuses_a_draft_that_cannot_draft_in_one_line_before_any_worker(tiny_dir, mode):
    run = subprocess.run([sys.executable, "-m", "pdcluster.cli", "serve", "--port", "0", "--mode", mode, "--model",
                          MODEL, "--spec", "draft_model", "--draft-model", "smollm2"], capture_output=True, text=True,
                         timeout=300)
    lines = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "its KV is 3 heads x 64 a token, the target's 2 x 32" in lines[0]
