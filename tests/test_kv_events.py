"""KV events from the workers to the router's global index (issue 27 item 2): a worker publishes what its
engine stored in and removed from each KV tier as one ``KVEvents`` record a turn of its engine thread;
the router applies them to its KVIndex, ignores workers it does not know, forgets a worker that restarts
or leaves, and drops malformed events with a warning while it lives on."""

from __future__ import annotations

import asyncio
import logging
import queue
import time

import msgpack
import pytest
import zmq

from conftest import engine_config
from pdcluster.cluster.router import ClusterRouter, RouterConfig
from pdcluster.cluster.router.kv_index import TIER_WEIGHTS, KVIndex
from pdcluster.engine.block_manager import chained_block_hashes
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.actor import worker_engine_config
from pdcluster.node.event_pusher import EventPusher
from pdcluster.node.events import (EVENT_CODEC, EVENTS_VERSION, KV_TIERS, MAX_EVENT_BYTES, MAX_KV_EVENT_HASHES,
                                   KVEvent, KVEvents, kv_event_records)
from pdcluster.wire.records import ProtocolError

BLOCK = 16


# ---- the record --------------------------------------------------------------------------------------

def test_a_drain_is_one_record_in_order_and_a_burst_is_split():
    drained = [("stored", "device", [1, 2, 3]), ("removed", "device", [2]), ("stored", "host", [2])]
    (record,) = kv_event_records("d0", drained)
    assert record.worker_id == "d0"
    assert [(e.kind, e.tier, e.block_hashes) for e in record.events] == drained
    assert EVENT_CODEC.decode(EVENT_CODEC.encode(record), MAX_EVENT_BYTES) == record
    burst = list(range(-5, MAX_KV_EVENT_HASHES + 7))  # chained hashes are signed 64-bit
    records = kv_event_records("d0", [("stored", "device", [9]), ("removed", "disk", burst)])
    assert len(records) == 2
    assert [h for r in records for e in r.events for h in e.block_hashes] == [9, *burst]
    assert all(len(EVENT_CODEC.encode(r)) < MAX_EVENT_BYTES for r in records)
    assert kv_event_records("d0", []) == []


def test_neighbouring_entries_of_one_kind_and_tier_travel_as_one_event_in_order():
    """A decode step's drain: each evicted block and each request's new full blocks reported on their own. Runs of
    the same kind and tier become one event with their hashes in order; a change of kind or tier starts another,
    so a block stored, removed and stored again keeps that order. The drained lists are left as they were."""
    drained = [("removed", "device", [1]), ("removed", "device", [2]), ("stored", "device", [3, 4]),
               ("stored", "device", [5]), ("stored", "host", [3]), ("removed", "device", [3]),
               ("stored", "device", [3])]
    before = [(k, t, list(h)) for k, t, h in drained]
    (record,) = kv_event_records("d0", drained)
    assert [(e.kind, e.tier, e.block_hashes) for e in record.events] == [
        ("removed", "device", [1, 2]), ("stored", "device", [3, 4, 5]), ("stored", "host", [3]),
        ("removed", "device", [3]), ("stored", "device", [3])]
    assert drained == before


def test_the_tiers_are_the_index_tiers_and_bad_values_are_refused():
    assert set(KV_TIERS) == set(TIER_WEIGHTS)
    with pytest.raises(ProtocolError, match="tier"):
        KVEvent("stored", "gpu", [1])
    with pytest.raises(ProtocolError, match="kind"):
        KVEvent("moved", "host", [1])
    with pytest.raises(ProtocolError, match="expected int"):
        KVEvent("stored", "host", ["x"])


def test_the_disk_tier_gets_a_folder_per_worker():
    config = engine_config(kv_offload_disk_dir="/tmp/kv", kv_offload_disk_gib=1.0)
    assert worker_engine_config(config, "decode-0-ab").kv_offload_disk_dir == "/tmp/kv/decode-0-ab"
    assert worker_engine_config(config, "prefill-0-ab").kv_offload_disk_dir == "/tmp/kv/prefill-0-ab"
    plain = engine_config()
    assert worker_engine_config(plain, "decode-0-ab") is plain


