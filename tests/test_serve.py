"""`pdcluster serve` as users run it: a subprocess, real Ray, real HTTP, the real `openai` client.
Greedy outputs equal the offline engine's (what `pdcluster generate` prints) in colocated mode, in
disagg mode for every transport, and in disagg mode with speculation."""

import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import make_engine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.transports import available_transports

openai = pytest.importorskip("openai")

TRANSPORTS = [name for name, reason in available_transports().items() if reason is None]
PROMPTS = ["Hello there, how", "The list of numbers: 3, 1, 4,", "def main():"]
CHAT = [{"role": "user", "content": "Name a color."}]
MAX_TOKENS = 10


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags, timeout_s=240):
        self.port = _free_port()
        self.tmp = tempfile.mkdtemp(prefix="pdcluster-serve-")
        env = dict(os.environ, RAY_TMPDIR=self.tmp, HOME=self.tmp)
        cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", "tiny-random", "--num-kv-blocks", "256",
               "--max-model-len", "1024", "--port", str(self.port), *flags]
        self.log = open(os.path.join(self.tmp, "serve.log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.output()}")
            if "pdcluster serving" in self.output():
                break
            time.sleep(0.5)
        else:
            self.close()
            raise AssertionError(f"server not ready in {timeout_s}s: {self.output()[-3000:]}")
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", timeout=120)

    def output(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def expected(tiny_dir):
    engine = make_engine("tiny-random", num_kv_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    completions = [o.text for o in engine.generate(PROMPTS, params)]
    chat_prompt = engine.tokenizer.apply_chat_template(CHAT)
    chat = engine.generate([chat_prompt], params)[0].text
    return completions, chat


def _check_server(server, expected):
    completions, chat = expected
    c = server.client
    for prompt, want in zip(PROMPTS, completions):
        r = c.completions.create(model="tiny-random", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == want, f"{prompt!r}: served {r.choices[0].text!r}, engine {want!r}"
        stream = c.completions.create(model="tiny-random", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want
    r = c.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == chat
    stream = c.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat
    # A bad request is a clear 4xx, and the server keeps serving.
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="tiny-random", prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="tiny-random"):
        c.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    r = c.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == completions[0]


def _metric(text, name):
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags", [["--mode", "colocated"], ["--mode", "disagg", "--spec", "ngram", "--num-spec-tokens", "3"]],
                         ids=["colocated", "disagg-ngram"])
def test_serve_modes_match_engine(expected, flags):
    server = Server(*flags)
    try:
        _check_server(server, expected)
    finally:
        server.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_serve_disagg_every_transport(expected, transport):
    import httpx

    server = Server("--mode", "disagg", "--transport", transport, "--cluster-secret", "ci-secret")
    try:
        _check_server(server, expected)
        metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
        assert _metric(metrics, "pdcluster:ttft_kv_transfer_seconds_count") > 0
        assert (_metric(metrics, "pdcluster:kv_transfer_bytes_total") or 0) > 0
    finally:
        server.close()
