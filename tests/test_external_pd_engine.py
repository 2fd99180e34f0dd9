"""vLLM's external prefill/decode protocol at the engine (wire/external_kv.py, kv_transfer/external/): a prefill
instance keeps a finished prompt's full blocks for one pull, a decode instance pulls them before its first step and
takes them as a prefix hit. Token-exact against computing the prompt, in bf16 (what users run here) and fp32; every
way the pull can fail (expired, wrong token, another model's layout, an unreachable or hostile peer) computes the
prompt instead and still gives the same tokens; every held block goes back exactly once."""

from __future__ import annotations

import json
import random
import socket
import time

import pytest
import torch
import zmq

from conftest import engine_config
from pdcluster.engine.config import ConfigError
from pdcluster.engine.llm_engine import InvalidRequestError, LLMEngine
from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.external.wire import CODEC, Blocks, Pull
from pdcluster.node.external_kv import make_external_connector
from pdcluster.wire.external_kv import ExternalKVError, parse_config, remote_prefill

BLOCK = 16
DO_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _config(**extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra})


class Instance:
    """One engine with the external connector, as a `serve --kv-transfer-config` worker builds it."""

    def __init__(self, name: str, dtype: str = "bfloat16", **kwargs):
        extra = kwargs.pop("extra", {})
        self.loaded = LoadedModel.load(engine_config(dtype=dtype, kv_transfer_config=_config(**extra), **kwargs),
                                       progress=False)
        self.connector = make_external_connector(self.loaded, name)
        self.engine = LLMEngine(self.loaded, self.connector)

    @property
    def num_free_blocks(self) -> int:
        return self.engine.scheduler.block_manager.num_free_blocks

    def prefill_for_remote(self, prompt: list[int]):
        out = self.engine.generate([prompt], SamplingParams(max_tokens=1, kv_transfer_params=dict(DO_REMOTE_DECODE)))
        return out[0]

    def settle(self) -> None:
        """What the worker loop does between steps: the connector's news (ended holds) applied."""
        self.engine.poll_kv()

    def close(self) -> None:
        self.connector.close()


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40000) for _ in range(length)]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def pair(request):
    p, d = Instance("p", request.param), Instance("d", request.param)
    plain = LLMEngine.from_config(engine_config(dtype=request.param))
    yield p, d, plain
    p.close()
    d.close()


