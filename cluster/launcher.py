"""Starts the cluster on Ray: prefill and decode actors in a placement group (one device each), the
control-plane mesh between them (every decode worker handshakes with every prefill worker: xPyD),
the router, and the HTTP server.

Devices: with CUDA each worker asks Ray for ``num_gpus=1``. On CPU, custom resources
``prefill_slot`` / ``decode_slot`` stand in for devices and each worker gets its own share of the
cores (torch threads), so prefill and decode do not fight over them.

Ray is imported where a cluster starts, not at the top: its import loads the psutil Ray vendors, which
tests/test_runtime_dependencies.py's isolated import (declared distributions' names only) refuses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import uuid
from dataclasses import asdict, dataclass, replace

from fastapi import FastAPI

from pdcluster.cluster.api.admin import install_admin_routes
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.middleware import install_error_handlers
from pdcluster.cluster.api.options import ApiOptions
from pdcluster.cluster.autoscale import Planner
from pdcluster.cluster.engine_args import engine_config_from_args
from pdcluster.cluster.http_options import HttpOptions
from pdcluster.cluster.http_server import listen, run_server
from pdcluster.cluster.metrics import Metrics
from pdcluster.cluster.router import ClusterRouter, RouterConfig
from pdcluster.cluster.router.weights import SLEEP_TIMEOUT_S, WorkerWeights
from pdcluster.decode_node.actor import DecodeActor
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.models.architectures import arch_from_dir, max_model_len_for
from pdcluster.engine.draft_model import check_draft_model
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.tokenizer_overlay import check_tokenizer_fits
from pdcluster.engine.tensor_parallel.driver import check_shared_caches
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.prefill_node.actor import PrefillActor

log = logging.getLogger(__name__)

_FORWARDED_ENV = ("PDCLUSTER_CACHE_DIR", "UCX_NET_DEVICES", "UCX_TLS", "UCX_WARN_UNUSED_ENV_VARS", "TOKENIZERS_PARALLELISM")


@dataclass
class ClusterSpec:
    engine: EngineConfig
    transfer: TransferConfig
    mode: str = "disagg"  # "disagg" | "colocated"
    num_prefill: int = 1
    num_decode: int = 1
    policy: str = "least_loaded"
    address: str | None = None  # Ray address; None = start a local Ray instance
    conditional_prefill_tokens: int = 0
    busy_prefill_tokens: int = 0
    request_timeout_s: float = 300.0
    served_model_name: str = ""
    # Ray restarts a crashed worker process this many times; the router re-wires it when it is back.
    max_worker_restarts: int = 3
    # Most workers of each role this cluster may grow to (add_worker, --autoscale); 0 = the initial
    # count. A local Ray instance is started with that many device slots.
    max_prefill: int = 0
    max_decode: int = 0
    # Ranks each prefill / decode worker splits the model across (disagg); 0 = engine.tensor_parallel_size. They may
    # differ (heterogeneous tensor parallelism): the prefill workers lay their KV out for the decode workers' ranks
    # (kv_transfer/transports/resplit.py).
    prefill_tensor_parallel_size: int = 0
    decode_tensor_parallel_size: int = 0

    def role_tensor_parallel_size(self, role: str) -> int:
        """Ranks a ``role`` ("prefill" or "decode") worker splits the model across."""
        own = self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size
        return own or self.engine.tensor_parallel_size

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated"):
            raise ValueError(f"mode: {self.mode!r} is not one of disagg, colocated (or local without Ray)")
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")
        for role in ("prefill", "decode"):
            if self.role_tensor_parallel_size(role) < 1:
                raise ValueError(f"{role}_tensor_parallel_size must be >= 1 (0: engine.tensor_parallel_size), "
                                 f"got {self.role_tensor_parallel_size(role)}")
        if self.mode != "disagg" and self.role_tensor_parallel_size("prefill") != self.engine.tensor_parallel_size:
            raise ValueError(f"prefill_tensor_parallel_size: {self.mode} mode has no prefill workers")
        if self.mode == "disagg" and self.engine.pipeline_parallel_size > 1:
            raise ValueError(f"pipeline_parallel_size {self.engine.pipeline_parallel_size}: a KV transfer sends rank "
                             "0's cache, which holds its stage's layers only: serve pipeline-parallel workers "
                             "colocated")
        if self.num_decode < 1 or (self.mode == "disagg" and self.num_prefill < 1):
            raise ValueError(f"need at least one decode worker and, in disagg mode, one prefill worker "
                             f"(got num_prefill={self.num_prefill}, num_decode={self.num_decode})")


def engine_for_gpu_share(engine: EngineConfig, gpu_share: float) -> EngineConfig:
    """Workers sharing a GPU (a share below 1) split the memory they may use: each sizes its KV pool from its
    part of gpu_memory_utilization."""
    if 0 < gpu_share < 1:
        return replace(engine, gpu_memory_utilization=engine.gpu_memory_utilization * gpu_share)
    return engine


def gpu_share_per_worker(num_gpus: float, num_workers: int) -> float:
    """The GPU each worker asks Ray for: a whole one where there are enough, else an equal share of
    what there is (1 GPU, 1 prefill + 1 decode: 0.5 each). Shares are rounded down to hundredths so
    that Ray's bundles add up to no more than the GPUs."""
    if num_gpus >= num_workers:
        return 1.0
    return max(0.01, int(100 * num_gpus / num_workers) / 100)


