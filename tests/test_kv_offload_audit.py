"""The offload tiers' audit (engine/kv_offload/audit.py) on its own: clean tiers report no problem, and
each kind of leak or damage it exists to find is named (a host slot neither used nor free, a block file
nobody indexes, a temporary file left, an indexed block whose file is gone); an engine's audit (what
engine_stats reports as ``kv_tier_audit``) is reused for AUDIT_INTERVAL_S and counts what is in flight.
The soak (tests/test_soak.py, offload) checks it on every live worker after a run."""

from __future__ import annotations

import torch

from conftest import make_engine
from pdcluster.engine.kv_offload.audit import audit_tiers, offload_audit
from pdcluster.engine.kv_offload.config import OffloadConfig
from pdcluster.engine.kv_offload.tiers import OffloadTiers
from pdcluster.engine.sampling_params import SamplingParams

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block_size, kv heads, head_dim: 256 bytes in bf16


def _tiers(tmp_path) -> OffloadTiers:
    tiers = OffloadTiers(OffloadConfig(host_gib=2 * 256 / (1 << 30), disk_dir=str(tmp_path), disk_gib=0.001),
                         SHAPE, torch.bfloat16, "layout-a")
    for h in range(10, 15):  # two stay in host memory, three move on to disk
        tiers.offload(h, torch.full(SHAPE, float(h), dtype=torch.bfloat16))
    assert tiers.disk.flush()
    return tiers


def test_clean_tiers_have_no_problem(tmp_path):
    tiers = _tiers(tmp_path)
    report = audit_tiers(tiers)
    assert report["problems"] == []
    assert report["tiers"]["host"] == {"blocks": 2, "free_slots": 0, "capacity_blocks": 2}
    disk = report["tiers"]["disk"]
    assert disk["blocks"] == disk["files"] == 3 and disk["tmp_files"] == 0 and disk["pending_writes"] == 0
    tiers.close()


def test_each_leak_and_fault_is_named(tmp_path):
    tiers = _tiers(tmp_path)
    leaked_slot = tiers.host._slot_of.popitem()[1]  # a block leaves the index, its slot is never freed
    (tiers.disk.directory / "00000000000000ff.kvb").write_bytes(b"x")  # nobody indexes it
    (tiers.disk.directory / "00000000000000fe.tmp").write_bytes(b"x")  # no write is under way
    tiers.disk.path_of(10).unlink()  # deleted behind the tier's back
    problems = audit_tiers(tiers)["problems"]
    assert f"host: 1 of 2 slots neither used nor free (leaked): [{leaked_slot}]" in problems
    assert "disk: 1 block files nobody indexes (leaked): ['00000000000000ff.kvb']" in problems
    assert "disk: 1 temporary files left with no write queued: ['00000000000000fe.tmp']" in problems
    assert "disk: 1 indexed blocks have no file: ['000000000000000a']" in problems
    assert len(problems) == 4, problems
    tiers.close()


def test_an_engines_audit_is_reused_and_counts_what_is_in_flight(tmp_path):
    engine = make_engine(num_kv_blocks=24, kv_offload_host_gib=0.001, kv_offload_disk_dir=str(tmp_path),
                         kv_offload_disk_gib=0.01)
    assert offload_audit(make_engine(num_kv_blocks=24)) == {}  # no tiers: nothing to audit
    prompt = list(range(100, 260))
    for p in (prompt, list(range(300, 460)), list(range(500, 660))):  # one at a time: the third evicts the first
        engine.generate([p], SamplingParams(max_tokens=2, ignore_eos=True))
    first = offload_audit(engine)
    assert first["problems"] == [] and first["tiers"]["host"]["blocks"] > 0
    assert offload_audit(engine)["at_unix_s"] == first["at_unix_s"]  # reused within AUDIT_INTERVAL_S
    assert offload_audit(engine, max_age_s=0)["at_unix_s"] > first["at_unix_s"]
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.scheduler.schedule()  # its evicted prefix loads back: the request waits for it
    in_flight = offload_audit(engine, max_age_s=0)["in_flight"]
    assert in_flight["load_jobs"] == in_flight["requests_loading"] == in_flight["requests_waiting_for_offload"] == 1
    while engine.has_unfinished():
        engine.step()
    report = offload_audit(engine, max_age_s=0)
    assert not any(report["in_flight"].values()) and report["problems"] == []
    assert report["counters"]["host"]["hits"] > 0
    engine.offload.close()
