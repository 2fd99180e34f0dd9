"""A decode step's tokens as one ``StepTokens`` event (node/events.py): the decode worker sends one event a
step for every request that needs nothing more said (not finished, no logprobs) instead of one ``Tokens``
a request, and every consumer reads its rows as the ``Tokens`` they stand for. Checked here: the rows
equal those Tokens field by field, malformed columns are refused (built locally and off the wire; the
router's receiver drops and logs one: test_router_lifecycle.py), and a real decode worker's stream,
expanded, equals the engine's output with a request's last tokens and logprobs still in their own
``Tokens``."""

from __future__ import annotations

import dataclasses
import queue
import re
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import engine_config, make_engine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.events import EVENT_CODEC, EVENTS_VERSION, MAX_EVENT_BYTES, StepTokens, Tokens, expand
from pdcluster.wire.records import ProtocolError

_counts = st.integers(0, 2**40)
_rows = st.lists(st.tuples(st.text(min_size=1, max_size=12), st.lists(st.integers(0, 2**31), max_size=4),
                           _counts, _counts, _counts, _counts, _counts, _counts), max_size=20)


def _step(worker_id: str, rows) -> StepTokens:
    columns = list(zip(*rows)) if rows else [()] * 8
    return StepTokens(worker_id, list(columns[0]), [len(t) for t in columns[1]], [t for ts in columns[1] for t in ts],
                      *(list(c) for c in columns[2:]))


def _tokens(worker_id: str, row) -> Tokens:
    request_id, token_ids, computed, output, draft, accepted, cached, offloaded = row
    return Tokens(request_id=request_id, worker_id=worker_id, new_token_ids=list(token_ids),
                  num_computed_tokens=computed, num_output_tokens=output, num_draft_tokens=draft,
                  num_accepted_tokens=accepted, num_cached_tokens=cached, num_offloaded_tokens=offloaded)


@pytest.mark.timeout(60)
@given(rows=_rows)
@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_rows_are_the_tokens_each_request_would_have_sent(rows):
    step = _step("decode-0", rows)
    expected = [_tokens("decode-0", row) for row in rows]
    decoded = EVENT_CODEC.decode(EVENT_CODEC.encode(step), MAX_EVENT_BYTES)
    assert decoded == step
    for got in (step.rows(), decoded.rows(), expand(decoded)):
        assert got == expected
        # Every field of Tokens, set (a field added to Tokens must be added to rows() too).
        assert all(set(vars(t)) == {f.name for f in dataclasses.fields(Tokens)} for t in got)
    rows_a, rows_b = step.rows(), step.rows()
    assert all(a.new_token_ids is not b.new_token_ids for a, b in zip(rows_a, rows_b))  # no shared lists


def test_of_engine_columns_is_the_checked_record_and_encoding_still_checks_it():
    """The decode worker's per-step record skips the construction checks (its columns are its engine's
    ints); it equals the checked record, and one that left a bad value is still refused when encoded for the
    wire."""
    body = _body()
    fast = StepTokens.of_engine_columns(*body.values())
    assert fast == StepTokens(**body) and fast.rows() == StepTokens(**body).rows()
    bad = StepTokens.of_engine_columns(*_body(num_cached_tokens=[0, "1"]).values())
    with pytest.raises(ProtocolError, match=re.escape("StepTokens.num_cached_tokens[1]: expected int")):
        EVENT_CODEC.encode(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model, overrides", [
    ("tiny-random", {}),
    ("tiny-random", {"async_scheduling": True}),
    ("tiny-random", {"spec_method": "ngram", "num_spec_tokens": 2}),
    ("tiny-random", {"spec_method": "ngram", "num_spec_tokens": 2, "async_scheduling": True}),
    ("tiny-hybrid", {}),
])
def test_the_fields_a_step_tokens_row_carries_are_plain_values(model, overrides):
    """The decode worker builds its StepTokens unchecked from the engine's outputs (of_engine_columns), so those
    outputs must already be what a checked build would make of them: plain ints (never numpy's, which the codec's
    check would convert and in-process consumers such as JSON would refuse) and a str id, under speculation, async
    scheduling and a hybrid model, greedy and seeded rows alike."""
    engine = make_engine(model, **overrides)
    engine.cumulative_outputs = False  # the decode worker's setting
    for i in range(4):
        engine.add_request([5 + (7 * i + 3 * j) % 300 for j in range(20 + 5 * i)],
                           SamplingParams(max_tokens=12, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True))
    counts = ("num_computed_tokens", "num_output_tokens", "num_draft_tokens", "num_accepted_tokens",
              "num_cached_tokens", "num_offloaded_tokens")
    num_rows = 0
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            num_rows += 1
            assert type(out.request_id) is str
            assert all(type(getattr(out, name)) is int for name in counts), out
            assert all(type(t) is int for t in out.new_token_ids), out.new_token_ids
    assert not engine.has_unfinished() and num_rows >= 4 * 12 // 3