def ray_has_resource(name: str) -> bool:
    import ray  # see the module docstring

    return bool(ray.cluster_resources().get(name))


class Cluster:
    """Handles to a running cluster. ``shutdown()`` stops the actors (and Ray, if we started it)."""

    def __init__(self, spec: ClusterSpec):
        import ray  # see the module docstring
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec = spec
        self._ray = ray
        num_prefill = spec.num_prefill if spec.mode == "disagg" else 0
        num_workers = num_prefill + spec.num_decode
        self.model_dir = resolve_model(spec.engine.model, cache_dir=spec.engine.cache_dir or None,
                                       hf_overrides=spec.engine.hf_overrides, revision=spec.engine.revision,
                                       download_dir=spec.engine.download_dir, tokenizer=spec.engine.tokenizer,
                                       tokenizer_revision=spec.engine.tokenizer_revision,
                                       load_format=spec.engine.load_format)
        self.tokenizer = Tokenizer(self.model_dir)
        arch = arch_from_dir(self.model_dir)
        if spec.engine.tokenizer:  # one line now, not a failure in every worker after start
            check_tokenizer_fits(self.tokenizer, arch, spec.engine.tokenizer)
        if spec.engine.spec_method == "draft_model":  # one line now, not a failure in every worker after start
            check_draft_model(spec.engine, arch, self.tokenizer)
        self._started_ray = False
        if not ray.is_initialized():
            if spec.address:
                ray.init(address=spec.address, log_to_driver=True)
            else:
                slots = {"prefill_slot": max(num_prefill, spec.max_prefill if spec.mode == "disagg" else 0),
                         "decode_slot": max(spec.num_decode, spec.max_decode)}
                ray.init(num_cpus=os.cpu_count(), resources=slots,
                         include_dashboard=False, log_to_driver=True)
                self._started_ray = True
        num_gpus = float(ray.cluster_resources().get("GPU", 0))
        use_gpu = num_gpus > 0
        # A worker per GPU where there are enough; fewer GPUs than workers (disagg on a one-GPU machine):
        # the workers share them, each asking Ray for its fraction (Ray then gives them the same device).
        gpu_share = gpu_share_per_worker(num_gpus, num_workers) if use_gpu else 0.0
        tps = {role: spec.role_tensor_parallel_size(role) for role in ("prefill", "decode")}
        stages = spec.engine.pipeline_parallel_size  # a pipeline-parallel worker's ranks (colocated only)
        ranks = {role: tp * stages for role, tp in tps.items()}
        num_ranks = num_prefill * ranks["prefill"] + spec.num_decode * ranks["decode"]
        split_roles = [role for role in ("prefill", "decode") if ranks[role] > 1 and (role == "decode" or num_prefill)]
        if use_gpu and split_roles and spec.mode == "disagg" and spec.engine.device != "cpu":
            for role in split_roles:  # what the workers would refuse, after loading
                check_shared_caches(replace(spec.engine, device="cuda", tensor_parallel_size=tps[role]))
        gpu_shares = dict.fromkeys(tps, gpu_share)
        if use_gpu and split_roles:  # a worker's ranks each take a whole GPU of the worker's (cuda:0 .. tp-1)
            if num_gpus < num_ranks:
                raise ValueError(f"ranks per worker {'/'.join(str(ranks[r]) for r in split_roles)} (tensor x pipeline "
                                 f"parallel): {num_workers} worker(s) need {num_ranks} GPUs, the cluster has "
                                 f"{num_gpus:g}")
            gpu_shares = {role: float(n) for role, n in ranks.items()}
        event_host = "127.0.0.1" if not spec.address else ray.util.get_node_ip_address()
        engine = spec.engine
        if not engine.num_threads and not use_gpu and not spec.address:
            # Share this machine's cores between the workers (each worker is its own "device").
            # ... and a tensor-parallel worker's share between its ranks.
            engine = EngineConfig(**{**asdict(engine), "num_threads": max(1, (os.cpu_count() or 1) // num_ranks)})
        engines = {role: engine_for_gpu_share(replace(engine, tensor_parallel_size=tp), gpu_shares[role])
                   for role, tp in tps.items()}
        engine = engines["decode"]
        transfer = spec.transfer
        if transfer.secret is None:
            # Secure by default: the workers of this cluster share a fresh random secret, so nothing
            # outside it can join the control or transfer planes even when nobody configured one.
            transfer = replace(transfer, secret=secrets.token_hex(32))
        if spec.address and transfer.host == "127.0.0.1":
            # Workers on other nodes must reach each other: each binds its own node's address.
            transfer = TransferConfig(**{**asdict(transfer), "host": "auto"})
        self.router = ClusterRouter(
            {}, {}, self.tokenizer, spec.served_model_name or spec.engine.model,
            max_model_len=max_model_len_for(arch, engine.max_model_len),
            block_size=engine.block_size, lora_names=tuple(engine.lora_paths()),
            max_loras=engine.max_loras if engine.serves_lora else 0,
            max_images_per_prompt=engine.max_images_per_prompt(), mm_processor_kwargs=engine.mm_processor_kwargs,
            config=RouterConfig(policy=spec.policy, mode=spec.mode, num_spec_tokens=engine.num_spec_steps,
                                conditional_prefill_tokens=spec.conditional_prefill_tokens,
                                busy_prefill_tokens=spec.busy_prefill_tokens, request_timeout_s=spec.request_timeout_s,
                                event_host=event_host),
        )
        self.router.generation.start_path = str(self.model_dir)
        slot = {"prefill": "prefill_slot", "decode": "decode_slot"}
        # On GPU clusters the role slot still decides the node type (prefill vs decode nodes).
        role_slots = ray.cluster_resources()
        bundles = [self._bundle(gpu_shares["prefill"], slot["prefill"], role_slots) for _ in range(num_prefill)]
        bundles += [self._bundle(gpu_shares["decode"], slot["decode"], role_slots) for _ in range(spec.num_decode)]
        self.placement_group = placement_group(bundles, strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=120)
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        tag = uuid.uuid4().hex[:6]
        self._next_event_rank = 0  # _ranked
        self.prefill_handles, self.decode_handles = {}, {}
        for i in range(num_prefill):
            opts = self._actor_options(PlacementGroupSchedulingStrategy(self.placement_group, i), gpu_shares["prefill"],
                                       slot["prefill"], spec.max_worker_restarts)
            wid = f"prefill-{i}-{tag}"
            self.prefill_handles[wid] = ray.remote(PrefillActor).options(**opts).remote(
                wid, self._ranked(engines["prefill"]), transfer, self.router.event_address, env)  # its KV events
        for j in range(spec.num_decode):
            opts = self._actor_options(PlacementGroupSchedulingStrategy(self.placement_group, num_prefill + j),
                                       gpu_shares["decode"], slot["decode"], spec.max_worker_restarts)
            wid = f"decode-{j}-{tag}"
            self.decode_handles[wid] = ray.remote(DecodeActor).options(**opts).remote(
                wid, self._ranked(engine), transfer if spec.mode == "disagg" else None, self.router.event_address, env)
        addresses = dict(zip(self.prefill_handles, ray.get([h.address.remote() for h in self.prefill_handles.values()], timeout=300)))
        for handle in self.decode_handles.values():
            ray.get([handle.connect_prefill.remote(addr) for addr in addresses.values()], timeout=60)
        stats = ray.get([h.stats.remote() for h in self.decode_handles.values()], timeout=60)
        handles = {**self.prefill_handles, **self.decode_handles}
        pings = dict(zip(handles, ray.get([h.ping.remote() for h in handles.values()], timeout=60)))
        num_blocks = {wid: engine.num_kv_blocks for wid in self.prefill_handles}
        num_blocks.update({wid: st["num_blocks"] for wid, st in zip(self.decode_handles, stats)})
        state_blocks = {wid: st.get("num_state_blocks", 0) for wid, st in zip(self.decode_handles, stats)}
        if engine.lora_modules:  # their digests stamp requests (cluster/router/lora.py): one worker says them
            self.router.lora.learn(ray.get(next(iter(self.decode_handles.values())).lora_adapters.remote(), timeout=60))
        for wid, handle in handles.items():  # the same path as add_worker
            role = "prefill" if wid in self.prefill_handles else "decode"
            ping = pings[wid]
            self.router.membership.add(wid, role, handle, num_blocks[wid], engine.block_size, ping.incarnation, ping.pid,
                                       state_blocks.get(wid, 0), ping.kv_event_source)
        # One set of handles: workers added or removed later (add_worker, remove_worker) show in both.
        self.prefill_handles, self.decode_handles = self.router.prefill, self.router.decode
        self._engine, self._transfer, self._env, self._tag = engine, transfer, env, tag
        self._engines, self._gpu_shares = engines, gpu_shares
        self._next_index = {"prefill": num_prefill, "decode": spec.num_decode}
        self.router.health.on_worker_restarted = self.rewire
        self.router.health.on_pair_lost = self.rewire_pair

    def _ranked(self, engine_config: EngineConfig) -> EngineConfig:
        """The config of the next worker started: under --kv-events-config its rank, its place in the start order
        (prefill workers, then decode workers, then those added later), offsets its endpoint's port as vLLM's
        data-parallel rank does. A worker Ray restarts keeps it (the same constructor arguments)."""
        rank, self._next_event_rank = self._next_event_rank, self._next_event_rank + 1
        return replace(engine_config, kv_events_rank=rank) if engine_config.kv_events_config else engine_config

    async def rewire_pair(self, prefill_id: str, decode_id: str, timeout_s: float = 30.0) -> None:
        """Have decode worker ``decode_id`` handshake with prefill worker ``prefill_id`` again: it
        dropped that peer after the control plane's peer timeout (the prefill worker was frozen) and
        the same process resumed, so nothing else would. The handshake a restart runs (``rewire``);
        raises if it fails (the router retries on its next health check)."""
        address = await asyncio.wait_for(self.prefill_handles[prefill_id].address.remote(), timeout_s)
        await asyncio.wait_for(self.decode_handles[decode_id].connect_prefill.remote(address), timeout_s)

    async def rewire(self, worker_id: str, timeout_s: float = 60.0) -> None:
        """Re-run the handshakes of a worker Ray restarted (new process: new ports, no peers).
        A prefill worker gets every live decode worker connected again; a decode worker connects to
        every prefill worker. Raises if the worker itself cannot be wired (the router retries)."""
        if worker_id in self.prefill_handles:
            address = await asyncio.wait_for(self.prefill_handles[worker_id].address.remote(), timeout_s)
            decodes = [wid for wid in self.decode_handles if self.router.views[wid].healthy]
            results = await asyncio.gather(
                *(asyncio.wait_for(self.decode_handles[wid].connect_prefill.remote(address), timeout_s) for wid in decodes),
                return_exceptions=True)
            failed = {wid: r for wid, r in zip(decodes, results) if isinstance(r, BaseException)}
            for wid, err in failed.items():  # that decode worker is in trouble itself: the health check decides
                log.warning("re-wiring %s: decode worker %s did not connect: %s", worker_id, wid, err)
            if decodes and len(failed) == len(decodes):
                raise RuntimeError(f"no decode worker could connect to restarted prefill worker {worker_id}")
        elif worker_id in self.decode_handles:
            handle = self.decode_handles[worker_id]
            addresses = await asyncio.gather(
                *(asyncio.wait_for(h.address.remote(), timeout_s) for h in self.prefill_handles.values()),
                return_exceptions=True)
            for addr in addresses:
                if not isinstance(addr, BaseException):
                    await asyncio.wait_for(handle.connect_prefill.remote(addr), timeout_s)
            st = await asyncio.wait_for(handle.stats.remote(), timeout_s)
            self.router.views[worker_id].num_blocks = st["num_blocks"]
        # The router forgot what it held (health.py); its offload tiers' disk files outlived the process.
        handle = self.prefill_handles.get(worker_id) or self.decode_handles.get(worker_id)
        async with self.router.lora.lock:  # the adapters loaded while serving: not in its config
            await self.router.lora.sync(worker_id, handle)
        await self._sync_weights(worker_id, handle)
        await asyncio.wait_for(handle.announce_kv.remote(), timeout_s)

    async def _sync_weights(self, worker_id: str, handle) -> None:
        """The weights the cluster serves since an update (cluster/generation_control.py), for a restarted or new
        worker that loaded the start-up checkpoint; under the update lock, so no update passes it by."""
        generation = self.router.generation
        async with generation.exclusive():
            await WorkerWeights.sync(worker_id, handle, generation.weights_path, generation.weight_version,
                                     generation.weights_digest)
            if generation.asleep_tags:  # the cluster sleeps: so does a worker that comes meanwhile
                await asyncio.wait_for(handle.release_memory.remote(tuple(sorted(generation.asleep_tags)),
                                                                    generation.sleep_level), SLEEP_TIMEOUT_S)

    async def add_worker(self, role: str, timeout_s: float = 300.0) -> str:
        """Start one more worker of ``role`` ("prefill" in disagg mode, or "decode"), wire it to the other
        role (handshakes), and put it into rotation; returns its id. Outside the placement group (its
        bundles are fixed): Ray places it on any node with a free slot, and on a real cluster the Ray
        autoscaler adds a node when none has one."""
        if role not in ("prefill", "decode") or (role == "prefill" and self.spec.mode != "disagg"):
            raise ValueError(f"cannot add a {role!r} worker in {self.spec.mode} mode")
        ray = self._ray
        wid = f"{role}-{self._next_index[role]}-{self._tag}"
        self._next_index[role] += 1
        opts = self._actor_options(None, self._gpu_shares[role], f"{role}_slot", self.spec.max_worker_restarts)

        async def call(ref):
            return await asyncio.wait_for(ref, timeout_s)

        if role == "prefill":
            handle = ray.remote(PrefillActor).options(**opts).remote(wid, self._ranked(self._engines["prefill"]),
                                                                    self._transfer,
                                                                    self.router.event_address, self._env)
            address = await call(handle.address.remote())
            await asyncio.gather(*(call(h.connect_prefill.remote(address)) for h in list(self.decode_handles.values())))
            num_blocks, num_state_blocks = self._engine.num_kv_blocks, 0
        else:
            transfer = self._transfer if self.spec.mode == "disagg" else None
            handle = ray.remote(DecodeActor).options(**opts).remote(wid, self._ranked(self._engine), transfer,
                                                                   self.router.event_address, self._env)
            for prefill in list(self.prefill_handles.values()):
                await call(handle.connect_prefill.remote(await call(prefill.address.remote())))
            st = await call(handle.stats.remote())
            num_blocks, num_state_blocks = st["num_blocks"], st.get("num_state_blocks", 0)
        try:
            ping = await call(handle.ping.remote())
            await self._sync_weights(wid, handle)
            async with self.router.lora.lock:  # no adapter load between its sync and its joining
                await self.router.lora.sync(wid, handle)
                self.router.membership.add(wid, role, handle, num_blocks, self._engine.block_size, ping.incarnation,
                                           ping.pid, num_state_blocks, ping.kv_event_source)
        except BaseException:  # it cannot serve what the cluster serves: it goes, and nothing is left wired to it
            if role == "prefill":
                await asyncio.gather(*(asyncio.wait_for(h.disconnect_prefill.remote(wid), 30)
                                       for h in list(self.decode_handles.values())), return_exceptions=True)
            ray.kill(handle, no_restart=True)
            raise
        log.info("worker %s added and in rotation", wid)
        return wid

    async def remove_worker(self, worker_id: str, timeout_s: float = 120.0):
        """Drain ``worker_id`` (no new placements; wait until nothing depends on it: see
        cluster/router/membership.py), then stop it. Returns the DrainResult."""
        handle = self.prefill_handles.get(worker_id) or self.decode_handles.get(worker_id)
        if handle is None:
            raise KeyError(f"no worker {worker_id!r} in this cluster")
        is_prefill = worker_id in self.prefill_handles
        result = await self.router.membership.drain(worker_id, timeout_s)
        if is_prefill:  # the decode workers leave it: nothing more is expected from it
            await asyncio.gather(*(asyncio.wait_for(h.disconnect_prefill.remote(worker_id), 30)
                                   for h in list(self.decode_handles.values())), return_exceptions=True)
        try:
            await asyncio.wait_for(handle.shutdown.remote(), 30)
        except Exception:  # noqa: BLE001 - it is being stopped either way
            pass
        self._ray.kill(handle)
        log.info("worker %s drained in %.2f s and stopped", worker_id, result.waited_s)
        return result

    @staticmethod
    def _bundle(gpu_share: float, slot: str, cluster_resources: dict) -> dict:
        bundle = {slot: 1} if cluster_resources.get(slot) else {}
        if gpu_share:
            bundle["GPU"] = gpu_share
        return bundle or {slot: 1}

    @staticmethod
    def _actor_options(strategy, gpu_share: float, slot: str, max_restarts: int = 0) -> dict:
        # Restarted actors keep their id and bundle; calls are not retried (the router recovers them).
        opts = {"num_cpus": 0, "max_concurrency": 4, "max_restarts": max_restarts, "max_task_retries": 0}
        if strategy is not None:
            opts["scheduling_strategy"] = strategy
        if gpu_share:
            opts["num_gpus"] = gpu_share
        if not gpu_share or ray_has_resource(slot):
            opts["resources"] = {slot: 1}
        return opts

    def worker_stats(self) -> dict:
        handles = {**self.prefill_handles, **self.decode_handles}
        return dict(zip(handles, self._ray.get([h.stats.remote() for h in handles.values()], timeout=30)))

    def shutdown(self) -> None:
        ray = self._ray
        for h in [*self.prefill_handles.values(), *self.decode_handles.values()]:
            try:
                ray.kill(h)
            except Exception:  # noqa: BLE001
                pass
        self.router.close()
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001
            pass
        if self._started_ray:
            ray.shutdown()


def spec_from_args(args) -> ClusterSpec:
    return ClusterSpec(
        engine=engine_config_from_args(args),
        transfer=TransferConfig(
            transport=args.transport,
            secret=args.cluster_secret,
        ),
        mode=args.mode,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        policy=args.router_policy,
        address=args.address or None,
        request_timeout_s=args.request_timeout_s,
        served_model_name=args.served_model_name or "",
        conditional_prefill_tokens=getattr(args, "conditional_prefill_tokens", 0) or 0,
        max_worker_restarts=getattr(args, "max_worker_restarts", 3),
        max_prefill=args.autoscale_config.max_prefill if getattr(args, "autoscale", False) else 0,
        max_decode=args.autoscale_config.max_decode if getattr(args, "autoscale", False) else 0,
        prefill_tensor_parallel_size=getattr(args, "prefill_tensor_parallel_size", None) or 0,
        decode_tensor_parallel_size=getattr(args, "decode_tensor_parallel_size", None) or 0,
    )


def run_cluster(args) -> int:
    """`pdcluster serve` for the Ray modes: start everything, serve HTTP until interrupted."""
    spec = spec_from_args(args)
    cluster = Cluster(spec)
    servers = None
    try:
        num_api_servers = getattr(args, "api_servers", 1)
        if num_api_servers > 1:  # before the Metrics: their values then go where every process reads them
            from pdcluster.cluster.frontend.supervisor import ApiServers

            servers = ApiServers(num_api_servers, listen(args.host, args.port), args.host)
        metrics = Metrics(cluster.router.model_name, multiprocess_dir=servers.metrics_dir if servers else None,
                          prefix=getattr(args, "metrics_prefix", "pdcluster"))
        cluster.router.on_kv_transfer = metrics.observe_kv_transfer
        print(f"pdcluster: {spec.mode}, {len(cluster.prefill_handles)} prefill + {len(cluster.decode_handles)} decode "
              f"workers, transport {spec.transfer.transport}, policy {spec.policy}", file=sys.stderr, flush=True)
        on_ready = None
        if getattr(args, "autoscale", False):
            planner = Planner(cluster, args.autoscale_config, on_action=metrics.observe_autoscale)

            def on_ready(loop):  # the planner runs on the server's loop, beside the router
                cluster.router.start(loop)
                loop.create_task(planner.run(lambda: cluster.router.closed))

        options = ApiOptions.from_args(args, runtime_lora=cluster.spec.engine.enable_lora)
        http = getattr(args, "http_options", None) or HttpOptions.from_args(args)  # serve_cli checked it
        if servers is not None:
            admin_app = FastAPI()  # /admin/* of every API process is answered here, beside the cluster
            install_error_handlers(admin_app)
            install_admin_routes(admin_app, cluster, args.admin_key)
            return servers.run(cluster.router, cluster.router.model_name, options, admin_app=admin_app,
                               on_ready=on_ready, http=http)
        app = build_app(cluster.router, cluster.router.model_name, metrics=metrics, **options.app_kwargs())
        install_admin_routes(app, cluster, args.admin_key)  # /admin/drain: `pdcluster drain`, preStop hooks
        return run_server(app, args.host, args.port, cluster.router.model_name, on_ready=on_ready, http=http)
    finally:
        if servers is not None:
            servers.close()
        cluster.shutdown()
