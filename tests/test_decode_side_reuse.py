"""Decode-side prefix reuse in disaggregated serving (issue 27 item 3): a decode worker that already holds a
conversation's earlier turns in its prefix cache takes those blocks by reference and asks the prefill
worker only for the rest (engine/remote_admission.py; TransferRequest.num_reused_blocks; the prefill
connector sends only the blocks after them).

Scheduler and connector level first (no model), then real prefill and decode workers on 127.0.0.1 over
tcp: a two-turn conversation (turn 2's prompt = turn 1's prompt + its answer + a new message) moves
exactly the reused blocks' bytes less in turn 2, with tokens equal to the same run with reuse off
(deterministic mode, the default, makes the KV bitwise the same on either worker), and both pools get
every block back.

Mutations run by hand: the prefill worker ignoring ``num_reused_blocks`` (sending from block 0) -> turn 2
fails (the suffix-only destination list is too short: refused); an MTP decode side keeping the last
matched block -> the recorded drafts differ (the MTP case whose turn 2 diverges right after that block).
A decode side that reports blocks as reused without holding them is checked below: its tokens differ."""

from __future__ import annotations

import dataclasses
import functools

import msgpack
import pytest
import torch

from conftest import engine_config
from test_kv_transfer_e2e import Events, _wait_free, connected_pair
import pdcluster.engine.scheduler as scheduler_module
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.scheduler_output import ModelRunnerOutput
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.kv_transfer.connector.prefill import PrefillKVConnector
from pdcluster.kv_transfer.protocol import PROTOCOL_VERSION, ProtocolError, TransferRequest, decode, encode
from pdcluster.node.events import Failed, KVReady, Tokens
from pdcluster.wire.kv_connector import KVConnectorOutput, LoadedKV

BS = 4


# ---- scheduler: what the decode side takes and reserves ------------------------------------------------

def _scheduler(num_blocks=16, num_state_blocks=0, **cfg):
    config = EngineConfig(model="x", block_size=BS, max_num_batched_tokens=64, prefill_chunk_size=64, **cfg)
    return Scheduler(config.resolve_batch_limits("cpu"), num_blocks=num_blocks, max_model_len=64, eos_token_ids={0},
                     num_state_blocks=num_state_blocks)


def _cache_turn(s: Scheduler, tokens: list[int]) -> None:
    """Run a request with these tokens here (one step, one output token), leaving its full blocks cached."""
    s.add_request(Request("turn1", list(tokens), SamplingParams(max_tokens=1)))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["turn1"], [[99]]))
    assert "turn1" not in s.requests and s.num_free_blocks == s.block_manager.num_blocks


def test_remote_request_takes_the_cached_prefix_and_reserves_the_rest():
    s = _scheduler()
    _cache_turn(s, list(range(1, 14)))  # 13 tokens: blocks 0-2 cached
    cached = s.block_manager.find_cached_prefix(Request("q", list(range(1, 14)) + [7], SamplingParams()))
    assert len(cached) == 3
    request = Request("r", list(range(1, 14)) + [7, 8, 9, 10, 11], SamplingParams(max_tokens=4))  # 18 tokens, 5 blocks
    reserved = s.add_remote_request(request)
    assert reserved.num_reused_blocks == 3 and reserved.num_reused_tokens == 12
    assert request.block_ids[:3] == cached and reserved.dst_block_ids == request.block_ids[3:]
    assert len(request.block_ids) == 5 and s.num_free_blocks == 16 - 5
    assert s.num_prompt_tokens_reused == 12
    # Landed: it continues from the whole prompt, and registers its new full blocks after the shared ones.
    s.update_from_kv(KVConnectorOutput(finished_recving={"r": LoadedKV(5)}))
    out = s.schedule()
    assert list(out.scheduled[0].block_ids) == request.block_ids and out.scheduled[0].num_computed_tokens == 18
    s.update_from_output(out, ModelRunnerOutput(["r"], [[0]]))
    assert not s.requests and s.num_free_blocks == 16  # shared blocks freed once each (ref counts)
    assert len(s.block_manager.find_cached_prefix(Request("z", list(range(1, 14)) + [7, 8, 9, 10, 11, 5, 1],
                                                          SamplingParams()))) == 4


