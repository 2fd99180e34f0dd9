"""The decode side of a KV transfer, scheduler only (no model): a request whose prompt another worker
computes is one Request in the scheduler from admission (WAITING_FOR_REMOTE_KV, its real prompt, its
blocks reserved), moved by what the connector reports (``update_from_kv``): landed -> waiting with the
producer's first token; failed -> finished, its blocks held while the connector says a sender may still
write them (quarantine) and freed once when it says they are safe. The worker-level and transport-level
paths are in test_kv_transfer_e2e.py and test_late_writes.py."""

import pytest

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.scheduler_output import ModelRunnerOutput
from pdcluster.wire.kv_connector import KVConnectorOutput, LoadedKV, SchedulerConnector

NUM_BLOCKS = 16
BS = 4


class Consumer(SchedulerConnector):
    """The scheduler-side contract of a consumer: it keeps the blocks of the ids in ``quarantined``."""

    def __init__(self):
        self.quarantined: set[str] = set()
        self.finished: list[str] = []

    def request_finished(self, request) -> bool:
        self.finished.append(request.request_id)
        return request.request_id in self.quarantined


def _scheduler(connector=None, num_state_blocks=0, **cfg):
    config = EngineConfig(model="x", block_size=BS, max_num_batched_tokens=64, prefill_chunk_size=64, **cfg)
    return Scheduler(config.resolve_batch_limits("cpu"), num_blocks=NUM_BLOCKS, max_model_len=64, eos_token_ids={0}, connector=connector,
                     num_state_blocks=num_state_blocks)


def _req(rid, n, max_tokens=4):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def test_remote_request_is_one_request_from_admission_to_decode():
    s = _scheduler(Consumer())
    request = _req("r", 9)
    assert s.add_remote_request(request)
    assert s.requests["r"] is request and request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(request.block_ids) == 3 and s.num_free_blocks == NUM_BLOCKS - 3  # the prompt's blocks
    assert not s.waiting and not s.running and not s.has_work() and s.num_waiting_for_remote_kv == 1
    assert s.schedule().scheduled == []  # nothing runs before the KV is there

    landed, failed = s.update_from_kv(KVConnectorOutput(finished_recving={"r": LoadedKV(7, [8, 9])}))
    assert landed == [request] and failed == {}
    assert request.status == RequestStatus.WAITING and list(s.waiting) == [request]
    assert request.num_computed_tokens == 9 and request.output_token_ids == [7] and request.spec_token_ids == [8, 9]
    out = s.schedule()
    [row] = out.scheduled
    assert row.is_new and row.all_token_ids == list(range(1, 10)) + [7]  # the real prompt, never a placeholder
    assert row.num_computed_tokens == 9 and row.input_token_ids == [7, 8, 9]
    s.update_from_output(out, ModelRunnerOutput(["r"], [[8, 0]]))  # one draft accepted, then eos
    assert "r" not in s.requests and s.num_free_blocks == NUM_BLOCKS


def test_first_token_that_ends_the_request_finishes_it_on_landing():
    s = _scheduler(Consumer())
    assert s.add_remote_request(_req("r", 5, max_tokens=1))
    landed, _ = s.update_from_kv(KVConnectorOutput(finished_recving={"r": LoadedKV(7)}))
    assert landed[0].status == RequestStatus.FINISHED_LENGTH and "r" not in s.requests
    assert s.num_free_blocks == NUM_BLOCKS


def test_a_pool_without_room_for_the_first_decode_step_refuses_and_changes_nothing():
    s = _scheduler(num_spec_tokens=2, spec_method="ngram")
    assert s.add_remote_request(_req("a", 40)) and s.num_free_blocks == 6
    # 24 prompt tokens fit in the 6 free blocks, but the first decode step (first token + 2 drafts) needs a 7th.
    assert not s.add_remote_request(_req("c", 24))
    assert "c" not in s.requests and s.num_free_blocks == 6
    assert s.add_remote_request(_req("b", 20)) and s.num_free_blocks == 1  # 5 blocks, and room for the step
    with pytest.raises(ValueError, match="already in use"):
        s.add_remote_request(_req("a", 4))


def test_hybrid_reservation_includes_the_state_blocks():
    s = _scheduler(num_state_blocks=2)
    request = _req("r", 9)
    assert s.add_remote_request(request)
    assert len(request.block_ids) == 3 + 2  # the state lands in the 2 blocks after the prompt's


def test_failed_transfer_keeps_quarantined_blocks_until_the_connector_releases_them():
    consumer = Consumer()
    s = _scheduler(consumer)
    assert s.add_remote_request(_req("q", 9)) and s.add_remote_request(_req("f", 9))
    consumer.quarantined.add("q")  # a pushing sender may still write q's blocks
    landed, failed = s.update_from_kv(KVConnectorOutput(failed_recving={"q": "prefill gone", "f": "deadline"}))
    assert landed == [] and failed == {"q": "prefill gone", "f": "deadline"}
    assert "q" not in s.requests and "f" not in s.requests and consumer.finished == ["q", "f"]
    assert set(s.held) == {"q"} and s.num_free_blocks == NUM_BLOCKS - 3  # f's freed at once, q's held
    with pytest.raises(ValueError, match="already in use"):  # its id names a transfer still revoking
        s.add_remote_request(_req("q", 4))
    consumer.quarantined.discard("q")
    s.update_from_kv(KVConnectorOutput(failed={"q"}))
    s.update_from_kv(KVConnectorOutput(failed={"q"}))  # reported twice: freed once
    assert not s.held and s.num_free_blocks == NUM_BLOCKS


def test_abort_while_waiting_for_kv_goes_through_the_connector_once():
    consumer = Consumer()
    s = _scheduler(consumer)
    assert s.add_remote_request(_req("a", 9))
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert consumer.finished == ["a"] and s.num_free_blocks == NUM_BLOCKS
    # A landing reported after the abort finds nothing to move.
    assert s.update_from_kv(KVConnectorOutput(finished_recving={"a": LoadedKV(7)})) == ([], {})


def test_fork_follower_waits_for_a_leader_whose_kv_is_on_its_way():
    s = _scheduler(Consumer())
    assert s.add_remote_request(_req("lead", 9))
    s.add_request(_req("follow", 9), follow="lead")
    assert len(s.forks) == 1 and s.schedule().scheduled == []
    s.update_from_kv(KVConnectorOutput(finished_recving={"lead": LoadedKV(7)}))
    out = s.schedule()  # the leader runs; the follower waits until the leader's prompt is cached
    assert [r.request_id for r in out.scheduled] == ["lead"] and len(s.forks) == 1
    s.update_from_output(out, ModelRunnerOutput(["lead"], [[5]]))
    assert [r.request_id for r in s.schedule().scheduled] == ["lead", "follow"]
