"""Fault handling, measured: how long until a dead worker's resources are back and its requests go on.
Real processes throughout (child processes / Ray actors, sockets on 127.0.0.1). Prints one JSON object.

    python bench/recovery.py [--model tiny-random] [--repeats 3] [--transports tcp shm ucx nccl]
                             [--scenarios reclaim decode_kill_recovery restart_rejoin] [--out FILE]

1. ``reclaim_s`` (per transport, no Ray; driven as tests/test_kv_transfer_e2e.py drives it): a
   PrefillWorker and a DecodeWorker in two processes. ``decode_killed``: the decode process is SIGKILLed
   while the layer-wise transfer of a 1200-token prompt is under way (bytes sent, not finished) ->
   seconds until the prefill side has every block back (free blocks as before the request, nothing
   held, no transfer left). ``prefill_killed``: the reverse -> seconds until the decode side has released
   the reservation. ``failed_event_s``: kill -> the survivor's "failed" event. Target: < 5 s. The
   surviving side runs in a driver process of its own, so a survivor that crashes when its peer vanishes
   is reported (with its last output) rather than ending the run.
2. ``decode_kill_recovery`` (Ray; as tests/test_recovery.py): disagg, 1 prefill + 2 decode, no actor
   restarts. A greedy request streams; after ``--kill-after`` tokens its decode actor is ray.kill-ed.
   Seconds from the kill to detection (the router marks the worker unhealthy), router-side detection ->
   re-placement (router.recorder.recoveries), kill -> first token after the kill, and whether the whole output
   equals the uninterrupted run of the offline engine (token_exact).
3. ``restart_rejoin`` (Ray; as tests/test_worker_restart.py): 1 prefill + 1 decode, max_worker_restarts=2.
   The decode actor's process, then the prefill actor's, is SIGKILLed (os.kill of ``handle.pid``);
   seconds until the router shows it healthy again under a new incarnation (restarted by Ray and
   re-wired), seconds until the router first noticed (unhealthy or new incarnation), and whether a
   request afterwards gives the offline engine's output. A cluster is reused while its actors have
   restarts left, then replaced.

Medians and maxima are over the successful repetitions; each sample also appears on its own, and a
failed repetition is listed under ``errors`` instead of ending the run. Every wait is bounded. JSON goes
to stdout (and --out); progress and native libraries' chatter go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import re
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Children are forked from a forkserver that has torch and the workers imported already: a spawned
# child re-imports everything (seconds each on a loaded 2-core machine), a forkserver child does not.
# The server itself is single-threaded (it only imports), so forking it is safe.
CTX = mp.get_context("forkserver")
PRELOAD = ["torch", "numpy", "zmq", "pdcluster.engine.llm_engine", "pdcluster.prefill_node.worker",
           "pdcluster.decode_node.worker"]
TRANSPORTS = ["tcp", "shm", "ucx", "nccl"]
SCENARIOS = ["reclaim", "decode_kill_recovery", "restart_rejoin"]
TARGET_S = 5.0

# reclaim (as in tests/test_kv_transfer_e2e.py)
XFER_BLOCKS = 128
XFER_PROMPT_LEN = 1200  # 75 blocks; with 8-token prefill chunks the layer-wise transfer takes ~150 steps
CHILD_START_TIMEOUT_S = 120.0
TRANSFER_START_TIMEOUT_S = 30.0
RECLAIM_TIMEOUT_S = 15.0  # 3x the target: a miss is reported as such, not waited for forever
POLL_S = 0.01

# Ray scenarios (as in tests/test_recovery.py and tests/test_worker_restart.py)
CLUSTER_BLOCKS = 256
HEALTH_INTERVAL_S = 0.3
REQUEST_TIMEOUT_S = 120.0
RECOVERY_TIMEOUT_S = 60.0
REJOIN_TIMEOUT_S = 120.0
SCENARIO_TIMEOUT_S = 240.0  # one cluster's whole async part


def log(msg: str) -> None:
    print(f"[recovery] {msg}", file=sys.stderr, flush=True)


def summary(samples: list[float]) -> dict:
    if not samples:
        return {"median": None, "max": None, "n": 0}
    return {"median": round(statistics.median(samples), 3), "max": round(max(samples), 3), "n": len(samples)}


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def bounded(fn, timeout_s: float, what: str, notes: list[str]) -> None:
    """Run a cleanup call in a daemon thread, waiting at most ``timeout_s``; a hang is noted, not waited on."""
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        notes.append(f"{what} did not return within {timeout_s:.0f} s")
    elif errors:
        notes.append(f"{what} raised {short_error(errors[0])}")


def quiet_stdout() -> None:
    """Native libraries (UCX) may log to fd 1; keep stdout for the JSON."""
    os.dup2(2, 1)


# ==================================================================== 1. reclaim (no Ray)


def xfer_engine_config(model: str, **kw):
    from pdcluster.engine.config import EngineConfig

    base = dict(model=model, num_kv_blocks=XFER_BLOCKS, max_model_len=1536, prefill_chunk_size=16)
    base.update(kw)
    return EngineConfig(**base)


def transfer_config(transport: str, secret: str | None):
    from pdcluster.kv_transfer.config import TransferConfig

    return TransferConfig(transport=transport, secret=secret)


class Events(logging.Handler):
    """Worker events (node/events.py) with the time each arrived (a decode worker emits them from its
    threads). Also a logging handler: a prefill worker reports a failed transfer to its requester,
    which is dead here, and logs it; the log record becomes a ``TransferLog`` event."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.items: list[tuple[float, object]] = []
        self._items_lock = threading.Lock()  # not ``lock``: logging.Handler has its own

    def __call__(self, event):
        from pdcluster.node.events import expand

        now = time.monotonic()
        with self._items_lock:
            self.items.extend((now, e) for e in expand(event))  # a step's StepTokens as its requests' Tokens

    def emit(self, record: logging.LogRecord) -> None:
        self(TransferLog(record.getMessage()))

    def first(self, pred):
        with self._items_lock:
            return next(((t, e) for t, e in self.items if pred(e)), None)


