"""vLLM's ``thinking_token_budget`` (engine/thinking_budget.py): at most that many tokens inside a thinking section,
then the end marker is forced, token by token.

The forced token is a function of the tokens alone, checked against a plain full-scan reference on random
generations (the windowed search agrees with it everywhere a budget could have produced); then the real engine on
the tiny model: the free tokens before the budget, the end marker at the budget (the prompt's open section counted),
nothing forced outside a section; speculative decoding (n-gram and MTP, synchronous and async) and a
disaggregated pair give exactly the plain engine's tokens; and the API (a real server on the real engine, the
`openai` client): the reasoning cut at the budget, whole and streamed, on chat and completions, and clear 400s.
"""

from __future__ import annotations

import contextlib
import functools

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import engine_config, make_engine
from test_api import serving
from test_kv_transfer_e2e import run_on_pair
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.reasoning import thinking_markers
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.thinking_budget import forced_token, last_index, open_section_tokens
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.kv_transfer.config import TransferConfig

pytestmark = pytest.mark.timeout(300)

# The tiny model's tokenizer (SmolLM2's) spells the markers in three tokens each.
START, END = [44, 17400, 46], [9617, 17400, 46]
NUM_BLOCKS = 256


def _budget(budget: int, **kw) -> SamplingParams:
    return SamplingParams(thinking_token_budget=budget, reasoning_start_token_ids=START,
                          reasoning_end_token_ids=END, **kw)


# ================================================================================== the rule, on token lists


def _reference(prompt, output, budget, start, end):
    """The rule read off the whole sequence (no window, no cache): the open section's length from its start."""
    seq = prompt + output
    count = open_section_tokens(seq, start, end)
    if count is None or count < budget:
        return None
    return next(end[k] for k in range(len(end) - 1, -1, -1) if k == 0 or seq[-k:] == end[:k])


def _forced(prompt, output, budget, start=START, end=END):
    return forced_token(prompt, output, budget, start, end, open_section_tokens(prompt, start, end))


def test_last_index_finds_the_last_occurrence():
    assert last_index([1, 2, 3, 1, 2, 3], [1, 2]) == 3
    assert last_index([1, 2, 3], [3]) == 2
    assert last_index([1, 2, 3], [2, 1]) == -1
    assert last_index([1], [1, 1]) == -1


@pytest.mark.parametrize("prompt,output,budget,expected", [
    ([5, *START], [], 0, END[0]),  # budget 0 closes the prompt's open section at once
    ([5, *START], [7, 8], 2, END[0]),
    ([5, *START], [7, 8, END[0]], 2, END[1]),  # the marker goes on, token by token
    ([5, *START], [7, 8, *END[:2]], 2, END[2]),
    ([5, *START], [7, 8, *END], 2, None),  # closed: free again
    ([5, *START], [7], 2, None),  # under the budget
    ([5, *START, 9, 9], [7], 3, END[0]),  # the prompt's tokens after the marker count
    ([5, 6], [7, 8, 9], 0, None),  # no section: nothing forced
    ([5, *START, 9, *END], [7, 8], 0, None),  # the prompt's section closed in the prompt
    ([5, *START[:2]], [START[2], 7], 1, END[0]),  # the start marker straddles the prompt's end
    ([5, *START], [7, END[0]], 2, END[1]),  # the model began the marker itself: it is finished, not restarted
    ([5], [*START, 7, 8, *END, 1, 2, *START, 3], 1, END[0]),  # a section opened again counts afresh
    ([5], [*START, 7, 8, *END, 1, 2, *START], 1, None),
])
def test_forced_token(prompt, output, budget, expected):
    assert _forced(prompt, output, budget) == expected
    assert _reference(prompt, output, budget, START, END) == expected


