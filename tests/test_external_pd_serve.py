"""vLLM's external prefill/decode split over real servers: two `pdcluster serve --kv-transfer-config` processes, the
real `openai` client driving them as vLLM's disaggregated-serving example does (prefill with do_remote_decode,
decode with the answer's kv_transfer_params), and `pdcluster pd-proxy`'s app on a real uvicorn server in front of
them. The decode instance's answers equal the same requests computed whole, its usage shows the prompt's blocks
came from the prefill instance, and the prefill instance's pool is empty again afterwards."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from test_api import serving
from pdcluster.cluster.pd_proxy import build_proxy_app
from pdcluster.tools.server_process import ServeProcess

BLOCK = 16
KV_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_ip": "127.0.0.1"})
FLAGS = ["--model", "tiny-random", "--mode", "local", "--num-kv-blocks", "128", "--max-model-len", "1024"]
PROMPT = "The history of the paged attention kernel begins with a question about memory " * 4
MESSAGES = [{"role": "user", "content": "Tell me about prefill and decode, and why one would split them apart."}]

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def instances():
    with ServeProcess([*FLAGS, "--kv-transfer-config", KV_CONFIG], timeout_s=240) as prefill, \
            ServeProcess([*FLAGS, "--kv-transfer-config", KV_CONFIG], timeout_s=240) as decode:
        yield prefill, decode


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def _kv_usage(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return float(re.search(r"^pdcluster:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M).group(1))


def _settled_usage(server, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (usage := _kv_usage(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return usage


def test_vllms_openai_client_recipe_splits_a_request_token_exactly(instances):
    prefill, decode = instances
    p, d = _client(prefill), _client(decode)
    whole = d.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=24, temperature=0,
                                 extra_body={"cache_salt": "whole"})
    first = p.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=1, temperature=0,
                                 extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    kv = first.kv_transfer_params
    assert kv["do_remote_prefill"] is True and kv["remote_host"] == "127.0.0.1"
    num_blocks = first.usage.prompt_tokens // BLOCK
    assert len(kv["remote_block_ids"]) == num_blocks and _kv_usage(prefill) > 0  # held for the decode instance
    split = d.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=24, temperature=0,
                                 extra_body={"kv_transfer_params": kv})
    assert split.choices[0].text == whole.choices[0].text
    assert split.usage.prompt_tokens_details.cached_tokens == min(num_blocks, (split.usage.prompt_tokens - 1) // BLOCK) * BLOCK
    assert _settled_usage(prefill) == 0.0  # pulled, so freed


def test_pd_proxy_serves_completions_and_streamed_chat_through_the_split(instances):
    prefill, decode = instances
    d = _client(decode)
    whole_text = d.completions.create(model="tiny-random", prompt=PROMPT + "!", max_tokens=16, temperature=0,
                                      extra_body={"cache_salt": "whole"}).choices[0].text
    whole_chat = d.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, temperature=0,
                                           extra_body={"cache_salt": "whole"}).choices[0].message.content
    with serving(build_proxy_app([prefill.base_url], [decode.base_url])) as proxy_url:
        client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="none", max_retries=0, timeout=120)
        answer = client.completions.create(model="tiny-random", prompt=PROMPT + "!", max_tokens=16, temperature=0)
        assert answer.choices[0].text == whole_text
        assert answer.usage.prompt_tokens_details.cached_tokens > 0  # its prompt's blocks came from the prefill side
        stream = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole_chat
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        # What the prefill leg cannot split (n > 1) is decoded whole, not refused.
        two = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=4, temperature=0, n=2)
        assert len(two.choices) == 2 and two.choices[0].text == two.choices[1].text
        health = httpx.get(f"{proxy_url}/health", timeout=30).json()
        assert health["requests"] == {"split": 2, "whole": 1}
        bad = httpx.post(f"{proxy_url}/v1/completions", timeout=30,
                         json={"model": "tiny-random", "prompt": "x", "kv_transfer_params": {}})
        assert bad.status_code == 400 and "set by the proxy" in bad.json()["error"]["message"]
    assert _settled_usage(prefill) == 0.0


@pytest.mark.parametrize("body, message", [
    ({"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "set stream=false"),
    ({"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "n=1"),
    ({"kv_transfer_params": {"do_remote_decode": "yes"}}, "must be true or false"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h", "remote_port": "80",
                             "remote_block_ids": [1]}}, "remote_port"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": True}}, "not both"),
])
def test_malformed_kv_transfer_params_are_a_400(instances, body, message):
    prefill, _ = instances
    r = httpx.post(f"{prefill.base_url}/v1/completions", timeout=60,
                   json={"model": "tiny-random", "prompt": "hello", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert _settled_usage(prefill) == 0.0


def test_a_server_without_the_flag_refuses_them(tiny_dir):
    from test_api_openai import Script, ScriptedRouter
    from pdcluster.cluster.api.app import build_app
    from pdcluster.engine.tokenizer import Tokenizer

    with serving(build_app(ScriptedRouter(Tokenizer(tiny_dir), Script({0: "ok"})), "scripted")) as url:
        body = {"model": "scripted", "prompt": "hello", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={**body, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and "--kv-transfer-config" in r.json()["error"]["message"]
        # Asking for no split is no split: served (as vLLM, where no connector reads them), answered with null.
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={**body, "kv_transfer_params": {"do_remote_decode": False}})
        assert r.status_code == 200 and r.json()["kv_transfer_params"] is None


def test_the_answer_crosses_the_api_process_boundary():
    """With --api-servers > 1 the final delta reaches the API process as a frontend record."""
    from pdcluster.cluster.api.router_contract import TokenDelta
    from pdcluster.cluster.frontend.protocol import FRONTEND_CODEC, MAX_FRONTEND_BYTES, from_delta, to_delta

    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_host": "10.0.0.2", "remote_port": 5600,
              "remote_token": "ab", "remote_engine_id": "decode-0-x", "remote_request_id": "cmpl-1", "tp_size": 1}
    delta = TokenDelta([7], finished=True, finish_reason="length", kv_transfer_params=params)
    wire = FRONTEND_CODEC.decode(FRONTEND_CODEC.encode(to_delta("cmpl-1", delta)), MAX_FRONTEND_BYTES)
    assert from_delta(wire).kv_transfer_params == params
    assert from_delta(to_delta("cmpl-2", TokenDelta([1]))).kv_transfer_params is None


@pytest.mark.slow
def test_a_colocated_ray_cluster_is_a_prefill_and_a_decode_instance():
    """The same split with each side a Ray cluster (--mode colocated, two workers each): the answer's parameters
    travel worker -> router -> API as events, each worker with an export server of its own."""
    flags = [*FLAGS[:2], "--mode", "colocated", "--num-decode", "2", *FLAGS[4:]]
    with ServeProcess([*flags, "--kv-transfer-config", KV_CONFIG], timeout_s=300) as prefill, \
            ServeProcess([*flags, "--kv-transfer-config", KV_CONFIG], timeout_s=300) as decode:
        p, d = _client(prefill), _client(decode)
        whole = d.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"cache_salt": "whole"}).choices[0].text
        for _ in range(2):
            kv = p.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=1, temperature=0,
                                      extra_body={"kv_transfer_params": {"do_remote_decode": True}}).kv_transfer_params
            split = d.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"kv_transfer_params": kv})
            assert split.choices[0].text == whole and split.usage.prompt_tokens_details.cached_tokens > 0
        assert _settled_usage(prefill) == 0.0
