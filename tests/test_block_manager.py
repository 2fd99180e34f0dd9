"""Block allocator and scheduler bookkeeping: every block freed exactly once, prefix sharing."""

import pytest

from pdcluster.engine.block_manager import BlockManager, chained_block_hashes
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.scheduler_output import ModelRunnerOutput


def _req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def _allocated(bm, rid, num_tokens):
    """A request of tokens 0 .. num_tokens - 1 with a slot for each."""
    req = _req(rid, range(num_tokens))
    assert bm.allocate_slots(req, num_tokens)
    return req


def _cached(bm, rid, num_tokens):
    """:func:`_allocated`, then every token computed and the full blocks put in the prefix cache."""
    req = _allocated(bm, rid, num_tokens)
    req.num_computed_tokens = num_tokens
    bm.cache_full_blocks(req)
    return req


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = _req("a", range(9)), _req("b", range(5))
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 5)
    assert len(a.block_ids) == 3 and len(b.block_ids) == 2
    assert bm.num_free_blocks == 5
    assert not bm.allocate_slots(_req("c", range(24)), 24), "6 blocks do not fit in 5"
    assert bm.num_free_blocks == 5, "a failed allocation changes nothing"
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _allocated(bm, "a", 4)
    ids = list(a.block_ids)
    bm.free(a)
    a.block_ids = ids
    with pytest.raises(AssertionError, match="double free"):
        bm.free(a)


def test_prefix_cache_shares_full_blocks_and_survives_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _cached(bm, "a", 10)
    first_two = a.block_ids[:2]
    bm.free(a)
    b = _req("b", list(range(8)) + [99, 98, 97])
    cached = bm.find_cached_prefix(b)
    assert cached == first_two
    assert bm.allocate_slots(b, 3, cached)
    assert b.block_ids[:2] == first_two
    assert bm.num_free_blocks == 8 - 3
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_prefix_cache_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    _cached(bm, "a", 8)
    # The same 8 tokens again: only the first block may be reused, the last token must be computed.
    assert len(bm.find_cached_prefix(_req("b", range(8)))) == 1


def test_without_prefix_caching_nothing_is_hashed(monkeypatch):
    """Prefix caching off (as in vs-vLLM comparisons): a waiting request's prompt is never hashed, neither
    by the scheduler nor by a decode-side admission (a BLAKE2b chain per prompt for no use)."""
    import pdcluster.engine.block_manager as block_manager_module

    calls = []
    monkeypatch.setattr(block_manager_module, "chained_block_hashes", lambda *a, **k: calls.append(a) or [])
    cfg = EngineConfig(model="x", block_size=4, max_num_batched_tokens=64, prefill_chunk_size=64,
                       enable_prefix_caching=False)
    s = Scheduler(cfg.resolve_batch_limits("cpu"), num_blocks=16, max_model_len=64, eos_token_ids={0})
    s.add_request(_req("a", range(1, 30)))
    s.schedule()
    assert s.add_remote_request(_req("b", range(1, 30))).num_reused_blocks == 0
    assert calls == []


def test_default_prefill_takes_the_whole_step_budget():
    """prefill_chunk_size 0 (the default, vLLM's): a prompt is cut only by the step's token budget, which running
    requests share; a positive size still caps one request's chunk; a negative one is refused."""
    from pdcluster.engine.config import ConfigError

    cfg = EngineConfig(model="x", block_size=4, max_num_batched_tokens=40)
    assert cfg.prefill_chunk_size == 0 and cfg.prefill_chunk_tokens == 40
    s = Scheduler(cfg.resolve_batch_limits("cpu"), num_blocks=64, max_model_len=128, eos_token_ids={0})
    s.add_request(_req("a", range(1, 34), max_tokens=2))  # 33 tokens: one step, not cut at any fixed chunk
    s.add_request(_req("b", range(1, 31), max_tokens=2))  # what the budget leaves: 7 of 30
    out = s.schedule()
    assert [(x.request_id, x.num_scheduled_tokens) for x in out.scheduled] == [("a", 33), ("b", 7)]
    s = Scheduler(EngineConfig(model="x").resolve_batch_limits("cpu"), num_blocks=64, max_model_len=2048, eos_token_ids={0})
    s.add_request(_req("long", range(1, 851), max_tokens=2))  # 850 tokens: one step within the default 2,048
    assert [x.num_scheduled_tokens for x in s.schedule().scheduled] == [850]
    capped = EngineConfig(model="x", block_size=4, max_num_batched_tokens=40, prefill_chunk_size=16)
    assert capped.prefill_chunk_tokens == 16
    s = Scheduler(capped.resolve_batch_limits("cpu"), num_blocks=64, max_model_len=128, eos_token_ids={0})
    s.add_request(_req("a", range(1, 34), max_tokens=2))
    assert [x.num_scheduled_tokens for x in s.schedule().scheduled] == [16]
    assert EngineConfig(model="x", max_num_batched_tokens=40, prefill_chunk_size=100).prefill_chunk_tokens == 40
    with pytest.raises(ConfigError, match="prefill_chunk_size: must be a non-negative integer"):
        EngineConfig(model="x", prefill_chunk_size=-1)


def test_chained_hash_depends_on_prefix():
    h1 = chained_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    h2 = chained_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert h1[1] != h2[1], "same second block after a different first block must hash differently"


def test_scheduler_chunks_budget_and_frees_on_finish():
    cfg = EngineConfig(model="x", block_size=4, max_num_batched_tokens=10, prefill_chunk_size=6)
    s = Scheduler(cfg.resolve_batch_limits("cpu"), num_blocks=16, max_model_len=64, eos_token_ids={0})
    s.add_request(_req("a", range(1, 14), max_tokens=2))
    s.add_request(_req("b", range(1, 4), max_tokens=2))
    out = s.schedule()
    assert [(x.request_id, x.num_scheduled_tokens) for x in out.scheduled] == [("a", 6), ("b", 3)]
    assert out.total_num_scheduled_tokens == 9
    res = s.update_from_output(out, ModelRunnerOutput(["a", "b"], [[], [7]]))
    assert s.requests["a"].num_computed_tokens == 6 and res[1].new_token_ids == [7]
    out = s.schedule()
    assert [(x.request_id, x.num_scheduled_tokens) for x in out.scheduled] == [("a", 6), ("b", 1)]
    s.update_from_output(out, ModelRunnerOutput(["a", "b"], [[], [0]]))  # b hits eos
    assert "b" not in s.requests
    out = s.schedule()
    assert out.finished_req_ids == {"b"}
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.num_free_blocks == 16 and not s.has_unfinished()
