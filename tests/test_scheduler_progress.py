"""The scheduler always makes progress: a queue whose head cannot get its blocks while requests behind it
hold them (prompts whose KV landed from a prefill worker, not yet running) must not stall the worker.

Found by the soak test on a loaded box: after a decode worker was killed, its requests were placed on the
other one; a request preempted there went back to the head of the queue needing more blocks than were
free, the landed prompts behind it held the rest, nothing ran, and every step was empty from then on.
"""

from __future__ import annotations

from conftest import make_engine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.wire.kv_connector import KVConnectorOutput, LoadedKV


def _land(engine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    assert engine.add_remote_request(request_id, prompt, params) is not None
    engine.scheduler.update_from_kv(KVConnectorOutput(finished_recving={request_id: LoadedKV(first_token_id=7)}))


def test_head_blocked_by_landed_prompts_behind_it(tiny_dir):
    engine = make_engine("tiny-random", num_kv_blocks=5, block_size=16, enable_prefix_caching=False)
    scheduler = engine.scheduler
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=0)  # the router seeds remote requests
    _land(engine, "landed-b", list(range(100, 132)), params)  # 2 blocks each, the first decode step needs a 3rd
    _land(engine, "landed-c", list(range(200, 232)), params)
    assert scheduler.num_free_blocks == 1 and [r.request_id for r in scheduler.waiting] == ["landed-b", "landed-c"]
    # A request back at the head of the queue (as a preempted one is) that needs 3 blocks of its own.
    head = engine.add_request(list(range(300, 340)), params)
    request = scheduler.requests[head]
    scheduler.waiting.remove(request)
    scheduler.waiting.appendleft(request)
    assert scheduler.waiting[0].request_id == head

    finished = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert set(finished) == {head, "landed-b", "landed-c"}, f"stalled: finished only {sorted(finished)}"
    assert all(len(o.token_ids) == 6 for o in finished.values())
    # Only the last landed prompt gave its blocks up (computed again here), and every block came back.
    assert scheduler.requests.get("landed-c") is None
    assert scheduler.num_preemptions_total == 1
    assert scheduler.num_free_blocks == 5
