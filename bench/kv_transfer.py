"""Benchmark the KV data-plane transports between two processes on this host.

Moves 64 MiB of KV (16 KiB rows: one layer's K or V of one block) from randomly chosen source blocks
into permuted destination blocks, once per repetition, and reports the median end-to-end time from
``send()`` in the sender until ``poll_received()`` in the receiver reports the transfer (gather,
transfer and scatter included). Also measures an in-process memcpy of the same byte count (the
ceiling) and, where the ``nixl`` package is installed, NIXL (UCX backend, DRAM) writing the same
scattered rows.

``--ranks N`` splits each side's cache N ways by KV head, as tensor parallelism does, and moves the same bytes as N
rank caches through one ranked transport (kv_transfer/transports/ranked.py: one transport per rank, driven as one).
``--peer-ranks D`` splits the receiver D ways instead: the sender copies each receiver rank's heads into staging caches
laid out its way before sending (kv_transfer/transports/resplit.py), the same bytes end to end.

    python bench/kv_transfer.py --out result.json
    python bench/kv_transfer.py --transports tcp shm --ranks 2 --out result.json
    python bench/kv_transfer.py --transports tcp shm --ranks 2 --peer-ranks 4 --out result.json

JSON goes to --out and stdout; everything else (including native libraries' chatter in the child
processes) goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_report import emit_json  # noqa: E402  (bench/json_report.py)

CTX = mp.get_context("spawn")
CHILD_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 8
    num_blocks: int = 1024  # per cache; a transfer moves ``send_blocks`` of them
    block_size: int = 16
    num_kv_heads: int = 8
    head_dim: int = 32  # float32: 16 * 8 * 32 * 4 B = 16 KiB per row
    send_blocks: int = 256  # 8 layers * 2 * 256 rows * 16 KiB = 64 MiB
    ranks: int = 1  # tensor-parallel ranks per side: each cache holds num_kv_heads / ranks heads
    peer_ranks: int = 0  # the receiver's ranks where they differ (0: ranks): the sender re-lays its heads out

    @property
    def shape(self) -> tuple[int, ...]:
        """One sender rank's cache."""
        return self.shape_of(self.ranks)

    def shape_of(self, ranks: int) -> tuple[int, ...]:
        """One rank's cache where a side splits ``ranks`` ways."""
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads // ranks, self.head_dim)

    def ranks_of(self, role: str) -> int:
        return self.peer_ranks or self.ranks if role == "receiver" else self.ranks

    @property
    def row_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * 4

    @property
    def transfer_bytes(self) -> int:
        return self.num_layers * 2 * self.send_blocks * self.row_bytes


