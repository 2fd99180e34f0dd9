"""LoRA adapters loaded and unloaded while serving (engine/lora/runtime.py, EngineConfig.enable_lora): the
engine's side. The served routes (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) are tested in
test_lora_runtime_served.py.

- an adapter loaded between steps, beside running requests, gives peft's tokens (float32, both ways of running
  the updates), and a runtime-loaded adapter is bit for bit the start-up one in deterministic bf16;
- an unload refuses new requests at once and lets the running ones finish with the adapter's weights, which go
  only then; the freed slot is taken by the next load;
- an adapter reloaded under its name with other files never gets the old one's cached KV, and a request placed
  with the old content is refused;
- what cannot be loaded is refused with the reason, and the engine serves on.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.llm_engine import InvalidRequestError
from pdcluster.engine.lora import LoraAdapterError
from pdcluster.engine.sampling_params import SamplingParams
from test_lora import MODEL, PROMPTS, _copy, _first, _modules, _params, adapters, references  # noqa: F401


def _runtime_engine(**kw):
    return make_engine(MODEL, dtype="float32", enable_lora=True, **kw)


def _step_until(engine, done, tokens: dict, max_steps: int = 200) -> dict:
    """Step until ``done(tokens)``, adding each step's new tokens to ``tokens`` ({request id: its tokens})."""
    for _ in range(max_steps):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if done(tokens):
            return tokens
    raise AssertionError(f"not done within {max_steps} steps: {tokens}")


def _slots(engine) -> list[str | None]:
    return [a.name if a is not None else None for a in engine.model.lora.adapters]


@pytest.mark.parametrize("way", ["grouped", "stacked"])
def test_adapters_loaded_between_steps_match_peft(adapters, references, way, monkeypatch):  # noqa: F811
    """A base request decodes; a1 is loaded and its request joins the running batch; then a2: every request
    gets peft's tokens, whichever way the updates run."""
    from pdcluster.engine.lora import layers

    if way == "stacked":
        monkeypatch.setattr(layers.cpu_lora, "available", lambda: False)
    engine = _runtime_engine()
    engine.cumulative_outputs = False
    assert engine.lora_names == () and engine.model.layers[0].qkv_proj.slice_updates == {}
    base = engine.add_request(PROMPTS[0], _params(None))
    tokens: dict = {}
    _step_until(engine, lambda t: len(t.get(base, [])) >= 3, tokens)
    digest = engine.load_lora("a1", adapters["a1"])
    assert engine.lora_adapters == {"a1": digest} and len(digest) == 16
    first = engine.add_request(PROMPTS[1], _params("a1"))
    _step_until(engine, lambda t: len(t.get(first, [])) >= 2, tokens)
    engine.load_lora("a2", adapters["a2"])
    second = engine.add_request(PROMPTS[2], _params("a2"))
    third = engine.add_request(PROMPTS[0], _params("a1"))
    _step_until(engine, lambda t: not engine.has_unfinished(), tokens)
    assert tokens[base] == references[(None, 0)]
    assert tokens[first] == references[("a1", 1)]
    assert tokens[second] == references[("a2", 2)]
    assert tokens[third] == references[("a1", 0)]
    assert _slots(engine) == ["a1", "a2"]


def test_runtime_adapter_is_bitwise_the_start_up_one_bf16(adapters):  # noqa: F811
    """Deterministic bf16 (the CPU default): an adapter loaded while serving runs the same kernels on the same
    packed weights as one named at start-up: equal tokens, bit for bit, in a mixed batch."""
    static = make_engine(MODEL, dtype="bfloat16", deterministic=True, lora_modules=_modules(adapters))
    runtime = make_engine(MODEL, dtype="bfloat16", deterministic=True, enable_lora=True)
    runtime.load_lora("a2", adapters["a2"])  # the other order: other slots, same tokens
    runtime.load_lora("a1", adapters["a1"])
    jobs = [(PROMPTS[i], SamplingParams(max_tokens=16, ignore_eos=True, lora_name=name))
            for i, name in enumerate(["a1", "a2", None])]
    want = static.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    got = runtime.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_unload_refuses_new_requests_and_lets_running_ones_finish(adapters, references):  # noqa: F811
    engine = _runtime_engine(num_kv_blocks=64)
    engine.cumulative_outputs = False
    engine.load_lora("a1", adapters["a1"])
    running = engine.add_request(PROMPTS[1], _params("a1"))
    waiting = engine.add_request(PROMPTS[2], _params("a1"))
    tokens: dict = {}
    _step_until(engine, lambda t: len(t.get(running, [])) >= 2, tokens)
    engine.unload_lora("a1")
    assert engine.lora_names == ()
    with pytest.raises(InvalidRequestError, match=r"no LoRA adapter 'a1' is loaded"):
        engine.add_request(PROMPTS[0], _params("a1"))
    assert _slots(engine) == ["a1"], "unloaded while requests still run with it"
    _step_until(engine, lambda t: not engine.has_unfinished(), tokens)
    assert tokens[running] == references[("a1", 1)] and tokens[waiting] == references[("a1", 2)]
    assert _slots(engine) == [None], "the weights outlived the last request that ran with them"
    assert all(layer.slice_updates == {} and layer.grouped is None and layer.stacked is None
               for layer in engine.model.lora.layers)
    # Its slot is the next adapter's; the base model still gives its own tokens.
    engine.load_lora("a2", adapters["a2"])
    assert _slots(engine) == ["a2"]
    outs = engine.generate([PROMPTS[2], PROMPTS[2]], [_params("a2"), _params(None)])
    assert [o.token_ids for o in outs] == [references[("a2", 2)], references[(None, 2)]]
    with pytest.raises(KeyError, match="no LoRA adapter 'a1' is loaded; loaded: a2"):
        engine.unload_lora("a1")


