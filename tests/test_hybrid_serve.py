"""`pdcluster serve --model tiny-hybrid` (Mamba2 + attention) as users run it, in every mode: local
(in-process engine, no Ray), colocated and disagg (Ray actors; disagg sends each prompt's Mamba state
with its KV). A real subprocess, real HTTP, the real `openai` client; one server per mode.

In each mode: greedy completion and chat equal the in-process LLMEngine's tokens (text and count),
streamed or not; n=2 with seed s gives two choices equal to what the engine samples with seeds s and
s + 1 (cluster/api/fanout.py; a hybrid never shares a prompt between choices, so each choice computes,
or disaggregated fetches, its own, engine/llm_engine.py ``shares_prompts``) and to two single requests
with those seeds; logprobs=2 on a completion are the engine's; /health lists the mode's workers.
"""

from __future__ import annotations

import httpx
import pytest

from conftest import make_engine, slow_params
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.tools.server_process import ServeProcess
from test_serve import CHAT, MAX_TOKENS, PROMPTS, _metric

openai = pytest.importorskip("openai")

MODEL = "tiny-hybrid"
SERVER_FLAGS = ["--model", MODEL, "--num-kv-blocks", "256", "--max-model-len", "512"]
SEED = 1234
TOL = 1e-4
MODES = {"local": ["--mode", "local"], "colocated": ["--mode", "colocated"],
         "disagg": ["--mode", "disagg", "--transport", "tcp"],
         # Both workers split over two ranks: each rank's heads' Mamba state travels in its own cache's state blocks.
         "disagg-tp2": ["--mode", "disagg", "--transport", "tcp", "--tensor-parallel-size", "2"]}
# What /health lists in each mode: the roles of its workers (None: the local worker has no role).
WORKER_ROLES = {"local": [None], "colocated": ["decode"], "disagg": ["decode", "prefill"],
                "disagg-tp2": ["decode", "prefill"]}
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}  # every request runs to max_tokens


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def expected():
    """The in-process engine's outputs (the same flags as the servers'), by what the tests ask for."""
    engine = make_engine(MODEL, num_kv_blocks=256, max_model_len=512)
    chat_prompt = engine.tokenizer.apply_chat_template(CHAT)
    return {
        "completions": engine.generate(PROMPTS, _greedy()),
        "chat": engine.generate([chat_prompt], _greedy())[0],
        "sampled": [engine.generate(PROMPTS[:1], _sampled(SEED + j))[0] for j in range(2)],
        "logprobs": engine.generate(PROMPTS[:1], _greedy(logprobs=2))[0],
    }


# colocated is local's engine behind disagg's Ray plumbing, disagg-tp2 disagg's split (its engine paths are
# tests/test_tensor_parallel_hybrid.py's): in the slow pass (.ci/run runs it after).
@pytest.fixture(scope="module", params=slow_params(MODES, slow=("colocated", "disagg-tp2")))
def server(request):
    s = ServeProcess([*SERVER_FLAGS, *MODES[request.param]], timeout_s=180, stop_timeout_s=20)
    s.mode = request.param
    s.client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)
    yield s
    s.close()


@pytest.mark.timeout(300)
def test_health_lists_the_workers(server):
    body = httpx.get(server.base_url + "/health", timeout=10, trust_env=False).json()
    assert body["status"] == "ok", body
    workers = body["workers"]
    assert sorted((w.get("role") for w in workers), key=str) == WORKER_ROLES[server.mode], workers
    assert all(w.get("healthy", True) for w in workers), workers


@pytest.mark.timeout(300)
def test_greedy_equals_the_engine(server, expected):
    c = server.client
    for prompt, want in zip(PROMPTS, expected["completions"]):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **IGNORE_EOS)
        assert r.choices[0].text == want.text, f"{prompt!r}: served {r.choices[0].text!r}, engine {want.text!r}"
        assert r.usage.completion_tokens == len(want.token_ids) == MAX_TOKENS
    want = expected["chat"]
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, **IGNORE_EOS)
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.timeout(300)
def test_streaming_equals_the_engine(server, expected):
    c = server.client
    want = expected["completions"][0].text
    stream = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                  **IGNORE_EOS)
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       **IGNORE_EOS)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == expected["chat"].text


def _kv_bytes_sent(server) -> float:
    """KV (and state) bytes moved from prefill to decode workers so far; 0 where nothing moves."""
    text = httpx.get(server.base_url + "/metrics", timeout=10, trust_env=False).text
    return _metric(text, "pdcluster:kv_transfer_bytes_total") or 0


@pytest.mark.timeout(300)
def test_n2_with_seed_equals_two_seeded_requests(server, expected):
    c = server.client
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0, **IGNORE_EOS)
    before = _kv_bytes_sent(server)
    r = c.completions.create(**kw, seed=SEED, n=2)
    n2_bytes = _kv_bytes_sent(server) - before
    choices = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1]
    assert choices == [o.text for o in expected["sampled"]]
    assert choices[0] != choices[1], "two seeds gave one sample"
    assert r.usage.completion_tokens == 2 * MAX_TOKENS
    before = _kv_bytes_sent(server)
    singles = [c.completions.create(**kw, seed=SEED + j).choices[0].text for j in range(2)]
    assert singles == choices
    # A hybrid shares no prompt between choices: disaggregated, each choice fetched its own prompt
    # (KV + Mamba state), as the two single requests did.
    assert n2_bytes == _kv_bytes_sent(server) - before
    assert (n2_bytes > 0) == server.mode.startswith("disagg"), n2_bytes


@pytest.mark.timeout(300)
def test_completion_logprobs_equal_the_engine(server, expected):
    want = expected["logprobs"]
    r = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=2, **IGNORE_EOS)
    ch = r.choices[0]
    assert ch.text == want.text
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    for got, rec in zip(lp.token_logprobs, want.logprobs):
        assert abs(got - rec.logprob) < TOL, (lp.token_logprobs, [x.logprob for x in want.logprobs])
    for top, rec in zip(lp.top_logprobs, want.logprobs):
        # Greedy: the sampled token is the most likely, so exactly the 2 most likely are listed.
        assert len(top) == 2 and max(top.values()) == pytest.approx(rec.logprob, abs=TOL)
        assert sorted(top.values(), reverse=True) == pytest.approx(rec.top_logprobs[:2], abs=TOL)
