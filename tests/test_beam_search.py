"""Beam search (engine/beam_search.py, ``LLMEngine.beam_search``, ``use_beam_search`` at the HTTP API).

- The search on made-up step results: end tokens complete a beam, the length penalty ranks as vLLM's
  score does (the prompt counts in the length, an end token does not), ``ignore_eos``, the step bound.
- On SmolLM2 in float32: beam width 1 is greedy decoding; the beams equal an independent beam search
  over transformers' log-softmax (vLLM's algorithm, written out here); the served answer (the `openai`
  client, a real server, a LocalRouter) equals the offline one, beam for beam, and frees every block;
  what beam search does not combine with is a 400 naming the field.
"""

from __future__ import annotations

import openai
import pytest
import torch

from conftest import make_engine
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.protocol import ChatMessage
from pdcluster.cluster.api.validation import chat_prompt_ids
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.beam_search import Beam, BeamSearch, BeamSearches, BeamSearchParams, beam_score
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.wire.logprobs import TokenLogprobs
from test_api import API_KEY, serving

pytestmark = pytest.mark.timeout(300)

EOS = 0
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NUM_BLOCKS = 256


def record(*pairs: tuple[int, float]) -> TokenLogprobs:
    """A step's record: the first pair is the sampled token, all of them the top alternatives."""
    ids, lps = [t for t, _ in pairs], [lp for _, lp in pairs]
    return TokenLogprobs(ids[0], lps[0], 1, ids, lps)


# ================================================================================== the search alone


def run_three_steps(length_penalty: float) -> BeamSearch:
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty),
                        frozenset({EOS}))
    assert search.pending() == [[7, 8]]
    search.advance([record((5, -0.1), (EOS, -2.0), (6, -3.0))])
    # EOS completed a beam; the two best others live on.
    assert [b.tokens for b in search.completed] == [[7, 8, EOS]]
    assert search.pending() == [[7, 8, 5], [7, 8, 6]]
    search.advance([record((9, -4.0), (EOS, -5.0)), record((9, -0.5), (EOS, -6.0))])
    # Live: [7,8,6,9] -3.5 and [7,8,5,9] -4.1 (the same length: the penalty ranks them alike).
    assert search.pending() == [[7, 8, 6, 9], [7, 8, 5, 9]]
    assert [b.tokens for b in search.completed] == [[7, 8, EOS], [7, 8, 5, EOS], [7, 8, 6, EOS]]
    search.advance([record((1, -0.1)), record((1, -0.1))])
    assert not search.live and search.pending() == []
    return search


def test_end_token_completes_a_beam_and_the_length_penalty_ranks():
    # length_penalty 1: cum / len, the prompt counted, an end token not: [7,8,6,9,1] -3.6 / 5 = -0.72,
    # [7,8,5,9,1] -4.2 / 5 = -0.84, [7,8,EOS] -2.0 / 2 = -1.0, [7,8,5,EOS] -5.1 / 3 = -1.7.
    best = run_three_steps(1.0).best()
    assert [b.tokens for b in best] == [[7, 8, 6, 9, 1], [7, 8, 5, 9, 1]]
    assert [b.finish_reason for b in best] == ["length", "length"]
    assert best[0].output_token_ids == [6, 9, 1] and best[0].cum_logprob == pytest.approx(-3.6)
    assert [lp.token_id for lp in best[0].logprobs] == [6, 9, 1]
    # length_penalty 0: the cumulative logprob alone: the short completed beam wins.
    best = run_three_steps(0.0).best()
    assert [b.tokens for b in best] == [[7, 8, EOS], [7, 8, 6, 9, 1]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert beam_score(Beam([7, 8, EOS], 2, -2.0), frozenset({EOS}), 1.0) == pytest.approx(-1.0)
    assert beam_score(Beam([7, 8, 4], 2, -2.0), frozenset({EOS}), 1.0) == pytest.approx(-2.0 / 3)


def test_ignore_eos_keeps_end_tokens_as_ordinary_tokens():
    search = BeamSearch([3], BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), frozenset({EOS}))
    search.advance([record((EOS, -0.1), (4, -1.0))])
    assert search.completed == [] and search.pending() == [[3, EOS]]


def test_sampled_token_outside_the_top_is_a_candidate_too():
    search = BeamSearch([3], BeamSearchParams(beam_width=3, max_tokens=1), frozenset({EOS}))
    # Sampled (at a temperature) token 9 is not among the top 2: it still competes, once.
    search.advance([TokenLogprobs(9, -0.7, 3, [4, 5], [-0.2, -0.5])])
    assert [b.output_token_ids for b in search.best()] == [[4], [5], [9]]
    assert [b.logprobs[0].rank for b in search.best()] == [1, 2, 3]


def test_more_logprobs_asked_never_change_the_candidates():
    """A step's record may hold more alternatives than the 2 x width the search looks at (the API asked for more
    logprobs): the others are shown, never searched. With a negative length penalty a completed beam ranks above
    longer ones, so an end token third in the list would win here were it a candidate."""
    params = BeamSearchParams(beam_width=1, max_tokens=1, length_penalty=-1.0, num_logprobs=3)
    assert params.step_params().logprobs == 3
    search = BeamSearch([3], params, frozenset({EOS}))
    search.advance([record((4, -1.0), (5, -1.1), (EOS, -1.2))])
    (best,) = search.best()
    assert best.output_token_ids == [4] and search.completed == []
    assert best.logprobs[0].top_token_ids == [4, 5, EOS]  # shown as they came