def test_reloaded_under_its_name_with_other_files_is_another_adapter(adapters, references, tmp_path):  # noqa: F811
    """Unload a1 and load other files as "a1": the prefix cache keeps the old content's blocks apart (its block
    hashes start from the content digest), the tokens are the new files' (equal to an engine that started
    with them), and a request placed with the old digest is refused, not run with the new weights."""
    doubled = _copy(adapters["a1"], tmp_path / "doubled", tensors=lambda w: {
        **w, _first(w, "v_proj.lora_B.weight"): w[_first(w, "v_proj.lora_B.weight")] * 2})
    engine = _runtime_engine()
    old = engine.load_lora("a1", adapters["a1"])
    prompt = PROMPTS[1]  # 37 tokens: two full blocks
    engine.generate([prompt], [_params("a1")])
    again = engine.generate([prompt], [_params("a1")])[0]
    assert again.num_cached_tokens == 32 and again.token_ids == references[("a1", 1)]
    engine.unload_lora("a1")
    new = engine.load_lora("a1", doubled)
    assert new != old
    out = engine.generate([prompt], [_params("a1")])[0]
    assert out.num_cached_tokens == 0, "the reloaded adapter was given the old content's KV"
    fresh = make_engine(MODEL, dtype="float32", lora_modules=(f"a1={doubled}",))
    assert out.token_ids == fresh.generate([prompt], [_params("a1")])[0].token_ids != references[("a1", 1)]
    with pytest.raises(InvalidRequestError, match=f"content {new}, not the {old} the request was placed with"):
        engine.add_request(prompt, _params("a1", lora_digest=old))


def test_what_cannot_be_loaded_is_refused_and_the_engine_serves_on(adapters, references, tmp_path):  # noqa: F811
    plain = make_engine(MODEL, dtype="float32", lora_modules=_modules(adapters))
    with pytest.raises(LoraAdapterError, match="only with --enable-lora"):
        plain.load_lora("a3", adapters["a1"])
    engine = _runtime_engine(max_loras=2)
    engine.load_lora("a1", adapters["a1"])
    cases = [
        (("a1", adapters["a2"]), "'a1' is already loaded"),
        (("", adapters["a2"]), "give a non-empty name other than the base model's"),
        ((MODEL, adapters["a2"]), "other than the base model's"),
        (("x", str(tmp_path / "nowhere")), "no such directory"),
        (("x", _copy(adapters["a1"], tmp_path / "dora", config={"use_dora": True})), "DoRA"),
        (("x", _copy(adapters["a1"], tmp_path / "wide", tensors=lambda w: {
            **w, _first(w, "o_proj.lora_A.weight"): torch.zeros(8, 7)})), r"o_proj: lora_A \(8, 7\) .* do not fit"),
    ]
    for (name, path), message in cases:
        with pytest.raises(LoraAdapterError, match=message):
            engine.load_lora(name, path)
    assert engine.lora_names == ("a1",) and _slots(engine) == ["a1"]
    engine.load_lora("a2", adapters["a2"])
    with pytest.raises(LoraAdapterError, match=r"2 adapters are held \(max_loras 2"):
        engine.load_lora("a3", adapters["a1"])
    outs = engine.generate([PROMPTS[0]] * 3, [_params(n) for n in ("a1", "a2", None)])
    assert [o.token_ids for o in outs] == [references[(n, 0)] for n in ("a1", "a2", None)]
