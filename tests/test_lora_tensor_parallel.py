"""LoRA adapters on a model split over ranks (engine/tensor_parallel/shard_lora.py): every rank holds its slice of each
adapter (B's rows where the ranks split a projection's outputs, A's columns where they split its inputs), the step's
adapter rows reach every rank with its forward, and adapters loaded while serving reach every rank in the same slot.

- float32: a batch mixing two adapters and the base model on two ranks gives peft's tokens (tiny-random: q/k/v, o,
  gate/up, down; rsLoRA); a NemotronH hybrid's adapter on q/k/v/o, up/down and the Mamba in_proj (cut z | x | B | C |
  dt) on two ranks equals the unsplit engine's;
- adapters loaded and unloaded while a split engine serves (and behind the runtime HTTP routes, with async
  scheduling): peft's tokens, the freed slot taken again on every rank;
- split prefill and decode workers with adapters (tcp between rank pairs): peft's tokens;
- an adapter that fits only a rank's slice of the model is refused with the whole model's shapes, before any rank is
  left running; a rank refuses start-up adapters whose files changed after rank 0 read them.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine
from pdcluster.engine.lora import LoraAdapterError
from pdcluster.engine.lora.layers import LoraLinear
from test_lora import MODEL, PROMPTS, _copy, _first, _modules, _params, adapters, references  # noqa: F401
from test_tensor_parallel import _children

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread_per_module")]


def _generate(engine, jobs) -> list[list[int]]:
    outs = engine.generate([PROMPTS[i] for _, i in jobs], [_params(name) for name, _ in jobs])
    return [o.token_ids for o in outs]


def test_two_adapters_and_the_base_model_on_two_ranks_match_peft_in_one_batch(adapters, references):
    engine = make_engine(MODEL, dtype="float32", tensor_parallel_size=2, lora_modules=_modules(adapters))
    try:
        a = engine.model.arch  # rank 0's: half the heads, half the MLP
        a1 = engine.model.lora.adapters[engine.model.lora.index["a1"]]
        # Rank 0 holds its slice: q's B rows of its heads, o_proj's A columns of its heads, down's A of its MLP half.
        assert a1.modules[(0, "q_proj")].b.shape[0] == a.num_heads * a.head_dim
        assert a1.modules[(0, "o_proj")].a.shape[1] == a.num_heads * a.head_dim
        assert a1.modules[(0, "down_proj")].a.shape[1] == a.intermediate_size
        assert isinstance(engine.model.layers[0].o_proj.linear, LoraLinear)  # inside the all-reduce, not after it
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in (None, "a1", "a2")]
        assert _generate(engine, jobs) == [references[job] for job in jobs]
        assert all(p.is_alive() for p in engine.model.tp_driver.processes)
    finally:
        engine.close()


def test_adapters_loaded_and_unloaded_while_a_split_engine_serves(adapters, references):
    """Loads reach every rank as the bytes rank 0 read; an unloaded adapter's slot is emptied on every rank, and the
    next load takes it everywhere (a rank whose free slot differed would stop the engine with the two slots named)."""
    engine = make_engine(MODEL, dtype="float32", tensor_parallel_size=2, enable_lora=True)
    try:
        engine.load_lora("a1", adapters["a1"])
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a1", None)]
        assert _generate(engine, jobs) == [references[job] for job in jobs]
        engine.load_lora("a2", adapters["a2"])
        engine.unload_lora("a1")
        engine.load_lora("again", adapters["a2"])  # a1's emptied slot, on every rank
        assert engine.model.lora.index == {"again": 0, "a2": 1}
        outs = _generate(engine, [("again", i) for i in range(len(PROMPTS))] + [("a2", 0)])
        assert outs == [references[("a2", i)] for i in range(len(PROMPTS))] + [references[("a2", 0)]]
        assert all(p.is_alive() for p in engine.model.tp_driver.processes)
    finally:
        engine.close()


def test_a_hybrids_adapter_on_two_ranks_equals_the_whole_model(tmp_path):
    """tiny-hybrid (Mamba, attention and MLP layers), an adapter on every projection peft adapts in it; chunked prefill
    beside base requests. tests/test_lora.py checks the whole engine against peft."""
    from pdcluster.engine.models.registry import resolve_model

    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny-hybrid", progress=False),
                                                           dtype=torch.float32).eval()
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"]
    peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules,
                                            init_lora_weights=False)).save_pretrained(tmp_path / "h1")
    kw = dict(dtype="float32", prefill_chunk_size=16, lora_modules=(f"h1={tmp_path / 'h1'}",))
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("h1", None)]
    whole = make_engine("tiny-hybrid", **kw)
    try:
        want = _generate(whole, jobs)
    finally:
        whole.close()
    assert want[0] != want[1]  # the adapter changes what the model says
    split = make_engine("tiny-hybrid", tensor_parallel_size=2, **kw)
    try:
        assert _generate(split, jobs) == want
    finally:
        split.close()


def _half_rows(suffix: str):
    def cut(weights: dict) -> dict:
        key = _first(weights, suffix)
        return {**weights, key: weights[key][: weights[key].shape[0] // 2].contiguous()}
    return cut


def test_an_adapter_for_a_ranks_slice_is_refused_with_the_whole_models_shapes(adapters, tmp_path):
    """q_proj's B with half its rows fits a rank's q slice, not the model: refused, naming the whole projection, as an
    unsplit engine refuses it, and no rank is left running."""
    path = _copy(adapters["a1"], tmp_path / "half", tensors=_half_rows("q_proj.lora_B.weight"))
    with pytest.raises(LoraAdapterError) as whole:
        make_engine(MODEL, dtype="float32", lora_modules=(f"x={path}",))
    children = set(_children())
    with pytest.raises(LoraAdapterError) as split:
        make_engine(MODEL, dtype="float32", tensor_parallel_size=2, lora_modules=(f"x={path}",))
    assert "q_proj: lora_A" in str(split.value) and "do not fit the base model's projection" in str(split.value)
    assert str(split.value) == str(whole.value)
    assert set(_children()) <= children


def test_a_rank_refuses_start_up_adapters_whose_files_changed(adapters):
    """Each rank reads the start-up adapters itself: contents other than rank 0's stop it before it serves."""
    from pdcluster.engine.models.architectures import load_model
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tensor_parallel.messages import WorkerSpec
    from pdcluster.engine.tensor_parallel.worker import _install_lora

    model = load_model(resolve_model(MODEL, progress=False), torch.float32, 64)
    spec = WorkerSpec(1, 2, 0, "", "", "float32", 64, 64, "cpu", False, 1, lora_modules={"a1": adapters["a1"]},
                      lora_digests={"a1": "0" * 16}, max_lora_rank=16)
    with pytest.raises(RuntimeError, match="LoRA adapters changed on disk while the ranks read them"):
        _install_lora(model, spec)
    assert model.lora is None


