"""``--chaos`` around one measured run: check before any load that every event can hit a worker, then
run the workload with the controller beside it and build the result's ``chaos`` section."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import numpy as np

from pdcluster.tools.loadtest import chaos_targets
from pdcluster.tools.loadtest.chaos import ChaosEvent
from pdcluster.tools.loadtest.chaos_controller import (ChaosController, busiest_index, health_reports_pids,
                                                         role_workers)
from pdcluster.tools.loadtest.chaos_report import chaos_section
from pdcluster.tools.loadtest.client import Target
from pdcluster.tools.loadtest.metrics import SLO
from pdcluster.tools.loadtest.runner import RunOutcome, run_workload

PREFLIGHT_TIMEOUT_S = 10.0
PIDS_FROM_HEALTH = "health"
PIDS_FROM_PROCESS_TABLE = "process_table"


@dataclass(frozen=True)
class ChaosSetup:
    events: list[ChaosEvent]
    spec: str
    server_pid: int
    pids_from: str  # PIDS_FROM_HEALTH or PIDS_FROM_PROCESS_TABLE
    recovery_timeout_s: float


async def chaos_preflight(target: Target, events: list[ChaosEvent], spec: str, recovery_timeout_s: float) -> ChaosSetup:
    """One clear error (ChaosTargetError, a ValueError) unless every event's worker exists here."""
    chaos_targets.require_loopback(target.base_url)
    parts = urlsplit(target.base_url)
    server = chaos_targets.server_pid(parts.port or (443 if parts.scheme == "https" else 80))
    try:
        async with httpx.AsyncClient(timeout=PREFLIGHT_TIMEOUT_S, trust_env=False) as http:
            health = (await http.get(target.base_url + "/health", headers=target.headers)).json()
    except (httpx.HTTPError, ValueError) as e:
        raise chaos_targets.ChaosTargetError(f"--chaos: cannot read {target.base_url}/health ({type(e).__name__}): "
                                             "chaos needs a pdcluster server") from None
    for event in events:
        workers = role_workers(health, event.role)
        if event.busiest:
            busiest_index(workers, event.spec)  # the role has a worker and /health counts its requests
            chaos_targets.find_worker(server, event.role, None, 0)  # and its processes are here
            continue
        if event.index >= len(workers):
            have = ", ".join(w["worker_id"] for w in workers) or "none"
            raise chaos_targets.ChaosTargetError(
                f"--chaos: {event.spec} needs {event.role} worker {event.index}, but /health lists {have}")
        chaos_targets.find_worker(server, event.role, None, event.index)  # its process is here
    pids_from = PIDS_FROM_HEALTH if health_reports_pids(health) else PIDS_FROM_PROCESS_TABLE
    return ChaosSetup(events, spec, server, pids_from, recovery_timeout_s)


def warn_late_events(setup: ChaosSetup, send_times_s: np.ndarray) -> None:
    last_send_s = float(send_times_s[-1]) if len(send_times_s) else 0.0
    for event in setup.events:
        if event.at_s > last_send_s:
            print(f"pdcluster loadtest: warning: chaos {event.spec} is after the last request is sent "
                  f"({last_send_s:.1f} s): it fires only if requests are still running", file=sys.stderr)


async def run_under_chaos(setup: ChaosSetup, target: Target, requests, send_times_s: np.ndarray, slo: SLO,
                          max_concurrency: int | None, tokenizer, progress: bool, description: str
                          ) -> tuple[RunOutcome, dict]:
    warn_late_events(setup, send_times_s)
    last_send_s = float(send_times_s[-1]) if len(send_times_s) else 0.0
    longest_stop_s = max((e.stop_s or 0.0 for e in setup.events), default=0.0)
    # The controller's hard bound: the load's own (last send + per-request limit), then a recovery wait.
    max_run_s = max(last_send_s, setup.events[-1].at_s) + target.timeout_s + longest_stop_s + setup.recovery_timeout_s
    controller = ChaosController(target.base_url, target.headers, setup.events, setup.server_pid, max_run_s)
    t0 = time.perf_counter()
    controller.start(t0)
    try:
        outcome = await run_workload(target, requests, send_times_s, max_concurrency, tokenizer,
                                     progress=progress, description=description)
        await controller.finish(setup.recovery_timeout_s)
    finally:
        await controller.cancel()  # also resumes any worker still stopped
    events = [ev.public() for ev in controller.events]
    section = chaos_section(setup.spec, events, controller.health_samples, outcome.records, t0, slo, setup.pids_from)
    return outcome, section
