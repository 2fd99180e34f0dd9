"""Rank 0 of a tensor-parallel engine: starts ranks 1 .. n-1 (engine/tensor_parallel/worker.py, spawned processes),
joins their group, and hands each forward's inputs to them before running its own slice of it (LlamaModel.forward).

Everything else stays on rank 0: the scheduler, sampling, logits, the API. The other ranks' KV caches mirror rank 0's
block for block (the same block tables reach every rank with each forward), so nothing outside a forward touches the
cache but a KV transport, which reaches the other ranks' caches through shared memory on CPUs (shared_cache.py,
kv_transfer/transports/ranked.py). A hybrid's Mamba state is each rank's own (its heads'), advanced by the forwards
and by the verification rows' choice of state (``keep_states``), and carried through a KV transport in each rank's
own state blocks (``pack_states`` / ``unpack_states``)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import weakref
from dataclasses import replace
from multiprocessing.reduction import send_handle

import torch

from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.kv_cache import KVCacheSpec
from pdcluster.engine.tensor_parallel.group import TPGroup, open_store
from pdcluster.engine.tensor_parallel.messages import (AddLora, AllocateCache, CommitWeights, DraftForward, Forward,
                                                       KeepStates, MoveStates, ReadWeights, RemoveLora, Stop,
                                                       WorkerSpec, decode_status, encode)
from pdcluster.engine.tensor_parallel.shared_cache import create_shared_cache
from pdcluster.engine.tensor_parallel.shm_allreduce import create_segment, remove_segment
from pdcluster.engine.tensor_parallel.worker import worker_main

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # a rank loading its slice of a large checkpoint from a slow disk
WEIGHTS_TIMEOUT_S = 1800.0  # a rank reading its slice of a new checkpoint (engine/weight_update.py)
STOP_TIMEOUT_S = 10.0


def check_engine_config(config: EngineConfig) -> EngineConfig:
    """``config`` (device resolved) for a tensor-parallel engine, or ConfigError naming what does not combine with
    it. CUDA graphs are turned off: a captured graph would replay this rank's kernels without handing the other ranks
    their inputs. On a CPU each rank takes an equal share of the cores unless num_threads says otherwise."""
    n = ranks_of(config)
    if n == 1:
        return config
    if config.offload_config().enabled and config.device != "cpu":
        raise ConfigError(f"tensor_parallel_size {n}: the KV offload tiers reach a split model's rank caches on CPUs "
                          f"only (shared memory); on {config.device} drop the --kv-offload-* flags or serve with "
                          "--tensor-parallel-size 1")
    if config.device.startswith("cuda"):
        size = (f"tensor_parallel_size {n}" if config.tensor_parallel_size > 1
                else f"pipeline_parallel_size {n}")
        if config.device != "cuda":
            raise ConfigError(f"{size}: device {config.device!r}; split over ranks, rank r runs on cuda:r of the "
                              "visible GPUs: use --device cuda (CUDA_VISIBLE_DEVICES picks them)")
        if torch.cuda.device_count() < n:
            raise ConfigError(f"{size} needs {n} GPUs; {torch.cuda.device_count()} visible")
        if config.cuda_graphs:
            log.info("tensor parallelism: CUDA graphs off (each forward hands the other ranks their inputs)")
            config = replace(config, cuda_graphs=False)
    elif not config.num_threads:
        cores = len(_cores())
        config = replace(config, num_threads=max(1, cores // n))
    return config


def ranks_of(config: EngineConfig) -> int:
    """The engine's ranks: its tensor-parallel slices or its pipeline stages (one of the two is 1)."""
    return config.tensor_parallel_size * config.pipeline_parallel_size


