"""The shared KV tier (engine/kv_offload/shared_tier.py): one folder of block files every worker reads and writes.

Two tiers on one folder as two workers' (a block one wrote is the other's, read back exactly and never written twice;
the folder's size kept by sweeps that delete the least recently used, a read counting as a use; faults a miss),
two engines as two workers (a prompt one computed is a hit for the other, token-exact, with no host or disk tier of
its own: blocks are written through as they are cached), the router's index (a block in the folder is every worker's), and `pdcluster serve` with two workers where
the second serves the first's evicted prompt from the folder.
"""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest
import torch

from conftest import make_engine
from pdcluster.cluster.router.kv_index import KVIndex
from pdcluster.engine.kv_offload.config import OffloadConfig
from pdcluster.engine.kv_offload.shared_tier import SharedDiskTier
from pdcluster.engine.kv_offload.tiers import OffloadTiers
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.tools.server_process import ServeProcess

pytestmark = pytest.mark.timeout(300)

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block_size, kv heads, head_dim
BLOCK_BYTES = 2 * 2 * 4 * 1 * 8 * 2
HEADER_BYTES = 32
BLOCK = 16
POOL = 24  # blocks: two 160-token prompts do not fit together, so the first one's blocks are evicted
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _tier(folder, num_blocks: int = 64) -> SharedDiskTier:
    return SharedDiskTier(folder, num_blocks * (BLOCK_BYTES + HEADER_BYTES), SHAPE, torch.bfloat16, "layout-a")


def test_a_block_one_worker_wrote_is_the_others(tmp_path):
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert a.store(7, _block(7)) and a.flush()
    assert 7 in b and torch.equal(b.load(7), _block(7))  # b never stored it: its file says it is there
    assert not b.store(7, _block(7))  # not written twice
    assert 8 not in b and b.load(8) is None
    a.close()
    b.close()
    # A worker that starts later (a restart, a scale-up) finds the folder's blocks and announces them.
    c = _tier(tmp_path)
    assert c.hashes() == [7] and torch.equal(c.load(7), _block(7))
    c.close()


def test_the_folder_keeps_its_size_least_recently_used_first(tmp_path):
    a, b = _tier(tmp_path, num_blocks=8), _tier(tmp_path, num_blocks=8)
    removed = []
    a.on_evicted = b.on_evicted = removed.extend
    assert a.sweep_every_writes == 1  # a small folder is looked at after every write
    for h in range(6):
        assert a.store(h, _block(h)) and a.flush()
    assert torch.equal(b.load(0), _block(0))  # a read by the other worker makes block 0 the most recently used
    for h in range(6, 12):
        assert b.store(h, _block(h)) and b.flush()
    files = sorted(int(p.stem, 16) for p in b.directory.glob("*.kvb"))
    assert len(files) == 8 and 0 in files, files  # 12 written, 8 kept; block 0 survived its neighbours
    assert sorted(removed) == [1, 2, 3, 4], removed
    assert b.num_blocks == 8
    for h in (1, 2):  # gone for both workers: a miss, never an error
        assert h not in a and a.load(h) is None
    a.close()
    b.close()


def test_a_corrupt_file_is_a_miss_for_every_worker(tmp_path):
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert a.store(3, _block(3)) and a.flush()
    data = bytearray(a.path_of(3).read_bytes())
    data[-1] ^= 0x40
    a.path_of(3).write_bytes(bytes(data))
    tiers = OffloadTiers(OffloadConfig(shared_dir=str(tmp_path), shared_gib=0.001), SHAPE, torch.bfloat16, "layout-a",
                         on_event=(events := []).append)
    out = torch.zeros(SHAPE, dtype=torch.bfloat16)
    assert tiers.match([3]) == 1 and not tiers.load(3, out)  # found, not intact: recomputed
    assert ("removed", "shared", [3]) in [(e.kind, e.tier, e.block_hashes) for e in events]
    assert 3 not in b  # the file went with it
    tiers.close()
    a.close()
    b.close()


def test_offload_writes_through_to_the_folder_beside_the_host_tier(tmp_path):
    events = []
    tiers = OffloadTiers(OffloadConfig(host_gib=2 * BLOCK_BYTES / (1 << 30), shared_dir=str(tmp_path),
                                       shared_gib=0.001), SHAPE, torch.bfloat16, "layout-a", on_event=events.append)
    for h in (1, 2, 3):
        tiers.offload(h, _block(h))
    tiers.shared.flush()
    assert [tiers.tier_of(h) for h in (1, 2, 3)] == ["shared", "host", "host"]  # 1 left host; the folder keeps it
    assert sorted(h for e in events if e.kind == "stored" and e.tier == "shared" for h in e.block_hashes) == [1, 2, 3]
    out = torch.zeros(SHAPE, dtype=torch.bfloat16)
    assert tiers.load(1, out) and torch.equal(out, _block(1)) and tiers.counters["shared"].hits == 1
    tiers.close()


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 40000) for _ in range(length)] for _ in range(n)]


