"""Requests their first token ends (max_tokens 1: scoring, classification, a beam search's step) between a real
prefill and decode worker on 127.0.0.1: the decode worker asks for the first token alone (TransferRequest
``first_token_only``), so no block is reserved on the decode side and no KV moves, for a request that would
never decode; the answer is the colocated engine's. The asks that cannot be answered fail (the router places
them again), and an ask given up stops the prefill worker's work."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from conftest import engine_config, make_engine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.events import ADMITTED, Admission, Failed, KVReady, Tokens
from test_kv_transfer_e2e import Events, _collect_tokens, _wait_free, connected_pair

NUM_BLOCKS = 128
PROMPTS = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 17, 45])]
_engine_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=1536, prefill_chunk_size=16)

pytestmark = pytest.mark.timeout(120)


def _finals(events: Events) -> dict[str, Tokens]:
    with events.lock:
        return {e.request_id: e for e in events.items if isinstance(e, Tokens) and e.finished}


def test_the_first_token_is_the_answer_and_no_kv_moves(tiny_dir):
    params = SamplingParams(max_tokens=1, seed=3, logprobs=2, prompt_logprobs=1)
    want = make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(PROMPTS, params)
    # One more request whose first token is one of its stop tokens: it ends as a stop, not at its length.
    stop = SamplingParams(max_tokens=1, seed=3, stop_token_ids=[want[0].token_ids[0]])
    events = Events()
    with connected_pair(_engine_config(), TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            d.submit(rid, prompt, params, "p0")
        d.submit("stopped", PROMPTS[0], stop, "p0")
        tokens = _collect_tokens(events, [*ids, "stopped"])
        assert [tokens[rid] for rid in ids] == [o.token_ids for o in want]
        finals = _finals(events)
        for rid, out in zip(ids, want):
            final = finals[rid]
            assert final.finish_reason == "length" and final.num_output_tokens == 1
            assert final.num_computed_tokens == len(out.prompt_token_ids)
            assert [(lp.token_id, lp.rank, lp.top_token_ids) for lp in final.logprobs] == \
                [(lp.token_id, lp.rank, lp.top_token_ids) for lp in out.logprobs]
            assert [lp.logprob for lp in final.logprobs] == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
            assert [lp.token_id for lp in final.prompt_logprobs] == [lp.token_id for lp in out.prompt_logprobs]
        assert tokens["stopped"] == want[0].token_ids and finals["stopped"].finish_reason == "stop"
        with events.lock:
            assert [e.verdict for e in events.items if isinstance(e, Admission)] == [ADMITTED] * 4
            assert not [e for e in events.items if isinstance(e, (KVReady, Failed))]
        assert p.stats()["bytes_sent"] == 0  # no KV left the prefill worker
        dst = d.stats()
        assert dst["num_prompt_tokens_computed"] == 0 and dst["num_free_blocks"] == NUM_BLOCKS  # never held
        assert dst["num_first_token_only"] == 0
        _wait_free(p, NUM_BLOCKS, 5)


def test_longer_requests_still_move_their_kv(tiny_dir):
    """The same pair: a request of two tokens still gets the KV (the ask is for max_tokens 1 alone)."""
    params = SamplingParams(max_tokens=2, seed=3)
    want = make_engine("tiny-random", num_kv_blocks=NUM_BLOCKS).generate(PROMPTS[:1], params)
    events = Events()
    with connected_pair(_engine_config(), TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        d.submit("two", PROMPTS[0], params, "p0")
        assert _collect_tokens(events, ["two"])["two"] == want[0].token_ids
        assert p.stats()["bytes_sent"] > 0 and d.stats()["num_prompt_tokens_computed"] == 0


def test_an_ask_the_prefill_worker_refuses_fails(tiny_dir):
    events = Events()
    with connected_pair(_engine_config(), TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        d.submit("bad", [5, 10**7, 6], SamplingParams(max_tokens=1), "p0")  # a token id past the vocabulary
        failed = events.wait_for(lambda e: isinstance(e, Failed) and e.request_id == "bad", 20)
        assert failed is not None and "prefill refused" in failed.reason, events.items
        assert d.stats()["num_first_token_only"] == 0
        _wait_free(p, NUM_BLOCKS, 5)


def _hold(worker, seconds: float) -> None:
    """Keep ``worker``'s engine thread busy for ``seconds``, returning once it is: posted alone, the sleep could
    start after a turn that had already taken the next ask in and computed it (seen on a loaded 2-core CI box)."""
    started = threading.Event()
    worker.post(lambda: (started.set(), time.sleep(seconds)))
    assert started.wait(10), "the engine thread never took the posted sleep"


def test_an_ask_past_its_deadline_fails_and_the_prefill_worker_drops_it(tiny_dir):
    """The prefill worker is held (its engine thread busy) past the ask's deadline: the decode worker fails the
    request and tells the prefill worker, which drops it when it wakes instead of computing it."""
    events = Events()
    tc = TransferConfig(transport="tcp", secret="s3cret", transfer_timeout_s=0.5)
    with connected_pair(_engine_config(), tc, events) as (p, d):
        _hold(p, 2.0)  # the prefill worker's engine thread is busy for 2 s
        d.submit("late", PROMPTS[1], SamplingParams(max_tokens=1), "p0")
        failed = events.wait_for(lambda e: isinstance(e, Failed) and e.request_id == "late", 10)
        assert failed is not None and "deadline" in failed.reason
        time.sleep(2.5)  # the prefill worker woke, read the ask and its withdrawal
        assert p.stats()["num_prompt_tokens_computed"] == 0
        _wait_free(p, NUM_BLOCKS, 5)
        with events.lock:
            assert not [e for e in events.items if isinstance(e, Tokens) and e.request_id == "late"]


def test_an_ask_the_router_aborts_is_withdrawn(tiny_dir):
    events = Events()
    with connected_pair(_engine_config(), TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        _hold(p, 1.0)  # the ask and its withdrawal both wait for the prefill worker
        d.submit("gone", PROMPTS[2], SamplingParams(max_tokens=1), "p0")
        d.abort("gone")
        time.sleep(1.5)
        assert d.stats()["num_first_token_only"] == 0
        assert p.stats()["num_prompt_tokens_computed"] == 0
        with events.lock:
            assert not [e for e in events.items if isinstance(e, (Tokens, Failed)) and e.request_id == "gone"]
        _wait_free(p, NUM_BLOCKS, 5)
