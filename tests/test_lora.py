"""Multi-LoRA serving (engine/lora/): adapters in PEFT's format, made here by peft on the tiny-random model.

- float32: an adapter request's greedy tokens equal peft's (transformers with the adapter) and the base
  model's equal transformers' alone, in one batch with both adapters;
- deterministic bf16 (the CPU default): every request of a batch that mixes two adapters and the base model,
  prefills and decodes, is bit for bit what it is alone; speculative verification with adapters is lossless;
- the prefix cache never hands one adapter's KV to another (or to the base model), and does to the same;
- adapters we cannot run are refused when they load, with the reason; an unknown adapter name is refused;
- served: the OpenAI ``model`` field picks the adapter (real HTTP server, real ``openai`` client), /v1/models
  lists them, another name is a 404; disaggregated over Ray, an adapter request equals the engine's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import OracleProposer, engine_config, make_engine, settled_worker_stats
from pdcluster.engine.config import ConfigError
from pdcluster.engine.llm_engine import InvalidRequestError
from pdcluster.engine.lora import LoraAdapterError
from pdcluster.engine.sampling_params import SamplingParams

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MODEL = "tiny-random"
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 99, 3, 250, 11, 42, 7], [1000 + 7 * i for i in range(37)], [321, 654, 987]]
NUM_TOKENS = 12


def _hf(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """{name: directory}: "a1" on all seven projections (r 8), "a2" on q and v only (r 4, rsLoRA); both
    with random B (peft's init_lora_weights=False), so that they change the output."""
    root = tmp_path_factory.mktemp("lora")
    configs = {"a1": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
               "a2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True)}
    out = {}
    for i, (name, kw) in enumerate(configs.items()):
        torch.manual_seed(i)
        model = peft.get_peft_model(_hf(tiny_dir), peft.LoraConfig(init_lora_weights=False, **kw))
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _modules(adapters) -> tuple[str, ...]:
    return tuple(f"{name}={path}" for name, path in adapters.items())


@pytest.fixture(scope="module")
def references(tiny_dir, adapters) -> dict:
    """{(adapter name or None, prompt index): greedy tokens} from transformers (+ peft), float32."""
    refs = {}
    for name in (None, *adapters):
        model = _hf(tiny_dir)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name]).eval()
        for i, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                     min_new_tokens=NUM_TOKENS)
            refs[(name, i)] = ids[0, len(prompt):].tolist()
    return refs


def _params(name, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, lora_name=name, **kw)


@pytest.mark.parametrize("way", ["grouped", "stacked"])
def test_adapters_match_peft_in_one_batch_float32(adapters, references, way, monkeypatch):
    """Both ways of running the updates (engine/lora/layers.py): the C kernel's (CPU) and every adapter's
    stacked matmuls with each token's own columns kept (what CUDA runs; here with the C kernel made
    unavailable)."""
    from pdcluster.engine.lora import layers

    if way == "stacked":
        monkeypatch.setattr(layers.cpu_lora, "available", lambda: False)
    engine = make_engine(MODEL, dtype="float32", lora_modules=_modules(adapters))
    wrapped = engine.model.layers[0].qkv_proj
    assert (wrapped.grouped is not None) == (way == "grouped") and (wrapped.stacked is not None) == (way == "stacked")
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in (None, "a1", "a2")]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(name) for name, _ in jobs])
    for (name, i), out in zip(jobs, outs):
        assert out.token_ids == references[(name, i)], (name, i)
    # The adapters change what the model says (else the equalities above prove nothing).
    for i in range(len(PROMPTS)):
        assert references[("a1", i)] != references[(None, i)] and references[("a2", i)] != references[(None, i)]


def _stacked_engine(monkeypatch, **kw):
    """An engine whose updates run the stacked way (CUDA's; the C kernel made unavailable), decode steps through
    the emulated CUDA graphs."""
    from pdcluster.engine.lora import layers

    monkeypatch.setattr(layers.cpu_lora, "available", lambda: False)
    engine = make_engine(MODEL, max_num_seqs=12, **kw)
    engine.runner.use_decode_graphs(emulate=True)
    assert engine.runner.graphs.lora is engine.model.lora
    return engine


