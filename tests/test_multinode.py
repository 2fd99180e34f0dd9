"""Elastic prefill/decode on a multi-node Ray cluster on this machine (ray.cluster_utils.Cluster): a
head that hosts no worker, and worker nodes that each carry their own device slots and their own
address (127.0.0.2, 127.0.0.3, ...: distinct loopback addresses, so a node is found by its IP as a
Kubernetes pod is by its pod IP). Workers land on different Ray nodes (checked: node ids differ).

- load rises: the planner adds a decode worker, Ray places it on the node with a free slot, and it
  takes requests; load falls: the planner drains one with requests in flight, losing, failing and
  recomputing nothing, and every block comes back;
- a node goes away (a pod terminating, `ray down` of a node): `POST /admin/drain {"node_ip": ...}`, as
  the Helm chart's preStop hook sends it, drains every worker on that node while KV transfers from its
  prefill worker are in flight and requests stream on its decode worker; then the node is removed and
  the rest serves on. Every transport usable here.
"""

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager

import httpx
import pytest

from conftest import settled_worker_stats, transport_params
from pdcluster.cluster.api.admin import worker_places
from pdcluster.cluster.autoscale import AutoscaleConfig, Planner
from test_admin_api import ADMIN_KEY, admin_app, auth, serving
from test_elastic import PROMPTS, _disagg, _generate, expected  # noqa: F401 - expected is a fixture

PREFILL_IP, DECODE_IP = "127.0.0.2", "127.0.0.3"


@dataclasses.dataclass
class RayNodes:
    cluster: object  # ray.cluster_utils.Cluster
    next_host: int = 10

    @contextmanager
    def node(self, **resources):
        """One more worker node with ``resources`` and an address of its own, removed on exit (if the
        test has not removed it): yields (node, its IP)."""
        ip = f"127.0.0.{self.next_host}"
        self.next_host += 1
        node = self.cluster.add_node(num_cpus=1, resources=resources, node_ip_address=ip)
        self.cluster.wait_for_nodes()
        try:
            yield node, ip
        finally:
            if node in self.cluster.worker_nodes:
                self.cluster.remove_node(node)


