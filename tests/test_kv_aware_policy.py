"""``--router-policy kv_aware`` (cluster/policies.py): placement on the prompt prefix a worker really
holds (the router's KV index, fed by the workers' KV events) against its load. Pure functions over
worker views; the cluster test (a repeated prompt goes to the worker holding its blocks) is in
tests/test_cluster.py."""

import pytest

from pdcluster.cluster.policies import POLICIES, Placer, WorkerView, decode_load_tokens, kv_aware_score
from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.router.kv_index import KVIndex
from pdcluster.cluster.router.placement import PairPlacement

BLOCK = 16
PROMPT_BLOCKS = 10  # a prompt of 10 full blocks (160 tokens)
HASHES = list(range(100, 100 + PROMPT_BLOCKS))


def _prefill(wid, queued=0):
    return WorkerView(wid, "prefill", num_blocks=256, block_size=BLOCK, queued_prefill_tokens=queued)


def _decode(wid, kv_tokens=0, num_blocks=64, num_requests=0):
    return WorkerView(wid, "decode", num_blocks=num_blocks, block_size=BLOCK, kv_tokens=kv_tokens,
                      num_requests=num_requests)


def test_score_is_overlap_tokens_minus_load_tokens():
    assert kv_aware_score(10, BLOCK, 0) == 160
    assert kv_aware_score(4.5, BLOCK, 100) == 72 - 100
    assert kv_aware_score(0, BLOCK, 0) == 0
    assert "kv_aware" in POLICIES


def test_decode_load_is_the_prompt_times_the_pool_share_in_use():
    half = _decode("d", kv_tokens=512, num_blocks=64)  # 512 of 1024 token slots
    assert decode_load_tokens(half, PROMPT_BLOCKS, 0) == PROMPT_BLOCKS * BLOCK / 2
    assert decode_load_tokens(_decode("d"), PROMPT_BLOCKS, 0) == 0
    # The speculative slots of running requests count as load (Placer's decode measure).
    assert decode_load_tokens(_decode("d", kv_tokens=0, num_requests=4), PROMPT_BLOCKS, 3) == 160 * 12 / 1024
    assert decode_load_tokens(_decode("d", num_blocks=0), PROMPT_BLOCKS, 0) == 0  # pool not known yet


def test_prefill_goes_where_the_prefix_is_unless_the_queue_costs_more():
    placer = Placer("kv_aware")
    idle, holder = _prefill("p0"), _prefill("p1", queued=100)
    full = {"p1": float(PROMPT_BLOCKS)}
    # p1 holds the whole prompt (160 tokens) and has 100 queued: waiting beats computing 160.
    assert placer.pick_prefill([idle, holder], HASHES, full) is holder
    # Hopelessly busy: more queued than the prompt is long; the idle worker without the prefix wins.
    holder.queued_prefill_tokens = 161
    assert placer.pick_prefill([idle, holder], HASHES, full) is idle


def test_no_overlap_anywhere_is_least_loaded():
    placer = Placer("kv_aware")
    a, b = _prefill("p0", queued=50), _prefill("p1", queued=10)
    assert placer.pick_prefill([a, b], HASHES, {}) is b
    assert placer.pick_prefill([a, b], HASHES, None) is b
    d0, d1 = _decode("d0", kv_tokens=300), _decode("d1", kv_tokens=20)
    assert placer.order_decode([d0, d1], HASHES, {}) == [d1, d0]
    # Ties (both idle, nothing held) go to the lower id, as least_loaded.
    assert placer.pick_prefill([_prefill("p1"), _prefill("p0")], HASHES, {}).worker_id == "p0"


def test_a_device_hit_beats_the_same_blocks_on_disk():
    index = KVIndex()
    index.stored("p0", "disk", HASHES)
    index.stored("p1", "device", HASHES)
    overlaps = {wid: index.overlap(wid, HASHES) for wid in ("p0", "p1")}
    assert overlaps == {"p0": PROMPT_BLOCKS * 0.5, "p1": float(PROMPT_BLOCKS)}
    assert Placer("kv_aware").pick_prefill([_prefill("p0"), _prefill("p1")], HASHES, overlaps).worker_id == "p1"


def test_decode_order_weighs_overlap_against_the_pool_in_use():
    placer = Placer("kv_aware")
    idle = _decode("d0")
    holder = _decode("d1", kv_tokens=256)  # a quarter of its pool in use: forfeits 40 of 160 tokens
    full = {"d1": float(PROMPT_BLOCKS)}
    assert placer.order_decode([idle, holder], HASHES, full) == [holder, idle]
    # A full pool forfeits the whole prompt: the idle worker with nothing cached goes first.
    holder.kv_tokens = 64 * BLOCK
    assert placer.order_decode([idle, holder], HASHES, full) == [idle, holder]
    # Out of rotation: not a candidate whatever it holds.
    holder.kv_tokens, holder.draining = 0, True
    assert placer.order_decode([idle, holder], HASHES, full) == [idle]


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware"])
def test_placement_reads_the_kv_index_only_for_kv_aware(policy):
    """PairPlacement asks the index for every worker's overlap and hands it to the policy."""
    placement = PairPlacement(RouterConfig(policy=policy, mode="disagg"))
    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        placement.add_worker(wid, role, 64, BLOCK)
    placement.kv_index.stored("p1", "device", HASHES)
    placement.kv_index.stored("d1", "host", HASHES)
    pairs = [(d.worker_id, p.worker_id) for d, p in placement.candidates(False, HASHES, None, now=0.0)]
    expected = [("d1", "p1"), ("d0", "p1")] if policy == "kv_aware" else [("d0", "p0"), ("d1", "p0")]
    assert pairs == expected
    # A prompt shorter than a block has no hashes: nothing to match, least loaded.
    assert [(d.worker_id, p.worker_id) for d, p in placement.candidates(False, [], None, now=0.0)] == \
        [("d0", "p0"), ("d1", "p0")]