def test_an_engine_gets_the_prompt_another_computed(tmp_path):
    """Written through as its blocks are cached, not when they are evicted: the prompt's first blocks, which a pool
    keeps longest (and which a system prompt shares), reach the folder while the first engine still holds them."""
    a_prompt, b_prompt = _prompts(1, 2, 160)
    fresh = make_engine(num_kv_blocks=POOL, dtype="float32")
    expected = [fresh.generate([p], GREEDY)[0].token_ids for p in (a_prompt, b_prompt)]
    shared = {"kv_offload_shared_dir": str(tmp_path), "kv_offload_shared_gib": 0.05}
    first = make_engine(num_kv_blocks=POOL, dtype="float32", **shared)
    first.generate([a_prompt], GREEDY)
    first.offload.tiers.shared.flush()
    second = make_engine(num_kv_blocks=POOL, dtype="float32", **shared)
    out = second.generate([a_prompt], GREEDY)[0]
    assert out.token_ids == expected[0]
    assert out.num_cached_tokens == 9 * BLOCK and out.num_offloaded_tokens == 9 * BLOCK, out
    # And back: what the second computed is the first's.
    assert second.generate([b_prompt], GREEDY)[0].token_ids == expected[1]
    second.offload.tiers.shared.flush()
    out = first.generate([b_prompt], GREEDY)[0]
    assert out.token_ids == expected[1] and out.num_offloaded_tokens == 9 * BLOCK, out
    assert second.scheduler.num_free_blocks == first.scheduler.num_free_blocks == POOL
    first.offload.close()
    second.offload.close()


def test_the_router_counts_a_folder_block_for_every_worker():
    index = KVIndex()
    index.stored("w1", "device", [1])
    index.stored("w1", "shared", [1, 2, 3])
    assert index.overlap("w1", [1, 2, 3, 4]) == 1.0 + 0.4 + 0.4
    assert index.overlap("w2", [1, 2, 3, 4]) == pytest.approx(1.2)  # never announced by w2, in the folder all the same
    index.forget_worker("w1")  # the worker left; its files did not
    assert index.overlap("w2", [1, 2, 3]) == pytest.approx(1.2)
    index.removed("w2", "shared", [2])  # a file deleted, whoever says so: gone for everyone
    assert index.overlap("w1", [1, 2, 3]) == pytest.approx(0.4) and index.num_blocks("w3")["shared"] == 2


def test_serve_a_second_worker_serves_the_firsts_prompt_from_the_folder(tiny_dir, tmp_path):
    """Colocated, two workers placed round robin: P on worker 1, X on worker 2, then P on worker 1 again (a device hit)
    and on worker 2, which never computed it: its prompt tokens come from the folder, the same answer."""
    p, x, y = (" ".join(f"w{i}" for i in random.Random(seed).sample(range(1000, 9999), 30)) for seed in (1, 2, 3))
    flags = ["--model", "tiny-random", "--mode", "colocated", "--num-decode", "2", "--router-policy", "round_robin",
             "--num-kv-blocks", str(POOL), "--max-model-len", "384", "--dtype", "float32",
             "--kv-offload-shared-dir", str(tmp_path), "--kv-offload-shared-gib", "0.05"]
    with ServeProcess(flags) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        def complete(prompt):
            r = http.post("/v1/completions", json={"model": "tiny-random", "prompt": prompt, "max_tokens": 8,
                                                    "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        first = complete(p)
        complete(x)
        complete(y)
        again = complete(p)  # worker 2 (round robin: p, x, y, p)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * BLOCK, again["usage"]
        # /metrics counts the folder once (every worker reports it), as the workers' stats come in: a worker counts
        # the folder again every COUNT_EVERY_S, so an early sample may still be one worker's own writes.
        deadline, held = time.monotonic() + 20, None
        while time.monotonic() < deadline and not (held and held >= 3 * 8):
            match = re.search(r'^pdcluster:kv_tier_blocks\{[^}]*tier="shared"[^}]*\} ([0-9.eE+-]+)$',
                              http.get("/metrics").text, re.M)
            held = float(match.group(1)) if match else None
            time.sleep(0.5)
    files = len(list(tmp_path.glob("*/*.kvb")))
    assert held is not None and 3 * 8 <= held <= files, (held, files)  # three prompts' blocks, not one per worker


def _hammer(folder: str, seed: int, rounds: int, queue) -> None:
    """One worker's side of the race: store and load random blocks of a small folder others sweep meanwhile."""
    rng = random.Random(seed)
    tier = _tier(folder, num_blocks=16)
    wrong = loaded = 0
    try:
        for _ in range(rounds):
            h = rng.randrange(64)
            if rng.random() < 0.5:
                tier.store(h, _block(h))
            else:
                kv = tier.load(h) if h in tier else None
                if kv is not None:
                    loaded += 1
                    wrong += not torch.equal(kv, _block(h))
        tier.flush()
        tier.close()
        queue.put((seed, wrong, loaded, None))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put((seed, wrong, loaded, repr(e)))


def test_workers_racing_on_one_small_folder_never_read_wrong_kv(tmp_path):
    """Three processes store, load and sweep one 16-block folder at once (64 hashes between them): every load is the
    block's KV or a miss, nothing raises, and the folder ends within its size."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), seed, 400, queue)) for seed in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(error is None for *_, error in results), results
    assert sum(wrong for _, wrong, _, _ in results) == 0 and sum(loaded for _, _, loaded, _ in results) > 0, results
    assert len(list(tmp_path.glob("*/*.kvb"))) <= 16 + 3  # each worker's last writes may land after its last sweep
