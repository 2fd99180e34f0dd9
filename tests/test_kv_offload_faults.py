"""Disk tier faults under HTTP load (issue 27 acceptance): a real `pdcluster serve --mode local` with an
80-block device pool, an 8-block host tier and a disk tier, eight conversations sent concurrently turn by
turn over HTTP, while their blocks' files in the disk tier are deleted, truncated and corrupted. Every
response is a 200 without error and every completion equals the offline engine's without prefix
caching (nothing reused): a damaged block is recomputed, never read as KV.

The faults are placed so that they must hit: between turns the conversations' blocks are pushed out of
the device pool and the host tier (long unrelated prompts, one at a time), the test waits until each of
their files is on disk and then damages them, one kind of fault per conversation (payload bits flipped,
which only the CRC catches; first file deleted; all files truncated; a middle file flipped, so the
prefix loads up to it; the magic overwritten; all deleted; two left intact). So the next turn's load of
each damaged conversation fails exactly once (the worker's disk failed_loads, /health) and the intact
blocks load (prompt_tokens_cached{tier="offload"} on /metrics, exactly). The third turn runs while a
thread keeps damaging the files that turn loads, as its requests read them. /metrics shows every tier's
usage, and the tiers' audit sees the blocks still indexed whose files are gone, and no leak.

Mutation check: DiskTier._read without its CRC comparison fails the second turn (wrong text)."""

from __future__ import annotations

import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import make_engine
from pdcluster.engine.block_manager import chained_block_hashes
from pdcluster.engine.kv_offload.config import GIB
from pdcluster.engine.kv_offload.disk_tier import HEADER, SUFFIX
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.tools.server_process import ServeProcess

openai = pytest.importorskip("openai")

MODEL = "tiny-random"
BLOCK = 16
# Device pool: room for the eight conversations' next turn at once (8 x 8 blocks: a block loaded for
# one request is not evicted by the others before it runs), not for their history and the fillers.
NUM_KV_BLOCKS = 80
HOST_BLOCKS = 8
MAX_MODEL_LEN = 512
MAX_TOKENS = 8
FIRST_TURN_TOKENS = 64  # 4 full blocks
NEW_TOKENS_PER_TURN = 40
FILLER_TOKENS = 256  # 16 full blocks: seven of them push every older block out of device and host
NUM_FILLERS = -(-(NUM_KV_BLOCKS + HOST_BLOCKS) // (FILLER_TOKENS // BLOCK)) + 1
# One fault per conversation, applied to its blocks' files between turn 1 and turn 2.
FAULTS = ["flip_all", "delete_first", "truncate_all", "flip_middle", "bad_magic", "intact", "delete_all", "intact"]
NUM_DAMAGED = sum(f != "intact" for f in FAULTS)


def _flip(path: Path) -> None:
    """Bit 6 of every odd payload byte (the high byte of each bf16, two of each fp32's four, exponent
    included): the header still names the block and its size, so only the checksum tells. In place
    ("r+b"): a file the tier removed meanwhile is not created again."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for i in range(HEADER.size + 1, len(data), 2):
            data[i] ^= 0x40
        f.seek(0)
        f.write(data)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _bad_magic(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"NOTABLK!")


def _damage(fault: str, paths: list[Path]) -> None:
    if fault == "flip_all":
        for p in paths:
            _flip(p)
    elif fault == "delete_first":
        paths[0].unlink()
    elif fault == "truncate_all":
        for p in paths:
            _truncate(p)
    elif fault == "flip_middle":
        _flip(paths[len(paths) // 2])
    elif fault == "bad_magic":
        _bad_magic(paths[0])
    elif fault == "delete_all":
        for p in paths:
            p.unlink()
    else:
        assert fault == "intact", fault


def _file_name(block_hash: int) -> str:
    return f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The three turns of every conversation (each turn = the previous prompt + its reference output +
    new tokens) and each turn's completion text from an engine without prefix caching; also the
    device block's size in bytes, to size the host tier in blocks."""
    rng = random.Random(27)
    engine = make_engine(MODEL, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(100, 40000) for _ in range(FIRST_TURN_TOKENS)] for _ in FAULTS]
    turns, texts = [], []
    for _ in range(3):
        outputs = engine.generate(prompts, params)
        assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)
        turns.append(prompts)
        texts.append([o.text for o in outputs])
        prompts = [p + list(o.token_ids) + [rng.randrange(100, 40000) for _ in range(NEW_TOKENS_PER_TURN)]
                   for p, o in zip(prompts, outputs)]
    kv = engine.kv_cache  # [layers, K/V, blocks, block_size, kv heads, head_dim]
    bytes_per_block = kv[:, :, 0].numel() * kv.element_size()
    return turns, texts, bytes_per_block