@pytest.mark.parametrize("deterministic", [False, True])
def test_decode_steps_with_adapter_rows_replay_through_the_graphs(adapters, references, monkeypatch, deterministic):
    """The stacked updates inside the CUDA graphs (emulated): each token's adapter slot is a static buffer, so
    decode steps with a1, a2 and base rows replay (padded rows past the batch take no adapter) and every
    request gets peft's tokens; steps with prefill rows run eagerly beside them."""
    engine = _stacked_engine(monkeypatch, dtype="float32", deterministic=deterministic,
                             lora_modules=_modules(adapters))
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a1", None, "a2")]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(name) for name, _ in jobs])
    assert [o.token_ids for o in outs] == [references[job] for job in jobs]
    assert engine.runner.graphs.num_replays >= NUM_TOKENS - 2


def test_graphs_are_captured_again_when_an_adapter_comes(adapters, references, monkeypatch):
    """An adapter loaded while serving changes the stacked updates the graphs were captured over: the buckets
    are captured again (on a GPU the old graphs would read the old, freed updates), and the new adapter's
    requests replay with their own tokens."""
    engine = _stacked_engine(monkeypatch, dtype="float32", enable_lora=True)
    graphs = engine.runner.graphs
    first = engine.generate([PROMPTS[0]] * 2, [_params(None), _params(None)])
    assert [o.token_ids for o in first] == [references[(None, 0)]] * 2
    captures = graphs.num_captures
    assert captures > 0
    engine.load_lora("a1", adapters["a1"])
    replays = graphs.num_replays
    outs = engine.generate([PROMPTS[0], PROMPTS[2]], [_params("a1"), _params(None)])
    assert [o.token_ids for o in outs] == [references[("a1", 0)], references[(None, 2)]]
    assert graphs.num_captures > captures and graphs.num_replays > replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapter_rows_in_real_cuda_graphs_match_peft(adapters, references):
    """On a GPU (fp32): decode steps with adapter rows replay through captured graphs with peft's tokens."""
    engine = make_engine(MODEL, device="cuda", dtype="float32", lora_modules=_modules(adapters))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.lora is engine.model.lora
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a1", None, "a2")]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(name) for name, _ in jobs])
    assert [o.token_ids for o in outs] == [references[job] for job in jobs]
    assert graphs.num_replays > 0


@pytest.mark.parametrize("variant", ["chunked+preemption", "async_scheduling"])
def test_adapters_through_preemption_and_async_scheduling(adapters, references, variant):
    """A pool too small for the batch (requests preempted and recomputed, with their adapter) and chunked
    prefills; async scheduling (steps launched ahead, CUDA's default): every request still gets peft's tokens."""
    kw = (dict(num_kv_blocks=8, prefill_chunk_size=7, max_num_batched_tokens=32) if variant == "chunked+preemption"
          else dict(async_scheduling=True))
    engine = make_engine(MODEL, dtype="float32", lora_modules=_modules(adapters), **kw)
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a1", None, "a2")]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(name) for name, _ in jobs])
    assert [o.token_ids for o in outs] == [references[job] for job in jobs]
    if variant == "chunked+preemption":
        assert engine.scheduler.num_preemptions_total > 0
    else:
        assert engine.num_steps_launched_ahead > 0


def test_nemotron_h_adapter_matches_peft(tmp_path):
    """A NemotronH (the built-in tiny-hybrid: Mamba, attention and MLP layers) with an adapter on every kind of
    projection peft makes for it (attention q/k/v/o, MLP up/down, Mamba in_proj; peft refuses a Mamba model's
    out_proj): peft's greedy (full forwards, as
    tests/test_hybrid_model.py's oracle) in one batch with base requests, fp32, chunked prefill."""
    from pdcluster.engine.models.registry import resolve_model

    model_dir = resolve_model("tiny-hybrid", progress=False)
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"]
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules,
                                                    init_lora_weights=False)).eval()
    model.save_pretrained(tmp_path / "h1")
    saved = load_file(str(tmp_path / "h1" / "adapter_model.safetensors"))
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in saved} == set(modules)

    def greedy(prompt: list[int]) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NUM_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    want_lora = [greedy(p) for p in PROMPTS]
    with model.disable_adapter():
        want_base = [greedy(p) for p in PROMPTS]
    assert want_lora != want_base
    engine = make_engine("tiny-hybrid", dtype="float32", prefill_chunk_size=16,
                         lora_modules=(f"h1={tmp_path / 'h1'}",))
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("h1", None)]
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(name) for name, _ in jobs])
    assert [o.token_ids for o in outs] == [(want_lora if name else want_base)[i] for name, i in jobs]