@pytest.mark.parametrize("length, seed, sampled", [(37, 1, False), (48, 2, False), (200, 3, False), (90, 4, True)])
def test_decode_from_a_prefill_instance_equals_computing_the_prompt(pair, length, seed, sampled):
    p, d, plain = pair
    prompt = _prompt(seed, length)
    params = SamplingParams(max_tokens=12, temperature=0.8 if sampled else 0.0, seed=7 if sampled else None)
    reference = plain.generate([prompt], params)[0].token_ids
    free_before = p.num_free_blocks
    answer = p.prefill_for_remote(prompt)
    kv = answer.kv_transfer_params
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == p.connector.server.port
    assert len(kv["remote_block_ids"]) == length // BLOCK  # every full prompt block, held
    assert p.num_free_blocks < free_before and len(p.engine.scheduler.held) == 1
    out = d.engine.generate([prompt], SamplingParams(**{**params.__dict__, "kv_transfer_params": kv}))[0]
    assert out.token_ids == reference
    # Pulled, not computed: every usable full block (a hit leaves the prompt's last token to compute).
    assert out.num_cached_tokens == min(length // BLOCK, (length - 1) // BLOCK) * BLOCK
    p.settle()
    assert p.num_free_blocks == free_before and not p.engine.scheduler.held
    assert p.connector.server.num_held == 0


def test_the_decode_instance_runs_on_the_pulled_bytes():
    """D's blocks hold P's bytes, and a poisoned hold changes D's answer: it never recomputed the prompt."""
    p, d = Instance("p"), Instance("d")
    try:
        prompt = _prompt(5, 120)
        reference = LLMEngine.from_config(engine_config(dtype="bfloat16")).generate(
            [prompt], SamplingParams(max_tokens=16))[0].token_ids
        kv = p.prefill_for_remote(prompt).kv_transfer_params
        d.engine.generate([prompt], SamplingParams(max_tokens=2, kv_transfer_params=kv))
        d_cache = d.engine.scheduler.block_manager
        d_blocks = d_cache.find_cached_prefix(_request(prompt))
        assert len(d_blocks) == 7
        for p_block, d_block in zip(kv["remote_block_ids"], d_blocks):
            assert torch.equal(p.loaded.kv_cache[:, :, p_block], d.loaded.kv_cache[:, :, d_block])

        p2, d2 = Instance("p2"), Instance("d2")
        try:
            kv = p2.prefill_for_remote(prompt).kv_transfer_params
            for block in kv["remote_block_ids"]:
                p2.loaded.kv_cache[:, :, block] = 0
            out = d2.engine.generate([prompt], SamplingParams(max_tokens=16, kv_transfer_params=kv))[0]
            assert out.num_cached_tokens == 7 * BLOCK and out.token_ids != reference
        finally:
            p2.close()
            d2.close()
    finally:
        p.close()
        d.close()


def _request(prompt):
    from pdcluster.engine.request import Request

    return Request("probe", list(prompt), SamplingParams())


def test_an_expired_hold_frees_the_blocks_and_the_decode_side_computes():
    p, d = Instance("p", extra={"hold_timeout_s": 0.2}), Instance("d")
    try:
        prompt = _prompt(6, 64)
        reference = d.engine.generate([prompt], SamplingParams(max_tokens=8, cache_salt="ref"))[0].token_ids
        free_before = p.num_free_blocks
        kv = p.prefill_for_remote(prompt).kv_transfer_params
        time.sleep(0.4)
        p.settle()
        assert p.num_free_blocks == free_before and p.connector.server.counters["expired"] == 1
        out = d.engine.generate([prompt], SamplingParams(max_tokens=8, kv_transfer_params=kv))[0]
        assert out.token_ids == reference and out.num_cached_tokens == 0
        assert d.connector.pull_stats.num_failed == 1
    finally:
        p.close()
        d.close()


def test_wrong_tokens_and_malformed_pulls_change_nothing():
    p, d = Instance("p"), Instance("d")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        prompt = _prompt(7, 80)
        kv = p.prefill_for_remote(prompt).kv_transfer_params
        sock.connect(f"tcp://127.0.0.1:{kv['remote_port']}")
        for junk in (b"\x00not msgpack", b"", CODEC.encode(Blocks("x", 0, 0))):
            sock.send(junk)
        assert not sock.poll(300)  # dropped, unanswered, and the server lives on:
        layout = p.connector.layout
        sock.send(CODEC.encode(Pull(kv["remote_request_id"], "0" * 32, layout, 0, [1, 2])))
        assert sock.poll(5000)
        header = CODEC.decode(sock.recv_multipart()[0], 1 << 16)
        assert "wrong token" in header.error and header.num_blocks == 0
        sock.send(CODEC.encode(Pull("no-such-request", kv["remote_token"], layout, 0, [1])))
        assert sock.poll(5000) and "no blocks held" in CODEC.decode(sock.recv_multipart()[0], 1 << 16).error
        p.settle()
        assert p.connector.server.num_held == 1  # a stranger cannot release a proxy's blocks
        out = d.engine.generate([prompt], SamplingParams(max_tokens=4, kv_transfer_params=kv))[0]
        assert out.num_cached_tokens == 4 * BLOCK
        sock.send(CODEC.encode(Pull(kv["remote_request_id"], kv["remote_token"], layout, 0, [1])))
        assert sock.poll(5000) and "no blocks held" in CODEC.decode(sock.recv_multipart()[0], 1 << 16).error
    finally:
        sock.close()
        ctx.term()
        p.close()
        d.close()


def test_an_unreachable_prefill_instance_means_computing_the_prompt():
    d = Instance("d", extra={"fetch_timeout_s": 0.5})
    try:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        prompt = _prompt(8, 50)
        reference = d.engine.generate([prompt], SamplingParams(max_tokens=6, cache_salt="ref"))[0].token_ids
        kv = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "r",
              "remote_token": "t", "remote_engine_id": "e", "remote_block_ids": [0, 1, 2]}
        out = d.engine.generate([prompt], SamplingParams(max_tokens=6, kv_transfer_params=kv))[0]
        assert out.token_ids == reference and out.num_cached_tokens == 0
        assert d.connector.pull_stats.num_failed == 1
    finally:
        d.close()


