"""vLLM's request ``priority`` (lower first): the scheduler admits the most urgent waiting request first,
gives the step's budget to the most urgent running ones, and preempts the least urgent when blocks run out.
With one priority everything is first come, first served as before (the waiting queue is the old deque
there, checked operation by operation against a deque).

Real engine on tiny-random (and smollm2 for preemption); the API's ``priority`` through the real server.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from conftest import make_engine
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.waiting_queue import WaitingQueue

pytestmark = pytest.mark.timeout(300)


def _req(i: int, priority: int = 0) -> Request:
    return Request(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                   sampling_params=SamplingParams(max_tokens=4, priority=priority))


def test_one_priority_is_the_old_deque():
    rng = random.Random(0)
    queue, reference = WaitingQueue(), deque()
    made = 0
    for _ in range(2000):
        op = rng.choice(["append", "appendleft", "extendleft", "popleft", "remove"])
        if op in ("popleft", "remove") and not reference:
            continue
        if op == "append" or op == "appendleft":
            r = _req(made)
            made += 1
            getattr(queue, op)(r)
            getattr(reference, op)(r)
        elif op == "extendleft":
            rs = [_req(made + k) for k in range(rng.randint(0, 3))]
            made += len(rs)
            queue.extendleft(reversed(rs))
            reference.extendleft(reversed(rs))
        elif op == "popleft":
            assert queue.popleft() is reference.popleft()
        else:
            r = rng.choice(list(reference))
            queue.remove(r)
            reference.remove(r)
        assert list(queue) == list(reference) and list(reversed(queue)) == list(reversed(reference))
        assert len(queue) == len(reference) and bool(queue) == bool(reference)
        if reference:
            assert queue[0] is reference[0]


def test_waiting_queue_orders_by_priority():
    queue = WaitingQueue()
    a, b, c, d, e = _req(0, 5), _req(1, 0), _req(2, -3), _req(3, 0), _req(4, 5)
    for r in (a, b, c, d, e):
        queue.append(r)
    assert list(queue) == [c, b, d, a, e] and list(reversed(queue)) == [e, a, d, b, c]
    preempted = _req(5, 0)
    queue.appendleft(preempted)  # back at the front of its own priority, behind more urgent ones
    assert list(queue) == [c, preempted, b, d, a, e]
    queue.remove(c)
    assert queue[0] is preempted and queue.popleft() is preempted
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(_req(9, 7))
    assert [queue.popleft() for _ in range(len(queue))] == [b, d, a, e] and not queue
    with pytest.raises(IndexError):
        queue.popleft()


def _finish_order(engine, prompts_and_priorities, max_tokens=3) -> list[str]:
    for i, (prompt, priority) in enumerate(prompts_and_priorities):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority),
                           request_id=f"q{i}")
    order = []
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
        if not engine.has_unfinished():
            return order
    raise AssertionError(f"not done after 200 steps: {order}")


def test_admission_follows_priority():
    engine = make_engine("tiny-random", max_num_seqs=1)
    prompts = ["Hello world", "The capital of France is", "1, 2, 3,", "def fibonacci(n):"]
    # One priority: first come, first served.
    assert _finish_order(engine, [(p, 0) for p in prompts]) == ["q0", "q1", "q2", "q3"]
    # q3 the most urgent, q0 the least: admitted (one at a time) in that order; q1 and q2 keep theirs.
    assert _finish_order(engine, list(zip(prompts, [7, 0, 0, -2]))) == ["q3", "q1", "q2", "q0"]
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


BASE = "Write a short note about the history of computing and the people who built it. "
PREEMPT_PROMPTS = [f"{i} " + BASE * 2 for i in range(4)]


@pytest.fixture(scope="module")
def alone_tokens():
    alone = make_engine("smollm2", max_model_len=256)
    return [alone.generate([p], SamplingParams(max_tokens=24, temperature=0.0))[0].token_ids for p in PREEMPT_PROMPTS]


def _run_with_small_pool(priorities: tuple[int, ...]):
    """The first prompt admitted alone, then the other three: 4 prompts of ~35 tokens + 24 new need ~16
    blocks of 16, so a pool of 10 preempts. Returns each request's preemptions, the total, the tokens."""
    small = make_engine("smollm2", num_kv_blocks=10, max_model_len=256)
    params = [SamplingParams(max_tokens=24, temperature=0.0, priority=p) for p in priorities]
    ids = [small.add_request(PREEMPT_PROMPTS[0], params[0])]
    outputs: dict[str, list[int]] = {ids[0]: []}
    for out in small.step():  # running before the others arrive: the first admitted
        outputs[out.request_id] += out.new_token_ids
    ids += [small.add_request(p, sp) for p, sp in zip(PREEMPT_PROMPTS[1:], params[1:])]
    requests = [small.scheduler.requests[rid] for rid in ids]
    outputs.update({rid: [] for rid in ids[1:]})
    for _ in range(500):
        for out in small.step():
            outputs[out.request_id] += out.new_token_ids
        if not small.has_unfinished():
            break
    assert small.scheduler.num_free_blocks == 10
    return [r.num_preemptions for r in requests], small.scheduler.num_preemptions_total, [outputs[r] for r in ids]


def test_preemption_takes_the_least_urgent_and_keeps_tokens(alone_tokens):
    per_request, total, tokens = _run_with_small_pool((9, 0, 0, 0))
    assert total > 0, "the pool was meant to be too small"
    assert per_request[0] == total  # only the least urgent, though it was admitted first
    assert tokens == alone_tokens
    # The control, every priority equal: first come first served preempts the last admitted, never the first.
    per_request, total, tokens = _run_with_small_pool((0, 0, 0, 0))
    assert total > 0 and per_request[0] == 0
    assert tokens == alone_tokens


def test_priority_must_be_an_integer():
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(max_tokens=2, priority=1.5)