def _run_alone_and_together(engine, jobs):
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in jobs]
    together = [o.token_ids for o in engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])]
    return alone, together


@pytest.mark.parametrize("way", ["grouped", "stacked"])
def test_mixed_batch_is_bitwise_each_request_alone_bf16(adapters, way, monkeypatch):
    """Deterministic bf16, prefix caching off (every run computes every token): a batch of base, a1 and a2
    requests, chunked prefills beside decodes, gives each request exactly its tokens alone. A row that got
    another row's adapter, or none, would differ (the rows are found by the step's token offsets)."""
    from pdcluster.engine.lora import layers

    if way == "stacked":
        monkeypatch.setattr(layers.cpu_lora, "available", lambda: False)
    engine = make_engine(MODEL, dtype="bfloat16", deterministic=True, enable_prefix_caching=False,
                         prefill_chunk_size=16, lora_modules=_modules(adapters))
    jobs = [(PROMPTS[i % 3], _params(name)) for i, name in enumerate(["a1", None, "a2", "a1", "a2", None, "a1"])]
    alone, together = _run_alone_and_together(engine, jobs)
    assert together == alone
    by_adapter = {sp.lora_name: toks for (p, sp), toks in zip(jobs, alone) if p is PROMPTS[0]}
    assert len(set(map(tuple, by_adapter.values()))) == len(by_adapter), "an adapter changed nothing"


def test_speculative_verification_with_adapters_is_lossless(adapters):
    """Verification steps (1 + k tokens a row) with adapter rows: drafts that are the right tokens with some
    corrupted (conftest's OracleProposer) leave every request's tokens as without speculation, bit for bit,
    with a1, a2 and base requests verified in one batch."""
    modules = _modules(adapters)
    plain = make_engine(MODEL, dtype="bfloat16", deterministic=True, lora_modules=modules)
    spec = make_engine(MODEL, dtype="bfloat16", deterministic=True, lora_modules=modules,
                       spec_method="ngram", num_spec_tokens=3)
    jobs = [(PROMPTS[i], SamplingParams(max_tokens=24, ignore_eos=True, lora_name=name))
            for i, name in enumerate(["a1", "a2", None])]
    want = [plain.generate([p], [sp])[0] for p, sp in jobs]
    spec.runner.proposer = OracleProposer(spec.runner.proposer, [o.prompt_token_ids + o.token_ids for o in want],
                                          corrupt=0.3)
    got = spec.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(0 < o.num_accepted_tokens < o.num_draft_tokens for o in got)


def test_prefix_cache_is_keyed_by_adapter(adapters, references):
    """Float32 with prefix caching: a prompt's blocks cached under a1 serve a1 again, and neither a2 nor the
    base model, whose answers stay their own."""
    engine = make_engine(MODEL, dtype="float32", lora_modules=_modules(adapters))
    prompt = PROMPTS[1]  # 37 tokens: two full blocks of 16 can be reused
    first = engine.generate([prompt], [_params("a1")])[0]
    again = engine.generate([prompt], [_params("a1")])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert again.token_ids == first.token_ids == references[("a1", 1)]
    for name in ("a2", None):
        out = engine.generate([prompt], [_params(name)])[0]
        assert out.num_cached_tokens == 0, f"{name} was given a1's KV"
        assert out.token_ids == references[(name, 1)]


def test_unknown_adapter_name_is_refused(adapters):
    engine = make_engine(MODEL, lora_modules=_modules(adapters))
    with pytest.raises(InvalidRequestError, match=r"no LoRA adapter 'a3' is loaded; loaded: a1, a2"):
        engine.add_request([1, 2, 3], _params("a3"))
    bare = make_engine(MODEL)
    with pytest.raises(InvalidRequestError, match="--lora-modules"):
        bare.add_request([1, 2, 3], _params("a1"))
    assert not engine.has_unfinished() and not bare.has_unfinished()