def check_speculation(config: EngineConfig, arch) -> str:
    """The MTP draft a split engine's ranks load their slices of (engine/tensor_parallel/draft.py): "own" (the
    checkpoint's own MTP layers: NemotronH's, DeepSeek-V3's), "head" (our MTP head, an EAGLE or EAGLE-3 draft; on a
    hybrid, our MTP head: a Llama layer of its attention heads and MLP width), "" without MTP speculation;
    ConfigError for a draft head on DeepSeek (latent attention drafts with its own layer only) or a head whose heads
    or MLP width do not split."""
    from pdcluster.engine.models.mtp import latent_attention_refusal, uses_own_mtp_layers

    if config.spec_method != "mtp":
        return ""
    hybrid, mla = hasattr(arch, "mamba_num_heads"), getattr(arch, "mla", None) is not None
    if (hybrid or mla) and uses_own_mtp_layers(config.mtp_checkpoint, arch):
        return "own"
    if mla:
        raise ConfigError(latent_attention_refusal(config.mtp_checkpoint))
    n = config.tensor_parallel_size
    for what, count in (("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
                        ("intermediate_size", arch.intermediate_size)):
        if count % n:
            raise ConfigError(f"tensor_parallel_size {n}: the MTP draft head's {count} {what} (the model's) do not "
                              f"split {n} ways; use n-gram speculation or a size that divides {count}")
    return "head"


def check_shared_caches(config: EngineConfig) -> None:
    """ConfigError unless a KV transport can reach every rank's cache from rank 0 (shared_cache.py): CPUs only."""
    if config.device != "cpu":
        raise ConfigError(f"tensor_parallel_size {config.tensor_parallel_size}: KV transfer between split caches runs "
                          f"on CPUs; on {config.device} each rank's cache is on its own GPU, out of the KV transport's "
                          "reach yet: serve tensor-parallel workers colocated, or disaggregated with "
                          "--tensor-parallel-size 1")


def _cores() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


class TensorParallelDriver:
    """Rank 0's handle on the other ranks."""

    def __init__(self, processes: list, conns: list, group: TPGroup, shm_path: str = "") -> None:
        self.processes, self.conns, self.group, self.shm_path = processes, conns, group, shm_path
        self.closed = False
        self._send_lock = threading.Lock()
        if group.shm is not None:
            group.shm.check_peers = self.check_alive
        # An engine dropped without close() still stops its ranks (and at interpreter exit: daemon processes).
        self._finalizer = weakref.finalize(self, _stop, list(processes), list(conns), shm_path)

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str, dtype_name: str, max_positions: int, max_model_len: int,
              deterministic: bool, draft: str = "", lora_digests: dict[str, str] | None = None
              ) -> "TensorParallelDriver":
        """Spawns ranks 1 .. n-1 (each starts loading its slice at once) and joins their group as rank 0.
        ``draft`` (check_speculation's): the MTP draft every rank then loads its slice of too. ``lora_digests``: the
        start-up adapters (config.lora_modules) by name, with the contents rank 0 read; each rank reads the same files
        and refuses to start on other contents."""
        from pdcluster.engine.models.mtp import DRAFT_VOCAB_SIZE
        from pdcluster.engine.models.registry import default_cache_dir
        from pdcluster.engine.tensor_parallel.draft import eagle3_buffer_tokens

        n = ranks_of(config)
        on_gpu = config.device == "cuda"
        store = open_store(n) if on_gpu else None
        shm_path = "" if on_gpu else create_segment(n)
        ctx = multiprocessing.get_context("spawn")  # CUDA and a Ray actor's threads rule out fork
        processes, conns = [], []
        for rank in range(1, n):
            device = f"cuda:{rank}" if on_gpu else config.device
            spec = WorkerSpec(rank, n, store.port if on_gpu else 0, shm_path, str(model_dir), dtype_name,
                              max_positions, max_model_len, device, deterministic, config.num_threads, draft,
                              config.mtp_checkpoint, str(config.cache_dir or default_cache_dir()), config.model,
                              config.seed, DRAFT_VOCAB_SIZE, eagle3_buffer_tokens(config),
                              config.lora_paths(), dict(lora_digests or {}), config.max_lora_rank, config.enable_lora,
                              pipeline=config.pipeline_parallel_size > 1)
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(theirs, spec), name=f"pdcluster-tp{rank}", daemon=True)
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        device = torch.device("cuda:0" if on_gpu else config.device)
        try:
            group = TPGroup.join(0, n, device, shm_path=shm_path, store=store)
        except Exception as e:
            _stop(processes, conns, shm_path)
            raise RuntimeError(f"tensor parallelism: the {n} ranks did not meet: {e}") from None
        return cls(processes, conns, group, shm_path)

    def wait(self, what: str) -> None:
        """Blocks until every rank reports ``what`` ("loaded", "ready"); RuntimeError with a rank's own error."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank in range(1, len(self.conns) + 1):
            status, _ = self._status(rank, what, deadline)
            if status != what:
                raise RuntimeError(f"tensor-parallel rank {rank}: expected {what!r}, got {status!r}")

    def _status(self, rank: int, what: str, deadline: float) -> tuple[str, str]:
        """Rank ``rank``'s next status (waiting for it up to ``deadline``); RuntimeError with its own error, or when
        it exits or stays silent."""
        process, conn = self.processes[rank - 1], self.conns[rank - 1]
        while not conn.poll(0.2):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {process.exitcode}) before it was {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} not {what} within the time allowed")
        status, detail = decode_status(conn.recv_bytes())
        if status == "error":
            raise RuntimeError(detail)
        return status, detail

    def allocate_cache(self, kv_spec: KVCacheSpec, shared: bool = False, allocator=None) -> list[torch.Tensor]:
        """Every rank makes its cache like rank 0's (after every rank loaded its slice); returns once all have.
        ``shared`` (CPU: a KV transport moves the caches): rank 0 makes ranks 1 .. n-1's caches in shared memory
        and returns them, mapped here too (shared_cache.py). ``allocator(kv_spec) -> (cache, fd)`` makes each (the
        transport's own shared memory, say); the default is shared_cache.create_shared_cache."""
        self.wait("loaded")
        if self.shm_path:  # every rank mapped it when it joined: the name can go (no file outlives a crash)
            remove_segment(self.shm_path)
        if not shared:
            self._send(AllocateCache(kv_spec))
            self.wait("ready")
            return []
        caches, fds = [], []
        try:
            for _ in self.conns:
                cache, fd = (allocator or create_shared_cache)(kv_spec)
                caches.append(cache)
                fds.append(fd)
            self._send(AllocateCache(kv_spec, shared=True))
            for rank, (process, conn, fd) in enumerate(zip(self.processes, self.conns, fds), start=1):
                try:
                    send_handle(conn, fd, process.pid)
                except OSError:
                    raise RuntimeError(f"tensor-parallel rank {rank} is gone: {self.why_failed()}") from None
        finally:
            for fd in fds:  # each rank holds its own descriptor (or mapping) now
                os.close(fd)
        self.wait("ready")
        return caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, lora_rows=None, image_rows=None,
                prompt_rows=None) -> None:
        """Hands a forward's inputs to the other ranks, which start it at once (rank 0 runs its own next).
        ``lora_rows``: the step's adapter of each row and its rows' token offsets (LoraSet.step_rows), None without
        adapter rows; ``image_rows``: the image placeholder rows and the embeddings rank 0 encoded for them;
        ``prompt_rows``: the prompt rows given as embeddings and theirs."""
        self._send(Forward(input_ids, positions, meta, lora_rows=lora_rows, image_rows=image_rows,
                           prompt_rows=prompt_rows))

    def add_lora(self, slot: int, name: str, path: str, files: tuple[bytes, bytes], max_rank: int) -> None:
        """Every other rank holds the adapter made of ``files`` (the bytes rank 0 parsed) in ``slot``, its slice of it,
        before the next forward (the pipe's order)."""
        self._send(AddLora(slot, name, path, files[0], files[1], max_rank))

    def remove_lora(self, slot: int) -> None:
        """Every other rank empties adapter slot ``slot`` (no request runs with it any more)."""
        self._send(RemoveLora(slot))

    def read_weights(self, model_dir: str, digest: str) -> None:
        """Every other rank reads its slice of the checkpoint in ``model_dir`` (contents ``digest``) and holds it;
        returns once all have. ValueError with a rank's reason where one could not (every rank then drops its)."""
        self._send(ReadWeights(model_dir, digest))
        refused = self._answers("weights_read", WEIGHTS_TIMEOUT_S)
        if refused:
            self._send(CommitWeights(discard=True))
            raise ValueError(refused)

    def commit_weights(self) -> None:
        """Every other rank copies the slice it read into its served tensors; returns once all have."""
        self._send(CommitWeights())
        refused = self._answers("weights_copied", WEIGHTS_TIMEOUT_S)
        if refused:  # a rank that read and cannot copy: the split no longer computes one model
            raise RuntimeError(f"a weight update reached some ranks and not others: {refused}")

    def discard_weights(self) -> None:
        self._send(CommitWeights(discard=True))

    def _answers(self, expected: str, timeout_s: float) -> str:
        """Every other rank's answer to a weight message: "" when all said ``expected``, else the first refusal."""
        refusals = []
        deadline = time.monotonic() + timeout_s
        for rank in range(1, len(self.conns) + 1):
            status, detail = self._status(rank, expected, deadline)
            if status != expected:
                refusals.append(detail or f"rank {rank}: {status}")
        return "; ".join(refusals)

    def draft_forward(self, from_target: bool, rows_np, next_token_ids_np, positions_np, meta) -> None:
        """Hands the other ranks one forward of the MTP draft (engine/tensor_parallel/draft.py)."""
        self._send(DraftForward(from_target, rows_np, next_token_ids_np, positions_np, meta))

    def pack_states(self, slots_np, block_ids_np, pool_size: tuple[int, int]) -> None:
        """Every other rank packs its heads' state of each slot into its own cache's state blocks; returns once all
        have (one all-reduce they join after packing), so a KV transport may send the blocks."""
        self._send(MoveStates(True, slots_np, block_ids_np, pool_size))
        self.group.all_reduce_(torch.zeros(1, device=self.group.device))

    def unpack_states(self, slots_np, block_ids_np, pool_size: tuple[int, int]) -> None:
        """Every other rank reads a transferred state from its own cache's state blocks into each slot (before the
        next forward, which may write KV into those blocks: the pipe keeps the order)."""
        self._send(MoveStates(False, slots_np, block_ids_np, pool_size))

    def keep_states(self, slots_np, position_index_np) -> None:
        """A hybrid's verification rows keep these per-position Mamba states on every rank (MambaStatePool.select
        there, after the forward that stored them and before the next)."""
        self._send(KeepStates(slots_np, position_index_np))

    def _send(self, message) -> None:
        if self.closed:
            raise RuntimeError("tensor parallelism: the engine's other ranks were stopped (engine closed)")
        payload = encode(message)
        # One message at a time on each pipe: an adapter loaded while serving is sent from the engine's thread, the
        # forwards from the runner's under async scheduling.
        with self._send_lock:
            for rank, conn in enumerate(self.conns, start=1):
                try:
                    conn.send_bytes(payload)
                except OSError:
                    raise RuntimeError(f"tensor-parallel rank {rank} is gone: {self.why_failed()}") from None

    def check_alive(self) -> None:
        """RuntimeError naming a rank that is gone (asked while rank 0 waits in a collective)."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited mid-forward: {self.why_failed()}")

    def why_failed(self) -> str:
        """What the other ranks said or how they ended (for an error on rank 0's side of a collective)."""
        said = []
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            try:
                while conn.poll(0):
                    status, detail = decode_status(conn.recv_bytes())
                    if status == "error":
                        said.append(detail.strip())
            except (EOFError, OSError, ValueError):
                pass
            if not process.is_alive():
                said.append(f"rank {rank} exited with code {process.exitcode}")
        return "; ".join(said) or "every rank is alive"

    def close(self) -> None:
        """Stops the other ranks (idempotent)."""
        if not self.closed:
            self.closed = True
            self._finalizer()


def _stop(processes: list, conns: list, shm_path: str = "") -> None:
    if shm_path:
        remove_segment(shm_path)
    payload = encode(Stop())
    for conn in conns:
        try:
            conn.send_bytes(payload)
        except OSError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(1.0)
    for conn in conns:
        conn.close()
