"""vLLM's KV events (--kv-events-config) published by the workers for routers outside the cluster: the payload is
vLLM 0.32's bytes (golden payloads its own msgspec encoder made), every stored block comes with its tokens and its
parent so a consumer can key it, evictions and offload tiers are told, replays work, a malformed replay request is
logged and the publisher lives on, and `pdcluster serve` publishes from every worker, listed by GET /kv_event_sources."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import time

import httpx
import openai
import pytest
import zmq

from conftest import make_engine
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.block_manager import StoredRun, block_hash_root, chained_block_hashes
from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.kv_event_publisher import KVEventPublisher, extra_keys, lora_id, make_kv_event_publisher
from pdcluster.tools.server_process import ServeProcess
from pdcluster.wire.kv_events import (END_SEQ, KVEventsConfig, KVEventsConfigError, all_blocks_cleared, binds,
                                      block_removed, block_stored, decode_batch, encode_batch, endpoint_for_rank,
                                      parse_kv_events_config)
from test_api import serving

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
U64 = (1 << 64) - 1
ANY_PORT = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                       "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"})

# vLLM 0.32's msgspec encoder on these batches (vllm.distributed.kv_events.KVEventBatch):
# KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5, 6],
#   block_size=16, lora_id=None, medium="GPU", lora_name=None), BlockRemoved(block_hashes=[3], medium="GPU"),
#   AllBlocksCleared()], data_parallel_rank=0)
VLLM_PLAIN = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f62"
    "6c6f636b5f68617368c0a9746f6b656e5f696473920506aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da34750"
    "55a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739103a66d656469756da3"
    "47505581a474797065b0416c6c426c6f636b73436c656172656400")
# KVEventBatch(ts=1796539084.25, events=[BlockStored(block_hashes=[2**64 - 1, 7], parent_block_hash=2**63,
#   token_ids=[1, 2, 3, 4], block_size=2, lora_id=77, medium="GPU", lora_name="sql",
#   extra_keys=[("sql", ("abc", -1), "salt"), ("sql",)]), BlockStored(block_hashes=[9], parent_block_hash=None,
#   token_ids=[], block_size=0, lora_id=None, medium="CPU", lora_name=None),
#   BlockRemoved(block_hashes=[2**64 - 1], medium="STORAGE")], data_parallel_rank=3)
VLLM_FULL = bytes.fromhex(
    "93cb41dac540b31000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfffffffffffffffff07b1"
    "706172656e745f626c6f636b5f68617368cf8000000000000000a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a7"
    "6c6f72615f69644da66d656469756da3475055a96c6f72615f6e616d65a373716caa65787472615f6b6579739293a373716c92a36162"
    "63ffa473616c7491a373716c88a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739109b1706172656e745f62"
    "6c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f6964c0a66d656469756da3435055a9"
    "6c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfffffffffffffffffa66d"
    "656469756da753544f5241474503")


# ---- the wire ---------------------------------------------------------------------------------------------------

def test_payloads_are_vllms_bytes():
    plain = [block_stored([1, 2], None, [5, 6], 16, "GPU"), block_removed([3], "GPU"), all_blocks_cleared()]
    assert encode_batch(1.5, plain, 0) == VLLM_PLAIN
    # Our hashes are signed 64-bit: published unsigned, as vLLM publishes its own.
    full = [block_stored([-1, 7], -(1 << 63), [1, 2, 3, 4], 2, "GPU", 77, "sql", [("sql", ("abc", -1), "salt"),
                                                                                  ("sql",)]),
            block_stored([9], None, [], 0, "CPU"), block_removed([-1], "STORAGE")]
    assert encode_batch(1796539084.25, full, 3) == VLLM_FULL
    ts, events, rank = decode_batch(VLLM_FULL)
    assert (ts, rank) == (1796539084.25, 3) and events[0]["block_hashes"] == [U64, 7]
    for bad in (b"\x93", encode_batch(1.0, [{"type": "BlockStored"}], 0), b"\x01", encode_batch(1.0, [{"x": 1}], 0)):
        with pytest.raises(ValueError, match="not a KV event"):
            decode_batch(bad)


def test_config_is_vllms_and_bad_values_are_named():
    assert parse_kv_events_config("") is None
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv", "buffer_steps": 5}')
    assert config == KVEventsConfig(True, "zmq", "", None, 5, 100_000, 100_000, "kv")
    for text, names in [("{", "not JSON"), ("[]", "JSON object"), ('{"enable": true}', "unknown key 'enable'"),
                        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
                        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                        ('{"enable_kv_cache_events": true, "endpoint": "127.0.0.1:5557"}', "endpoint"),
                        ('{"enable_kv_cache_events": true, "endpoint": "tcp://host"}', "HOST:PORT"),
                        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm"),
                        ('{"enable_kv_cache_events": true, "topic": 3}', "topic")]:
        with pytest.raises(KVEventsConfigError, match=names):
            parse_kv_events_config(text)
    with pytest.raises(ConfigError, match="kv_events_config.hwm"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "hwm": -1}')
    with pytest.raises(ConfigError, match="turn prefix caching on"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true}', enable_prefix_caching=False)
    # vLLM's port offset per data-parallel rank (a worker's rank here) and its bind-or-connect rule.
    assert endpoint_for_rank("tcp://*:5557", 2) == "tcp://*:5559" and endpoint_for_rank("tcp://*:5557", 0).endswith("7")
    assert endpoint_for_rank("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert endpoint_for_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert binds("tcp://*:5557") and binds("ipc:///tmp/kv") and binds("tcp://10.0.0.1:0")
    assert not binds("tcp://indexer:5557") and not binds("tcp://127.0.0.1:5557")


def test_extra_keys_are_vllms_per_block():
    """vLLM's untagged per-block extra keys: the LoRA name, (image, its offset from the block start) for each image
    the block holds part of, the cache salt on the prompt's first block."""
    images = ({"offset": 10, "length": 20, "digest": "img"},)
    run = StoredRun([1, 2, 3], None, list(range(48)), 0, "sql", "tenant", images)
    assert extra_keys(run, 16) == [("sql", ("img", 10), "tenant"), ("sql", ("img", -6)), ("sql",)]
    later = StoredRun([4], 3, list(range(16)), 48, None, "tenant", images)
    assert extra_keys(later, 16) is None  # past the image, not the first block, no adapter
    assert lora_id("sql") == lora_id("sql") != lora_id("chat") and lora_id(None) is None and 0 < lora_id("sql") < 2**31