@dataclass(frozen=True)
class TransferLog:
    message: str  # "KV transfer of <request> to <peer> failed: <reason>"


def _decode_child(conn, model, prefill_address, prompt_len, transport, secret, worker_id, prefill_id):
    """Decode worker in its own process: connect, take the request (it asks the prefill worker for the
    KV), report its admission verdict, then idle until killed."""
    quiet_stdout()
    try:
        import torch

        torch.set_num_threads(1)
        from pdcluster.decode_node.worker import DecodeWorker
        from pdcluster.engine.sampling_params import SamplingParams

        from pdcluster.node.events import Admission

        d = DecodeWorker(worker_id, xfer_engine_config(model), transfer_config(transport, secret))
        events = Events()
        d.on_event = events
        d.connect_prefill(prefill_address)
        d.submit("victim", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), prefill_id)
        admission = _wait(lambda: events.first(lambda e: isinstance(e, Admission)), 30, "admission")
        conn.send(("ok", admission[1].verdict))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        return
    # Idle until killed; leave if the parent is gone (EOF on the pipe), and in any case within bounds.
    deadline = time.monotonic() + CHILD_START_TIMEOUT_S + 60
    while time.monotonic() < deadline:
        if conn.poll(1.0):
            try:
                conn.recv()
            except EOFError:
                return


def _prefill_child(conn, model, transport, secret, worker_id):
    """Prefill worker in its own process (decode workers ask it for KV); the pipe asks for its stats."""
    quiet_stdout()
    try:
        import torch

        torch.set_num_threads(1)
        from pdcluster.prefill_node.worker import PrefillWorker

        p = PrefillWorker(worker_id, xfer_engine_config(model, prefill_chunk_size=8), transfer_config(transport, secret))
        conn.send(("ok", p.address))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        return
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            continue
        try:
            cmd = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            if cmd[0] == "stats":
                conn.send(("ok", p.stats()))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


def _child_reply(conn, timeout_s: float, what: str):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{what}: no answer from the child within {timeout_s:.0f} s")
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(f"{what} failed in the child:\n{value}")
    return value


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"{what} not within {timeout_s:.0f} s")


