"""Async scheduling frees a request's blocks while a step that writes them may still run (it finished,
was aborted or preempted between its step's launch and that step's end). The scheduler's own next step
runs after it on the same device queue, so it may take those blocks at once; a writer outside that
queue may not: a KV transfer landing in a decode worker's reserved blocks, or an offload load, would
race the running step's KV write. Such blocks are *fenced* until the step finished
(engine/block_manager.py); these tests fail when the fence is dropped (the reservation below then
takes the aborted request's blocks while its step still runs).
"""

from __future__ import annotations

import pytest

from conftest import make_engine
from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 8


def _req(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=4))


def test_fenced_blocks_go_to_the_next_step_but_not_to_outside_writers_until_lifted():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = _req("a", 8)
    assert bm.allocate_slots(a, 8)
    a_blocks = set(a.block_ids)
    bm.free(a, fence=7)  # step 7, in flight, may still write them
    assert bm.num_free_blocks == 4 and bm.num_free_blocks_for(out_of_stream=True) == 2
    assert bm.fenced_block_ids == a_blocks
    outside = _req("b", 12)
    assert not bm.reserve(outside, 12), "3 blocks for an outside writer while only 2 are unfenced"
    assert outside.block_ids == [] and bm.num_free_blocks == 4, "a refused allocation changes nothing"
    small = _req("c", 8)
    assert bm.reserve(small, 8) and not set(small.block_ids) & a_blocks
    bm.free(small)
    bm.lift_fences(6)
    assert bm.fenced_block_ids == a_blocks, "step 6 finishing says nothing about step 7"
    in_stream = _req("d", 16)
    assert bm.allocate_slots(in_stream, 16), "the steps' own queue may take fenced blocks"
    assert bm.fenced_block_ids == set() and bm.num_free_blocks == 0
    bm.free(in_stream, fence=9)
    bm.lift_fences(9)
    assert bm.fenced_block_ids == set() and bm.reserve(_req("e", 16), 16)


@pytest.mark.timeout(120)
def test_an_aborted_requests_blocks_wait_for_its_step_before_a_kv_transfer_may_take_them():
    """A decode worker's engine (async scheduling, launch-ahead): a request aborted mid-decode frees its
    blocks while its next step is in flight. A remote reservation needing every block of the pool is
    refused while that step may run; the fence is lifted once it finished, under load (another request
    keeps steps in flight) as when idle; the reservation is then granted."""
    engine = make_engine(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=256,
                         async_scheduling=True, enable_prefix_caching=False)
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    engine.add_request(list(range(1, 41)), long, request_id="a")
    engine.add_request(list(range(1, 4)), long, request_id="c")  # keeps the engine busy throughout
    for _ in range(4):
        engine.step()
    a = engine.scheduler.requests["a"]
    a_blocks = set(a.block_ids)
    assert len(a_blocks) == 3 and engine._stepper.in_flight
    assert engine._stepper.num_launched_ahead >= 1  # the hazard's own case: a step already queued ahead

    engine.abort_request("a")
    assert engine.scheduler.block_manager.fenced_block_ids == a_blocks
    whole_pool = list(range(1, NUM_BLOCKS * BLOCK_SIZE))  # 127 tokens + the first output: 8 blocks
    params = SamplingParams(max_tokens=1)
    assert engine.add_remote_request("b", whole_pool, params) is None, \
        "a transfer would land in blocks the aborted request's step may still write"

    for _ in range(2):  # the steps in flight at the abort end; "c" keeps steps in flight
        engine.step()
    assert engine._stepper.in_flight and engine.scheduler.block_manager.fenced_block_ids == set(), \
        "fences outlived their step: under steady load a transfer could never take those blocks"
    assert engine.add_remote_request("b", whole_pool, params) is None  # "c" holds a block
    engine.abort_request("c")
    for _ in range(10):  # the in-flight steps end; the engine settles (bounded)
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and engine.scheduler.block_manager.fenced_block_ids == set()
    reservation = engine.add_remote_request("b", whole_pool, params)
    assert reservation is not None and set(engine.scheduler.requests["b"].block_ids) >= a_blocks
    engine.abort_request("b")
    assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