def test_an_adapter_changed_under_its_name_is_another_fingerprint(adapters, tmp_path):
    """Workers compare the model fingerprint before they exchange KV (kv_transfer/protocol.py check_compatible),
    and the disk tier keeps its blocks under a namespace: both cover each adapter's content, so a prefill and a
    decode worker with different files under one name do not pair, and KV kept on disk is not read back after
    the adapter changed."""
    from pdcluster.engine.kv_offload.events import layout_namespace
    from pdcluster.node.endpoint import endpoint_config
    from pdcluster.kv_transfer.config import TransferConfig

    class NoTransport:
        def local_descriptor(self):
            return {}

    def identity(path: str) -> tuple[str, str]:
        loaded = _load(path)
        fp = endpoint_config("w", loaded, TransferConfig(), NoTransport()).model_fingerprint
        return fp, layout_namespace(str(loaded.model_dir), loaded.dtype_name, loaded.kv_cache,
                                    loaded.model.kv_fingerprint)

    same = _copy(adapters["a1"], tmp_path / "same")
    doubled = lambda w: {**w, _first(w, "v_proj.lora_B.weight"): w[_first(w, "v_proj.lora_B.weight")] * 2}  # noqa: E731
    changed = _copy(adapters["a1"], tmp_path / "changed", tensors=doubled)
    first = identity(adapters["a1"])
    assert identity(same) == first
    changed_fp, changed_ns = identity(changed)
    assert changed_fp != first[0] and changed_ns != first[1]


# ------------------------------------------------------------------------------ refused adapters


def _copy(src: str, dst: Path, config: dict | None = None, tensors=None) -> str:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        weights = load_file(str(dst / "adapter_model.safetensors"))
        save_file(tensors(weights), str(dst / "adapter_model.safetensors"))
    return str(dst)


def _first(weights: dict, suffix: str) -> str:
    return next(k for k in sorted(weights) if k.endswith(suffix))


def _hidden(weights: dict) -> int:
    return weights[_first(weights, "q_proj.lora_A.weight")].shape[1]


def _load(path: str, **kw):
    from pdcluster.engine.loaded_model import LoadedModel

    return LoadedModel.load(engine_config(kw.pop("model", MODEL), lora_modules=(f"x={path}",), **kw), progress=False)


def _with_layer_99(w: dict) -> dict:
    key = "base_model.model.model.layers.99.self_attn.q_proj.lora_{}.weight"
    return {**w, key.format("A"): torch.zeros(8, _hidden(w)), key.format("B"): torch.zeros(_hidden(w), 8)}


BAD = {
    "dora": (dict(config={"use_dora": True}), "DoRA"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "bias": (dict(config={"bias": "lora_only"}), "bias='lora_only'"),
    "alpha_pattern": (dict(config={"alpha_pattern": {"q_proj": "three"}}), "alpha_pattern .* is not a mapping"),
    "lm_head": (dict(tensors=lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, _hidden(w))}),
                "'base_model.model.lm_head.lora_A.weight' is not a LoRA A/B weight"),
    "unpaired": (dict(tensors=lambda w: {k: v for k, v in w.items() if k != _first(w, "q_proj.lora_B.weight")}),
                 "q_proj: has lora_A without its pair"),
    "shape": (dict(tensors=lambda w: {**w, _first(w, "o_proj.lora_A.weight"): torch.zeros(8, 7)}),
              r"o_proj: lora_A \(8, 7\) / lora_B .* do not fit"),
    "layer": (dict(tensors=_with_layer_99), "layer 99 but the base model has"),
}


def test_rank_and_alpha_patterns_match_peft(tiny_dir, tmp_path):
    """PEFT's rank_pattern and alpha_pattern (a module's own r and lora_alpha, by name or by regular expression):
    peft's greedy tokens in fp32."""
    torch.manual_seed(5)
    config = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=ALL_MODULES,
                             rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 64, r".*\.0\.mlp\.down_proj": 1})
    model = peft.get_peft_model(_hf(tiny_dir), config).eval()
    model.save_pretrained(tmp_path / "p")
    engine = make_engine(MODEL, dtype="float32", lora_modules=(f"p={tmp_path / 'p'}",))
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                  min_new_tokens=NUM_TOKENS)[0, len(prompt):].tolist()
        assert engine.generate([prompt], [_params("p")])[0].token_ids == want
    adapter = engine.model.lora.adapters[0]
    assert adapter.modules[(0, "q_proj")].rank == 2 and adapter.modules[(0, "v_proj")].scale == 64 / 8
    assert adapter.modules[(0, "down_proj")].scale == 1 / 8 and adapter.modules[(1, "down_proj")].scale == 16 / 8


