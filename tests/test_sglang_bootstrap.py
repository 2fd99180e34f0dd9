"""SGLang's prefill/decode protocol (wire/sglang_bootstrap.py): its router sends each request to a prefill and a decode
server at once with bootstrap_host / bootstrap_port / bootstrap_room. Here: the fields' checks; the export server's
room holds, a release that comes before its hold (it ends the hold when it comes: nothing stranded); a pull that
starts before the hold waits for it, and one that gives up releases it; and the real sglang-router binary in front of
two `pdcluster serve` processes, answers token-exact against computing the prompt on the decode server alone, the KV
pulled, the prefill server's pool empty afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
import torch
import zmq

from pdcluster.kv_transfer.external.export_server import KVExportServer
from pdcluster.kv_transfer.external.pull import PullSource, PullStats
from pdcluster.tools.server_process import ServeProcess
from pdcluster.wire.external_kv import ExternalKVError, check_request_params
from pdcluster.wire.sglang_bootstrap import (ALL_BLOCKS, bootstrap_kv_params, bootstrap_remote, is_bootstrap_pull,
                                             room_key)

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
LAYOUT = "layout-1"
BLOCK_SHAPE = (2, 4)  # a block's column: 8 float32 values, 32 bytes


# ---- the fields ----------------------------------------------------------------------------------------------------

def test_fields_become_kv_transfer_params_by_the_servers_role():
    assert bootstrap_kv_params("10.0.0.1", 8998, 7, "kv_producer") == {"do_remote_decode": True, "bootstrap_room": 7}
    consumer = bootstrap_kv_params("10.0.0.1", 8998, 7, "kv_consumer")
    assert consumer == {"do_remote_prefill": True, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                        "bootstrap_room": 7}
    remote = bootstrap_remote(consumer)
    assert (remote.host, remote.port, remote.request_id, remote.token) == ("10.0.0.1", 8998, room_key(7), "")
    assert remote.wait_for_hold and remote.num_blocks == ALL_BLOCKS
    assert is_bootstrap_pull(consumer) and not is_bootstrap_pull({"do_remote_decode": True, "bootstrap_room": 7})
    for args, names in [(("h", 1, -1, "kv_producer"), "bootstrap_room"), (("h", 1, 2**64, "kv_consumer"), "bootstrap_room"),
                        (("h", 1, True, "kv_producer"), "bootstrap_room"), (("", 1, 3, "kv_consumer"), "bootstrap_host"),
                        (("h", 0, 3, "kv_consumer"), "bootstrap_port"), (("h", 1, 3, "kv_both"), "kv_role is kv_both"),
                        (("h", 1, 3, ""), "takes no part")]:
        with pytest.raises(ExternalKVError, match=names):
            bootstrap_kv_params(*args)
    with pytest.raises(ExternalKVError, match="bootstrap_host"):
        bootstrap_remote({"do_remote_prefill": True, "bootstrap_room": 5})  # not a KeyError
    with pytest.raises(ExternalKVError, match="remote_block_ids"):  # vLLM's form needs vLLM's fields
        check_request_params({"do_remote_prefill": True, "bootstrap_room": 5})


# ---- the export server and the pull --------------------------------------------------------------------------------

def _blocks(block_ids: list[int]) -> bytes:
    return b"".join(torch.full(BLOCK_SHAPE, float(b)).numpy().tobytes() for b in block_ids)


@pytest.fixture
def server():
    srv = KVExportServer("127.0.0.1", 0, LAYOUT, 32, _blocks)
    yield srv
    srv.close()


def _source(server, room: int, timeout_s: float, ctx: zmq.Context) -> PullSource:
    remote = bootstrap_remote(bootstrap_kv_params("127.0.0.1", server.port, room, "kv_consumer"))
    return PullSource(remote, LAYOUT, BLOCK_SHAPE, torch.float32, 32, timeout_s, ctx, PullStats())


def _ended(server, request_id: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded
        if request_id in server.take_ended():
            return True
        time.sleep(0.02)
    return False


def test_a_pull_waits_for_a_hold_made_after_it_and_takes_it(server):
    ctx = zmq.Context()
    try:
        source = _source(server, 41, 5.0, ctx)
        holder = threading.Timer(0.3, server.hold, ("req-41", [3, 5], [11, 12], 60.0, room_key(41)))
        holder.start()
        started = time.monotonic()
        got = source.fetch(0, [11, 12])
        assert 0.25 < time.monotonic() - started < 4.0
        assert got.shape == (2, *BLOCK_SHAPE) and got[0].eq(3).all() and got[1].eq(5).all()
        assert _ended(server, "req-41") and server.num_held == 0  # pulled: the blocks go back
        # A room hold is taken by its room alone: a pull that brings a token (vLLM's protocol) is refused.
        token = server.hold("req-42", [1], [9], 60.0, room_key(42))
        assert token == ""
        remote = bootstrap_remote(bootstrap_kv_params("127.0.0.1", server.port, 42, "kv_consumer"))
        vllm_style = PullSource(replace(remote, token="guess", wait_for_hold=False), LAYOUT, BLOCK_SHAPE,
                                torch.float32, 32, 1.0, ctx, PullStats())
        assert vllm_style.fetch(0, [9]).shape[0] == 0 and server.num_held == 1
    finally:
        ctx.term()


def test_a_release_before_its_hold_ends_the_hold_when_it_comes(server):
    ctx = zmq.Context()
    try:
        _source(server, 50, 2.0, ctx).release()  # the decode side found the prompt itself, first
        server.hold("req-50", [1, 2], [7, 8], 60.0, room_key(50))
        assert _ended(server, "req-50") and server.num_held == 0
        # A pull that gives up (no hold within its timeout) releases the room: a late hold ends at once too.
        stats = PullStats()
        late = PullSource(bootstrap_remote(bootstrap_kv_params("127.0.0.1", server.port, 51, "kv_consumer")),
                          LAYOUT, BLOCK_SHAPE, torch.float32, 32, 0.3, ctx, stats)
        assert late.fetch(0, [7]).shape[0] == 0 and stats.num_failed == 1
        server.hold("req-51", [4], [7], 60.0, room_key(51))
        assert _ended(server, "req-51") and server.num_held == 0
        # Only room names are remembered ahead of their holds: an ordinary request's hold is untouched.
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        from pdcluster.kv_transfer.external.wire import CODEC, Pull

        sock.send(CODEC.encode(Pull("req-60", "", LAYOUT, 0, [])))
        assert sock.poll(5000) and CODEC.decode(sock.recv_multipart()[0], 1 << 16).error
        sock.close()
        server.hold("req-60", [1], [7], 60.0)
        assert not _ended(server, "req-60", 0.3) and server.num_held == 1
    finally:
        ctx.term()


# ---- the real SGLang router in front of two servers ---------------------------------------------------------------

FLAGS = ["--model", "tiny-random", "--mode", "local", "--num-kv-blocks", "128", "--max-model-len", "1024"]
PROMPT = "The history of the paged attention kernel begins with a question about memory " * 4
MESSAGES = [{"role": "user", "content": "Tell me about prefill and decode, and why one would split them apart."}]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export_stats(server) -> dict:
    return httpx.get(f"{server.base_url}/health", timeout=30).json()["workers"][0]["external_kv"]


@pytest.fixture(scope="module")
def sglang_router():
    pytest.importorskip("sglang_router")
    bootstrap_port = _free_port()
    producer = json.dumps({"kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": bootstrap_port})
    consumer = json.dumps({"kv_role": "kv_consumer", "kv_ip": "127.0.0.1"})
    with ServeProcess([*FLAGS, "--kv-transfer-config", producer], timeout_s=240) as prefill, \
            ServeProcess([*FLAGS, "--kv-transfer-config", consumer], timeout_s=240) as decode:
        port = _free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
             prefill.base_url, str(bootstrap_port), "--decode", decode.base_url, "--host", "127.0.0.1", "--port",
             str(port), "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port",
             str(_free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # bounded: the router registers both servers
                try:
                    if httpx.post(f"{url}/v1/completions", timeout=30, json={
                            "model": "tiny-random", "prompt": "warm", "max_tokens": 1}).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                pytest.fail("sglang-router did not serve within 60 s")
            yield url, prefill, decode
        finally:
            router.terminate()
            router.wait(30)


def test_sglang_router_splits_requests_token_exactly(sglang_router):
    url, prefill, decode = sglang_router
    direct = openai.OpenAI(base_url=f"{decode.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    through = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    pulls_before = _export_stats(decode)["pulls"]["num_blocks"]
    whole = direct.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"cache_salt": "whole"})
    split = through.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=24, temperature=0)
    assert split.choices[0].text == whole.choices[0].text
    # The decode server pulled the prompt's full blocks from the prefill server (the last partial one it computed).
    full_blocks = (split.usage.prompt_tokens - 1) // BLOCK
    assert split.usage.prompt_tokens_details.cached_tokens == full_blocks * BLOCK
    assert _export_stats(decode)["pulls"]["num_blocks"] - pulls_before == full_blocks
    # Chat, streamed through the router.
    whole_chat = direct.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, temperature=0,
                                                extra_body={"cache_salt": "whole"}).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in through.chat.completions.create(
        model="tiny-random", messages=MESSAGES, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == whole_chat
    # Nothing stranded on the prefill server: every hold pulled or released, its pool empty.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _export_stats(prefill)["export"]["num_held"]:
        time.sleep(0.1)
    export = _export_stats(prefill)["export"]
    assert export["num_held"] == 0 and export["expired"] == 0 and export["pulled"] >= 2
    text = httpx.get(f"{prefill.base_url}/metrics", timeout=30).text
    assert float(re.search(r"^pdcluster:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M).group(1)) == 0.0


def test_sglang_router_splits_native_generate_token_exactly(sglang_router):
    """SGLang's own route through SGLang's own router: /generate (cluster/api/sglang_generate.py) sent to both servers
    with the bootstrap fields; the answer, streamed or not, with logprobs or not, is the decode server's alone."""
    url, prefill, decode = sglang_router
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    whole = httpx.post(f"{decode.base_url}/generate", json={**body, "extra_key": "whole", "return_logprob": True,
                                                            "logprob_start_len": 0}, timeout=120).json()
    split = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    assert split["output_ids"] == whole["output_ids"] and split["text"] == whole["text"]
    full_blocks = (split["meta_info"]["prompt_tokens"] - 1) // BLOCK
    assert split["meta_info"]["cached_tokens"] == full_blocks * BLOCK  # the prompt's KV came from the prefill server
    # Prompt logprobs: the prefill server's, which the router puts before the decode server's (none: it pulled the
    # prompt's KV, which carries no logprobs).
    scored = httpx.post(f"{url}/generate", json={**body, "return_logprob": True, "logprob_start_len": 0},
                        timeout=120).json()
    assert scored["meta_info"]["cached_tokens"] == full_blocks * BLOCK
    for key in ("output_token_logprobs", "input_token_logprobs"):
        got, want = scored["meta_info"][key], whole["meta_info"][key]
        assert [e[1] for e in got] == [e[1] for e in want], key
        assert [e[0] or 0.0 for e in got] == pytest.approx([e[0] or 0.0 for e in want], abs=1e-4), key
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["output_ids"] == whole["output_ids"]
    deadline = time.monotonic() + 10  # nothing stranded on the prefill server
    while time.monotonic() < deadline and _export_stats(prefill)["export"]["num_held"]:
        time.sleep(0.1)
    export = _export_stats(prefill)["export"]
    assert export["num_held"] == 0 and export["expired"] == 0


def test_bootstrap_fields_on_servers_that_cannot_take_them_are_400(sglang_router):
    url, prefill, decode = sglang_router
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 1, "bootstrap_room": -3}
    r = httpx.post(f"{decode.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]
    r = httpx.post(f"{prefill.base_url}/v1/completions", timeout=30,
                   json={**body, "bootstrap_room": 5, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]
    r = httpx.post(f"{decode.base_url}/v1/completions", timeout=30, json={
        "model": "tiny-random", "prompt": "hi", "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True, "bootstrap_room": 5, "bootstrap_host": "127.0.0.1",
                               "bootstrap_port": 1}})
    assert r.status_code == 400 and "field of the request itself" in r.json()["error"]["message"]
    # The servers live on.
    assert httpx.post(f"{decode.base_url}/v1/completions", json={"model": "tiny-random", "prompt": "hi",
                                                                 "max_tokens": 2}, timeout=30).status_code == 200
