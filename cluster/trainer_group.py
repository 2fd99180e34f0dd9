"""The server's end of an RL trainer's weight-broadcast group (SGLang's ``/init_weights_update_group``).

A trainer that does not share a machine with its rollout servers sends the new weights over a torch.distributed
group: rank 0 is the trainer, the servers' receiving ranks follow (``rank_offset``). The trainer makes the group with
the helper every RL framework copies (OpenRLHF, SGLang, slime, AReaL: ``init_custom_process_group``): a TCP
rendezvous at ``master_address:master_port``, then a process group under the group's own name, beside any default
group. The receiving side has to make it the same way (the group's name prefixes its keys in the rendezvous store),
so this uses the same two torch calls. Each weight then arrives as one ``broadcast`` from rank 0, in the order the
update names them (cluster/weights_from_trainer.py).

Here one rank receives for the whole cluster: the router's process (it holds no accelerator, so the backend is gloo;
the trainer's tensors may be on its GPUs, gloo reads them there). A trainer sizes its group as for a server of one
rank: ``world_size`` = 1 + the number of such servers, ``rank_offset`` = this server's place among them.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKENDS = ("gloo",)
MAX_TENSORS_PER_UPDATE = 1 << 16


class TrainerGroupError(ValueError):
    """A request about a trainer group that cannot be done as asked: nothing was received."""


def parse_dtype(name) -> torch.dtype:
    """A dtype as trainers spell it over HTTP: "bfloat16" or "torch.bfloat16" (str(torch.bfloat16)); floating only."""
    text = str(name).removeprefix("torch.")
    dtype = getattr(torch, text, None) if text.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TrainerGroupError(f"dtype {name!r} is not a floating torch dtype (e.g. 'bfloat16', 'float32')")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def tensor_specs(names, dtypes, shapes) -> list[TensorSpec]:
    """The weights an update announces, checked for form (TrainerGroupError before anything is received)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise TrainerGroupError(f"names, dtypes and shapes must be as long as each other: {len(names)}, {len(dtypes)}, "
                                f"{len(shapes)}")
    if len(names) > MAX_TENSORS_PER_UPDATE:
        raise TrainerGroupError(f"{len(names)} tensors in one update: at most {MAX_TENSORS_PER_UPDATE}")
    if len(set(names)) != len(names):
        raise TrainerGroupError("a tensor is named twice in one update")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise TrainerGroupError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise TrainerGroupError(f"{name}: shape {shape!r} is not a list of sizes")
        specs.append(TensorSpec(name, parse_dtype(dtype), tuple(shape)))
    return specs


class TrainerGroup:
    """One joined group: ``receive`` takes the broadcasts of an update, in order."""

    def __init__(self, name: str, rank: int, world_size: int, backend: str, timeout_s: float):
        self.name, self.rank, self.world_size, self.backend = name, rank, world_size, backend
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._group = None

    def join(self, master_address: str, master_port: int) -> None:
        """Rendezvous with the trainer and the other servers (blocks until all ``world_size`` ranks came, or the
        timeout: RuntimeError)."""
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(c10d.rendezvous(url, self.rank, self.world_size, timeout=self._timeout))
        store.set_timeout(self._timeout)
        group, _ = c10d._new_process_group_helper(world_size, rank, [], self.backend, store, group_name=self.name,
                                                  timeout=self._timeout)
        # Ranks in this group are its own (0 is the trainer): what broadcast's src is read against.
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        self._group = group

    @property
    def joined(self) -> bool:
        return self._group is not None

    def receive(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """One broadcast from rank 0 per spec, in order, into new host tensors."""
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
        works = [dist.broadcast(t, src=0, group=self._group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        return tensors

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            dist.destroy_process_group(group)
