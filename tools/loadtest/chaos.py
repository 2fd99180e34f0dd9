"""The ``--chaos`` schedule: which worker to hit, how, and when, parsed from one flag.

    kill-decode@30s              SIGKILL the first decode worker 30 s into the run (Ray restarts it)
    kill-prefill1@60s            SIGKILL the second prefill worker (index 1) at 60 s
    stop-prefill@20s+5s          SIGSTOP the first prefill worker at 20 s, SIGCONT it 5 s later
    kill-busiest-decode@30s      SIGKILL the decode worker holding the most requests at 30 s

Events are comma-separated; times are seconds from the first request of the measured run (after the
warm-up). ``kill`` takes no duration; ``stop`` needs one (a stopped process never resumed would turn
the rest of the run into a different experiment). The index counts the role's workers in the order
of their ids on the server's /health (``decode-0-…``, ``decode-1-…``); no index means 0. ``busiest``
picks, when the event fires, the healthy worker of the role with the most requests on /health (the
lowest index on a tie): the hit then catches requests in flight whenever there are any, whereas a
fixed index can find its worker with nothing streaming at that moment. When no worker of the role
holds a request yet (a slow start: every request still waits for its admission), a busiest event
waits a poll and looks again, until the load ends; ``idle_polls`` in the JSON counts those waits.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
ROLES = ("prefill", "decode")
# Bounds that catch typos (30000s for 30s) rather than policy: a day of load is not a load test.
MAX_AT_S = 86_400.0
MAX_STOP_S = 3_600.0
EXAMPLE = "kill-decode@30s,stop-prefill@40s+5s"

_EVENT = re.compile(
    r"(?P<action>[a-z]+)-(?:(?P<busiest>busiest)-)?(?P<role>[a-z]+)(?P<index>\d+)?"
    r"@(?P<at>[0-9]*\.?[0-9]+)s"
    r"(?:\+(?P<duration>[0-9]*\.?[0-9]+)s)?")


class ChaosSpecError(ValueError):
    pass


@dataclass(frozen=True)
class ChaosEvent:
    action: str  # a key of ACTIONS
    role: str  # one of ROLES
    index: int  # which worker of the role, in /health's worker-id order (ignored when busiest)
    at_s: float  # from the start of the measured run
    stop_s: float | None = None  # action "stop": seconds until SIGCONT
    busiest: bool = False  # the role's worker with the most requests when it fires, not ``index``

    @property
    def signal(self) -> signal.Signals:
        return ACTIONS[self.action]

    @property
    def spec(self) -> str:
        """The event as it would be written in ``--chaos`` (index always shown)."""
        tail = f"+{self.stop_s:g}s" if self.stop_s is not None else ""
        who = f"busiest-{self.role}" if self.busiest else f"{self.role}{self.index}"
        return f"{self.action}-{who}@{self.at_s:g}s{tail}"


def parse_chaos(text: str) -> list[ChaosEvent]:
    """Events of a ``--chaos`` value, in firing order (stable for equal times)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ChaosSpecError(f"want comma-separated events like {EXAMPLE!r}, got {text!r}")
    events = [_parse_event(p) for p in parts]
    return sorted(events, key=lambda e: e.at_s)


def _parse_event(part: str) -> ChaosEvent:
    m = _EVENT.fullmatch(part)
    if m is None:
        raise ChaosSpecError(f"{part!r} is not <kill|stop>-[busiest-]<prefill|decode>[N]@<seconds>s[+<seconds>s], "
                             f"e.g. {EXAMPLE!r}")
    action, role = m["action"], m["role"]
    if action not in ACTIONS:
        raise ChaosSpecError(f"{part!r}: action {action!r} is not one of {', '.join(ACTIONS)}")
    if role not in ROLES:
        raise ChaosSpecError(f"{part!r}: role {role!r} is not one of {', '.join(ROLES)}")
    busiest = m["busiest"] is not None
    if busiest and m["index"] is not None:
        raise ChaosSpecError(f"{part!r}: busiest picks the worker itself; give an index or busiest, not both")
    at_s = float(m["at"])
    if at_s > MAX_AT_S:
        raise ChaosSpecError(f"{part!r}: {at_s:g} s is after the longest run this accepts ({MAX_AT_S:g} s)")
    stop_s = float(m["duration"]) if m["duration"] is not None else None
    if action == "kill" and stop_s is not None:
        raise ChaosSpecError(f"{part!r}: kill takes no duration (a killed worker is restarted by Ray); "
                             f"did you mean stop-{role}@{at_s:g}s+{stop_s:g}s?")
    if action == "stop":
        if stop_s is None:
            raise ChaosSpecError(f"{part!r}: stop needs how long, e.g. stop-{role}@{at_s:g}s+5s")
        if not 0 < stop_s <= MAX_STOP_S:
            raise ChaosSpecError(f"{part!r}: a stop lasts more than 0 and at most {MAX_STOP_S:g} s, got {stop_s:g} s")
    return ChaosEvent(action, role, int(m["index"] or 0), at_s, stop_s, busiest)