@pytest.mark.parametrize("case", sorted(BAD))
def test_adapters_we_cannot_run_are_refused_with_the_reason(adapters, tmp_path, case):
    kw, message = BAD[case]
    path = _copy(adapters["a1"], tmp_path / case, **kw)
    with pytest.raises(LoraAdapterError, match=message):
        _load(path)


def test_rank_limit_missing_files_and_other_models_are_refused(adapters, tmp_path):
    with pytest.raises(LoraAdapterError, match="rank 8 exceeds max_lora_rank 4"):
        _load(adapters["a1"], max_lora_rank=4)
    with pytest.raises(LoraAdapterError, match="no such directory"):
        _load(str(tmp_path / "nowhere"))
    (tmp_path / "bin").mkdir()
    shutil.copy(Path(adapters["a1"]) / "adapter_config.json", tmp_path / "bin")
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(LoraAdapterError, match="safe_serialization=True"):
        _load(str(tmp_path / "bin"))
    # tiny-random's adapter on tiny-hybrid: its layer 0 is a Mamba layer, which has no q/k/v/o, gate/up/down.
    with pytest.raises(LoraAdapterError, match=r"layer 0 \w+_proj: this layer has no such projection"):
        _load(adapters["a1"], model="tiny-hybrid")
    for bad in (("a1",), ("=x",), ("a=x", "a=y")):
        with pytest.raises(ConfigError, match="lora_modules"):
            engine_config(MODEL, lora_modules=bad)


# ------------------------------------------------------------------------------ the CLI


@pytest.mark.timeout(300)
def test_generate_cli_with_an_adapter(adapters):
    """``pdcluster generate --lora-modules NAME=PATH --lora NAME`` (a real subprocess): the engine's tokens with
    that adapter; an unknown adapter or a malformed --lora-modules is one line and exit status 2."""
    import os
    import subprocess
    import sys

    def run(*args):
        cmd = [sys.executable, "-m", "pdcluster.cli", "generate", "--model", MODEL, "--dtype", "float32",
               "--num-kv-blocks", "64", "--prompt", "The capital of France is", "--max-tokens", str(NUM_TOKENS),
               "--ignore-eos", "--json", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=os.environ.copy())

    r = run("--lora-modules", *_modules(adapters), "--lora", "a2")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    engine = make_engine(MODEL, dtype="float32", lora_modules=_modules(adapters))
    prompt = engine.tokenize("The capital of France is")
    with_adapter, base = (engine.generate([prompt], [_params(name)])[0].token_ids for name in ("a2", None))
    assert got == with_adapter != base
    for args, message in ((("--lora-modules", *_modules(adapters), "--lora", "a9"), "no LoRA adapter 'a9'"),
                          (("--lora-modules", "a1"), "'a1' is not of the form name=path")):
        r = run(*args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr)


# ------------------------------------------------------------------------------ served


def test_openai_model_field_picks_the_adapter(adapters, references):
    import httpx
    import openai

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    router = LocalRouter(engine_config(MODEL, dtype="float32", lora_modules=_modules(adapters)), request_timeout_s=30)
    tokenizer = router.tokenizer
    try:
        with serving(build_app(router, MODEL)) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            for name in (MODEL, "a1", "a2"):
                resp = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=NUM_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True})
                want = references[(None if name == MODEL else name, 0)]
                assert resp.model == name
                assert resp.choices[0].text == tokenizer.decode(want)
                assert resp.usage.completion_tokens == NUM_TOKENS
            # Per-adapter counters on /metrics: one request of NUM_TOKENS tokens each.
            metrics = httpx.get(base_url + "/metrics").text
            for name in ("a1", "a2"):
                assert f'pdcluster:lora_requests_total{{lora_name="{name}",model_name="{MODEL}"}} 1.0' in metrics
                assert (f'pdcluster:lora_generation_tokens_total{{lora_name="{name}",model_name="{MODEL}"}} '
                        f'{float(NUM_TOKENS)}') in metrics
            assert f'lora_name="{MODEL}"' not in metrics
            # Chat and the Responses API pick the adapter the same way (the same conversation, the same answer).
            chat = {name: client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=8, temperature=0) for name in (MODEL, "a1")}
            response = client.responses.create(model="a1", input="Hi", max_output_tokens=8, temperature=0)
            assert chat["a1"].model == response.model == "a1"
            answer = {name: c.choices[0].message.content for name, c in chat.items()}
            assert response.output_text == answer["a1"] != answer[MODEL]
            cards = {m.id: m for m in client.models.list().data}
            assert list(cards) == [MODEL, "a1", "a2"]
            assert cards["a1"].parent == MODEL and cards[MODEL].parent is None
            assert client.models.retrieve("a2").parent == MODEL
            with pytest.raises(openai.NotFoundError, match="'a1', 'a2'"):
                client.completions.create(model="a3", prompt=PROMPTS[0], max_tokens=2)
            with pytest.raises(openai.NotFoundError):
                client.models.retrieve("a3")
    finally:
        router.close()