def test_at_least_the_tail_block_is_transferred():
    s = _scheduler()
    _cache_turn(s, list(range(1, 14)))
    reserved = s.add_remote_request(Request("r", list(range(1, 13)), SamplingParams()))  # exactly 3 cached blocks
    assert reserved.num_reused_blocks == 2 and len(reserved.dst_block_ids) == 1  # the last token is computed there


def test_mtp_drops_the_last_matched_block():
    s = _scheduler(spec_method="mtp", num_spec_tokens=2)
    _cache_turn(s, list(range(1, 14)))
    reserved = s.add_remote_request(Request("r", list(range(1, 14)) + [7, 8], SamplingParams()))
    assert reserved.num_reused_blocks == 2  # 3 matched, the last one recomputed for its MTP entry


@pytest.mark.parametrize("cfg,num_state_blocks", [({"decode_prefix_reuse": False}, 0),
                                                  ({"enable_prefix_caching": False}, 0), ({}, 2)])
def test_no_reuse_when_off_without_prefix_caching_and_on_hybrids(cfg, num_state_blocks):
    s = _scheduler(num_state_blocks=num_state_blocks, **cfg)
    _cache_turn(s, list(range(1, 14)))
    request = Request("r", list(range(1, 19)), SamplingParams())
    reserved = s.add_remote_request(request)
    assert reserved.num_reused_blocks == 0 and reserved.dst_block_ids == request.block_ids
    assert len(request.block_ids) == 5 + num_state_blocks and s.num_prompt_tokens_reused == 0


def test_shared_blocks_cost_no_free_block_and_a_full_pool_changes_nothing():
    s = _scheduler(num_blocks=8)
    _cache_turn(s, list(range(1, 14)))
    holder = Request("h", list(range(1, 14)) + [50], SamplingParams())  # holds the 3 cached blocks
    assert s.add_remote_request(holder).num_reused_blocks == 3 and s.num_free_blocks == 8 - 4
    # 24 tokens + the first decode step = 7 blocks; 3 are shared, so the other 4 fit in the 4 free.
    request = Request("r", list(range(1, 14)) + list(range(60, 71)), SamplingParams())
    assert s.add_remote_request(request).num_reused_blocks == 3 and s.num_free_blocks == 1
    too_big = Request("t", list(range(1, 14)) + list(range(80, 95)), SamplingParams())
    assert s.add_remote_request(too_big) is None
    assert too_big.block_ids == [] and s.num_free_blocks == 1 and "t" not in s.requests


class _LowerTiers:
    """An offload manager (engine/kv_offload/manager.py) whose lower tiers hold every block asked about
    once ``holding`` is set; ``finish(n)`` ends the last load with its first ``n`` blocks intact."""

    writes_through = False  # no shared tier: nothing is written as it is cached

    def __init__(self):
        self.loads, self._done = [], []
        self.holding = False

    def on_evict(self, block_id, block_hash, out_of_stream):
        pass

    def settle_evictions(self):
        pass

    def match(self, block_hashes):
        return len(block_hashes) if self.holding else 0

    def start_load(self, job):
        self.loads.append(job)

    def finish(self, num_loaded):
        self.loads[-1].num_loaded = num_loaded
        self._done.append(self.loads[-1])

    def poll(self):
        done, self._done = self._done, []
        return done


def _tiered_scheduler(**cfg):
    tiers = _LowerTiers()
    config = EngineConfig(model="x", block_size=BS, max_num_batched_tokens=64, prefill_chunk_size=64, **cfg)
    s = Scheduler(config.resolve_batch_limits("cpu"), num_blocks=16, max_model_len=64, eos_token_ids={0}, offload=tiers)
    _cache_turn(s, list(range(1, 6)))  # 1 block in the device pool
    tiers.holding = True  # and the rest of any prompt in the lower tiers
    return s, tiers