# ---- the engine tells every store in full ----------------------------------------------------------------------

def _events(engine) -> list[dict]:
    from pdcluster.node.kv_event_publisher import to_vllm_events

    return to_vllm_events(engine.kv_events.drain_described(), BLOCK)


def test_stored_blocks_carry_tokens_and_parent_and_evictions_are_told():
    engine = make_engine(num_kv_blocks=12, kv_events_config=ANY_PORT)
    rng = random.Random(0)
    prompt = [rng.randrange(10, 1000) for _ in range(40)]
    engine.generate([prompt], GREEDY)
    (stored,) = _events(engine)
    hashes = chained_block_hashes(prompt, BLOCK)
    assert stored == block_stored(hashes[:2], None, prompt[:32], BLOCK, "GPU")
    assert stored["block_hashes"] == [h & U64 for h in hashes[:2]]
    # A longer prompt on the same prefix: its new blocks chain from the cached one it found.
    longer = prompt + [rng.randrange(10, 1000) for _ in range(30)]
    engine.generate([longer], GREEDY)
    (stored,) = _events(engine)
    hashes = chained_block_hashes(longer, BLOCK)
    assert stored["parent_block_hash"] == hashes[1] & U64
    assert stored["block_hashes"] == [h & U64 for h in hashes[2:4]] and stored["token_ids"] == longer[32:64]
    # A salted prompt: its blocks hash apart, the salt rides on the first block's extra keys, no parent.
    salted = SamplingParams(max_tokens=4, temperature=0.0, cache_salt="tenant-a")
    engine.generate([prompt], salted)
    (stored,) = _events(engine)
    assert stored["block_hashes"] == [h & U64 for h in chained_block_hashes(prompt, BLOCK, block_hash_root(salted))[:2]]
    assert stored["parent_block_hash"] is None and stored["extra_keys"] == [("tenant-a",), None]
    # A prompt that does not fit beside them evicts: each block leaving the cache is a BlockRemoved.
    engine.generate([[rng.randrange(10, 1000) for _ in range(150)]], GREEDY)
    events = _events(engine)
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and all(e["medium"] == "GPU" for e in events)
    assert set(removed) <= {h & U64 for h in chained_block_hashes(longer, BLOCK) + chained_block_hashes(
        prompt, BLOCK, block_hash_root(salted))}
    cached = engine.scheduler.block_manager.cached_block_hashes()
    engine.scheduler.block_manager.reset_prefix_cache()
    (cleared,) = _events(engine)  # every cached block, told removed
    assert cleared["type"] == "BlockRemoved" and cleared["block_hashes"] == [h & U64 for h in cached] and cached