def test_embeddings_with_an_adapter_match_peft(adapters, tiny_dir):
    """/v1/embeddings with ``model`` naming an adapter: the vector is peft's final hidden state (last token,
    normalised), not the base model's."""
    import httpx

    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving

    router = LocalRouter(engine_config(MODEL, dtype="float32", lora_modules=_modules(adapters)), request_timeout_s=30)
    try:
        with serving(build_app(router, MODEL)) as base_url:
            for name in (MODEL, "a1", "a2"):
                r = httpx.post(base_url + "/v1/embeddings", json={"model": name, "input": PROMPTS[1]}, timeout=60)
                assert r.status_code == 200 and r.json()["model"] == name, r.text
                got = torch.tensor(r.json()["data"][0]["embedding"])
                model = _hf(tiny_dir)
                if name != MODEL:
                    model = peft.PeftModel.from_pretrained(model, adapters[name]).eval().base_model.model
                with torch.no_grad():
                    hidden = model.model(torch.tensor([PROMPTS[1]])).last_hidden_state[0, -1]
                want = torch.nn.functional.normalize(hidden, dim=0)
                assert (got - want).abs().max() < 2e-5, name
                base = want if name == MODEL else base
                if name != MODEL:
                    assert (want - base).abs().max() > 1e-3  # the adapter changes the vector
        stats = router.worker.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        router.close()


def test_api_processes_learn_the_adapters_and_route_them(adapters, references):
    """Behind ``--api-servers N`` each API process learns the adapter names in its handshake (Welcome) and
    its requests carry the adapter to the router process (RouterService over real zmq ipc)."""
    from pdcluster.cluster.local_router import LocalRouter
    from test_api_servers import _tokens, with_one_api_process

    router = LocalRouter(engine_config(MODEL, dtype="float32", lora_modules=_modules(adapters)), request_timeout_s=30)

    async def body(remote):
        assert remote.lora_names == ("a1", "a2")
        for name in ("a2", None):
            tokens, _ = await _tokens(remote.generate(f"r-{name}", PROMPTS[2], _params(name)))
            assert tokens == references[(name, 2)], name

    with_one_api_process(router, body)


@pytest.mark.timeout(300)
def test_disagg_over_ray_equals_the_engine(ray_session, adapters, references):
    """Prefill and decode workers both load the adapters; the prompt's KV made with a1 on the prefill worker
    is decoded with a1 on the decode worker, beside a2 and base requests in flight."""
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    cluster = Cluster(ClusterSpec(engine=engine_config(MODEL, dtype="float32", lora_modules=_modules(adapters)),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg"))
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a1", None, "a2")]

    async def main():
        router = cluster.router
        router.start(asyncio.get_running_loop())
        assert router.lora_names == ("a1", "a2")

        async def one(k, name, i):
            tokens = []
            async for delta in router.generate(f"lora-{k}", PROMPTS[i], _params(name)):
                tokens += delta.new_token_ids
            return tokens

        return await asyncio.gather(*[one(k, name, i) for k, (name, i) in enumerate(jobs)])

    try:
        for (name, i), tokens in zip(jobs, asyncio.run(main())):
            assert tokens == references[(name, i)], (name, i)
        for wid, st in settled_worker_stats(cluster).items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
    finally:
        cluster.shutdown()