def test_step_params_keep_where_a_request_runs_not_its_sampling_filters():
    request = SamplingParams(max_tokens=50, temperature=0.7, top_k=3, stop=["."], cache_salt="tenant-a", priority=-2,
                             seed=5, presence_penalty=1.0)
    step = BeamSearchParams(beam_width=4, max_tokens=50, temperature=0.7).step_params(request)
    assert (step.max_tokens, step.logprobs, step.temperature, step.ignore_eos) == (1, 8, 0.7, True)
    assert (step.cache_salt, step.priority, step.seed) == ("tenant-a", -2, 5)
    assert (step.top_k, step.stop, step.presence_penalty) == (0, [], 0.0)


def test_several_searches_run_as_one_batch():
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    searches = BeamSearches([BeamSearch([3], params, frozenset({EOS})), BeamSearch([7, 8], params, frozenset({EOS}))])
    assert searches.pending() == [(0, [3]), (1, [7, 8])]
    searches.advance([record((4, -0.1), (5, -0.2)), record((9, -0.3), (6, -0.4))])
    assert searches.pending() == [(0, [3, 4]), (0, [3, 5]), (1, [7, 8, 9]), (1, [7, 8, 6])]
    with pytest.raises(ValueError, match="3 step results for 4 beams"):
        searches.advance([record((1, -0.1))] * 3)
    searches.advance([record((1, -0.1))] * 4)
    assert searches.pending() == []
    best = searches.best(lambda ids: "-".join(map(str, ids)))
    assert [[b.text for b in beams] for beams in best] == [["4-1", "5-1"], ["9-1", "6-1"]]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    search = BeamSearch([3], BeamSearchParams(beam_width=2, max_tokens=2), frozenset({EOS}))
    with pytest.raises(ValueError, match="2 step results for 1 beams"):
        search.advance([record((4, -1.0)), record((5, -1.0))])


# ================================================================================== on SmolLM2


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine("smollm2", dtype="float32", num_kv_blocks=NUM_BLOCKS, enable_prefix_caching=True)


def test_width_one_is_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=10))
    beams = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=10))
    for out, (beam,) in zip(greedy, beams):
        assert beam.output_token_ids == out.token_ids
        assert beam.text == out.text