def test_a_long_section_in_the_prompt_is_closed_at_once():
    prompt = [1, *START] + list(range(100, 400))  # 300 thinking tokens, beyond any window of a budget of 5
    assert _forced(prompt, [], 5) == END[0]
    assert _forced(prompt, [END[0], END[1]], 5) == END[2]
    assert _forced(prompt, list(END) + list(range(20)), 5) is None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_windowed_rule_equals_the_full_scan_on_any_generation(data):
    """Random generations over a small alphabet rich in marker pieces, each position forced where the rule says:
    at every position the windowed, cached search gives the full scan's answer."""
    start, end = data.draw(st.sampled_from([([1], [2]), ([1, 3], [2, 3]), ([1, 3, 4], [2, 3, 4])]))
    alphabet = st.integers(0, 5)
    prompt = data.draw(st.lists(alphabet, max_size=12))
    budget = data.draw(st.integers(0, 6))
    output = []
    for _ in range(data.draw(st.integers(0, 40))):
        want = _reference(prompt, output, budget, start, end)
        got = forced_token(prompt, output, budget, start, end, open_section_tokens(prompt, start, end))
        assert got == want, (prompt, output, budget)
        output.append(want if want is not None else data.draw(alphabet))
    # Under the rule no section outlives its budget by more than its end marker.
    opened = open_section_tokens(prompt + output, start, end)
    assert opened is None or opened < max(budget, open_section_tokens(prompt, start, end) or 0) + len(end)


def test_bad_budgets_are_refused_by_the_engine():
    with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0"):
        _budget(-1)
    with pytest.raises(ValueError, match="reasoning start and end markers"):
        SamplingParams(thinking_token_budget=4)
    with pytest.raises(ValueError, match="structured output"):
        _budget(4, structured_output='{"type": "json_object"}')


# ================================================================================== the engine

PROMPT = list(range(300, 320)) + START  # a section opened by the prompt (DeepSeek-R1's template does this)
PLAIN = list(range(300, 323))  # no section


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_engine(num_kv_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def free(engine):
    return engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_the_end_marker_comes_at_the_budget(engine, free, budget):
    out = engine.generate([PROMPT], _budget(budget, max_tokens=12, ignore_eos=True))[0].token_ids
    assert out[:budget] == free[:budget]  # free until the budget
    assert out[budget:budget + len(END)] == END
    assert out[budget + len(END):] != free[budget + len(END):]  # and the answer follows the forced marker


def test_the_prompts_own_thinking_counts(engine):
    prompt = PROMPT + [400, 401]
    free = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    out = engine.generate([prompt], _budget(5, max_tokens=8, ignore_eos=True))[0].token_ids
    assert out == free[:3] + END + out[6:]


def test_nothing_is_forced_outside_a_section(engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert (engine.generate([PLAIN], _budget(0, max_tokens=12, ignore_eos=True))[0].token_ids
            == engine.generate([PLAIN], params)[0].token_ids)


def test_sampling_keeps_to_the_forced_marker(engine):
    params = _budget(2, max_tokens=10, ignore_eos=True, temperature=1.0, seed=7, repetition_penalty=1.3)
    outs = engine.generate([PROMPT, PROMPT[5:]], params)
    for out in outs:
        assert out.token_ids[2:5] == END


# A prompt whose earlier text shows the markers, so n-gram drafts propose the forced tokens too.
SPEC_PROMPT = list(range(300, 310)) + START + [7, 8] + END + [9] + START
SPEC_PROMPTS = [SPEC_PROMPT, PROMPT, PLAIN]
SPEC_PARAMS = _budget(3, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_spec_tokens(tiny_dir):
    plain = make_engine(num_kv_blocks=NUM_BLOCKS, async_scheduling=False)
    return [o.token_ids for o in plain.generate(SPEC_PROMPTS, SPEC_PARAMS)]


@pytest.mark.parametrize("method,async_scheduling", [("none", True), ("ngram", False), ("ngram", True),
                                                     ("mtp", False), ("mtp", True)])
def test_speculative_decoding_and_async_scheduling_are_lossless_with_a_budget(plain_spec_tokens, method,
                                                                               async_scheduling):
    spec = make_engine(num_kv_blocks=NUM_BLOCKS, spec_method=method, num_spec_tokens=0 if method == "none" else 3,
                       async_scheduling=async_scheduling)
    assert [o.token_ids for o in spec.generate(SPEC_PROMPTS, SPEC_PARAMS)] == plain_spec_tokens
    assert plain_spec_tokens[0][3:6] == END


@pytest.mark.parametrize("budget", [0, 3])
def test_a_disaggregated_pair_equals_colocated(engine, budget):
    """Budget 0 forces the first token, which the prefill worker samples; the rest the decode worker does."""
    params = _budget(budget, max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in engine.generate(SPEC_PROMPTS, params)]
    cfg = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=512)()
    run = run_on_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), SPEC_PROMPTS, params, NUM_BLOCKS)
    assert run.tokens == expected
    assert run.tokens[1][budget:budget + 3] == END


