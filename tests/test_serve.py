"""`pdcluster serve` as users run it: a subprocess, real Ray, real HTTP, the real `openai` client.
Greedy outputs equal the offline engine's (what `pdcluster generate` prints) in colocated mode, in
disagg mode for every transport, and in disagg mode with speculation. Ctrl-C stops an idle server
cleanly; a busy port is one error line before Ray starts."""

import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import make_engine, transport_params
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.tools.loadtest.server_metrics import parse_prometheus
from pdcluster.tools.server_process import ServeProcess

openai = pytest.importorskip("openai")

PROMPTS = ["Hello there, how", "The list of numbers: 3, 1, 4,", "def main():"]
CHAT = [{"role": "user", "content": "Name a color."}]
MAX_TOKENS = 10


class Server(ServeProcess):
    """`pdcluster serve --model tiny-random` with ``flags``, and an openai client on it."""

    def __init__(self, *flags, timeout_s=240):
        super().__init__(["--model", "tiny-random", "--num-kv-blocks", "256", "--max-model-len", "1024", *flags],
                         timeout_s=timeout_s)
        self.client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", timeout=120)


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


MEAN_POOLER = ["--pooler-config", '{"pooling_type": "MEAN"}']


def _check_embeddings(server, pooling: str) -> None:
    """/v1/embeddings through the openai client: the engine's vectors (``pooling``, as --pooler-config set it)."""
    import numpy as np

    want = make_engine("tiny-random", num_kv_blocks=256).embed(PROMPTS, pooling=pooling)
    got = server.client.embeddings.create(model="tiny-random", input=PROMPTS)
    for d, ref in zip(got.data, want):
        assert np.abs(np.array(d.embedding, dtype=np.float32) - ref).max() < 1e-5


def _metric(text, name):
    return parse_prometheus(text).get(name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags", [["--mode", "colocated"], ["--mode", "disagg", "--spec", "ngram", "--num-spec-tokens", "3"]],
                         ids=["colocated", "disagg-ngram"])
def test_serve_modes_match_engine(expected, flags):
    server = Server(*flags, *MEAN_POOLER)
    try:
        _check_server(server, expected)
        _check_embeddings(server, "mean")
    finally:
        server.close()


@pytest.mark.timeout(600)
def test_serve_tensor_parallel_colocated_matches_engine(expected):
    """A colocated worker whose model is split over two ranks (engine/tensor_parallel/: the Ray actor is rank 0 and
    starts the other) serves what the whole model computes; the server's stop takes the other rank with it."""
    server = Server("--mode", "colocated", "--tensor-parallel-size", "2")
    try:
        _check_server(server, expected)
        ranks = _tp_ranks(server)
        assert len(ranks) == 1  # rank 1 (rank 0 is the worker actor itself)
    finally:
        server.close()
    deadline = time.monotonic() + 30
    while _alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(ranks)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags, num_other_ranks", [
    pytest.param(["--tensor-parallel-size", "2"], 2, marks=pytest.mark.slow, id="both-2"),
    pytest.param(["--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"], 1,
                 id="prefill-2-decode-1"),
])
def test_serve_tensor_parallel_disagg_matches_engine(expected, flags, num_other_ranks):
    """Disaggregated workers split over ranks. Both two ways: rank r of the prefill worker sends its KV heads to rank r
    of the decode worker (kv_transfer/transports/ranked.py, over the ranks' shared caches). Prefill two ways, decode
    whole: the prefill worker lays both ranks' heads side by side for it (kv_transfer/transports/resplit.py). What is
    served is what the whole model computes."""
    import httpx

    server = Server("--mode", "auto", *flags) if num_other_ranks == 1 else Server("--mode", "disagg", *flags)
    try:
        _check_server(server, expected)
        assert len(_tp_ranks(server)) == num_other_ranks  # each split worker's ranks past rank 0
        metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
        assert _metric(metrics, "pdcluster:ttft_kv_transfer_seconds_count") > 0
        assert (_metric(metrics, "pdcluster:kv_transfer_bytes_total") or 0) > 0
    finally:
        server.close()


def _tp_ranks(server) -> list:
    """``server``'s live processes running a tensor-parallel rank's entry (engine/tensor_parallel/worker.py): its
    descendants only (Ray's raylet and workers are), as another test's processes may run beside it."""
    import psutil

    ranks = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "multiprocessing.spawn" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                ranks.append(proc)
        except psutil.NoSuchProcess:
            pass
    return ranks


def _alive(procs) -> list:
    import psutil

    def running(proc) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [proc for proc in procs if running(proc)]


@pytest.mark.timeout(900)
# tcp, serve's default, is also test_serve_modes_match_engine's disagg run: here shm, the others slow.
@pytest.mark.parametrize("transport", transport_params(fast=("shm",)))
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


# ================================================================================== start and stop


@pytest.mark.timeout(600)
def test_ctrl_c_on_an_idle_server_exits_cleanly(tiny_dir):
    """Ctrl-C on a server that never served a request stops it with status 0 and no traceback. The
    router's event thread starts with the first request; its close() used to join it regardless
    (``RuntimeError: cannot join thread before it is started``, fixed in cluster/router/events.py)."""
    server = Server("--mode", "colocated")
    try:
        status = server.interrupt(timeout_s=120)
    finally:
        server.close()
    out = server.output()
    assert "Traceback" not in out and "cannot join thread" not in out, out[-3000:]
    assert status == 0, out[-3000:]


@pytest.mark.timeout(300)
def test_busy_port_is_one_line_before_ray_starts(tiny_dir, tmp_path):
    """A port already in use fails at once (before Ray and the workers start): one line naming the
    port, exit status 2, no traceback."""
    tmp = str(tmp_path)
    env = dict(os.environ, RAY_TMPDIR=tmp, HOME=tmp)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pdcluster.cli", "serve", "--mode", "colocated",
                            "--model", "tiny-random", "--port", str(port)],
                           capture_output=True, text=True, timeout=240, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0], out[-3000:]
    assert not os.path.exists(os.path.join(tmp, "ray")), "it started Ray before looking at the port"
