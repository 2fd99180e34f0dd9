"""Runs a ``--chaos`` schedule beside the load: fires each event at its time, resumes stopped workers,
and watches the server's /health (and this host's process table) until each hit worker is back.

One asyncio task, one loop: each turn fires what is due, resumes what is due, reads /health once
(``poll_interval_s``), and updates every fired event's watch. The loop ends when ``finish`` has been
called and every event is settled, or at ``finish``'s recovery deadline, or at ``max_run_s``:
bounded in time, and so in turns. A stopped worker is always sent SIGCONT before this returns (also
on cancellation or error), so a load test never leaves a process frozen behind it.

"Back" is read from what the server says: a worker is back when /health lists it healthy after the
hit, and, for a kill, when the process behind it is a new one. If /health gives each worker's
``pid``, that pid must have changed (the router updates it once it has re-wired the restarted
worker): basis ``health_pid``. Otherwise the replacement is seen in this host's process table (a new
process of the role, past its ``__init__``) and the worker is back at the first poll after that which
lists it healthy, once /health had listed it down (the router puts a dead worker back only after
re-wiring its replacement): basis ``process_table+health``. If the router never listed it down (it
restarted between two of the router's checks), that first healthy poll is reported with basis
``process_table (never listed down)``: the re-wiring is then not confirmed. A stopped worker is
back at the first poll after its SIGCONT that lists it healthy: basis ``health``.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from dataclasses import dataclass, field, fields

import httpx

from pdcluster.tools.loadtest import chaos_targets
from pdcluster.tools.loadtest.chaos import ChaosEvent
from pdcluster.tools.loadtest.chaos_targets import ChaosTargetError, WorkerProcess

POLL_INTERVAL_S = 0.25
HEALTH_TIMEOUT_S = 2.0
MIN_SLEEP_S = 0.01
FRESH_HEALTH_TRIES = 3  # polls before a busiest-worker event fires on the last answer it has
# The router checks every worker once a second and a ping may take 5 s to time out: a restarted worker
# not listed down within this long after its replacement was ready is taken as never listed down.
UNSEEN_GRACE_S = 8.0


@dataclass
class EventState:
    """What happened to one event; times in seconds from the run's start (``t0``)."""
    spec: str
    action: str
    role: str
    index: int | None  # busiest: None until it fires, then the worker it picked
    signal: str
    at_s: float
    stop_s: float | None
    fired_at_s: float | None = None
    skipped: str | None = None  # why it did not fire (the run ended first, no such worker, ...)
    worker_id: str | None = None  # as /health names it, when that is unambiguous
    pid: int | None = None
    pid_source: str | None = None  # "health" (the server named the pid) or "process_table"
    worker_num_requests: int | None = None  # requests the router had on that worker just before
    health_at_s: float | None = None  # when the /health it picked the worker from was polled
    idle_polls: int = 0  # busiest: polls at or after its time that found no worker of the role holding a request
    resumed_at_s: float | None = None  # stop: SIGCONT sent
    seen_down_at_s: float | None = None  # first /health poll listing it unhealthy
    replacement_pid: int | None = None  # kill: the process Ray started in its place
    replacement_ready_at_s: float | None = None  # kill: that process finished __init__ (this host)
    back_at_s: float | None = None
    back_basis: str | None = None  # how back_at_s was decided: see the module docstring
    # Not in the JSON: the role's pids when it fired (a replacement is a pid not among them).
    _pids_before: set = field(default_factory=set, repr=False)
    _process: WorkerProcess | None = field(default=None, repr=False)
    # Kill, no pids on /health, the router never listed the worker down: the first poll listing it
    # healthy after its replacement was ready. Only an upper bound's stand-in (see settle_unseen).
    _healthy_after_ready_at_s: float | None = field(default=None, repr=False)
    # Busiest, deferred because no worker of the role held a request: not tried again before this.
    _retry_at_s: float | None = field(default=None, repr=False)

    def public(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @property
    def settled(self) -> bool:
        return self.skipped is not None or self.back_at_s is not None


def _natural_key(worker_id: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", worker_id)]


def role_workers(health: dict | None, role: str) -> list[dict]:
    """/health's workers of ``role``, in worker-id order (``decode-2`` before ``decode-10``)."""
    workers = (health or {}).get("workers")
    if not isinstance(workers, list):
        return []
    mine = [w for w in workers if isinstance(w, dict) and w.get("role") == role and isinstance(w.get("worker_id"), str)]
    return sorted(mine, key=lambda w: _natural_key(w["worker_id"]))


def busiest_index(workers: list[dict], spec: str) -> int:
    """Position in ``workers`` (role_workers' order) of the healthy worker with the most requests;
    the lowest position on a tie."""
    counts = [(w.get("num_requests"), i) for i, w in enumerate(workers) if w.get("healthy", True)]
    counts = [(n, i) for n, i in counts if isinstance(n, int)]
    if not counts:
        raise ChaosTargetError(f"--chaos: {spec}: /health lists no healthy worker of the role with its num_requests")
    return min(counts, key=lambda c: (-c[0], c[1]))[1]


def role_is_idle(workers: list[dict]) -> bool:
    """Whether /health counts requests on the role's healthy workers and every count is 0."""
    counts = [w.get("num_requests") for w in workers if w.get("healthy", True)]
    return bool(counts) and all(n == 0 for n in counts)


def health_reports_pids(health: dict | None) -> bool:
    workers = (health or {}).get("workers") or []
    return bool(workers) and all(isinstance(w, dict) and isinstance(w.get("pid"), int) for w in workers)


class ChaosController:
    def __init__(self, base_url: str, headers: dict, events: list[ChaosEvent], server: int, max_run_s: float,
                 poll_interval_s: float = POLL_INTERVAL_S):
        self.base_url = base_url
        self.headers = headers
        self.server = server  # pid of the server process (chaos_targets.server_pid)
        self.max_run_s = max_run_s
        self.poll_interval_s = poll_interval_s
        self.events = [EventState(e.spec, e.action, e.role, None if e.busiest else e.index, e.signal.name, e.at_s,
                                  e.stop_s) for e in events]
        self._schedule = list(zip(events, self.events))
        self.health_samples: list[dict] = []  # {"t_s", "status", "healthy": {role: n}, "total": {role: n}}
        self.t0 = 0.0
        self._firing = True  # False once the load is over: later events are skipped
        self._finish_deadline: float | None = None
        self._task: asyncio.Task | None = None
        # Event position -> (event, process) of every stopped worker still awaiting its SIGCONT.
        self._stopped: dict[int, tuple[EventState, WorkerProcess]] = {}
        self._last_health: dict | None = None
        self._last_health_at_s: float | None = None

    # ---- control -------------------------------------------------------------------------------------
    def start(self, t0: float) -> None:
        """Begin at ``t0`` (perf_counter of the run's start): event times count from it."""
        self.t0 = t0
        self._task = asyncio.create_task(self._run())

    async def finish(self, recovery_timeout_s: float) -> None:
        """The load is over: skip events not yet fired, wait (at most ``recovery_timeout_s`` after the
        last pending resume) for the hit workers to come back, then stop."""
        self._firing = False
        pending_resume_s = max((ev.fired_at_s + ev.stop_s for ev, _ in self._stopped.values()), default=self.now_s())
        self._finish_deadline = max(pending_resume_s, self.now_s()) + recovery_timeout_s
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self._finish_deadline - self.now_s() + 10.0)
            except asyncio.TimeoutError:
                self._task.cancel()
            except Exception as e:  # noqa: BLE001 - the load's results still stand; say what broke
                print(f"pdcluster loadtest: warning: the chaos controller failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
        self._resume_all()

    async def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing; errors were logged
                pass
        self._resume_all()

    def now_s(self) -> float:
        return time.perf_counter() - self.t0

    # ---- the loop ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, trust_env=False) as http:
                await self._poll(http)  # an event due at 0 s needs /health's worker list
                while self.now_s() < self.max_run_s:
                    await self._fire_due(http)
                    self._resume_due()
                    await self._poll(http)
                    if self._finish_deadline is not None and (
                            self._all_settled() or self.now_s() >= self._finish_deadline):
                        break
                    await asyncio.sleep(self._sleep_s())
        finally:
            self._resume_all()
            for ev in self.events:
                if ev.fired_at_s is None and ev.skipped is None:
                    ev.skipped = "the load ended before its time"
                self.settle_unseen(ev)

    @staticmethod
    def settle_unseen(ev: EventState) -> None:
        """A killed worker the router never listed down (it restarted between two of its health
        checks, or /health was polled between them): back when it was listed healthy after its
        replacement was ready, labelled so; the router's re-wiring is then not confirmed."""
        if ev.back_at_s is None and ev._healthy_after_ready_at_s is not None:
            ev.back_at_s, ev.back_basis = ev._healthy_after_ready_at_s, "process_table (never listed down)"

    def _sleep_s(self) -> float:
        now = self.now_s()
        due = [max(ev.at_s, ev._retry_at_s or 0.0) for _, ev in self._schedule
               if ev.fired_at_s is None and ev.skipped is None]
        due += [ev.fired_at_s + ev.stop_s for ev, _ in self._stopped.values()]
        next_due = min(due, default=now + self.poll_interval_s)
        return max(MIN_SLEEP_S, min(self.poll_interval_s, next_due - now))

    def _all_settled(self) -> bool:
        now = self.now_s()

        def unseen_done(ev: EventState) -> bool:  # long enough for the router to have listed it down
            return ev._healthy_after_ready_at_s is not None and now - ev._healthy_after_ready_at_s > UNSEEN_GRACE_S

        return not self._stopped and all(ev.settled or unseen_done(ev) for ev in self.events)

    # ---- firing --------------------------------------------------------------------------------------
    async def _fire_due(self, http: httpx.AsyncClient) -> None:
        for event, ev in self._schedule:
            if (ev.fired_at_s is not None or ev.skipped is not None or ev.at_s > self.now_s()
                    or (ev._retry_at_s is not None and ev._retry_at_s > self.now_s())):
                continue
            if not self._firing:
                ev.skipped = "the load ended before its time"
                continue
            if event.busiest:
                # Counts from this moment: the last answer may be seconds old (a poll on a busy server
                # times out and the older answer stays), and the worker busiest then may have finished
                # everything it held by now.
                for _ in range(FRESH_HEALTH_TRIES):
                    if await self._poll(http):
                        break
                if role_is_idle(role_workers(self._last_health, event.role)):
                    # Nothing to hit yet (on a slow start every request may still wait for its
                    # admission): a kill now would test no recovery. Try again a poll later, until the
                    # load ends (then it is skipped as not fired).
                    ev.idle_polls += 1
                    ev._retry_at_s = self.now_s() + self.poll_interval_s
                    continue
            try:
                self._fire(event, ev)
            except ChaosTargetError as e:
                ev.skipped = str(e)
                print(f"pdcluster loadtest: warning: chaos {ev.spec} not fired: {e}", file=sys.stderr)

    def _fire(self, event: ChaosEvent, ev: EventState) -> None:
        workers = role_workers(self._last_health, event.role)
        ev.health_at_s = self._last_health_at_s
        if event.busiest:
            ev.index = busiest_index(workers, event.spec)
        entry = workers[ev.index] if ev.index < len(workers) else None
        pid = entry.get("pid") if entry is not None and isinstance(entry.get("pid"), int) else None
        target = chaos_targets.find_worker(self.server, event.role, pid, ev.index)
        ev.pid, ev.pid_source = target.pid, "health" if pid is not None else "process_table"
        # Without pids from the server, the index picks the role's processes by start time: the
        # worker id is certain only when the role has a single worker.
        if entry is not None and (pid is not None or len(workers) == 1):
            ev.worker_id = entry["worker_id"]
            ev.worker_num_requests = entry.get("num_requests")
        ev._pids_before = {w.pid for w in chaos_targets.worker_processes(self.server, event.role)}
        ev._process = target
        chaos_targets.send(target, event.signal)
        ev.fired_at_s = self.now_s()
        if event.action == "stop":
            key = self.events.index(ev)
            self._stopped[key] = (ev, target)
            # SIGCONT on its own timer: the loop's next turn may be seconds away (a /health poll of a server
            # with a frozen worker waits up to HEALTH_TIMEOUT_S), and a 2 s stop ran 2.75 s that way.
            asyncio.get_running_loop().call_later(ev.stop_s, self._resume_if_stopped, key)
        print(f"pdcluster loadtest: chaos: {event.signal.name} {ev.worker_id or event.role} worker pid {target.pid} "
              f"at {ev.fired_at_s:.2f} s ({ev.spec})", file=sys.stderr)

    def _resume_due(self) -> None:
        for key, (ev, proc) in list(self._stopped.items()):
            if self.now_s() >= ev.fired_at_s + ev.stop_s:
                self._resume(key)

    def _resume_if_stopped(self, key: int) -> None:
        if key in self._stopped:  # not resumed yet by the loop's check or at the end
            self._resume(key)

    def _resume(self, key: int) -> None:
        ev, proc = self._stopped.pop(key)
        try:
            chaos_targets.send(proc, signal.SIGCONT)
        except ChaosTargetError as e:  # it died meanwhile: nothing left frozen
            print(f"pdcluster loadtest: warning: chaos could not resume pid {proc.pid}: {e}", file=sys.stderr)
        ev.resumed_at_s = self.now_s()

    def _resume_all(self) -> None:
        for key in list(self._stopped):
            self._resume(key)

    # ---- watching ------------------------------------------------------------------------------------
    async def _poll(self, http: httpx.AsyncClient) -> bool:
        """One /health poll: sampled, and the fired events watched; whether the server answered."""
        t_s = self.now_s()
        try:
            response = await http.get(self.base_url + "/health", headers=self.headers)
            health = response.json()  # 503 (no healthy decode worker) still carries the workers
            status = response.status_code
        except (httpx.HTTPError, ValueError) as e:
            health, status = None, f"{type(e).__name__}"
        if not isinstance(health, dict):
            health = None
        if health is not None:
            self._last_health, self._last_health_at_s = health, t_s
        sample = {"t_s": round(t_s, 3), "status": status, "healthy": {}, "total": {}}
        for role in chaos_targets.ROLE_TITLES:
            workers = role_workers(health, role)
            sample["total"][role] = len(workers)
            sample["healthy"][role] = sum(1 for w in workers if w.get("healthy") and not w.get("draining"))
        self.health_samples.append(sample)
        if health is not None:
            for ev in self.events:
                if ev.fired_at_s is not None and ev.back_at_s is None:
                    self._watch(ev, health, t_s)
        return health is not None

    def _watch(self, ev: EventState, health: dict, t_s: float) -> None:
        workers = role_workers(health, ev.role)
        watched = [w for w in workers if w["worker_id"] == ev.worker_id] if ev.worker_id else workers
        if not watched:
            return
        all_healthy = all(w.get("healthy") and not w.get("draining") for w in watched)
        if not all_healthy and ev.seen_down_at_s is None:
            ev.seen_down_at_s = t_s
        if ev.action == "stop":
            if ev.resumed_at_s is not None and t_s >= ev.resumed_at_s and all_healthy:
                ev.back_at_s, ev.back_basis = t_s, "health"
            return
        if ev.pid_source == "health":
            new_pid = watched[0].get("pid")
            if all_healthy and isinstance(new_pid, int) and new_pid != ev.pid:
                ev.replacement_pid = ev.replacement_pid or new_pid
                ev.back_at_s, ev.back_basis = t_s, "health_pid"
            self._note_replacement(ev, t_s)
            return
        ready_before = ev.replacement_ready_at_s is not None
        self._note_replacement(ev, t_s)
        if ready_before and all_healthy:  # healthy at a poll after the replacement was seen ready
            if ev.seen_down_at_s is not None:
                ev.back_at_s, ev.back_basis = t_s, "process_table+health"
            elif ev._healthy_after_ready_at_s is None:
                ev._healthy_after_ready_at_s = t_s

    def _note_replacement(self, ev: EventState, t_s: float) -> None:
        if ev.replacement_ready_at_s is not None:
            return
        try:
            procs = chaos_targets.worker_processes(self.server, ev.role)
        except ChaosTargetError:
            return
        for w in procs:
            if w.pid not in ev._pids_before and not w.starting:
                ev.replacement_pid, ev.replacement_ready_at_s = w.pid, t_s
                return