def test_offload_tiers_are_media_and_a_load_back_chains_from_its_parent():
    engine = make_engine(num_kv_blocks=24, dtype="bfloat16", kv_offload_host_gib=0.01, kv_events_config=ANY_PORT)
    rng = random.Random(1)
    a, b, c = ([rng.randrange(10, 40000) for _ in range(160)] for _ in range(3))
    try:
        for prompt in (a, b, c):  # b and c evict a's blocks: they move to host memory
            engine.generate([prompt], GREEDY)
        out = engine.generate([a], GREEDY)[0]  # a comes back from the host tier
        assert out.num_offloaded_tokens > 0
        events = _events(engine)
        host = [e for e in events if e["medium"] == "CPU"]
        assert host and all(e["token_ids"] == [] and e["block_size"] == 0 for e in host if e["type"] == "BlockStored")
        hashes = [h & U64 for h in chained_block_hashes(a, BLOCK)]
        loaded = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"
                  and e["block_hashes"][0] in hashes]
        # a's blocks stored again on the device (loaded back, then its last block computed): tokens and parent as if
        # all were computed here; the loaded run starts after the blocks the device pool kept.
        firsts = []
        for back in loaded:
            first = hashes.index(back["block_hashes"][0])
            assert back["block_hashes"] == hashes[first: first + len(back["block_hashes"])]
            assert back["parent_block_hash"] == (hashes[first - 1] if first else None)
            assert back["token_ids"] == a[first * BLOCK: (first + len(back["block_hashes"])) * BLOCK]
            firsts.append(first)
        assert any(0 < f < len(hashes) - 1 for f in firsts), firsts  # a run loaded after the kept prefix
    finally:
        engine.offload.close()


# ---- the publisher over ZeroMQ -----------------------------------------------------------------------------------

def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    for _ in range(100):  # bounded
        assert sock.poll(5000), "no replay answer"
        _, topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            break
        assert topic == b"kv"
        batches.append((int.from_bytes(seq, "big"), payload))
    sock.close()
    return batches


def test_publisher_sends_batches_in_order_replays_them_and_survives_bad_requests(caplog):
    engine = make_engine(num_kv_blocks=12, kv_events_config=ANY_PORT)
    publisher = make_kv_event_publisher(engine, "w0")
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)  # the subscription reaches the publisher
        prompt = list(range(100, 150))
        engine.generate([prompt], GREEDY)
        publisher.publish(123.5, engine.kv_events.drain_described())
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        ts, events, rank = decode_batch(payload)
        assert (topic, int.from_bytes(seq, "big"), ts, rank) == (b"kv", 1, 123.5, 0)
        assert events[0]["token_ids"] == prompt[:48]
        # Replay from 0: the AllBlocksCleared a (re)started worker begins with, then the batch above.
        batches = _replay(ctx, publisher.replay_endpoint, 0)
        assert [s for s, _ in batches] == [0, 1] and batches[1][1] == payload
        assert decode_batch(batches[0][1])[1] == [all_blocks_cleared()]
        assert [s for s, _ in _replay(ctx, publisher.replay_endpoint, 1)] == [1]
        # A malformed replay request is logged and ignored; the publisher goes on.
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(publisher.replay_endpoint)
        with caplog.at_level(logging.WARNING, logger="pdcluster.node.kv_event_publisher"):
            bad.send_multipart([b"", b"short"])
            for _ in range(100):  # bounded: the request reaches the publisher's thread
                if "malformed KV events replay request" in caplog.text:
                    break
                time.sleep(0.05)
            assert "malformed KV events replay request" in caplog.text
            assert [s for s, _ in _replay(ctx, publisher.replay_endpoint, 1)] == [1]
            assert not bad.poll(100)  # left unanswered
        bad.close()
        source = publisher.source()
        assert source["endpoint"] == publisher.endpoint and source["rank"] == 0 and source["topic"] == "kv"
    finally:
        publisher.close()
        ctx.destroy(linger=0)
    assert not publisher._thread.is_alive()


def test_a_full_queue_drops_batches_and_never_blocks():
    config = parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                                                "max_queue_size": 1}))
    publisher = KVEventPublisher(config, 0, BLOCK, "w0")
    try:
        started = time.monotonic()
        for _ in range(2000):
            publisher.publish(1.0, [("removed", "device", [1], None)])
        assert time.monotonic() - started < 5 and publisher.num_dropped > 0
    finally:
        publisher.close()