@pytest.mark.parametrize("num_loaded", [3, 1, 0])
def test_lower_tier_blocks_load_first_then_only_the_rest_is_asked_for(num_loaded):
    """18 tokens = 5 blocks; the last token is never matched, so 4 can be held here: 1 in the device pool,
    3 in the lower tiers. They load into the reservation, then the prefill worker is asked for the blocks
    after the ones that arrived intact (a block that could not be read, from it on: asked for)."""
    s, tiers = _tiered_scheduler()
    request = Request("r", list(range(1, 19)), SamplingParams())
    reserved = s.add_remote_request(request)
    assert reserved.num_reused_blocks == 1 and reserved.num_loading_blocks == 3
    assert request.status.name == "WAITING_FOR_OFFLOAD" and len(request.block_ids) == 5
    assert [job.block_ids for job in tiers.loads] == [request.block_ids[1:4]]
    s.poll_offload()
    assert s.remote_ready == {} and s.has_work()  # still loading: nothing to ask yet
    tiers.finish(num_loaded)
    s.poll_offload()
    final = s.remote_ready.pop("r")
    num_reused = 1 + num_loaded
    assert not s.remote_ready and request.status.name == "WAITING_FOR_REMOTE_KV"
    assert final.num_reused_blocks == num_reused and final.dst_block_ids == request.block_ids[num_reused:]
    assert request.num_offloaded_tokens == num_loaded * BS and s.num_prompt_tokens_reused == num_reused * BS
    # The loaded blocks joined the device prefix cache; the whole prompt then lands and runs.
    probe = Request("p", list(range(1, 19)) + [3], SamplingParams())
    assert s.block_manager.find_cached_prefix(probe) == request.block_ids[:num_reused]
    s.update_from_kv(KVConnectorOutput(finished_recving={"r": LoadedKV(5)}))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["r"], [[0]]))
    assert not s.requests and s.num_free_blocks == 16


def test_a_request_aborted_while_its_prefix_loads_keeps_its_blocks_until_the_load_ends():
    s, tiers = _tiered_scheduler()
    request = Request("r", list(range(1, 19)), SamplingParams())
    assert s.add_remote_request(request).num_loading_blocks == 3
    s.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert "r" in s.held and s.num_free_blocks == 16 - 5  # the loader may still write them
    tiers.finish(3)
    s.poll_offload()
    assert s.remote_ready == {} and not s.held and s.num_free_blocks == 16


def test_mtp_leaves_the_last_lower_tier_block_to_the_prefill_worker():
    s, tiers = _tiered_scheduler(spec_method="mtp", num_spec_tokens=2)
    reserved = s.add_remote_request(Request("r", list(range(1, 19)), SamplingParams()))
    assert reserved.num_reused_blocks == 0 and reserved.num_loading_blocks == 3  # 1 + 3 matched, the last dropped
    assert len(tiers.loads[0].block_ids) == 3


def test_no_lower_tier_load_when_reuse_is_off():
    s, tiers = _tiered_scheduler(decode_prefix_reuse=False)
    reserved = s.add_remote_request(Request("r", list(range(1, 19)), SamplingParams()))
    assert reserved.num_reused_blocks == 0 and reserved.num_loading_blocks == 0 and tiers.loads == []


# ---- the producer: only the blocks after the reused ones go out --------------------------------------

class _Transport:
    def __init__(self):
        self.sent = []

    def block_layer_bytes_to(self, peer_id):
        return 2 * BS * 4  # K and V of one block: BS tokens x 1 head x dim 1 x 4 bytes

    def send(self, peer, request_id, layers, src, dst):
        self.sent.append((list(layers), list(src), list(dst)))

    def poll_sent(self):
        return [], []


class _Endpoint:
    def dead_peers(self):
        return set()


def test_prefill_connector_sends_only_blocks_after_the_reused_ones():
    transport = _Transport()
    c = PrefillKVConnector(transport, _Endpoint(), num_target_layers=1, num_layers=2, block_size=BS)
    # 18 prompt tokens = 5 blocks, the first 3 held by the decode side: 2 destinations.
    c.add_transfer("r", "d0", [40, 41], 18, 10.0, num_reused_blocks=3)

    class Sched:
        scheduled = [type("S", (), dict(request_id="r", block_ids=[10, 11, 12, 13, 14, 15],
                                        num_computed_tokens=0, num_scheduled_tokens=18))]
    c.pre_forward(Sched)
    c.save_layer(0)
    c.request_finished(type("R", (), dict(request_id="r", output_token_ids=[5], block_ids=[10, 11, 12, 13, 14, 15],
                                          num_cached_tokens=0, num_offloaded_tokens=0, spec_token_ids=[]))())
    c.post_forward({"r"})
    assert transport.sent == [([0], [13], [40]),  # the full block after the reused ones, layer by layer
                              ([0], [14], [41]),  # the tail block from post_forward (S2)
                              ([1], [13, 14], [40, 41])]  # the draft layer of every block not reused
    assert c.tasks["r"].num_bytes == 4 * 2 * BS * 4