# ---- the router's side ------------------------------------------------------------------------------

def _router() -> ClusterRouter:
    # No health checks: the workers here are names, not actors.
    router = ClusterRouter({}, {}, None, "m", max_model_len=1024, block_size=BLOCK,
                           config=RouterConfig(policy="kv_aware", health_interval_s=3600))
    for wid, role in (("p0", "prefill"), ("d0", "decode")):
        router.membership.add(wid, role, object(), 64, BLOCK, incarnation="i0")
    return router


def test_the_router_applies_events_of_known_workers():
    router = _router()
    try:
        router.on_event(KVEvents("p0", [KVEvent("stored", "device", [1, 2, 3]), KVEvent("stored", "host", [3]),
                                        KVEvent("removed", "device", [3])]))
        router.on_event(KVEvents("gone", [KVEvent("stored", "device", [1, 2, 3])]))  # not in the cluster
        assert router.kv_index.overlap("p0", [1, 2, 3]) == 2.8
        assert router.kv_index.num_blocks("p0") == {"device": 2, "host": 1, "disk": 0, "shared": 0}
        assert router.kv_index.overlap("gone", [1]) == 0.0
        # A worker that leaves is forgotten (membership drops it through the health monitor).
        router.membership.forget("p0")
        assert router.kv_index.overlap("p0", [1]) == 0.0
        router.on_event(KVEvents("p0", [KVEvent("stored", "device", [1])]))  # late: ignored
        assert router.kv_index.overlap("p0", [1]) == 0.0
    finally:
        router.close()


def test_a_restarted_worker_is_forgotten():
    router = _router()

    class Restarted:  # answers its health check with a new incarnation
        class ping:
            @staticmethod
            def remote():
                async def answer():
                    from pdcluster.node.actor import Ping

                    return Ping(alive=True, incarnation="i1", stalled_s=0.0, pid=1,
                                kv_tiers={"device": {"blocks": 0, "capacity_blocks": 64}})
                return answer()

    try:
        router.on_event(KVEvents("d0", [KVEvent("stored", "device", [1, 2])]))
        asyncio.run(router.health.check("d0", Restarted()))
        assert router.kv_index.overlap("d0", [1, 2]) == 0.0
        assert router.views["d0"].kv_tiers == {"device": {"blocks": 0, "capacity_blocks": 64}}
        assert router.stats()["workers"][1]["kv_tiers"]["device"]["capacity_blocks"] == 64
    finally:
        router.close()


def test_malformed_events_on_the_stream_are_dropped_and_logged(caplog):
    """Over the real zmq stream: garbage, a KVEvents with an unknown tier, then a good one. The first two
    are logged and dropped; the receiver lives on and applies the third."""
    router = _router()
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router.event_address)
    pusher = EventPusher(router.event_address)
    bad_tier = msgpack.packb({"v": EVENTS_VERSION, "t": "KVEvents", "b": {
        "worker_id": "p0", "events": [{"kind": "stored", "tier": "gpu", "block_hashes": [5]}]}})

    async def scenario():
        router.start(asyncio.get_running_loop())
        sock.send(b"\x93not an event")
        sock.send(bad_tier)
        pusher(KVEvents("p0", [KVEvent("stored", "disk", [7, 8])]))
        deadline = time.monotonic() + 10
        while router.kv_index.overlap("p0", [7, 8]) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    try:
        with caplog.at_level(logging.WARNING, logger="pdcluster.cluster.router.events"):
            asyncio.run(scenario())
        assert router.kv_index.overlap("p0", [7, 8]) == 1.0
        assert router.kv_index.overlap("p0", [5]) == 0.0
        dropped = [r.getMessage() for r in caplog.records if "dropping malformed worker event" in r.getMessage()]
        assert len(dropped) == 2 and "tier" in dropped[1], dropped
    finally:
        pusher.close()
        sock.close(0)
        router.close()