def test_another_models_layout_is_refused_and_released():
    p, d = Instance("p", dtype="float32"), Instance("d", dtype="bfloat16")
    try:
        prompt = _prompt(9, 70)
        reference = d.engine.generate([prompt], SamplingParams(max_tokens=6, cache_salt="ref"))[0].token_ids
        free_before = p.num_free_blocks
        kv = p.prefill_for_remote(prompt).kv_transfer_params
        out = d.engine.generate([prompt], SamplingParams(max_tokens=6, kv_transfer_params=kv))[0]
        assert out.token_ids == reference and out.num_cached_tokens == 0
        p.settle()
        assert p.num_free_blocks == free_before and p.connector.server.counters["refused"] == 1
    finally:
        p.close()
        d.close()


def test_a_decode_side_that_needs_no_pull_releases_the_hold():
    """D's own prefix cache holds the prompt already: nothing is pulled, and P hears at once it may free."""
    p, d = Instance("p"), Instance("d")
    try:
        prompt = _prompt(10, 66)
        d.engine.generate([prompt], SamplingParams(max_tokens=2))
        free_before = p.num_free_blocks
        kv = p.prefill_for_remote(prompt).kv_transfer_params
        d.engine.generate([prompt], SamplingParams(max_tokens=2, kv_transfer_params=kv))
        deadline = time.monotonic() + 10
        while p.connector.server.num_held and time.monotonic() < deadline:
            time.sleep(0.02)
        p.settle()
        assert p.num_free_blocks == free_before and p.connector.server.counters["released"] == 1
        assert d.connector.pull_stats.num_pulls == 0
    finally:
        p.close()
        d.close()


def test_only_requests_that_ask_and_end_normally_hold_blocks():
    p = Instance("p")
    try:
        free_before = p.num_free_blocks
        out = p.engine.generate([_prompt(11, 64)], SamplingParams(max_tokens=3))[0]
        assert out.kv_transfer_params is None and not p.engine.scheduler.held
        request_id = p.engine.add_request(_prompt(12, 64), SamplingParams(max_tokens=50,
                                                                           kv_transfer_params=DO_REMOTE_DECODE))
        p.engine.step()
        p.engine.abort_request(request_id)
        p.engine.step()
        p.settle()
        assert not p.engine.scheduler.held and p.connector.server.counters["held"] == 0
        assert p.num_free_blocks == free_before
        short = p.prefill_for_remote(list(range(20, 30)))  # no full block: an answer, nothing held
        assert short.kv_transfer_params["remote_block_ids"] == [] and not p.engine.scheduler.held
    finally:
        p.close()


