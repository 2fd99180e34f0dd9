"""The ``chaos`` section of a result: each event's effect read off the requests' own timings, a
per-second timeline for the plot, and the /health samples; plus its table on stderr.

All times are seconds from the run's start (the controller's ``t0``). Per fired event:

- ``in_flight``: requests sent at or before the hit and not ended by then; ``in_flight_completed_ok``
  of them finished without error (the router's recovery at work), ``in_flight_failed_by_kind`` the rest
- ``first_token_after_s`` / ``first_ok_completion_after_s``: from the hit to the next output chunk of
  any request, and to the next request that completed OK
- ``worker_back_s``: from the hit to the worker being back per /health (chaos_controller.py says how)
- ``sent_until_back``: requests sent between the hit and the worker being back: how many, how many
  completed OK, and their SLO attainment (what a client saw during the outage)
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import TextIO

from pdcluster.tools.loadtest.client import RequestRecord
from pdcluster.tools.loadtest.metrics import SLO

TIMELINE_BIN_S = 1.0


def request_rows(records: list[RequestRecord], t0: float, slo: SLO) -> list[dict]:
    out = []
    for r in records:
        send_s = r.send_time_s - t0
        out.append({"send_s": send_s, "end_s": r.end_time_s - t0, "ok": r.ok, "good": slo.met_by(r),
                    "error_kind": r.error_kind or None, "output_len": r.output_len,
                    "ttft_ms": r.chunk_times_s[0] * 1e3 if r.chunk_times_s else None,
                    "token_s": [send_s + c for c in r.chunk_times_s],
                    # Tokens a chunk stands for (several under speculative decoding); 1 when unknown.
                    "tokens_per_chunk": r.output_len / len(r.chunk_times_s) if r.ok and r.chunk_times_s else 1.0})
    return out


def _after(times: list[float], t: float) -> float | None:
    later = [x for x in times if x >= t]
    return min(later) - t if later else None


def _diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def event_outcome(ev: dict, reqs: list[dict]) -> dict:
    fired = ev.get("fired_at_s")
    if fired is None:
        return ev
    in_flight = [q for q in reqs if q["send_s"] <= fired < q["end_s"]]
    back = ev.get("back_at_s")
    sent_during = [q for q in reqs if fired <= q["send_s"] <= back] if back is not None else []
    return {
        **ev,
        "in_flight": len(in_flight),
        "in_flight_completed_ok": sum(q["ok"] for q in in_flight),
        "in_flight_failed_by_kind": dict(Counter(q["error_kind"] for q in in_flight if not q["ok"])),
        "first_token_after_s": _after([t for q in reqs for t in q["token_s"]], fired),
        "first_ok_completion_after_s": _after([q["end_s"] for q in reqs if q["ok"]], fired),
        "seen_down_after_s": _diff(ev.get("seen_down_at_s"), fired),
        "replacement_ready_after_s": _diff(ev.get("replacement_ready_at_s"), fired),
        "worker_back_s": _diff(back, fired),
        "sent_until_back": {
            "sent": len(sent_during),
            "completed_ok": sum(q["ok"] for q in sent_during),
            "slo_attainment": sum(q["good"] for q in sent_during) / len(sent_during) if sent_during else None,
        },
    }


def timeline(reqs: list[dict], bin_s: float = TIMELINE_BIN_S) -> dict:
    """Per ``bin_s``: output tokens/s streamed (every request), requests/s that ended OK, met the
    SLOs, or failed (by end time)."""
    end = max([q["end_s"] for q in reqs] + [t for q in reqs for t in q["token_s"]], default=0.0)
    n = max(1, math.ceil(end / bin_s))
    tokens, ok, good, failed = [0.0] * n, [0] * n, [0] * n, [0] * n

    def slot(t: float) -> int:
        return min(n - 1, max(0, int(t // bin_s)))

    for q in reqs:
        for t in q["token_s"]:
            tokens[slot(t)] += q["tokens_per_chunk"]
        i = slot(q["end_s"])
        ok[i] += q["ok"]
        good[i] += q["good"]
        failed[i] += not q["ok"]
    per_s = 1.0 / bin_s
    return {"bin_s": bin_s, "t_s": [i * bin_s for i in range(n)],
            "output_tokens_per_s": [round(x * per_s, 3) for x in tokens],
            "completed_ok_per_s": [x * per_s for x in ok], "good_per_s": [x * per_s for x in good],
            "failed_per_s": [x * per_s for x in failed]}


def chaos_section(spec: str, events: list[dict], health_samples: list[dict], records: list[RequestRecord],
                  t0: float, slo: SLO, pid_source_note: str) -> dict:
    reqs = request_rows(records, t0, slo)
    return {
        "spec": spec,
        "pids_from": pid_source_note,
        "events": [event_outcome(ev, reqs) for ev in events],
        "timeline": timeline(reqs),
        "health": health_samples,
        # One row per request, so a saved result can be re-plotted.
        "requests": {"send_s": [round(q["send_s"], 4) for q in reqs], "end_s": [round(q["end_s"], 4) for q in reqs],
                     "ttft_ms": [None if q["ttft_ms"] is None else round(q["ttft_ms"], 2) for q in reqs],
                     "ok": [q["ok"] for q in reqs], "good": [q["good"] for q in reqs],
                     "error_kind": [q["error_kind"] for q in reqs]},
    }


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_chaos(section: dict, out: TextIO | None = None) -> None:
    out = out or sys.stderr  # looked up per call: the stream may have been swapped since import
    print(f" chaos: {section['spec']} ".center(52, "-"), file=out)
    for ev in section["events"]:
        if ev.get("fired_at_s") is None:
            print(f"{ev['spec']}: not fired ({ev.get('skipped')})", file=out)
            continue
        who = ev.get("worker_id") or ev["role"]
        print(f"{ev['spec']}: {ev['signal']} {who} pid {ev['pid']} at {ev['fired_at_s']:.2f} s; "
              f"in flight {ev['in_flight_completed_ok']}/{ev['in_flight']} completed OK"
              + (f" (failed: {ev['in_flight_failed_by_kind']})" if ev["in_flight_failed_by_kind"] else ""), file=out)
        print(f"  first token after {_s(ev['first_token_after_s'])} s, first OK completion after "
              f"{_s(ev['first_ok_completion_after_s'])} s, worker back after {_s(ev['worker_back_s'])} s"
              + (f" ({ev['back_basis']})" if ev.get("back_basis") else " (not seen back)"), file=out)
