"""Tensor parallelism (Megatron's split, as vLLM's ``--tensor-parallel-size``): one engine's model over several
devices (CPU processes or GPUs), each rank holding its slice of every attention and MLP layer and of the KV cache.

- shard.py: which model shapes split, and how a checkpoint's tensors are cut per rank (shard_hybrid.py: hybrids'),
  layers.py: a rank's slice (Shard) and the layers that sum over the ranks;
- group.py: the ranks' collective (gloo on CPUs, NCCL on GPUs) and the all-reduce after each row-parallel matmul;
- driver.py: rank 0, inside the engine: starts the other ranks and hands each forward's inputs to them;
- worker.py: ranks 1 .. n-1, each its own process: its shard, its cache, a forward per message.

Rank 0 alone schedules, samples and speaks to clients (vLLM's driver worker): the others only run forwards, so the
scheduler, sampler and API know nothing of the split.
"""

from pdcluster.engine.tensor_parallel.layers import Shard
from pdcluster.engine.tensor_parallel.shard import check_shardable, shard_arch

__all__ = ["Shard", "check_shardable", "shard_arch"]
