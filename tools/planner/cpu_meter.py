"""How much CPU the rest of the machine used over an interval: all busy CPU time minus our own
process trees', as cores. The profile records it beside its step times (they are a worker's speed at
that background load) and the validation beside every run. Without psutil it reports nothing."""

from __future__ import annotations

import os
import time


class CpuMeter:
    def __init__(self, *root_pids: int, worker_prefix: str = "ray::"):
        """``root_pids``: processes whose whole trees count as ours (default: this process). Processes of
        those trees whose name starts with ``worker_prefix`` (Ray actors: the engine workers) are also
        counted apart, as "workers"."""
        self._worker_prefix = worker_prefix
        try:
            import psutil
        except ImportError:
            self._psutil = None
            return
        self._psutil = psutil
        self._roots = root_pids or (os.getpid(),)
        self._t0 = time.monotonic()
        self._total0 = self._total()
        self._ours0 = self._ours()

    def _total(self) -> float:
        t = self._psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))

    def _ours(self) -> dict[int, tuple[float, bool]]:
        out = {}
        for pid in self._roots:
            try:
                root = self._psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except self._psutil.Error:
                continue
            for p in procs:
                try:
                    c = p.cpu_times()
                    out[p.pid] = (c.user + c.system, p.name().startswith(self._worker_prefix))
                except self._psutil.Error:
                    pass
        return out

    def read(self) -> dict | None:
        """Cores used since the start: by everything, by our trees, by their workers, by the rest
        ("others"), and by everything but the workers ("besides_workers")."""
        if self._psutil is None:
            return None
        elapsed = max(1e-6, time.monotonic() - self._t0)
        ours = workers = 0.0
        for pid, (v, is_worker) in self._ours().items():
            used = v - self._ours0.get(pid, (0.0, False))[0]
            ours += used
            workers += used if is_worker else 0.0
        total = self._total() - self._total0
        return {"elapsed_s": round(elapsed, 1), "all_cores": round(total / elapsed, 3),
                "ours_cores": round(ours / elapsed, 3), "workers_cores": round(workers / elapsed, 3),
                "others_cores": round(max(0.0, total - ours) / elapsed, 3),
                "besides_workers_cores": round(max(0.0, total - workers) / elapsed, 3)}


def others_cores(reading: dict | None) -> float:
    return float(reading["others_cores"]) if reading else 0.0