# ---- a worker's side --------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_worker_publishes_its_device_and_host_blocks(tiny_dir):
    """A colocated decode worker with a small pool and a host tier: a prompt's blocks are stored on the
    device, a second prompt evicts them to host memory; every turn's events come as one record with
    the worker's id; its stats show every tier's usage; closing it ends the offload tiers."""
    from pdcluster.decode_node.worker import DecodeWorker

    worker = DecodeWorker("d7", engine_config(num_kv_blocks=16, kv_offload_host_gib=0.01))
    events: queue.SimpleQueue = queue.SimpleQueue()
    worker.on_event = events.put
    a, b = [list(range(1000 + 200 * i, 1000 + 200 * i + 160)) for i in range(2)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def run(request_id, prompt):
        worker.submit(request_id, prompt, params)
        records = []
        while True:
            ev = events.get(timeout=60)
            if isinstance(ev, KVEvents):
                records.append(ev)
            elif getattr(ev, "finished", False):
                worker.call(lambda: None)  # one more turn: its last events are out
                while not events.empty():
                    ev = events.get()
                    records += [ev] if isinstance(ev, KVEvents) else []
                return records

    try:
        first = run("a", a)
        assert {r.worker_id for r in first} == {"d7"}
        stored = [h for r in first for e in r.events if (e.kind, e.tier) == ("stored", "device")
                  for h in e.block_hashes]
        assert stored[:10] == chained_block_hashes(a, BLOCK)
        second = run("b", b)
        to_host = {h for r in second for e in r.events if (e.kind, e.tier) == ("stored", "host")
                   for h in e.block_hashes}
        left = {h for r in second for e in r.events if (e.kind, e.tier) == ("removed", "device")
                for h in e.block_hashes}
        # b's blocks took some of a's cached ones: those left the device pool for host memory.
        assert to_host and to_host == left and to_host <= set(chained_block_hashes(a, BLOCK))
        tiers = worker.stats()["kv_tiers"]
        assert tiers["device"]["capacity_blocks"] == 16 and tiers["host"]["blocks"] >= 3
    finally:
        worker.close()
    assert not worker.engine.offload._thread.is_alive()


@pytest.mark.timeout(120)
def test_a_restarted_worker_announces_the_disk_blocks_it_finds(tiny_dir, tmp_path):
    """A worker's disk tier outlives its process. The next worker on the same folder finds the blocks
    and, asked (its actor does at start, the re-wiring after a Ray restart: the router forgot it),
    publishes each tier's blocks as "stored" events, which the router's index applies."""
    from pdcluster.decode_node.worker import DecodeWorker

    cfg = engine_config(num_kv_blocks=16, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_gib=0.05)
    a, b = [list(range(1000 + 200 * i, 1000 + 200 * i + 160)) for i in range(2)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = DecodeWorker("d8", cfg)
    finished: queue.SimpleQueue = queue.SimpleQueue()
    first.on_event = lambda ev: finished.put(ev) if getattr(ev, "finished", False) else None
    try:
        for prompt in (a, b):  # b's blocks evict a's to disk
            first.submit(f"r{prompt[0]}", prompt, params)
            finished.get(timeout=60)
        on_disk = set(first.call(lambda: first.engine.offload.tiers.held_hashes()["disk"]))
    finally:
        first.close()  # the disk writer finishes its queue
    assert on_disk and on_disk <= set(chained_block_hashes(a, BLOCK))

    second = DecodeWorker("d8", cfg)
    events: queue.SimpleQueue = queue.SimpleQueue()
    second.on_event = events.put
    try:
        assert second.call(second.announce_kv_blocks) == len(on_disk)
        second.call(lambda: None)  # one more turn: the announcement is out
        index = KVIndex()
        while not events.empty():
            ev = events.get()
            if isinstance(ev, KVEvents):
                index.apply(ev.worker_id, ev.events)
        assert index.num_blocks("d8")["disk"] == len(on_disk)
        assert all(index.overlap("d8", [h]) == TIER_WEIGHTS["disk"] for h in on_disk)
    finally:
        second.close()