def test_lora_messages_round_trip_and_malformed_ones_are_refused():
    import msgpack
    import numpy as np

    from pdcluster.engine.attention import AttentionMetadata
    from pdcluster.engine.tensor_parallel.messages import AddLora, Forward, RemoveLora, decode, encode

    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(3), torch.zeros(1, 1, **i32), torch.tensor([3], **i32),
                             torch.tensor([0, 3], **i32), None, 0.5, None, 3, np.array([3]))
    rows = (np.array([1, -1], dtype=np.int32), np.array([0, 2, 3], dtype=np.int32))
    got = decode(encode(Forward(torch.arange(3), torch.arange(3), meta, lora_rows=rows)))
    assert all(np.array_equal(g, w) and g.dtype == w.dtype for g, w in zip(got.lora_rows, rows))
    assert decode(encode(Forward(torch.arange(3), torch.arange(3), meta))).lora_rows is None
    add = AddLora(2, "a", "/x", b'{"r": 4}', b"\x00\x01", 16)
    assert decode(encode(add)) == add and decode(encode(RemoveLora(3))) == RemoveLora(3)
    bad = msgpack.unpackb(encode(add), raw=False)
    bad["weights"] = "not bytes"
    with pytest.raises(ValueError, match="malformed rank message"):
        decode(msgpack.packb(bad, use_bin_type=True))


def test_runtime_routes_on_a_split_engine_over_http_while_a_request_streams(adapters, references):
    """vLLM's runtime LoRA routes in front of a split engine with async scheduling (the forwards go to the ranks from
    the runner's thread, the load from the engine's): an adapter loaded while a base request streams gives peft's
    tokens, the streaming request its own, and an unloaded name is a 404 again."""
    import threading

    from conftest import engine_config
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.local_router import LocalRouter
    from test_api import serving
    from test_lora import NUM_TOKENS

    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    config = engine_config(MODEL, dtype="float32", enable_lora=True, tensor_parallel_size=2, async_scheduling=True)
    router = LocalRouter(config, request_timeout_s=60)
    decode = router.tokenizer.decode
    try:
        with serving(build_app(router, MODEL, runtime_lora=True)) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

            def complete(model: str, prompt: int = 0, **kw) -> str:
                return client.completions.create(model=model, prompt=PROMPTS[prompt], temperature=0,
                                                 max_tokens=kw.pop("max_tokens", NUM_TOKENS),
                                                 extra_body={"ignore_eos": True}, **kw).choices[0].text

            streamed: list[str] = []
            stream = threading.Thread(target=lambda: streamed.append(complete(MODEL, 1)))
            stream.start()
            r = httpx.post(f"{base_url}/v1/load_lora_adapter", json=dict(lora_name="a1", lora_path=adapters["a1"]),
                           timeout=60)
            assert r.status_code == 200, r.text
            assert complete("a1", 2) == decode(references[("a1", 2)])
            stream.join(60)
            assert streamed == [decode(references[(None, 1)])]
            r = httpx.post(f"{base_url}/v1/unload_lora_adapter", json=dict(lora_name="a1"), timeout=60)
            assert r.status_code == 200, r.text
            with pytest.raises(openai.NotFoundError):
                complete("a1")
            assert complete(MODEL) == decode(references[(None, 0)])
    finally:
        router.close()


@pytest.mark.timeout(240)
def test_split_disaggregated_workers_with_adapters_match_peft(adapters, references):
    """A prefill and a decode worker, each split over two ranks with both adapters: every rank computes its slice of
    each adapter's update of the prompt (prefill) and of each token (decode), the KV of each rank's heads moves to the
    same rank (tcp), and every request gets peft's tokens."""
    from conftest import engine_config
    from pdcluster.kv_transfer.config import TransferConfig
    from test_kv_transfer_e2e import Events, _through_pair, connected_pair

    cfg = engine_config(MODEL, dtype="float32", tensor_parallel_size=2, lora_modules=_modules(adapters),
                        num_kv_blocks=128, max_model_len=1536, prefill_chunk_size=16)
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("a1", None, "a2")]
    events = Events()
    with connected_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        tokens = _through_pair(p, d, events, [PROMPTS[i] for _, i in jobs], [_params(name) for name, _ in jobs])
    assert tokens == [references[job] for job in jobs]
