"""A trainer's end of the weight-broadcast group, as RL frameworks write it (OpenRLHF's, SGLang's and slime's
``init_custom_process_group``: a TCP rendezvous, then a process group under its own name), in a process of its own:
what tests/test_weights_from_trainer.py and bench/weights_from_trainer.py send weights with. Rank 0 of the group.

``Trainer(port, world_size).join()`` starts the process and makes the group (the servers' ranks join through their
HTTP route meanwhile); ``send(model_dir, names, dtype)`` broadcasts those tensors of the checkpoint, in order, cast to
``dtype``, and returns once every broadcast completed (the receivers took them); ``close()`` ends it.
"""

from __future__ import annotations

import multiprocessing
import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank0(conn, port: int, world_size: int, group_name: str, timeout_s: float) -> None:
    import datetime
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(size, rank, [], "gloo", store, group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
    conn.send("joined")
    while True:
        command = conn.recv()
        if command[0] == "close":
            dist.destroy_process_group(group)
            conn.send("closed")
            return
        _, model_dir, names, dtype, zeros = command
        tensors = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                tensors.update({n: st.get_tensor(n) for n in st.keys() if n in names})  # noqa: SIM118
        dtype = getattr(torch, dtype)
        # Zeros of the shape the caller gives instead, where it gives one (the refusal tests).
        payload = [torch.zeros(zeros[n], dtype=dtype) if n in zeros else tensors[n].to(dtype).contiguous()
                   for n in names]
        works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in payload]
        for work in works:
            work.wait()
        conn.send("sent")


class Trainer:
    def __init__(self, port: int, world_size: int = 2, group_name: str = "weight_update_group",
                 timeout_s: float = 120.0):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.timeout_s = timeout_s
        self.process = context.Process(target=_rank0, args=(child, port, world_size, group_name, timeout_s),
                                       daemon=True)

    def join(self) -> None:
        """Start; returns at once (``wait_joined`` waits for the group)."""
        self.process.start()

    def wait_joined(self) -> None:
        self._expect("joined")

    def send(self, model_dir, names: list[str], dtype: str = "float32", zeros: dict | None = None) -> None:
        """Broadcast ``names`` of ``model_dir``'s checkpoint, in order, as ``dtype`` (``zeros``: name -> shape, zeros
        of that shape sent instead of that tensor, or for a name the checkpoint lacks)."""
        self._conn.send(("send", str(model_dir), list(names), dtype, dict(zeros or {})))
        self._expect("sent")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("close",))
                self._expect("closed")
            except (OSError, EOFError, TimeoutError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()

    def _expect(self, word: str) -> None:
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(f"the trainer process did not answer {word!r} in {self.timeout_s:.0f} s")
        got = self._conn.recv()
        assert got == word, got