def test_a_taken_port_is_one_clear_error():
    config = parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"}))
    first = KVEventPublisher(config, 0, BLOCK, "w0")
    taken = first.endpoint.replace("127.0.0.1", "*")
    try:
        with pytest.raises(RuntimeError, match=r"kv_events_config.endpoint: worker w1 cannot use tcp://\*:\d+"):
            KVEventPublisher(KVEventsConfig(True, "zmq", taken), 0, BLOCK, "w1")
    finally:
        first.close()


# ---- served -----------------------------------------------------------------------------------------------------

def _subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def _stored_tokens(sub: zmq.Socket, wait_s: float) -> list[int]:
    """Token ids of every BlockStored that arrives within ``wait_s``, in order."""
    tokens = []
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0 and sub.poll(int(left * 1000) + 1):
        for event in decode_batch(sub.recv_multipart()[2])[1]:
            if event["type"] == "BlockStored":
                tokens += event["token_ids"]
    return tokens


def test_local_server_lists_its_source_and_publishes_a_prompts_blocks(tiny_dir):
    router = LocalRouter(EngineConfig(model="tiny-random", num_kv_blocks=64, max_model_len=512,
                                      kv_events_config=ANY_PORT), request_timeout_s=60)
    ctx = zmq.Context()
    try:
        with serving(build_app(router, "tiny-random")) as base_url:
            sources = httpx.get(f"{base_url}/kv_event_sources", timeout=30).json()
            assert list(sources) == ["0"] and sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
            sub = _subscriber(ctx, sources["0"]["endpoint"])
            # `pdcluster kv-events` watching the same server, replaying from the first batch (AllBlocksCleared).
            watch = subprocess.Popen([sys.executable, "-m", "pdcluster.cli", "kv-events", "--url", base_url,
                                      "--seconds", "20", "--max-batches", "2", "--replay-from", "0", "--json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(3.0)  # its start and subscription
            prompt = list(range(200, 240))
            httpx.post(f"{base_url}/v1/completions", timeout=60,
                       json={"model": "tiny-random", "prompt": prompt, "max_tokens": 2}).raise_for_status()
            assert _stored_tokens(sub, 3.0)[:32] == prompt[:32]
            out, err = watch.communicate(timeout=60)
        assert watch.returncode == 0, err
        batches = [json.loads(line) for line in out.splitlines()]
        assert batches[0]["events"] == [{"type": "AllBlocksCleared"}] and batches[0]["seq"] == 0
        assert batches[1]["events"][0]["token_ids"][:32] == prompt[:32] and batches[1]["rank"] == 0
    finally:
        router.close()
        ctx.destroy(linger=0)
    assert not router.worker.kv_event_publisher._thread.is_alive()


@pytest.mark.timeout(420)
def test_serve_publishes_from_every_worker():
    """Two colocated Ray workers: ranks 0 and 1, each on its own endpoint; a prompt's blocks come from the worker
    that served it. A malformed config is one line before Ray starts."""
    bad = subprocess.run([sys.executable, "-m", "pdcluster.cli", "serve", "--model", "tiny-random", "--mode",
                          "colocated", "--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'],
                         capture_output=True, text=True, timeout=120)
    out = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "kv_events_config.hwm" in out and "Traceback" not in out, out[-2000:]
    flags = ["--model", "tiny-random", "--mode", "colocated", "--num-decode", "2", "--num-kv-blocks", "64",
             "--max-model-len", "256", "--kv-events-config", ANY_PORT]
    ctx = zmq.Context()
    try:
        with ServeProcess(flags, timeout_s=300) as server:
            sources = httpx.get(f"{server.base_url}/kv_event_sources", timeout=30).json()
            assert sorted(sources) == ["0", "1"]
            assert len({s["endpoint"] for s in sources.values()}) == 2
            assert {s["worker_id"].split("-")[0] for s in sources.values()} == {"decode"}
            subs = [_subscriber(ctx, s["endpoint"]) for s in sources.values()]
            time.sleep(0.5)
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
            prompt = list(range(300, 340))
            client.completions.create(model="tiny-random", prompt=prompt, max_tokens=2)
            told = [_stored_tokens(sub, 3.0) for sub in subs]
            assert sorted(len(t) > 0 for t in told) == [False, True]
            assert max(told, key=len)[:32] == prompt[:32]
    finally:
        ctx.destroy(linger=0)