@pytest.mark.parametrize("num_reused,num_dst", [(5, 1), (-1, 6), (3, 1)])
def test_prefill_connector_refuses_reuse_that_leaves_nothing_or_too_few_destinations(num_reused, num_dst):
    c = PrefillKVConnector(_Transport(), _Endpoint(), num_target_layers=1, num_layers=1, block_size=BS)
    with pytest.raises(ValueError, match="reused"):
        c.add_transfer("r", "d0", list(range(num_dst)), 18, 10.0, num_reused_blocks=num_reused)


def test_transfer_request_without_the_field_means_send_every_block():
    msg = TransferRequest("r", [1, 2], 5, 0.0, num_reused_blocks=3)
    assert decode(encode(msg), 1 << 20).num_reused_blocks == 3
    fields = dataclasses.asdict(TransferRequest("r", [1, 2], 5, 0.0))
    del fields["num_reused_blocks"]  # what a decode worker from before the field sends
    old = msgpack.packb({"v": PROTOCOL_VERSION, "t": "TransferRequest", "b": fields}, use_bin_type=True)
    assert decode(old, 1 << 20).num_reused_blocks == 0
    with pytest.raises(ProtocolError, match="num_reused_blocks"):
        TransferRequest("r", [1], 5, 0.0, num_reused_blocks=-1)


# ---- real workers: a two-turn conversation through 1 prefill + 1 decode ------------------------------

NUM_BLOCKS = 64
TURN1 = list(range(300, 350))  # 50 tokens
MORE = list(range(700, 730))  # turn 2's new message
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True, seed=3)
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
MTP = dict(spec_method="mtp", num_spec_tokens=2)

_config = functools.partial(engine_config, num_kv_blocks=NUM_BLOCKS, max_model_len=512, prefill_chunk_size=16)


@dataclasses.dataclass
class Conversation:
    turns: list[list[int]]  # each turn's tokens
    bytes_sent: list[int]  # what each turn's transfer moved (KVReady)
    num_reused_tokens: int  # the decode worker's, over both turns
    drafts: list[list[list[int]]]  # every draft the decode worker's proposer made, in order
    bytes_per_block: int
    first_reports: list[Tokens]  # each turn's first Tokens event (the prefill worker's cache counts)


def _turn_tokens(events: Events, request_id: str) -> list[int]:
    """Every token of one request on the decode worker's stream, once it finished (or failed: raises)."""
    mine = lambda e: getattr(e, "request_id", None) == request_id  # noqa: E731
    end = events.wait_for(lambda e: mine(e) and (getattr(e, "finished", False) or isinstance(e, Failed)), 120)
    assert end is not None and not isinstance(end, Failed), f"{request_id}: {end}"
    with events.lock:
        return [t for e in events.items if mine(e) and isinstance(e, Tokens) for t in e.new_token_ids]