@pytest.fixture(scope="module")
def ray_nodes(tiny_dir):
    """Head (no device slots: it hosts the driver only) + a prefill node + a decode node. Module-scoped
    like conftest's ray_session: pytest finishes one module's fixtures before the next module's begin,
    so the two never hold Ray at once (Ray allows one connection per process)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster as RayCluster

    if ray.is_initialized():  # left up by an earlier module's failed test: this module needs its own Ray
        warnings.warn("Ray was still initialized when test_multinode began; shutting it down", stacklevel=1)
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="pdcluster-multinode-")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp  # cluster_utils writes the cluster's address there
    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"prefill_slot": 1}, node_ip_address=PREFILL_IP)
        cluster.add_node(num_cpus=1, resources={"decode_slot": 1}, node_ip_address=DECODE_IP)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield RayNodes(cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(tmp, ignore_errors=True)  # the three nodes' session files


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)


def _assert_all_blocks_back(cluster) -> None:
    for wid, s in settled_worker_stats(cluster, 10).items():
        assert s["num_free_blocks"] == s["num_blocks"], (wid, s)
        assert s.get("num_reserved", 0) == 0 and s.get("num_transfers", 0) == 0, (wid, s)


@pytest.mark.slow  # the planner adding and draining under load: test_autoscale.py in the default suite
@pytest.mark.timeout(300)
def test_load_rises_adds_a_worker_on_another_node_load_falls_drains_one(ray_nodes, expected):
    with ray_nodes.node(decode_slot=1):  # a second decode slot: where the added worker can go
        cluster = _disagg("tcp", num_prefill=1, num_decode=1)
        router = cluster.router
        recorder = router.record()
        # A TPOT SLO no CPU meets: the planner must add a decode worker.
        strict = AutoscaleConfig(max_decode=2, slo_tpot_ms=0.001, slo_ttft_ms=1e6, cooldown_s=0.0, min_samples=4,
                                 window_s=600.0)
        planner = Planner(cluster, strict)

        async def main():
            router.start(asyncio.get_running_loop())
            before = {p.worker_id: p for p in await worker_places(cluster)}
            first = [await _generate(router, f"a{i}", p) for i, p in enumerate(PROMPTS[:4])]
            added = await planner.step()
            new_worker = planner.decisions[-1][2]
            second = await asyncio.gather(*(_generate(router, f"b{i}", p) for i, p in enumerate(PROMPTS[4:], 4)))
            after = {p.worker_id: p for p in await worker_places(cluster)}
            # Quiet now (an SLO far above what is measured): the planner drains a decode worker while
            # requests run on both.
            planner.config = dataclasses.replace(strict, slo_tpot_ms=1e6, low_fraction=1.0, kv_low=1.0)
            running = [asyncio.create_task(_generate(router, f"c{i}", p)) for i, p in enumerate(PROMPTS[:4])]
            await _until(lambda: len(router.requests) == 4 and all(r.running for r in router.requests.values()),
                         "all four requests run")
            on_each = {d.decode_id for d in recorder.decisions if d.request_id.startswith("c")}
            drained = await planner.step()
            drained_worker = planner.decisions[-1][2]
            third = await asyncio.gather(*running)
            return before, first + second + third, added, new_worker, after, on_each, drained, drained_worker

        try:
            before, outs, added, new_worker, after, on_each, drained, drained_worker = asyncio.run(main())
            (prefill,) = [p for p in before.values() if p.role == "prefill"]
            (decode,) = [p for p in before.values() if p.role == "decode"]
            assert prefill.node_ip == PREFILL_IP and decode.node_id not in (None, prefill.node_id)
            assert (added.kind, added.role) == ("add", "decode")
            assert after[new_worker].node_id not in (prefill.node_id, decode.node_id), "the added worker shares a node"
            assert any(d.decode_id == new_worker for d in recorder.decisions if d.request_id.startswith("b")), \
                "the added worker took no request"
            assert outs == expected + expected[:4]
            assert (drained.kind, drained.role) == ("drain", "decode")
            assert on_each == {decode.worker_id, new_worker}, "requests ran on one worker only: the drain had no teeth"
            assert drained_worker not in cluster.decode_handles and len(cluster.decode_handles) == 1
            assert not recorder.recoveries, "a drain must not recompute anything"
            _assert_all_blocks_back(cluster)
        finally:
            cluster.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", transport_params(fast=("tcp",)))  # the wire between nodes
def test_node_drain_with_transfers_in_flight_loses_nothing(ray_nodes, expected, transport):
    with ray_nodes.node(prefill_slot=1, decode_slot=1) as (leaving_node, leaving_ip):
        # 2P2D over three nodes: one prefill and one decode worker on the leaving node (its slots and
        # the prefill and decode nodes' single slots leave Ray no other choice).
        cluster = _disagg(transport, num_prefill=2, num_decode=2)
        router = cluster.router
        recorder = router.record()

        async def main():
            router.start(asyncio.get_running_loop())
            places = await worker_places(cluster)
            on_node = {p.role: p.worker_id for p in places if p.node_ip == leaving_ip}
            assert sorted(on_node) == ["decode", "prefill"], places
            assert {p.node_ip for p in places} == {PREFILL_IP, DECODE_IP, leaving_ip}, places
            assert len({p.node_id for p in places}) == 3, places
            leaving_p, leaving_d = on_node["prefill"], on_node["decode"]
            async with serving(admin_app(cluster)) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
                first = [asyncio.create_task(_generate(router, f"p{i}", p)) for i, p in enumerate(PROMPTS[:4])]
                # A transfer from the leaving prefill worker is under way, and a request streams on the
                # leaving decode worker.
                await _until(lambda: any(d.prefill_id == leaving_p for d in recorder.decisions)
                             and any(r.attempt is not None and r.attempt.decode_id == leaving_d and r.emitted
                                     for r in router.requests.values()), "both leaving workers are busy")
                drain = asyncio.create_task(http.post("/admin/drain", json={"node_ip": leaving_ip},
                                                      headers=auth(ADMIN_KEY)))
                await _until(lambda: all(wid not in router.views or router.views[wid].draining
                                         for wid in (leaving_p, leaving_d)), "the drain began")
                began = len(recorder.decisions)  # nothing new may go to the leaving node from here
                later = [asyncio.create_task(_generate(router, f"p{i}", p)) for i, p in enumerate(PROMPTS[4:], 4)]
                outs = await asyncio.gather(*first, *later)
                return on_node, await drain, outs, began

        try:
            on_node, r, outs, began = asyncio.run(main())
            assert r.status_code == 200, r.text
            drained = {d["worker_id"]: d for d in r.json()["drained"]}
            assert set(drained) == set(on_node.values())
            assert sum(d["num_requests_waited_for"] for d in drained.values()) >= 1, \
                "the drain had nothing to wait for: the test has no teeth"
            assert r.json()["workers_in_rotation"] == {"prefill": 1, "decode": 1}
            assert outs == expected
            assert not recorder.recoveries, "a drain must not recover (recompute) anything"
            later = recorder.decisions[began:]
            assert len(later) >= 2 and all(d.decode_id != on_node["decode"] and d.prefill_id != on_node["prefill"]
                                           for d in later), "a leaving worker got a new request"
            assert not set(on_node.values()) & set(router.views)

            ray_nodes.cluster.remove_node(leaving_node)  # the pod or machine goes away

            async def after():
                router.start(asyncio.get_running_loop())
                return [await _generate(router, f"q{i}", p) for i, p in enumerate(PROMPTS[:2])]

            assert asyncio.run(after()) == expected[:2]
            assert not recorder.recoveries, "nothing depended on the removed node"
            _assert_all_blocks_back(cluster)
        finally:
            cluster.shutdown()
