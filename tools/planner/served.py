"""How much slower a served worker's steps are than the bare engine's (part of `pdcluster profile`).

The profile times ``LLMEngine.step()`` alone. A served worker runs the same steps inside a worker
process beside its control plane, KV transport and ack threads, with the layer-wise KV sends in the
forward pass, and its peer process on the other cores; on this 2-core box that made a served 128-token
prefill step about 1.25x the bare one, and the planner predicted every run 20-35% fast. So the profile
also runs a real pair: a prefill worker here and a decode worker in another process, connected over the
real transport; lone prompts one after another (prefill steps), then decode batches of 1 to 8 requests.
Each step's time over what the bare fits predict for the same step (engine/step_trace.py records its
features) gives the raw factors (medians); profile.py divides them by how the bare engine ran against
the same fits just before and after (``bare_drift``: this host's speed drifts by 20-30% over minutes),
giving ``served.prefill_factor`` and ``served.decode_factor``, which the simulator multiplies into
every prefill and decode step.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import time
from dataclasses import asdict

import torch

from pdcluster.decode_node.worker import DecodeWorker
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.step_trace import StepTrace
from pdcluster.kv_transfer.config import TransferConfig
from pdcluster.node.events import Failed, Tokens
from pdcluster.prefill_node.worker import PrefillWorker

CTX = mp.get_context("spawn")
READY_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 60.0
PREFILL_SIZES = (128, 128, 128, 512, 512)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_TOKENS = 24
MAX_RECORDS = 4096


def _config(model: str, dtype: str, threads: int, num_kv_blocks: int, device: str = "cpu") -> EngineConfig:
    # Synchronous scheduling, as the bare profile's steps (steps.bare_engine): the two are compared step by step.
    return EngineConfig(model=model, dtype=dtype, num_threads=threads, max_model_len=2048, num_kv_blocks=num_kv_blocks,
                        device=device, async_scheduling=False)


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _wait_finished(events: list, request_ids: set[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = {e.request_id for e in list(events) if (isinstance(e, Tokens) and e.finished) or isinstance(e, Failed)}
        if request_ids <= done:
            return True
        time.sleep(0.01)
    return False


def _decode_child(conn, prefill_address: str, model: str, dtype: str, threads: int, transport: str,
                  num_kv_blocks: int, seed: int, device: str = "cpu") -> None:
    """The decode worker: connect, drive both phases (it is the one that submits), send its steps back."""
    torch.set_num_threads(threads)
    d = DecodeWorker("served-probe-d", _config(model, dtype, threads, num_kv_blocks, device),
                     TransferConfig(transport=transport))
    try:
        d.engine.step_trace = StepTrace("", keep=MAX_RECORDS)
        events: list = []
        d.on_event = events.append
        d.connect_prefill(prefill_address)
        vocab = d.engine.arch.vocab_size
        rng = random.Random(seed)
        ok = True
        for i, n in enumerate(PREFILL_SIZES):  # lone prompts: the prefill worker's steps
            rid = f"p{i}"
            d.submit(rid, _prompt(rng, vocab, n), SamplingParams(max_tokens=2, ignore_eos=True), "served-probe-p")
            ok &= _wait_finished(events, {rid}, REQUEST_TIMEOUT_S)
            time.sleep(0.2)
        decode_from = len(d.engine.step_trace.records)
        for batch in DECODE_BATCHES:  # decode batches: this worker's steps
            ids = {f"d{batch}-{j}" for j in range(batch)}
            for rid in sorted(ids):
                d.submit(rid, _prompt(rng, vocab, 128), SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True),
                         "served-probe-p")
            ok &= _wait_finished(events, ids, REQUEST_TIMEOUT_S)
        records = [asdict(r) for r in list(d.engine.step_trace.records)[decode_from:]]
        conn.send({"ok": bool(ok), "decode_steps": records})
    except Exception as e:  # noqa: BLE001 - reported to the parent, which records the probe as not measured
        conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        conn.poll(10.0)  # the parent closes its prefill worker first: neither side logs a lost peer
        d.close()


def measure_served(cost, model: str, dtype: str, threads: int, transport: str, seed: int, log,
                   device: str = "cpu") -> dict:
    """Served over bare step-time factors, measured on a real prefill/decode pair (see the module
    docstring); ``cost`` is the bare profile's CostModel. {"measured": False, ...} when it fails."""
    num_kv_blocks = 512
    p = PrefillWorker("served-probe-p", _config(model, dtype, threads, num_kv_blocks, device),
                      TransferConfig(transport=transport))
    p.engine.step_trace = StepTrace("", keep=MAX_RECORDS)
    parent, child_end = CTX.Pipe()
    child = CTX.Process(target=_decode_child, args=(child_end, p.address, model, dtype, threads, transport,
                                                    num_kv_blocks, seed, device), daemon=True)
    child.start()
    try:
        if not parent.poll(READY_TIMEOUT_S + REQUEST_TIMEOUT_S * (len(PREFILL_SIZES) + len(DECODE_BATCHES))):
            log("profile: the served probe's decode worker did not report; served factors not measured")
            return {"measured": False, "prefill_factor": 1.0, "decode_factor": 1.0}
        report = parent.recv()
    finally:
        p.close()  # before the decode worker goes: it says goodbye to a peer that is still there
        try:
            parent.send("bye")
        except OSError:  # the child is gone already
            pass
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(5)
        prefill_steps = [asdict(r) for r in list(p.engine.step_trace.records)]
    if not report.get("ok"):
        log(f"profile: the served probe failed ({report.get('error', 'a request did not finish')}); "
            "served factors not measured")
        return {"measured": False, "prefill_factor": 1.0, "decode_factor": 1.0}
    prefill = [r for r in prefill_steps if r["prefill_tokens"] and not r["num_decode"]]
    decode = [r for r in report["decode_steps"] if r["num_decode"] and not r["prefill_tokens"]]

    def factor(steps: list[dict]) -> float:
        ratios = [r["seconds"] / cost.step_s(r["prefill_tokens"], r["attn"], r["num_decode"], r["context"])
                  for r in steps]
        return max(1.0, statistics.median(ratios)) if ratios else 1.0

    return {"measured": True, "transport": transport, "prefill_factor": factor(prefill), "decode_factor": factor(decode),
            "prefill_steps": prefill, "decode_steps": decode}