def _conversation(params=PARAMS, cut: int | None = None, between_turns=None, **overrides) -> Conversation:
    """Turn 1, then turn 2 = (turn 1's prompt + its answer)[:cut] + MORE, on one prefill + decode pair;
    ``between_turns(p, d)`` runs after turn 1."""
    events = Events()
    with connected_pair(_config(**overrides), TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        drafts, propose = [], d.engine.runner.proposer.propose

        def recorded(batch):
            out = propose(batch)
            drafts.append([list(x) for x in out])
            return out

        d.engine.runner.proposer.propose = recorded
        turns, prompt = [], TURN1
        for turn in ("t1", "t2"):
            d.submit(turn, prompt, params, "p0")
            turns.append(_turn_tokens(events, turn))
            prompt = (TURN1 + turns[0])[:cut] + MORE
            if between_turns is not None and turn == "t1":
                between_turns(p, d)
        _wait_free(p, NUM_BLOCKS, 5)
        _wait_free(d, NUM_BLOCKS, 5)  # 0 leaked blocks on both workers (shared ones freed once)
        sent = {e.request_id: e.num_bytes for e in events.items if isinstance(e, KVReady)}
        assert sum(sent.values()) == p.stats()["bytes_sent"]
        first = {}
        for e in events.items:
            if isinstance(e, Tokens):
                first.setdefault(e.request_id, e)
        return Conversation(turns, [sent["t1"], sent["t2"]], d.stats()["num_prompt_tokens_reused"], drafts,
                            p.engine.kv_spec.bytes_per_block * p.engine.config.tensor_parallel_size,  # every rank's
                            [first["t1"], first["t2"]])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,spec,cut,num_reused_blocks", [
    ("float32", {}, None, 4), ("bfloat16", {}, None, 4),
    # MTP recomputes the last matched block (its last entry's MTP KV was written for the token after it):
    # turn 2 then diverges from turn 1 right after that block (cut), so reusing it would change the drafts.
    ("float32", MTP, None, 3), ("bfloat16", MTP, 64, 3), ("float32", dict(MTP, async_scheduling=True), 64, 3)])
def test_second_turn_moves_only_the_missing_suffix_and_equals_no_reuse(dtype, spec, cut, num_reused_blocks):
    params = GREEDY if spec else PARAMS
    reused = _conversation(params, cut, dtype=dtype, **spec)
    plain = _conversation(params, cut, dtype=dtype, decode_prefix_reuse=False, **spec)
    assert reused.turns == plain.turns
    assert reused.drafts == plain.drafts  # the draft layer's KV is exact too (MTP)
    assert plain.num_reused_tokens == 0 and reused.bytes_sent[0] == plain.bytes_sent[0]  # turn 1: nothing to reuse
    # The decode worker computed turn 1's prompt and answer but its last token: 69 tokens, 4 full blocks of 16.
    assert reused.num_reused_tokens == num_reused_blocks * 16
    assert reused.bytes_sent[1] == plain.bytes_sent[1] - num_reused_blocks * reused.bytes_per_block


@pytest.mark.timeout(300)
def test_tokens_catch_a_decode_side_that_claims_blocks_it_does_not_hold(monkeypatch):
    """The equality above has teeth: a decode side that tells the prefill worker it holds the prefix but
    reserved fresh (empty) blocks for it gets the suffix only, and its turn 2 tokens differ."""
    expected = _conversation(decode_prefix_reuse=False).turns
    real = scheduler_module.reserve_remote

    def claims_without_holding(block_manager, config, request, num_state_blocks, offload=None):
        reserved = real(block_manager, dataclasses.replace(config, decode_prefix_reuse=False), request,
                        num_state_blocks, offload)
        claimed = len(block_manager.find_cached_prefix(request)) if reserved is not None else 0
        if claimed:
            reserved.num_reused_blocks, reserved.num_reused_tokens = claimed, claimed * config.block_size
            reserved.dst_block_ids = reserved.dst_block_ids[claimed:]
        return reserved

    monkeypatch.setattr(scheduler_module, "reserve_remote", claims_without_holding)
    mutated = _conversation()
    assert mutated.num_reused_tokens == 64
    assert mutated.turns[0] == expected[0] and mutated.turns[1] != expected[1]


# ---- real workers with offload tiers: a prefix evicted to host memory or disk still counts -----------

def _evict_device_cache(worker) -> None:
    """Give every free block of the worker's pool a new owner once (on its engine thread): each cached
    block leaves the device prefix cache for the offload tiers, as under memory pressure. The new owner
    then writes over every block (of every rank's cache), as a real one would: a block loaded back must hold
    what the tiers kept, not what its memory still held."""

    def evict(engine):
        bm = engine.scheduler.block_manager
        num_tokens = bm.num_free_blocks * bm.block_size
        filler = Request("evict-all", [1] * num_tokens, SamplingParams())
        assert bm.allocate_slots(filler, num_tokens)
        for cache in engine.offload.columns.caches:  # nothing else runs: every block is the filler's or free
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(7)).to(cache.dtype))
        bm.free(filler)
        assert bm.find_cached_prefix(Request("probe", TURN1 + [1], SamplingParams())) == []

    worker.call(evict, worker.engine)