def block_ids(geom: Geometry, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.permutation(geom.num_blocks)[: geom.send_blocks]
    dst = rng.permutation(geom.num_blocks)[: geom.send_blocks]
    return src, dst


def child_process(fn):
    """Entry point of a child process (its last argument is its pipe to the parent): stdout goes to
    stderr, since native libraries (UCX) may log to fd 1 and stdout is for the JSON; a failure is sent
    to the parent as ("error", traceback)."""

    @functools.wraps(fn)
    def run(*args) -> None:
        os.dup2(2, 1)
        try:
            fn(*args)
        except BaseException:
            args[-1].send(("error", traceback.format_exc()))

    return run


class Memcpy:
    """In-process memcpy of the transfer's byte count: the ceiling. The machine is shared, so the
    sender samples it right before every repetition and results are judged against the samples
    taken under the same load."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.zeros_like(self.src)

    def gbps(self, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(self.dst, self.src)
            times.append(time.perf_counter() - t0)
        return self.src.size / statistics.median(times) / 1e9


def fill(cache, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    flat = cache.view(torch.uint8).view(-1)
    step = 64 << 20
    for start in range(0, flat.numel(), step):
        end = min(start + step, flat.numel())
        flat[start:end] = torch.randint(0, 256, (end - start,), generator=g, dtype=torch.uint8)


def checksum(caches, ids: np.ndarray) -> str:
    """Hash of blocks ``ids`` of the whole cache (the ranks' heads side by side): equal however a side splits it."""
    import hashlib

    import torch

    whole = torch.cat(list(caches), dim=4)
    rows = whole.view(torch.uint8).view(whole.shape[0], 2, whole.shape[2], -1)[:, :, torch.from_numpy(ids)]
    return hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------ our transports


def allocate(cls, shape: tuple[int, ...], shared: bool):
    """The transport's own allocation (shared memory for shm) or plain memory."""
    import torch

    return cls.allocate_kv_cache(shape, torch.float32) if shared else torch.zeros(shape, dtype=torch.float32)


# shm mode -> (sender cache shared, receiver cache shared); other transports: plain memory both sides
SHM_MODES = {"push+pull": (True, True), "push": (False, True), "ring": (False, False)}


def open_transport(name: str, mode: str, geom: Geometry, role: str):
    """(caches, transport) of one side: a cache per rank, filled with its side's random bytes; with more than one
    rank, a ranked transport over a transport per rank cache. A sender whose peer splits another way re-lays its heads
    out for it (kv_transfer/transports/resplit.py), as a prefill worker does."""
    from pdcluster.kv_transfer.transports import TransportConfig, get_transport_class
    from pdcluster.kv_transfer.transports.ranked import RankedTransport
    from pdcluster.kv_transfer.transports.resplit import ResplitSender

    cls = get_transport_class(name)
    sender = role == "sender"
    ranks = geom.ranks_of(role)
    shared = SHM_MODES.get(mode, (False, False))[0 if sender else 1]
    caches = [allocate(cls, geom.shape_of(ranks), shared) for _ in range(ranks)]
    for rank, cache in enumerate(caches):
        fill(cache, (2 if sender else 1) + 10 * rank)
    config = TransportConfig(admit_unexpected=True)
    parts = [cls(cache, role, config) for cache in caches]
    transport = parts[0] if len(parts) == 1 else RankedTransport(parts)
    if sender and geom.ranks_of("receiver") != ranks:
        transport = ResplitSender(transport, caches, make_part=lambda cache: cls(cache, "sender", config),
                                  allocate=cls.allocate_kv_cache)
    return caches, transport


@child_process
def receiver_proc(name: str, mode: str, geom: Geometry, reps: int, conn) -> None:
    caches, t = open_transport(name, mode, geom, "receiver")
    conn.send(t.local_descriptor())
    _, dst = block_ids(geom, 0)
    arrivals = []
    for rep in range(reps):
        tid, layers = f"rep{rep}", set()
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while len(layers) < geom.num_layers and time.monotonic() < deadline:
            for got, ls in t.poll_received():
                if got == tid:
                    layers.update(ls)
            if len(layers) < geom.num_layers:
                # Sleep, don't spin: a spinning main thread keeps the IO thread off the GIL
                # for a whole switch interval (5 ms).
                time.sleep(0.0002)
        arrivals.append(time.perf_counter())
    conn.send(("arrivals", arrivals, checksum(caches, dst)))
    conn.recv()  # the sender has its acks
    t.close()
    conn.send("closed")


def timed_sends(geom: Geometry, reps: int, send) -> tuple[list[float], list[float]]:
    """Each repetition: a memcpy sample, then ``send(rep)`` (returns once delivered) timed from its
    start. Returns the start times and the memcpy samples."""
    memcpy = Memcpy(geom.transfer_bytes)
    starts, memcpy_gbps = [], []
    for rep in range(reps):
        memcpy_gbps.append(memcpy.gbps())
        starts.append(time.perf_counter())
        send(rep)
    return starts, memcpy_gbps


@child_process
def sender_proc(name: str, mode: str, geom: Geometry, reps: int, desc: dict, conn) -> None:
    caches, t = open_transport(name, mode, geom, "sender")
    t.connect("decode", desc)
    moving = next(iter(t._splits.values())).transport if hasattr(t, "_splits") else t  # resplit: the staging's
    for part in getattr(moving, "parts", [moving]):
        if hasattr(part, "peer_mode"):
            assert part.peer_mode("decode") == mode, (part.peer_mode("decode"), mode)
    src, dst = block_ids(geom, 0)

    def send(rep: int) -> None:
        tid = f"rep{rep}"
        t.send("decode", tid, range(geom.num_layers), src, dst)
        done = False
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not done and time.monotonic() < deadline:
            delivered, failed = t.poll_sent()
            if failed:
                raise RuntimeError(f"transfer failed: {failed}")
            done = tid in delivered
            time.sleep(0.0002)
        if not done:
            raise TimeoutError(f"{tid} not delivered")

    starts, memcpy_gbps = timed_sends(geom, reps, send)
    conn.send(("starts", starts, checksum(caches, src), memcpy_gbps))
    conn.recv()
    t.close()
    conn.send("closed")


def expect(conn, kind: str):
    if not conn.poll(CHILD_TIMEOUT_S):
        raise TimeoutError(f"no {kind!r} from child")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg[0] == "error":
        raise RuntimeError(msg[1])
    if kind == "descriptor":
        return msg
    assert msg[0] == kind, msg
    return msg[1:]


def run_pair(recv_target, recv_args, send_target, send_args_fn,
             introduce=None) -> tuple[list[float], list[float], bool, list[float]]:
    """Start receiver then sender (``introduce(sender_pipe, receiver_pipe)``, if given, runs once both
    are up); return per-repetition start and arrival times, whether the destination blocks match the
    source blocks, and the memcpy samples."""
    r_parent, r_child = CTX.Pipe()
    s_parent, s_child = CTX.Pipe()
    receiver = CTX.Process(target=recv_target, args=(*recv_args, r_child))
    receiver.start()
    sender = None
    try:
        desc = expect(r_parent, "descriptor")
        sender = CTX.Process(target=send_target, args=(*send_args_fn(desc), s_child))
        sender.start()
        if introduce is not None:
            introduce(s_parent, r_parent)
        starts, src_sum, memcpy_gbps = expect(s_parent, "starts")
        arrivals, dst_sum = expect(r_parent, "arrivals")
        for c in (s_parent, r_parent):
            c.send("stop")
        return starts, arrivals, src_sum == dst_sum, memcpy_gbps
    finally:
        for p in (sender, receiver):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()


def summarize(transport: str, mode: str, geom: Geometry, run: tuple, warmup: int) -> dict:
    starts, arrivals, verified, memcpy_gbps = run
    times = [a - s for s, a in zip(starts[warmup:], arrivals[warmup:])]
    seconds = statistics.median(times)
    gbps = geom.transfer_bytes / seconds / 1e9
    memcpy = statistics.median(memcpy_gbps[warmup:])
    return {
        "transport": transport,
        "mode": mode,
        "ranks": geom.ranks,
        "peer_ranks": geom.ranks_of("receiver"),
        "bytes": geom.transfer_bytes,
        "seconds": seconds,
        "gbps": gbps,
        "all_seconds": times,
        "verified": verified,  # destination blocks hash equal to the source blocks
        "memcpy_gbps_alongside": memcpy,  # median of the samples taken before each repetition
        "fraction_of_memcpy": gbps / memcpy,
    }


def bench_transport(name: str, mode: str, geom: Geometry, reps: int, warmup: int) -> dict:
    total = reps + warmup
    run = run_pair(receiver_proc, (name, mode, geom, total), sender_proc, lambda desc: (name, mode, geom, total, desc))
    return summarize(name, mode, geom, run, warmup)


# ------------------------------------------------------------------ NIXL (reference)


def nixl_agent_for(name: str, error_handling: str):
    """A NIXL agent with the UCX backend. ``error_handling`` "peer" is NIXL's default (UCX then
    finds its shared-memory transports unreachable and puts over tcp/lo); "none" lets it use them."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
    return agent


@child_process
def nixl_receiver_proc(geom: Geometry, reps: int, error_handling: str, conn) -> None:
    import torch

    cache = torch.zeros(geom.shape, dtype=torch.float32)
    fill(cache, 1)
    agent = nixl_agent_for("decode", error_handling)
    agent.register_memory(cache)
    conn.send({"metadata": agent.get_agent_metadata(), "base": cache.data_ptr()})
    agent.add_remote_agent(conn.recv())
    _, dst = block_ids(geom, 0)
    arrivals = []
    for rep in range(reps):
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not agent.check_remote_xfer_done("prefill", f"rep{rep}".encode()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rep{rep} never arrived")
            time.sleep(0.0002)
        arrivals.append(time.perf_counter())
    conn.send(("arrivals", arrivals, checksum([cache], dst)))
    conn.recv()
    conn.send("closed")


def row_table(geom: Geometry, base: int) -> np.ndarray:
    """Nx3 (address, length, device) descriptors of every row of a cache, in row order."""
    rows = np.arange(geom.num_layers * 2 * geom.num_blocks, dtype=np.uint64)
    descs = np.zeros((rows.size, 3), dtype=np.uint64)
    descs[:, 0] = base + rows * geom.row_bytes
    descs[:, 1] = geom.row_bytes
    return descs


def row_indices(geom: Geometry, ids: np.ndarray) -> np.ndarray:
    """Row numbers of ``ids`` in every layer, K and V (layer-major), as NIXL descriptor indices."""
    layers = np.arange(geom.num_layers * 2, dtype=np.int64)[:, None] * geom.num_blocks
    return (layers + ids.astype(np.int64)[None, :]).reshape(-1).astype(np.int32)


@child_process
def nixl_sender_proc(geom: Geometry, reps: int, error_handling: str, peer: dict, conn) -> None:
    """NIXL used the way a connector would: both caches registered and every row prepared as a
    descriptor once, outside the timing; each transfer picks its rows by index."""
    import torch

    cache = torch.empty(geom.shape, dtype=torch.float32)
    fill(cache, 2)
    agent = nixl_agent_for("prefill", error_handling)
    agent.register_memory(cache)
    remote = agent.add_remote_agent(peer["metadata"])
    conn.send(("metadata", agent.get_agent_metadata()))
    local_rows = agent.prep_xfer_dlist("NIXL_INIT_AGENT", row_table(geom, cache.data_ptr()), "DRAM")
    remote_rows = agent.prep_xfer_dlist(remote, row_table(geom, peer["base"]), "DRAM")
    src, dst = block_ids(geom, 0)

    def send(rep: int) -> None:
        handle = agent.make_prepped_xfer(
            "WRITE", local_rows, row_indices(geom, src), remote_rows, row_indices(geom, dst), f"rep{rep}".encode()
        )
        state = agent.transfer(handle)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0002)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")
        agent.release_xfer_handle(handle)

    starts, memcpy_gbps = timed_sends(geom, reps, send)
    conn.send(("starts", starts, checksum([cache], src), memcpy_gbps))
    conn.recv()
    conn.send("closed")


def _pass_nixl_metadata(s_parent, r_parent) -> None:
    """The sender's agent metadata to the receiver, which adds the sender as its remote agent."""
    (metadata,) = expect(s_parent, "metadata")
    r_parent.send(metadata)


def bench_nixl(geom: Geometry, reps: int, warmup: int, error_handling: str) -> dict:
    total = reps + warmup
    run = run_pair(nixl_receiver_proc, (geom, total, error_handling), nixl_sender_proc,
                   lambda peer: (geom, total, error_handling, peer), introduce=_pass_nixl_metadata)
    return summarize("nixl", f"ucx-dram,error-handling={error_handling}", geom, run, warmup)


# ------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per transport (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--transports", nargs="*", help="subset of transports (default: all available)")
    parser.add_argument("--no-nixl", action="store_true")
    parser.add_argument("--ranks", type=int, default=1,
                        help="tensor-parallel ranks per side (a ranked transport over a cache per rank); divides 8")
    parser.add_argument("--peer-ranks", type=int, default=0,
                        help="the receiver's ranks where they differ from --ranks (heterogeneous tensor parallelism: "
                             "the sender copies each receiver rank's heads into staging caches laid out its way)")
    args = parser.parse_args()

    # Loopback only, and UCX's shared-memory path (FIELD_NOTES); children inherit the environment.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

    from pdcluster.kv_transfer.transports import available_transports

    geom = Geometry(ranks=args.ranks, peer_ranks=args.peer_ranks if args.peer_ranks != args.ranks else 0)
    for flag, ranks in (("--ranks", args.ranks), ("--peer-ranks", geom.ranks_of("receiver"))):
        if ranks < 1 or geom.num_kv_heads % ranks:
            parser.error(f"{flag} {ranks}: the {geom.num_kv_heads} KV heads do not split that way")
    result: dict = {"geometry": asdict(geom), "results": [], "unavailable": {}, "errors": {}}
    # The machine is shared: the load says how much to trust the numbers.
    result["loadavg_1min"] = {"start": os.getloadavg()[0], "cpus": os.cpu_count()}
    runs = []
    for name, reason in available_transports().items():
        if args.transports and name not in args.transports:
            continue
        if reason is not None:
            result["unavailable"][name] = reason
            continue
        # A re-laying sender sends from staging caches shm allocates: push+pull only.
        shm_modes = ["push+pull"] if geom.peer_ranks else list(SHM_MODES)
        runs += [(name, m) for m in shm_modes] if name == "shm" else [(name, "default")]
    for name, mode in runs:
        print(f"benchmarking {name} ({mode})", file=sys.stderr)
        try:
            result["results"].append(bench_transport(name, mode, geom, args.reps, args.warmup))
        except Exception as e:  # noqa: BLE001 - one broken transport must not hide the others
            result["errors"][f"{name}:{mode}"] = str(e)

    if not args.no_nixl and geom.ranks == 1 and not geom.peer_ranks:  # NIXL's reference moves one cache
        try:
            from importlib.metadata import version

            import nixl  # noqa: F401

            result["nixl_version"] = version("nixl")
        except ImportError as e:
            result["unavailable"]["nixl"] = f"nixl not installed: {e}"
        else:
            for error_handling in ("peer", "none"):
                print(f"benchmarking nixl (error handling {error_handling})", file=sys.stderr)
                try:
                    result["results"].append(bench_nixl(geom, args.reps, args.warmup, error_handling))
                except Exception as e:  # noqa: BLE001
                    result["errors"][f"nixl:{error_handling}"] = str(e)

    result["loadavg_1min"]["end"] = os.getloadavg()[0]
    samples = [r["memcpy_gbps_alongside"] for r in result["results"]]
    result["memcpy_gbps"] = statistics.median(samples) if samples else Memcpy(geom.transfer_bytes).gbps(9)
    ours = [r for r in result["results"] if r["transport"] != "nixl"]
    nixl = [r for r in result["results"] if r["transport"] == "nixl"]
    if ours:
        best = max(ours, key=lambda r: r["gbps"])
        result["best"] = {
            "transport": best["transport"],
            "mode": best["mode"],
            "gbps": best["gbps"],
            # Against the memcpy samples taken alongside this transport's own repetitions.
            "fraction_of_memcpy": best["fraction_of_memcpy"],
            # Against NIXL's best configuration, not its default.
            "speedup_over_nixl": best["gbps"] / max(r["gbps"] for r in nixl) if nixl else None,
        }
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