@pytest.mark.parametrize("mode", ["async", "mtp"])
def test_the_decode_side_under_async_scheduling_and_mtp(mode):
    kwargs = {"async_scheduling": True} if mode == "async" else {"spec_method": "mtp", "num_spec_tokens": 2}
    # Under MTP both run the draft layer: its KV is in the blocks (a prefill instance without it has another layout).
    p, d = Instance("p", **(kwargs if mode == "mtp" else {})), Instance("d", **kwargs)
    try:
        prompt = _prompt(13, 100)
        plain = LLMEngine.from_config(engine_config(dtype="bfloat16", **kwargs))
        reference = plain.generate([prompt], SamplingParams(max_tokens=10))[0].token_ids
        kv = p.prefill_for_remote(prompt).kv_transfer_params
        out = d.engine.generate([prompt], SamplingParams(max_tokens=10, kv_transfer_params=kv))[0]
        assert out.token_ids == reference
        # MTP recomputes the last matched block (its last entry depends on the token after it).
        assert out.num_cached_tokens == (5 if mode == "mtp" else 6) * BLOCK
    finally:
        p.close()
        d.close()


def test_settings_and_requests_are_checked():
    assert parse_config("") is None
    config = parse_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 5600, '
                          '"kv_connector_extra_config": {"hold_timeout_s": 30, "backends": ["UCX"]}}')
    assert config.port == 5600 and config.hold_timeout_s == 30.0 and config.public_host == "127.0.0.1"
    # A wildcard listener names this machine's address in its answers (a pod's IP), or the one given.
    assert parse_config('{"kv_ip": "0.0.0.0"}').public_host == socket.gethostbyname(socket.gethostname())
    assert parse_config('{"kv_ip": "0.0.0.0", "kv_connector_extra_config": {"advertise_host": "p.svc"}}'
                        ).public_host == "p.svc"
    for text, match in (("{", "not JSON"), ('{"kv_connector": "Nope"}', "kv_connector"),
                        ('{"kv_role": "kv_sideways"}', "kv_role"), ('{"kv_port": 70000}', "kv_port"),
                        ('{"kv_typo": 1}', "unknown key"),
                        ('{"kv_connector_extra_config": {"hold_timeout_s": -1}}', "hold_timeout_s")):
        with pytest.raises(ExternalKVError, match=match):
            parse_config(text)
    with pytest.raises(ConfigError, match="prefix caching"):
        engine_config(kv_transfer_config=_config(), enable_prefix_caching=False).validate()
    with pytest.raises(ExternalKVError, match="remote_port"):
        remote_prefill({"do_remote_prefill": True, "remote_host": "h", "remote_port": "80", "remote_block_ids": []})
    with pytest.raises(ValueError, match="hybrid"):
        LoadedModel.load(engine_config("tiny-hybrid", kv_transfer_config=_config()), progress=False)
    plain = LLMEngine.from_config(engine_config())
    with pytest.raises(InvalidRequestError, match="--kv-transfer-config"):
        plain.add_request([1, 2, 3], SamplingParams(kv_transfer_params=DO_REMOTE_DECODE))


def test_a_model_split_over_ranks_pulls_every_ranks_heads():
    """-tp 2 on both sides: a block's column is every rank's heads side by side (BlockColumns), pulled as one and
    written back into each rank's cache."""
    def split(name: str):
        loaded = LoadedModel.load(engine_config(dtype="bfloat16", kv_transfer_config=_config(), tensor_parallel_size=2),
                                  progress=False, share_rank_caches=True)
        connector = make_external_connector(loaded, name)
        return LLMEngine(loaded, connector), connector

    (p, p_conn), (d, d_conn) = split("p"), split("d")
    try:
        prompt = _prompt(14, 90)
        reference = d.generate([prompt], SamplingParams(max_tokens=8, cache_salt="ref"))[0].token_ids
        kv = p.generate([prompt], SamplingParams(max_tokens=1, kv_transfer_params=DO_REMOTE_DECODE))[0].kv_transfer_params
        out = d.generate([prompt], SamplingParams(max_tokens=8, kv_transfer_params=kv))[0]
        assert out.token_ids == reference and out.num_cached_tokens == 5 * BLOCK
        assert d_conn.pull_stats.num_blocks == 5
    finally:
        p_conn.close()
        d_conn.close()
        p.close()
        d.close()