def _evict_both(p, d):
    _evict_device_cache(p)
    _evict_device_cache(d)


def _corrupt_disk_tier(folder):
    def between(p, d):
        _evict_both(p, d)
        for w in (p, d):
            w.engine.offload.tiers.disk.flush()
        files = sorted(folder.rglob("*.kvb"))
        assert files, "the evicted blocks reached the disk tier"
        for path in files:  # flip one byte of every block's KV: its checksum no longer matches
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    return between


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,tensor_parallel_size", [("float32", 1), ("bfloat16", 1), ("bfloat16", 2)])
def test_a_prefix_evicted_to_host_memory_is_loaded_back_on_both_sides(dtype, tensor_parallel_size):
    """Both workers' device caches are emptied into their host tiers between the turns. The decode worker
    loads turn 1's 4 blocks back and asks only for the rest (as if they had stayed in its pool); the
    prefill worker loads its 3 and says so in the first token's report (FirstToken.num_offloaded_tokens).
    Tokens equal a run with neither reuse nor tiers. Split over two ranks, each block goes down and comes back
    with every rank's heads (kv_offload/block_columns.py) on both workers."""
    split = dict(dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    plain = _conversation(**split, decode_prefix_reuse=False, enable_prefix_caching=False)
    tiered = _conversation(between_turns=_evict_both, **split, kv_offload_host_gib=0.05)
    assert tiered.turns == plain.turns
    assert tiered.num_reused_tokens == 4 * 16  # all of them loaded back from host memory
    assert tiered.bytes_sent[1] == plain.bytes_sent[1] - 4 * tiered.bytes_per_block
    t2 = tiered.first_reports[1]
    assert t2.num_cached_tokens == 48 and t2.num_offloaded_tokens == 48  # the prefill worker's 3 blocks
    assert tiered.first_reports[0].num_offloaded_tokens == 0


@pytest.mark.timeout(300)
def test_corrupt_disk_blocks_are_asked_for_and_computed_never_used(tmp_path):
    """Every block file corrupted between the turns: both workers find it on reading (checksum), the
    decode worker asks the prefill worker for the whole prompt, which computes it; tokens exact."""
    plain = _conversation(decode_prefix_reuse=False, enable_prefix_caching=False)
    faulty = _conversation(between_turns=_corrupt_disk_tier(tmp_path), kv_offload_disk_dir=str(tmp_path),
                           kv_offload_disk_gib=0.05)
    assert faulty.turns == plain.turns
    assert faulty.num_reused_tokens == 0 and faulty.bytes_sent == plain.bytes_sent
    assert faulty.first_reports[1].num_offloaded_tokens == 0


def test_a_local_load_evicted_before_its_request_runs_reports_no_offloaded_tokens():
    """A local request's loaded blocks join the prefix cache and it lets them go until it runs; if another
    request takes them first, its hit is shorter and so is what it says came from the tiers (the count
    used to keep the load's figure: 12 offloaded tokens out of 0 cached)."""
    s, tiers = _tiered_scheduler()
    request = Request("r", list(range(1, 19)), SamplingParams(max_tokens=1))
    s.add_request(request)
    s.schedule()  # device hit 1 block, the next 3 from the lower tiers: it starts a load
    assert request.status.name == "WAITING_FOR_OFFLOAD"
    tiers.finish(3)
    s.poll_offload()
    assert request.num_offloaded_tokens == 12 and request.status.name == "WAITING"
    hog = Request("hog", list(range(100, 100 + 16 * BS - 1)), SamplingParams())
    assert s.block_manager.allocate_slots(hog, 16 * BS - 1)  # every free block: the loaded ones evicted
    s.block_manager.free(hog)
    tiers.holding = False
    s.schedule()
    assert request.num_cached_tokens == 0 and request.num_offloaded_tokens == 0