@pytest.fixture(scope="module")
def server(reference, tmp_path_factory):
    disk_dir = tmp_path_factory.mktemp("kv-disk")
    host_gib = (HOST_BLOCKS + 0.5) * reference[2] / GIB
    s = ServeProcess(["--mode", "local", "--model", MODEL, "--num-kv-blocks", str(NUM_KV_BLOCKS),
                      "--max-model-len", str(MAX_MODEL_LEN), "--kv-offload-host-gib", f"{host_gib:.12f}",
                      "--kv-offload-disk-dir", str(disk_dir), "--kv-offload-disk-gib", "0.05"], timeout_s=180)
    s.disk_dir = disk_dir
    s.http = httpx.Client(base_url=s.base_url, timeout=60, trust_env=False)
    # No retries: a 5xx must fail the test, not be sent again.
    s.client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0,
                             http_client=httpx.Client(timeout=120, trust_env=False))
    yield s
    s.close()


def _complete(client, prompt: list[int], stream: bool, max_tokens: int = MAX_TOKENS) -> str:
    """One completion over HTTP; any error status raises (openai.APIStatusError). Finished by length."""
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        r = client.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == max_tokens, r
        return r.choices[0].text
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    assert finish == "length", finish
    return text


def _turn(server, prompts: list[list[int]]) -> list[str]:
    """Every conversation's next turn at once (half of them streamed), texts in order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_complete, server.client, p, i % 2 == 1) for i, p in enumerate(prompts)]
        return [f.result(timeout=120) for f in futures]


def _push_down(server, rng: random.Random) -> None:
    """Long unrelated prompts, one at a time: the conversations' blocks leave the device pool and the
    host tier behind them, for disk."""
    for _ in range(NUM_FILLERS):
        _complete(server.client, [rng.randrange(100, 40000) for _ in range(FILLER_TOKENS)], stream=False, max_tokens=1)


def _files_of(server, prompts: list[list[int]], first_block: int = 0, timeout_s: float = 20.0) -> list[list[Path]]:
    """Per conversation, the disk files of its prompt's full blocks, once every one from ``first_block`` on
    is written (those before it: the ones still there)."""
    names = [[_file_name(h) for h in chained_block_hashes(p, BLOCK)] for p in prompts]
    deadline = time.monotonic() + timeout_s
    while True:
        on_disk = {p.name: p for p in server.disk_dir.rglob(f"*{SUFFIX}")}
        missing = sum(n not in on_disk for conv in names for n in conv[first_block:])
        if not missing:
            return [[on_disk[n] for n in conv if n in on_disk] for conv in names]
        assert time.monotonic() < deadline, f"{missing} blocks never reached the disk tier: {_worker(server)}"
        time.sleep(0.1)


def _worker(server) -> dict:
    health = server.http.get("/health").json()
    return health["workers"][0]


def _sample(text: str, name: str, tier: str) -> float | None:
    match = re.search(rf'^{re.escape(name)}\{{[^}}]*tier="{tier}"[^}}]*\}} ([0-9.eE+-]+)$', text, re.M)
    return float(match.group(1)) if match else None


class _Vandal(threading.Thread):
    """Damages the given files at random (delete, truncate, flip, bad magic) until stopped."""

    def __init__(self, paths: list[Path], seed: int) -> None:
        super().__init__(name="kv-disk-vandal", daemon=True)
        self.paths, self.rng = paths, random.Random(seed)
        self.stop = threading.Event()
        self.num_damaged = 0

    def run(self) -> None:
        faults = [Path.unlink, _truncate, _flip, _bad_magic]
        while not self.stop.wait(0.005):
            try:
                self.rng.choice(faults)(self.rng.choice(self.paths))
            except OSError:  # gone already (deleted by us, or dropped by the tier after a failed read)
                continue
            self.num_damaged += 1


@pytest.mark.timeout(300)
def test_disk_faults_under_http_load_recompute_never_a_wrong_token(server, reference):
    turns, texts, _ = reference
    rng = random.Random(0)

    assert _turn(server, turns[0]) == texts[0]
    _push_down(server, rng)
    for fault, paths in zip(FAULTS, _files_of(server, turns[0])):
        _damage(fault, paths)

    # Turn 2: each conversation's first blocks come from disk; the damaged ones are recomputed.
    assert _turn(server, turns[1]) == texts[1], "a damaged disk block was read as KV"
    disk = _worker(server)["kv_tier_audit"]["counters"]["disk"]
    assert disk["failed_loads"] == NUM_DAMAGED, disk  # every damaged conversation's load hit its fault, once
    # The intact conversations loaded their 4 blocks, "flip_middle" the 2 before its damaged one.
    assert disk["hits"] == 2 * 4 + 2, disk
    metrics = server.http.get("/metrics").text
    assert _sample(metrics, "pdcluster:prompt_tokens_cached_total", "offload") == (2 * 4 + 2) * BLOCK

    # Turn 3 while a thread damages the very files it loads.
    _push_down(server, rng)
    # (Turn 1's blocks deleted above stay indexed without a file: wait for the blocks turn 2 added.)
    written = _files_of(server, turns[1], first_block=FIRST_TURN_TOKENS // BLOCK)
    vandal = _Vandal([p for conv in written for p in conv], seed=1)
    vandal.start()
    try:
        assert _turn(server, turns[2]) == texts[2], "a damaged disk block was read as KV"
    finally:
        vandal.stop.set()
        vandal.join(10)
    turn3_done_s = time.time()
    assert vandal.num_damaged > 0
    print(f"disk faults: {NUM_DAMAGED} conversations damaged between turns, {vandal.num_damaged} files damaged "
          f"during turn 3; worker counters {_worker(server)['kv_tier_audit']['counters']}")

    # Every tier's usage on /metrics: device, host, disk, held and capacity.
    metrics = server.http.get("/metrics").text
    for tier in ("device", "host", "disk"):
        assert _sample(metrics, "pdcluster:kv_tier_blocks", tier) is not None, (tier, metrics)
        assert _sample(metrics, "pdcluster:kv_tier_capacity_blocks", tier) is not None, (tier, metrics)
    assert _sample(metrics, "pdcluster:kv_tier_capacity_blocks", "device") == NUM_KV_BLOCKS
    assert _sample(metrics, "pdcluster:kv_tier_capacity_blocks", "host") == HOST_BLOCKS
    assert _sample(metrics, "pdcluster:kv_tier_blocks", "host") == HOST_BLOCKS  # full: it pushed blocks to disk
    assert 0 < _sample(metrics, "pdcluster:kv_tier_blocks", "disk") <= _sample(
        metrics, "pdcluster:kv_tier_capacity_blocks", "disk")
    assert _sample(metrics, "pdcluster:kv_tier_blocks", "device") == 0  # idle: nothing in use

    # The audit sees what was done behind the disk tier's back: blocks still indexed whose files are
    # gone (read lazily: a load stops at the first bad block, the ones after it stay indexed).
    deadline = time.monotonic() + 10
    while True:  # an audit taken after turn 3 (the worker reuses one for up to a second)
        audit = _worker(server)["kv_tier_audit"]
        if audit["at_unix_s"] > turn3_done_s or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert any("have no file" in p for p in audit["problems"]), audit
    assert not any("leaked" in p for p in audit["problems"]), audit
    assert audit["tiers"]["host"]["blocks"] + audit["tiers"]["host"]["free_slots"] == HOST_BLOCKS, audit