def reference_beam_search(hf_model, prompt_ids: list[int], width: int, max_tokens: int, end_ids: frozenset[int],
                          length_penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's beam search written out over transformers' raw log-softmax (no engine code)."""
    def score(tokens, cum):
        n = len(tokens) - (1 if tokens[-1] in end_ids else 0)
        return cum / n ** length_penalty

    beams, completed = [(list(prompt_ids), 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                (completed if tok in end_ids else candidates).append((tokens + [tok], cum + lp))
        beams = sorted(candidates, key=lambda b: score(*b), reverse=True)[:width]
    ranked = sorted(completed + beams, key=lambda b: score(*b), reverse=True)[:width]
    return [(tokens[len(prompt_ids):], cum) for tokens, cum in ranked]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_equal_a_reference_search_over_transformers(engine, hf_model, length_penalty):
    width, max_tokens = 3, 6
    end_ids = frozenset(engine.tokenizer.stop_token_ids)
    results = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                           length_penalty=length_penalty))
    for prompt, beams in zip(PROMPTS, results):
        expected = reference_beam_search(hf_model, engine.tokenize(prompt), width, max_tokens, end_ids,
                                         length_penalty)
        assert [b.output_token_ids for b in beams] == [tokens for tokens, _ in expected]
        for beam, (_, cum) in zip(beams, expected):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert beam.finish_reason == ("stop" if beam.output_token_ids[-1] in end_ids else "length")
    assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


# ================================================================================== served


@pytest.fixture(scope="module")
def client(smollm2_dir):
    router = LocalRouter(EngineConfig(model="smollm2", dtype="float32", num_kv_blocks=NUM_BLOCKS),
                         request_timeout_s=60)
    metrics = Metrics("smollm2")
    app = build_app(router, "smollm2", api_key=API_KEY, metrics=metrics)
    try:
        with serving(app) as base_url:
            yield openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120), router, metrics
    finally:
        router.close()


def success_count(metrics: Metrics, reason: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith("pdcluster:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_served_completions_equal_offline_beams(client, engine):
    api, router, metrics = client
    width, max_tokens = 3, 8
    offline = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                           length_penalty=0.5))
    before = {reason: success_count(metrics, reason) for reason in ("length", "stop")}
    r = api.completions.create(model="smollm2", prompt=PROMPTS, n=width, max_tokens=max_tokens, temperature=0.0,
                               extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in r.choices] == list(range(len(PROMPTS) * width))
    for i, beams in enumerate(offline):
        got = r.choices[i * width:(i + 1) * width]
        assert [c.text for c in got] == [b.text for b in beams]
        assert [c.finish_reason for c in got] == [b.finish_reason for b in beams]
    assert r.usage.prompt_tokens == sum(len(engine.tokenize(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(b.output_token_ids) for beams in offline for b in beams)
    stats = router.worker.stats()
    assert stats["num_free_blocks"] == NUM_BLOCKS and stats["num_running"] == 0
    # /metrics: each returned beam is a finished request, its output tokens generated tokens.
    reasons = [b.finish_reason for beams in offline for b in beams]
    assert success_count(metrics, "length") - before["length"] == reasons.count("length")
    assert success_count(metrics, "stop") - before["stop"] == reasons.count("stop")


def test_served_chat_beam_search(client, engine):
    api, _, _ = client
    content = "Name a fruit."
    r = api.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}], n=2,
                                    max_tokens=6, temperature=0.0, extra_body={"use_beam_search": True})
    prompt_ids = chat_prompt_ids([ChatMessage(role="user", content=content)], True, engine.tokenizer)
    offline = engine.beam_search([prompt_ids], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    assert [c.message.content for c in r.choices] == [b.text for b in offline]
    assert [c.message.role for c in r.choices] == ["assistant", "assistant"]
    assert r.usage.prompt_tokens == len(prompt_ids)


def test_served_beams_carry_their_logprobs_when_asked(client, engine):
    api, _, _ = client
    width, max_tokens = 2, 6
    offline = engine.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=width, max_tokens=max_tokens))[0]
    r = api.completions.create(model="smollm2", prompt=PROMPTS[0], n=width, max_tokens=max_tokens, temperature=0.0,
                               logprobs=5, extra_body={"use_beam_search": True})
    for choice, beam in zip(r.choices, offline, strict=True):
        assert choice.text == beam.text
        lp = choice.logprobs
        assert len(lp.tokens) == len(beam.output_token_ids) == len(lp.token_logprobs) == len(lp.text_offset)
        assert sum(lp.token_logprobs) == pytest.approx(beam.cum_logprob, abs=1e-4)  # the score's own numbers
        assert all(len(top) >= 5 for top in lp.top_logprobs)  # 5 asked for, more than the 2 x 2 searched
        assert "".join(lp.tokens).startswith(choice.text)  # and an end token's own string, as every choice shows
    chat = api.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], n=width,
                                       max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2,
                                       extra_body={"use_beam_search": True})
    for choice in chat.choices:
        content = choice.logprobs.content
        assert content and "".join(e.token for e in content).startswith(choice.message.content)
        assert all(len(e.top_logprobs) == 2 for e in content)


@pytest.mark.parametrize("extra,field", [
    ({"stream": True}, "stream"), ({"prompt_logprobs": 2}, "prompt_logprobs"), ({"echo": True}, "echo"),
    ({"stop": ["."]}, "stop"), ({"n": 11}, "n"), ({"return_token_ids": True}, "return_token_ids"),
    ({"response_format": {"type": "json_object"}}, "response_format")])
def test_what_beam_search_does_not_combine_with_is_a_400(client, extra, field):
    api, _, _ = client
    body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 4, "n": 2, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(**{k: v for k, v in body.items() if k in ("model", "prompt", "max_tokens", "n",
                                                                         "stream", "logprobs", "echo", "stop")},
                               extra_body={"use_beam_search": True,
                                           **{k: v for k, v in extra.items()
                                              if k in ("return_token_ids", "response_format", "prompt_logprobs")}})
    assert field in str(err.value)


def test_length_penalty_without_beam_search_is_a_400(client):
    api, _, _ = client
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        api.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=2, extra_body={"length_penalty": 2.0})


def test_disagg_cluster_serves_the_offline_beams(ray_session, engine):
    """Through the Ray cluster's router, prefill and decode on two workers (KV over tcp): the same beams,
    and every worker has all its blocks back."""
    import asyncio

    import httpx

    from conftest import engine_config, settled_worker_stats
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig
    from test_admin_api import serving as async_serving

    width, max_tokens = 2, 5
    offline = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    cluster = Cluster(ClusterSpec(engine=engine_config("smollm2", dtype="float32", num_kv_blocks=NUM_BLOCKS),
                                  transfer=TransferConfig(transport="tcp", secret="k"), mode="disagg"))

    async def main():
        cluster.router.start(asyncio.get_running_loop())
        async with async_serving(build_app(cluster.router, "smollm2", api_key=API_KEY)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=240,
                                         headers={"Authorization": f"Bearer {API_KEY}"}) as http:
                r = await http.post("/v1/completions", json={
                    "model": "smollm2", "prompt": PROMPTS, "n": width, "max_tokens": max_tokens,
                    "temperature": 0.0, "use_beam_search": True})
                assert r.status_code == 200, r.text
                return r.json()

    try:
        body = asyncio.run(main())
        assert [c["text"] for c in body["choices"]] == [b.text for beams in offline for b in beams]
        for wid, st in settled_worker_stats(cluster, 10).items():
            assert st["num_free_blocks"] == st["num_blocks"], f"{wid} leaked blocks: {st}"
    finally:
        cluster.shutdown()