# ================================================================================== the API

MODEL = "tiny-random"


@contextlib.contextmanager
def _api(parser: str | None):
    router = LocalRouter(EngineConfig(model=MODEL, num_kv_blocks=NUM_BLOCKS, max_model_len=1024),
                         request_timeout_s=30)
    try:
        with serving(build_app(router, MODEL, reasoning_parser=parser)) as base_url:
            yield openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    finally:
        router.close()


@pytest.fixture(scope="module")
def client(tiny_dir):
    with _api("deepseek_r1") as c:
        yield c


# The reply begun by the client opens the section (deepseek_r1: reasoning until </think>).
THINKING_CHAT = [{"role": "user", "content": "Is 7 prime?"}, {"role": "assistant", "content": "<think>"}]
CHAT = dict(model=MODEL, messages=THINKING_CHAT, max_tokens=12, temperature=0.0,
            extra_body={"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True,
                        "return_token_ids": True})


def test_markers_of_each_parser(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert thinking_markers("qwen3", tok) == (START, END) == thinking_markers("deepseek_r1", tok)


def test_chat_reasoning_stops_at_the_budget(client, tiny_dir):
    tok = Tokenizer(tiny_dir)
    free = client.chat.completions.create(**CHAT)
    assert END not in [free.choices[0].token_ids[i:i + 3] for i in range(10)]  # this model never ends it itself
    body = {**CHAT, "extra_body": {**CHAT["extra_body"], "thinking_token_budget": 4}}
    r = client.chat.completions.create(**body)
    ids = r.choices[0].token_ids
    assert ids[:4] == free.choices[0].token_ids[:4] and ids[4:7] == END
    message = r.choices[0].message
    assert message.reasoning == tok.decode(ids[:4])
    assert message.content == tok.decode(ids[7:])
    # Streamed: the same reasoning and answer, piece by piece.
    stream = client.chat.completions.create(**{**body, "stream": True})
    reasoning, content = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning, message.content)


def test_completions_take_a_budget_too(client, tiny_dir):
    prompt = Tokenizer(tiny_dir).decode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0,
                                  extra_body={"ignore_eos": True, "thinking_token_budget": 2,
                                              "return_token_ids": True})
    assert r.choices[0].token_ids[2:5] == END
    assert "</think>" in r.choices[0].text


@pytest.mark.parametrize("extra,message", [
    ({"thinking_token_budget": -1}, "must be >= 0"),
    ({"thinking_token_budget": 4, "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"thinking_token_budget": 4, "use_beam_search": True, "n": 2, "return_token_ids": False}, "use_beam_search"),
])
def test_bad_requests_are_400s(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message) as e:
        client.chat.completions.create(**{**CHAT, "extra_body": {**CHAT["extra_body"], **extra}})
    assert e.value.body["param"] == "thinking_token_budget"


def test_a_server_without_a_reasoning_parser_says_what_is_missing(tiny_dir):
    with _api(None) as c:
        with pytest.raises(openai.BadRequestError, match="--reasoning-parser"):
            c.chat.completions.create(**{**CHAT, "extra_body": {**CHAT["extra_body"], "thinking_token_budget": 4}})