def _reason(failed, prefill_id: str, decode_id: str) -> str | None:
    """The failure reason, with what varies per repetition (worker ids, ports) taken out, cut short."""
    if failed is None:
        return None
    event = failed[1]
    text = event.message if isinstance(event, TransferLog) else str(getattr(event, "reason", ""))
    text = text.replace(prefill_id, "<prefill>").replace(decode_id, "<decode>")
    return re.sub(r":\d{2,5}\b", ":<port>", text)[:160]


def _kill_mid_transfer(proc, events: Events, landed, landed_what: str, failed_pred, reclaimed, what: str, stats,
                       prefill_id: str, decode_id: str, at_kill=dict) -> dict:
    """SIGKILL the child ``proc`` mid-transfer and time the survivor: an error if ``landed()``
    (``landed_what``) is true right after the kill, else the seconds until ``reclaimed()`` (``what``;
    ``stats()`` is shown when it times out) and until the first event matching ``failed_pred`` (the
    survivor gave the victim up). ``at_kill()`` is read right after the kill; its entries join the
    result."""
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    extra = at_kill()
    if landed():
        raise RuntimeError(f"{landed_what} before the kill (not mid-transfer)")
    try:
        _wait(reclaimed, RECLAIM_TIMEOUT_S, what)
    except TimeoutError as e:
        raise TimeoutError(f"{e}; stats now {stats()}") from None
    reclaimed_at = time.monotonic()
    failed = events.first(failed_pred)
    return {
        "reclaim_s": reclaimed_at - killed,
        "failed_event_s": failed[0] - killed if failed else None,
        "reason": _reason(failed, prefill_id, decode_id),
        **extra,
    }


def _stop_child(proc, close_survivor, what: str, notes: list[str]) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(10)
    bounded(close_survivor, 20, what, notes)


def reclaim_decode_killed(model: str, transport: str, secret: str | None, rep: int) -> dict:
    """Decode child SIGKILLed mid-transfer -> the prefill side has every block of the request back."""
    from pdcluster.prefill_node.worker import PrefillWorker

    notes: list[str] = []
    pid, did = f"p-{transport}-{rep}", f"d-{transport}-{rep}"
    events = Events()
    connector_log = logging.getLogger("pdcluster.kv_transfer.connector")
    connector_log.addHandler(events)
    # Small chunks make the prefill (and so the layer-wise transfer) long enough to be cut.
    p = PrefillWorker(pid, xfer_engine_config(model, prefill_chunk_size=8), transfer_config(transport, secret))
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_decode_child, args=(child, model, p.address, XFER_PROMPT_LEN, transport, secret, did, pid),
                       daemon=True)
    proc.start()
    child.close()  # so the child sees EOF if this process dies
    try:
        before = p.stats()
        verdict = _child_reply(parent, CHILD_START_TIMEOUT_S, "decode child start")
        if verdict != "admitted":
            raise RuntimeError(f"the decode child did not take the request: {verdict}")
        _wait(lambda: p.stats()["bytes_sent"] > before["bytes_sent"], TRANSFER_START_TIMEOUT_S, "transfer start")

        def reclaimed():
            s = p.stats()
            return (s["num_free_blocks"] == before["num_free_blocks"] and s["num_held"] == 0
                    and s["num_transfers"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0)

        at_kill = {}

        def read_at_kill():
            at_kill.update(p.stats())
            return {"bytes_sent_at_kill": at_kill["bytes_sent"] - before["bytes_sent"]}

        result = _kill_mid_transfer(
            proc, events, lambda: at_kill["num_transfers"] == 0, "the transfer finished",
            lambda e: isinstance(e, TransferLog) and "KV transfer of victim" in e.message,
            reclaimed, "prefill side reclaimed every block", p.stats, pid, did, at_kill=read_at_kill)
        return {**result, "notes": notes}
    finally:
        connector_log.removeHandler(events)
        _stop_child(proc, p.close, "PrefillWorker.close", notes)


def reclaim_prefill_killed(model: str, transport: str, secret: str | None, rep: int) -> dict:
    """Prefill child SIGKILLed mid-transfer -> the decode side has released the reservation."""
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.engine.sampling_params import SamplingParams
    from pdcluster.node.events import Admission, Failed, KVReady

    notes: list[str] = []
    pid, did = f"p-{transport}-{rep}", f"d-{transport}-{rep}"
    events = Events()
    d = DecodeWorker(did, xfer_engine_config(model), transfer_config(transport, secret))
    d.on_event = events
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_prefill_child, args=(child, model, transport, secret, pid), daemon=True)
    proc.start()
    child.close()
    try:
        address = _child_reply(parent, CHILD_START_TIMEOUT_S, "prefill child start")
        if d.connect_prefill(address) != pid:
            raise RuntimeError("handshake answered with another worker id")
        before = d.stats()
        time.sleep(0.2)  # as the test: let the handshake and first heartbeats settle
        d.submit("victim", list(range(1, XFER_PROMPT_LEN + 1)), SamplingParams(max_tokens=4), pid)
        admission = _wait(lambda: events.first(lambda e: isinstance(e, Admission)), 30, "admission")
        if admission[1].verdict != "admitted":
            raise RuntimeError(f"the decode worker did not take the request: {admission[1]}")

        def sent():
            parent.send(("stats",))
            return _child_reply(parent, 10, "stats")["bytes_sent"] > 0

        _wait(sent, TRANSFER_START_TIMEOUT_S, "transfer start")

        def released():
            s = d.stats()
            return s["num_free_blocks"] == before["num_free_blocks"] and s["num_reserved"] == 0

        result = _kill_mid_transfer(proc, events, lambda: events.first(lambda e: isinstance(e, KVReady)) is not None,
                                    "the KV landed", lambda e: isinstance(e, Failed) and e.request_id == "victim",
                                    released, "decode side released the reservation", d.stats, pid, did)
        return {**result, "notes": notes}
    finally:
        _stop_child(proc, d.close, "DecodeWorker.close", notes)


