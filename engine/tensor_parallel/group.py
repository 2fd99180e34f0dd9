"""The ranks' collective group over a TCP store on loopback (one node's ranks): gloo on CPUs, NCCL on GPUs. Process
group objects of their own, not torch.distributed's default group, so an engine with tensor parallelism shares its
process with a KV transport's groups (kv_transfer/transports/nccl) and with the next engine a test builds.

The one collective a forward needs is the sum after each row-parallel matmul (shard.RowParallelLinear)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

# A collective waits this long for its peers: a forward's all-reduces follow each other within milliseconds, so only a
# wedged rank makes one wait (a dead one's closed socket fails the call at once under gloo).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=2)


def open_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous on 127.0.0.1, on a port the OS picks (``store.port`` for the other ranks)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=RENDEZVOUS_TIMEOUT)


def _process_group(store: Any, rank: int, world_size: int, device: torch.device) -> Any:
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(dist.PrefixStore("tp/", store), rank, world_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(dist.PrefixStore("tp/", store), rank, world_size, opts)


@dataclass
class TPGroup:
    rank: int
    world_size: int
    device: torch.device
    process_group: Any
    # Deterministic mode with more than two ranks: the sum is an all-gather and a fixed-order float32 addition, so an
    # element's rounding does not depend on how the collective chunks a buffer of the step's size (two ranks' sum is
    # one addition, the same either way).
    ordered_sum: bool = False
    store: Any = None  # kept alive with the group (rank 0's is the server the others connect to)
    on_failure: Callable[[], str] | None = None  # rank 0: what the other ranks said (driver.why_failed)

    @classmethod
    def join(cls, rank: int, world_size: int, device: torch.device, deterministic: bool,
             store: dist.TCPStore | None = None, port: int = 0) -> "TPGroup":
        """Joins the group (rank 0 with its ``store``, the others by ``port``); returns once every rank has."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        group = _process_group(store, rank, world_size, device)
        return cls(rank, world_size, device, group, ordered_sum=deterministic and world_size > 2, store=store)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place; every rank gets the same bits. A peer's failure: RuntimeError saying
        what it said (rank 0), not the transport's own words alone."""
        try:
            if not self.ordered_sum:
                self.process_group.allreduce([x]).wait()
                return x
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self.process_group.allgather([parts], [x.contiguous()]).wait()
        except RuntimeError as e:
            why = self.on_failure() if self.on_failure is not None else ""
            raise RuntimeError(f"tensor parallelism: an all-reduce failed mid-forward ({why}): {e}") from e
        total = parts[0].float()
        for part in parts[1:]:
            total += part.float()
        return x.copy_(total)