def test_expand_leaves_other_events_alone():
    ev = Tokens(request_id="r", worker_id="w", new_token_ids=[1], num_computed_tokens=3, num_output_tokens=1)
    assert expand(ev) == [ev]


def _body(**overrides) -> dict:
    body = {"worker_id": "d0", "request_ids": ["a", "b"], "num_new_tokens": [1, 2], "new_token_ids": [5, 6, 7],
            "num_computed_tokens": [10, 11], "num_output_tokens": [1, 2], "num_draft_tokens": [0, 0],
            "num_accepted_tokens": [0, 0], "num_cached_tokens": [0, 0], "num_offloaded_tokens": [0, 0]}
    return {**body, **overrides}


@pytest.mark.parametrize("overrides, says", [
    ({"num_output_tokens": [1]}, "StepTokens.num_output_tokens: expected 2 values"),
    ({"request_ids": ["a"]}, "StepTokens.num_new_tokens: expected 1 values"),
    ({"num_new_tokens": [-1, 4]}, "StepTokens.num_new_tokens: expected counts >= 0"),
    ({"new_token_ids": [5, 6]}, "StepTokens.new_token_ids: expected 3 tokens"),
    ({"num_cached_tokens": [0, "1"]}, "StepTokens.num_cached_tokens[1]: expected int"),
    ({"request_ids": ["a", 7]}, "StepTokens.request_ids[1]: expected str, got int 7"),
    ({"request_ids": "ab"}, "StepTokens.request_ids: expected list of str"),
])
def test_malformed_columns_are_refused_built_and_decoded(overrides, says):
    body = _body(**overrides)
    with pytest.raises(ProtocolError, match="^" + re.escape(says)):
        StepTokens(**body)
    with pytest.raises(ProtocolError, match=re.escape(says)):
        EVENT_CODEC.decode(msgpack.packb({"v": EVENTS_VERSION, "t": "StepTokens", "b": body}), MAX_EVENT_BYTES)
    StepTokens(**_body())  # the unmodified body is fine


@pytest.mark.timeout(120)
def test_decode_worker_sends_one_event_a_step_and_the_stream_equals_the_engine():
    """Five requests on one real decode worker (tiny-random): four plain ones of different lengths and
    one with logprobs. Each step's plain rows come as one StepTokens; a request's last tokens and the
    logprobs request's tokens come as Tokens of their own; expanded, each request's tokens and counts
    are the engine's (S1: num_output_tokens is the running count)."""
    from pdcluster.decode_node.worker import DecodeWorker

    prompts = {f"r{i}": list(range(100 + 40 * i, 100 + 40 * i + 20 + 3 * i)) for i in range(5)}
    params = {rid: SamplingParams(max_tokens=12 + 4 * i, ignore_eos=True, logprobs=2 if rid == "r4" else None)
              for i, rid in enumerate(prompts)}
    engine = make_engine()
    expected = {rid: engine.generate([p], params[rid])[0].token_ids for rid, p in prompts.items()}
    worker = DecodeWorker("d0", engine_config())
    events: queue.SimpleQueue = queue.SimpleQueue()
    raw = []
    worker.on_event = events.put
    try:
        for rid, p in prompts.items():
            worker.submit(rid, p, params[rid])
        finished = set()
        deadline = time.monotonic() + 90
        while len(finished) < len(prompts) and time.monotonic() < deadline:
            try:
                ev = events.get(timeout=1)
            except queue.Empty:
                continue
            raw.append(ev)
            finished |= {e.request_id for e in expand(ev) if isinstance(e, Tokens) and e.finished}
        assert finished == set(prompts)
    finally:
        worker.close()
    steps = [ev for ev in raw if isinstance(ev, StepTokens)]
    assert steps and max(len(s.request_ids) for s in steps) == 4, "the plain rows of a step travel together"
    assert all("r4" not in s.request_ids for s in steps), "a request with logprobs keeps its own Tokens"
    assert all(len(set(s.request_ids)) == len(s.request_ids) for s in steps)
    for step in steps:  # built unchecked (of_engine_columns): exactly the record a checked build makes
        body = {f.name: getattr(step, f.name) for f in dataclasses.fields(StepTokens)}
        assert StepTokens(**body) == step
        assert all(type(x) is int for name, column in body.items() if name not in ("worker_id", "request_ids")
                   for x in column), "plain ints, as the codec packs them"
        assert all(type(x) is str for x in step.request_ids)
        assert EVENT_CODEC.decode(EVENT_CODEC.encode(step), MAX_EVENT_BYTES) == step
    for rid in prompts:
        mine = [e for ev in raw for e in expand(ev) if isinstance(e, Tokens) and e.request_id == rid]
        assert [t for e in mine for t in e.new_token_ids] == expected[rid], rid
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        counts = [e.num_output_tokens for e in mine if e.new_token_ids]
        assert counts == list(range(1, len(expected[rid]) + 1)), (rid, counts)  # one token a step here
        if rid == "r4":
            assert all(len(e.logprobs) == len(e.new_token_ids) for e in mine)