DIRECTIONS = {"decode_killed": (reclaim_decode_killed, "prefill"), "prefill_killed": (reclaim_prefill_killed, "decode")}
SAMPLE_TIMEOUT_S = CHILD_START_TIMEOUT_S + TRANSFER_START_TIMEOUT_S + RECLAIM_TIMEOUT_S + 60


def _reclaim_driver(conn, jobs: list[tuple[int, str, str, int]], model: str, secret: str | None,
                    log_path: str) -> None:
    """Runs the surviving side of the reclaim repetitions (``jobs``: index, transport, direction, rep) in
    its own process: if the survivor crashes (a native library aborting when its peer vanishes), that is
    a result, not the end of the run."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    import torch

    torch.set_num_threads(1)
    CTX.set_forkserver_preload(PRELOAD)
    for index, transport, direction, rep in jobs:
        conn.send(("start", index))
        fn, _ = DIRECTIONS[direction]
        try:
            conn.send(("ok", index, fn(model, transport, secret, rep)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", index, short_error(e)))
    conn.send(("done",))


def _death(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            kept = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(kept[-lines:])[-600:]


def run_reclaim_jobs(jobs: list[tuple[int, str, str, int]], model: str, secret: str | None) -> dict[int, dict | str]:
    """Every job's result dict, or its error text. A driver that dies or hangs costs the job it was
    running; a new driver runs the remaining ones."""
    results: dict[int, dict | str] = {}
    pending = list(jobs)
    while pending:
        fd, log_path = tempfile.mkstemp(prefix="pdcluster-bench-recovery-", suffix=".log")
        os.close(fd)
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_reclaim_driver, args=(child, pending, model, secret, log_path))
        proc.start()
        child.close()
        current = pending[0][0]
        try:
            while True:
                if not parent.poll(SAMPLE_TIMEOUT_S):
                    results[current] = f"the surviving side hung: no result within {SAMPLE_TIMEOUT_S:.0f} s"
                    break
                try:
                    msg = parent.recv()
                except EOFError:
                    proc.join(10)
                    tail = _tail(log_path)
                    survivor = DIRECTIONS[next(j[2] for j in jobs if j[0] == current)][1]
                    # A crash can come from an earlier repetition's leftovers: the output says which.
                    results[current] = (f"the surviving {survivor} process {_death(proc.exitcode)} during this "
                                        f"repetition"
                                        + (f"; its last output: {tail}" if tail else ""))
                    break
                if msg[0] == "start":
                    current = msg[1]
                elif msg[0] in ("ok", "error"):
                    results[msg[1]] = msg[2]
                    _, transport, direction, rep = next(j for j in jobs if j[0] == msg[1])
                    r = msg[2]
                    log(f"reclaim {transport} {direction} #{rep}: "
                        + (f"{r['reclaim_s']:.3f} s ({r['reason']})" if isinstance(r, dict) else f"FAILED {r}"))
                else:  # done
                    break
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
            parent.close()
            try:
                with open(log_path, errors="replace") as f:
                    sys.stderr.write(f.read())
                os.unlink(log_path)
            except OSError:
                pass
        pending = [j for j in pending if j[0] not in results]
    return results


def bench_reclaim(args, secret: str | None) -> dict:
    from pdcluster.kv_transfer.transports import available_transports

    available = available_transports()
    usable = [t for t in args.transports if available.get(t) is None]
    jobs = [(i, t, d, rep) for i, (t, d, rep) in
            enumerate((t, d, rep) for t in usable for d in DIRECTIONS for rep in range(args.repeats))]
    results = run_reclaim_jobs(jobs, args.model, secret)
    out = {}
    for transport in args.transports:
        if transport not in usable:
            out[transport] = {"skipped": available[transport]}
            continue
        row = {}
        for direction in DIRECTIONS:
            samples, failed_s, reasons, notes, errors = [], [], [], [], []
            for index, t, d, rep in jobs:
                if (t, d) != (transport, direction):
                    continue
                r = results.get(index, "not run")
                if isinstance(r, str):
                    errors.append(f"#{rep}: {r}")
                    continue
                samples.append(r["reclaim_s"])
                if r["failed_event_s"] is not None:
                    failed_s.append(r["failed_event_s"])
                reasons.append(r["reason"])
                notes += r["notes"]
            row[direction] = {
                **summary(samples),
                "samples": [round(x, 3) for x in samples],
                "under_target": bool(samples) and not errors and max(samples) < TARGET_S,
                "failed_event_s": summary(failed_s),
                "reasons": sorted({x for x in reasons if x}),
                **({"notes": notes} if notes else {}),
                **({"errors": errors} if errors else {}),
            }
        out[transport] = row
    return out


# ==================================================================== 2./3. Ray cluster scenarios


def cluster_engine_config(model: str):
    from pdcluster.engine.config import EngineConfig

    return EngineConfig(model=model, num_kv_blocks=CLUSTER_BLOCKS, max_model_len=1024, prefill_chunk_size=64)


def offline_outputs(model: str, prompts: list[list[int]], params) -> list[list[int]]:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(model=model, num_kv_blocks=CLUSTER_BLOCKS, max_model_len=1024), progress=False)
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


ROUTER_SETTINGS: dict = {}  # as the clusters ran, for the JSON's config section


def make_cluster(model: str, transport: str, num_prefill: int, num_decode: int, max_worker_restarts: int):
    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from pdcluster.kv_transfer.config import TransferConfig

    t0 = time.monotonic()
    cluster = Cluster(ClusterSpec(engine=cluster_engine_config(model), transfer=TransferConfig(transport=transport),
                                  mode="disagg", num_prefill=num_prefill, num_decode=num_decode,
                                  request_timeout_s=REQUEST_TIMEOUT_S, max_worker_restarts=max_worker_restarts))
    cluster.router.config.health_interval_s = HEALTH_INTERVAL_S
    cluster.router.record()  # recoveries, for the figures
    ROUTER_SETTINGS.update({k: getattr(cluster.router.config, k) for k in ("health_interval_s", "ping_timeout_s", "max_strikes",
                                                                            "max_recoveries", "admission_timeout_s")})
    log(f"cluster {num_prefill}P+{num_decode}D (restarts {max_worker_restarts}) up in {time.monotonic() - t0:.1f} s")
    return cluster


def on_a_cluster(what: str, errors: list[str], cluster_args: tuple, run):
    """``run(cluster)`` on ``make_cluster(*cluster_args)``, shut down after (bounded); a failure of either is
    logged and noted in ``errors``, not raised (the other runs go on), and gives None."""
    cluster = None
    try:
        cluster = make_cluster(*cluster_args)
        return run(cluster)
    except Exception as e:  # noqa: BLE001
        errors.append(short_error(e))
        log(f"{what}: FAILED {short_error(e)}\n{traceback.format_exc()}")
        return None
    finally:
        if cluster is not None:
            bounded(cluster.shutdown, 60, "Cluster.shutdown", errors)


async def _poll_until(pred, timeout_s: float, interval_s: float = POLL_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        await asyncio.sleep(interval_s)
    return None


async def _decode_kill_once(cluster, ray, prompt, params, kill_after: int) -> dict:
    router = cluster.router
    tokens, last = [], None
    t = {"killed": None, "first_after": None, "detected": None}
    detector = None

    async def detect(victim):
        t["detected"] = await _poll_until(lambda: not router.views[victim].healthy, RECOVERY_TIMEOUT_S)

    async def stream():
        nonlocal last, detector
        victim = None
        async for delta in router.generate("victim", prompt, params):
            tokens.extend(delta.new_token_ids)
            last = delta
            if t["killed"] is not None and t["first_after"] is None and delta.new_token_ids:
                t["first_after"] = time.monotonic()
            if t["killed"] is None and len(tokens) >= kill_after:
                victim = router.requests["victim"].attempt.decode_id
                ray.kill(cluster.decode_handles[victim], no_restart=True)
                t["killed"] = time.monotonic()
                detector = asyncio.create_task(detect(victim))
        return victim

    victim = await asyncio.wait_for(stream(), REQUEST_TIMEOUT_S + 10)
    if detector is not None:
        await asyncio.wait_for(detector, RECOVERY_TIMEOUT_S + 5)
    killed = t["killed"]
    if killed is None:
        raise RuntimeError(f"the request finished with {len(tokens)} tokens before the kill")
    recoveries = [s for rid, s in router.recorder.recoveries if rid == "victim"]
    return {
        "victim": victim,
        "tokens": tokens,
        "finish_reason": last.finish_reason if last else None,
        "error": getattr(last, "error", None) if last else None,
        "tokens_before_kill": kill_after,
        "detect_s": t["detected"] - killed if t["detected"] else None,
        "replace_s": recoveries[0] if recoveries else None,  # router: detection -> re-placement
        "first_token_after_kill_s": t["first_after"] - killed if t["first_after"] else None,
    }


def bench_decode_kill(args, ray) -> dict:
    from pdcluster.engine.sampling_params import SamplingParams

    prompt = list(range(2000, 2040))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)  # greedy
    expected = offline_outputs(args.model, [prompt], params)[0]
    detect, replace, first_after, exact, errors, runs = [], [], [], [], [], []

    def kill_once(cluster) -> dict:
        return asyncio.run(asyncio.wait_for(
            _decode_kill_once(cluster, ray, prompt, params, args.kill_after), SCENARIO_TIMEOUT_S))

    for rep in range(args.repeats):
        r = on_a_cluster(f"decode_kill #{rep}", errors, (args.model, args.cluster_transport, 1, 2, 0), kill_once)
        if r is None:
            continue
        ok = r["finish_reason"] == "length" and r["tokens"] == expected
        exact.append(ok)
        for key, acc in (("detect_s", detect), ("replace_s", replace), ("first_token_after_kill_s", first_after)):
            if r[key] is not None:
                acc.append(r[key])
        run = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"}
        run["num_tokens"] = len(r["tokens"])
        run["token_exact"] = ok
        runs.append(run)
        log(f"decode_kill #{rep}: detect {r['detect_s']}, first token after kill {r['first_token_after_kill_s']}, "
            f"exact {ok}")
    return {
        "kill_to_detect_s": summary(detect),
        "detect_to_replace_s": summary(replace),
        "kill_to_first_token_s": summary(first_after),
        "token_exact": bool(exact) and all(exact) and not errors,
        "runs": runs,
        **({"errors": errors} if errors else {}),
    }


async def _restart_rounds(cluster, ray, rounds: int, probe_prompt, probe_params, probe_expected) -> list[dict]:
    router = cluster.router
    (decode_id, decode), = cluster.decode_handles.items()
    (prefill_id, prefill), = cluster.prefill_handles.items()

    async def generate(rid):
        tokens, last = [], None
        async for delta in router.generate(rid, probe_prompt, probe_params):
            tokens += delta.new_token_ids
            last = delta
        return last is not None and last.finish_reason == "length" and tokens == probe_expected

    # A first request starts the router's health loop and shows the cluster works before any kill.
    if not await asyncio.wait_for(generate("warmup"), REQUEST_TIMEOUT_S):
        raise RuntimeError("the warm-up request did not produce the expected output")
    out = []
    for i in range(rounds):
        row = {}
        for role, wid, handle in (("decode", decode_id, decode), ("prefill", prefill_id, prefill)):
            old = router.health.incarnations.get(wid)
            pid = await asyncio.wait_for(handle.pid.remote(), 30)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            detected = None

            def rejoined():
                nonlocal detected
                view = router.views[wid]
                if detected is None and (not view.healthy or router.health.incarnations.get(wid) != old):
                    detected = time.monotonic()
                return view.healthy and router.health.incarnations.get(wid) not in (None, old)

            back = await _poll_until(rejoined, REJOIN_TIMEOUT_S)
            if back is None:
                raise TimeoutError(f"{role} worker {wid} did not rejoin within {REJOIN_TIMEOUT_S:.0f} s")
            probe_ok = await asyncio.wait_for(generate(f"after-{role}-{i}"), REQUEST_TIMEOUT_S)
            row[role] = {"rejoin_s": back - killed, "detect_s": detected - killed if detected else None,
                         "request_after_exact": probe_ok}
            log(f"restart round {i} {role}: detected {row[role]['detect_s']}, rejoined {back - killed:.3f} s, "
                f"request after: {probe_ok}")
        out.append(row)
    return out


def bench_restart(args, ray) -> dict:
    from pdcluster.engine.sampling_params import SamplingParams

    probe_prompt = list(range(7000, 7033))
    probe_params = SamplingParams(max_tokens=16, ignore_eos=True)
    probe_expected = offline_outputs(args.model, [probe_prompt], probe_params)[0]
    restarts = 2
    rows, errors, clusters = [], [], 0
    remaining = args.repeats

    def restart_rounds(cluster, rounds: int) -> list[dict]:
        nonlocal clusters
        cluster.router.config.admission_wait_s = 120.0  # the only worker of a role is coming back: wait for it
        clusters += 1
        return asyncio.run(asyncio.wait_for(
            _restart_rounds(cluster, ray, rounds, probe_prompt, probe_params, probe_expected), SCENARIO_TIMEOUT_S))

    while remaining > 0:
        rounds = min(remaining, restarts)  # each round restarts each actor once
        remaining -= rounds
        rows += on_a_cluster("restart_rejoin", errors, (args.model, args.cluster_transport, 1, 1, restarts),
                             lambda cluster: restart_rounds(cluster, rounds)) or []
    out = {"clusters": clusters}
    for role in ("decode", "prefill"):
        got = [r[role] for r in rows if role in r]
        out[role] = {
            "rejoin_s": summary([g["rejoin_s"] for g in got]),
            "detect_s": summary([g["detect_s"] for g in got if g["detect_s"] is not None]),
            "samples": [round(g["rejoin_s"], 3) for g in got],
            "request_after_exact": bool(got) and all(g["request_after_exact"] for g in got),
        }
    if errors:
        out["errors"] = errors
    return out


# ==================================================================== main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", nargs="+", default=TRANSPORTS, choices=TRANSPORTS)
    ap.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    ap.add_argument("--cluster-transport", default="tcp", choices=TRANSPORTS, help="KV transport of the Ray clusters")
    ap.add_argument("--kill-after", type=int, default=20, help="decode_kill_recovery: tokens streamed before the kill")
    ap.add_argument("--max-tokens", type=int, default=150, help="decode_kill_recovery: tokens of the request")
    ap.add_argument("--no-secret", action="store_true",
                    help="reclaim: workers without a cluster secret (default: a fresh random one, as the launcher does)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not 0 < args.kill_after < args.max_tokens:
        ap.error("--kill-after must be between 1 and --max-tokens - 1")

    # Stdout carries only the JSON: anything native code prints goes to stderr.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    started = time.monotonic()

    import torch

    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.kv_transfer.config import TransferConfig

    resolve_model(args.model, progress=False)  # build once, before children and actors race for it
    CTX.set_forkserver_preload(PRELOAD)
    torch.set_num_threads(1)  # 2 processes per scenario on a small machine: one thread each
    secret = None if args.no_secret else secrets.token_hex(16)
    defaults = TransferConfig()
    result: dict = {
        "model": args.model,
        "repeats": args.repeats,
        "target_s": TARGET_S,
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "config": {},
    }
    if "reclaim" in args.scenarios:
        result["config"]["reclaim"] = {
            "transports": args.transports, "num_kv_blocks": XFER_BLOCKS, "prompt_len": XFER_PROMPT_LEN,
            "prefill_chunk_size": 8, "heartbeat_interval_s": defaults.heartbeat_interval_s,
            "peer_timeout_s": defaults.peer_timeout_s, "transfer_timeout_s": defaults.transfer_timeout_s,
            "secret": secret is not None, "torch_threads_per_process": 1, "poll_s": POLL_S,
            "kill": "SIGKILL of the peer process once bytes_sent > 0"}
    if {"decode_kill_recovery", "restart_rejoin"} & set(args.scenarios):
        result["config"]["cluster"] = {
            "ray_init": {"num_cpus": 2, "resources": {"prefill_slot": 4, "decode_slot": 4}},
            "transport": args.cluster_transport, "secret": "random per cluster (launcher default)",
            "router": ROUTER_SETTINGS,  # filled in from the first cluster
            "heartbeat_interval_s": defaults.heartbeat_interval_s, "peer_timeout_s": defaults.peer_timeout_s,
            "num_kv_blocks": CLUSTER_BLOCKS, "prefill_chunk_size": 64, "request_timeout_s": REQUEST_TIMEOUT_S,
            "poll_s": POLL_S,
            "decode_kill_recovery": {"num_prefill": 1, "num_decode": 2, "max_worker_restarts": 0, "prompt_len": 40,
                                     "max_tokens": args.max_tokens, "kill_after_tokens": args.kill_after,
                                     "sampling": "greedy", "kill": "ray.kill(no_restart=True)"},
            "restart_rejoin": {"num_prefill": 1, "num_decode": 1, "max_worker_restarts": 2,
                               "admission_wait_s": 120.0, "kill": "SIGKILL of the actor's pid (decode, then prefill)",
                               "probe_request": {"prompt_len": 33, "max_tokens": 16}},
        }
    ray = None
    ray_tmp = None
    failed = False
    try:
        if "reclaim" in args.scenarios:
            t0 = time.monotonic()
            result["reclaim_s"] = bench_reclaim(args, secret)
            log(f"reclaim done in {time.monotonic() - t0:.1f} s")
        ray_scenarios = [s for s in ("decode_kill_recovery", "restart_rejoin") if s in args.scenarios]
        if ray_scenarios:
            import ray as ray_mod

            ray_tmp = tempfile.mkdtemp(prefix="pdcluster-bench-ray-")
            ray_mod.init(num_cpus=2, resources={"prefill_slot": 4, "decode_slot": 4}, include_dashboard=False,
                         log_to_driver=False, _temp_dir=ray_tmp)
            ray = ray_mod
            if "decode_kill_recovery" in ray_scenarios:
                t0 = time.monotonic()
                result["decode_kill_recovery"] = bench_decode_kill(args, ray)
                log(f"decode_kill_recovery done in {time.monotonic() - t0:.1f} s")
            if "restart_rejoin" in ray_scenarios:
                t0 = time.monotonic()
                result["restart_rejoin"] = bench_restart(args, ray)
                log(f"restart_rejoin done in {time.monotonic() - t0:.1f} s")
    except BaseException as e:  # noqa: BLE001 - still print what was measured
        failed = True
        result["error"] = short_error(e)
        log(traceback.format_exc())
    finally:
        if ray is not None:
            notes: list[str] = []
            bounded(ray.shutdown, 60, "ray.shutdown", notes)
            if notes:
                result.setdefault("cleanup", []).extend(notes)
        if ray_tmp is not None:
            if failed or any("errors" in result.get(s, {}) for s in ("decode_kill_recovery", "restart_rejoin")):
                result["ray_logs"] = ray_tmp  # kept for the post-mortem
            else:
                shutil.rmtree(ray_tmp, ignore_errors=True)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    json_out.write(text + "\n")
    json_out.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
