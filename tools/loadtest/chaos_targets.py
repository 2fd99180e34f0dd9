"""Which process on this host is a server's prefill or decode worker, and signalling it safely.

A ``pdcluster serve`` that started its own Ray runs every worker as a Ray actor process under it:
server -> raylet -> ``ray::PrefillActor`` / ``ray::DecodeActor`` (Ray's process titles; a worker
still loading shows ``ray::DecodeActor.__init__``). The server is found as the process listening on
the base URL's port. A process is signalled only if it is, at that moment, a worker of the asked role
*under that server* (psutil also refuses a pid re-used since it was looked up), so a load test never
signals another server's workers or anything else on a shared machine.

A server that joined a Ray cluster (``--address``) runs its workers elsewhere: refused, with why.

psutil is load-test tooling, not a serving dependency (the ``loadtest`` extra): imported on first use,
so the ``pdcluster`` command (which builds the load-test parser) starts without it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import psutil

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ROLE_TITLES = {"prefill": "ray::PrefillActor", "decode": "ray::DecodeActor"}
STARTING_SUFFIX = ".__init__"  # Ray's title while the actor's constructor runs (model loading)


class ChaosTargetError(ValueError):
    pass


@dataclass(frozen=True)
class WorkerProcess:
    pid: int
    role: str
    started_unix_s: float  # process create time: the order of the role's processes
    starting: bool  # still in the actor's __init__
    process: psutil.Process  # kept: send_signal on it refuses a pid re-used since


def _psutil() -> ModuleType:
    try:
        import psutil
    except ModuleNotFoundError:
        raise ChaosTargetError("--chaos: needs psutil to find the server's worker processes: "
                               "pip install 'pdcluster[loadtest]' (or psutil)") from None
    return psutil


def require_loopback(base_url: str) -> str:
    """The host of ``base_url`` when it is this machine's loopback, else one clear error."""
    host = urlsplit(base_url).hostname or ""
    if host not in LOOPBACK_HOSTS:
        raise ChaosTargetError(f"--chaos: signals worker processes on this host, so --base-url must be "
                               f"127.0.0.1 or localhost, got {host!r}")
    return host


def server_pid(port: int) -> int:
    """The pid of the process listening on loopback ``port`` (one of ours: same user)."""
    psutil = _psutil()
    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.AccessDenied:
        raise ChaosTargetError("--chaos: cannot read this host's sockets to find the server's process") from None
    pids = {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
    if not pids:
        raise ChaosTargetError(f"--chaos: nothing listens on port {port} here")
    known = pids - {None}
    if not known:
        raise ChaosTargetError(f"--chaos: the process on port {port} belongs to another user; run the load test "
                               "as the user who runs the server")
    if len(known) > 1:
        raise ChaosTargetError(f"--chaos: several processes listen on port {port} ({sorted(known)}): "
                               "cannot tell which is the server")
    return known.pop()


def _title(p: psutil.Process) -> str:
    psutil = _psutil()
    try:
        cmdline = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""
    return cmdline[0] if cmdline else ""


def worker_processes(server: int, role: str) -> list[WorkerProcess]:
    """Live ``role`` worker processes under the server process, oldest first."""
    psutil = _psutil()
    title = ROLE_TITLES[role]
    try:
        descendants = psutil.Process(server).children(recursive=True)
    except psutil.NoSuchProcess:
        raise ChaosTargetError(f"--chaos: the server process {server} has exited") from None
    found = []
    for p in descendants:
        t = _title(p)
        if t == title or t == title + STARTING_SUFFIX or t.startswith(title + "."):
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                found.append(WorkerProcess(p.pid, role, p.create_time(), t.endswith(STARTING_SUFFIX), p))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    return sorted(found, key=lambda w: (w.started_unix_s, w.pid))


def find_worker(server: int, role: str, pid: int | None, index: int) -> WorkerProcess:
    """The worker to hit: the process ``pid`` (as /health names it) or else the role's ``index``-th
    process by start time; it must be under the server and carry the role's title."""
    procs = worker_processes(server, role)
    if not procs:
        raise ChaosTargetError(f"--chaos: no {role} worker process under the server (pid {server}) on this host: "
                               "chaos needs a server that started its own Ray here (not --mode local, "
                               "not --address)")
    if pid is not None:
        for w in procs:
            if w.pid == pid:
                return w
        raise ChaosTargetError(f"--chaos: /health names pid {pid} for a {role} worker, but no such worker "
                               f"process runs under the server (pid {server}) here")
    if index >= len(procs):
        raise ChaosTargetError(f"--chaos: {role} worker {index} asked for, but the server runs "
                               f"{len(procs)} {role} worker process(es)")
    return procs[index]


def send(worker: WorkerProcess, sig: signal.Signals) -> None:
    """Signal the worker found by ``find_worker`` (psutil checks the pid was not re-used since)."""
    psutil = _psutil()
    try:
        worker.process.send_signal(sig)
    except psutil.NoSuchProcess:
        raise ChaosTargetError(f"--chaos: {worker.role} worker pid {worker.pid} is gone") from None
    except psutil.AccessDenied:
        raise ChaosTargetError(f"--chaos: not allowed to signal pid {worker.pid}") from None
