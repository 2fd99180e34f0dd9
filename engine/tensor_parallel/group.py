"""The ranks' collective: one node's ranks sum their row-parallel partial outputs (layers.RowParallelLinear). CPU ranks
through a shared-memory segment (shm_allreduce.py: microseconds, where gloo over loopback took milliseconds); GPU ranks
over NCCL, a process group of their own (not torch.distributed's default group) met through a TCP store on loopback,
so the engine shares its process with a KV transport's groups (kv_transfer/transports/nccl) and with the next engine a
test builds."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdcluster.engine.tensor_parallel.shm_allreduce import ShmAllReduce

# A collective waits this long for its peers: a forward's all-reduces follow each other within milliseconds, so only a
# wedged rank makes one wait (a dead one is noticed sooner: ShmAllReduce's check_peers, NCCL's closed sockets).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=2)


def open_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous on 127.0.0.1 (GPU ranks), on a port the OS picks (``store.port`` for the other ranks)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=RENDEZVOUS_TIMEOUT)


def _nccl_group(store: Any, rank: int, world_size: int) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupNCCL(dist.PrefixStore("tp/", store), rank, world_size, opts)


@dataclass
class TPGroup:
    rank: int
    world_size: int
    device: torch.device
    shm: ShmAllReduce | None = None  # CPU ranks
    process_group: Any = None  # GPU ranks (NCCL)
    store: Any = None  # kept alive with the NCCL group (rank 0's is the server the others connect to)

    @classmethod
    def join(cls, rank: int, world_size: int, device: torch.device, shm_path: str = "",
             store: dist.TCPStore | None = None, port: int = 0) -> "TPGroup":
        """CPU ranks map ``shm_path`` (shm_allreduce.create_segment's); GPU ranks join the NCCL group (rank 0 with its
        ``store``, the others by ``port``), which returns once every rank has."""
        if device.type != "cuda":
            return cls(rank, world_size, device,
                       shm=ShmAllReduce(shm_path, rank, world_size, COLLECTIVE_TIMEOUT.total_seconds()))
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        return cls(rank, world_size, device, process_group=_nccl_group(store, rank, world_size), store=store)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place; every rank gets the same bits (CPU: a float32 sum in rank order,
        whatever the batch; NCCL: its ring's order, fixed for a size)."""
        if self.shm is not None:
            return self.shm.all_reduce_(x)
        self.process_group.allreduce([x]).wait()
        return x

    def broadcast_(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place (pipeline parallelism's hand-over of a stage's hidden states:
        engine/pipeline_parallel.py). CPU ranks: the all-reduce with every other rank's part zero (a float32 sum of
        one value and zeros: the value, bit for bit); GPU ranks: NCCL's broadcast."""
        if self.shm is not None:
            if self.rank != src:
                x.zero_()
            return self.shm.all_reduce_(x)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.process_group.broadcast([x], opts).wait()
        return x
