"""Sleep mode on one engine (engine/sleep.py): what vLLM's LLM.sleep / wake_up and SGLang's release / resume promise,
checked on the memory itself (which pages the process has mapped, by /proc/self/pagemap) and on the tokens.

- Level 1 gives back every page of the KV cache (a hybrid's Mamba state pool too) and keeps the weights; the wake
  takes them back; the engine then answers as before (tokens and logprobs), its device prefix cache forgotten.
- Level 2 gives back the weights' pages too; the wake reads them again from the checkpoint served, unless a weight
  update wrote them meanwhile (then nothing is read twice, and the engine serves the update); a checkpoint whose
  files changed since is not read (refused by name: the weights stay asleep until an update).
- While asleep no request is taken (EngineSleeping); a sleep while a request is here, an unknown level or tag are
  refused and release nothing.
Served (HTTP, API processes, a Ray cluster): tests/test_sleep_mode_served.py.
"""

from __future__ import annotations

import mmap
import shutil

import numpy as np
import pytest

from conftest import make_engine
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.sleep import EngineSleeping, SleepError
from test_weight_updates import PROMPTS, checkpoints, perturbed_checkpoint  # noqa: F401 - a fixture

NUM_TOKENS = 10
_PRESENT = 1 << 63  # /proc/self/pagemap: the page is mapped in this process


def resident_bytes(tensors) -> tuple[int, int]:
    """(resident, total) bytes of the whole pages inside the storages of ``tensors`` (each storage once): the pages
    this process has mapped, by /proc/self/pagemap (a file's pages in the page cache but no longer mapped here, as a
    checkpoint's after its tensors are released, are not the process's memory)."""
    spans = {}
    for t in tensors:
        s = t.untyped_storage()
        spans[s.data_ptr()] = max(spans.get(s.data_ptr(), 0), s.nbytes())
    resident = total = 0
    page = mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        for start, nbytes in spans.items():
            begin, end = -(-start // page) * page, (start + nbytes) // page * page
            if end <= begin:
                continue
            pagemap.seek(begin // page * 8)
            entries = np.frombuffer(pagemap.read((end - begin) // page * 8), dtype=np.uint64)
            resident += int(np.count_nonzero(entries & np.uint64(_PRESENT))) * page
            total += end - begin
    return resident, total


def kv_tensors(engine):
    from pdcluster.engine.sleep import _kv_tensors

    return _kv_tensors(engine)


def weight_tensors(engine):
    from pdcluster.engine.sleep import _weight_tensors

    return _weight_tensors(engine)


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _run(engine, prompts=PROMPTS):
    outs = engine.generate(prompts, _params(logprobs=2))
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("model,kw", [("tiny-random", {"dtype": "float32"}),
                                      ("tiny-random", {"dtype": "float32", "async_scheduling": True}),
                                      ("tiny-hybrid", {"dtype": "float32"}),
                                      # level 1 leaves the weights alone: bf16 SmolLM2 is level 2's default-run case
                                      pytest.param("smollm2", {"dtype": "auto"}, marks=pytest.mark.slow)],
                         ids=["fp32", "fp32-async", "hybrid", "smollm2-default"])
def test_level_1_gives_back_the_kv_cache_and_answers_as_before(model, kw):
    engine = make_engine(model, enable_prefix_caching=not model.endswith("hybrid"), **kw)
    before, _ = _run(engine)
    weights_before = resident_bytes(weight_tensors(engine))[0]
    assert resident_bytes(kv_tensors(engine))[0] > 0.9 * resident_bytes(kv_tensors(engine))[1]
    if model.endswith("hybrid"):
        assert engine.runner.mamba_pool is not None  # its state pool is among the released tensors

    state = engine.sleep(level=1)
    resident, total = resident_bytes(kv_tensors(engine))
    assert resident == 0 and state["released_bytes"]["kv_cache"] == total > 0
    assert resident_bytes(weight_tensors(engine))[0] == weights_before, "level 1 keeps the weights"
    assert engine.is_sleeping and state["asleep_tags"] == ["kv_cache"] and state["sleep_level"] == 1
    with pytest.raises(EngineSleeping, match="the model is sleeping"):
        engine.add_request(PROMPTS[0], _params())
    assert not engine.has_unfinished()

    state = engine.wake_up()
    assert not engine.is_sleeping and state["asleep_tags"] == []
    resident, total = resident_bytes(kv_tensors(engine))
    assert resident == total, "the wake faults the pool in again"
    after, cached = _run(engine)
    assert after == before
    if not model.endswith("hybrid"):
        assert cached == [0, 0, 0], "the device prefix cache was forgotten with the pool's contents"
        assert _run(engine)[1][0] >= 32, "and caches again after the wake"


def test_level_2_discards_the_weights_and_the_wake_reads_them_again():
    engine = make_engine("smollm2", dtype="auto")
    before, _ = _run(engine)
    weights_resident, weights_total = resident_bytes(weight_tensors(engine))
    state = engine.sleep(level=2)
    assert state["sleep_level"] == 2 and state["asleep_tags"] == ["kv_cache", "weights"]
    # Only whole pages inside each storage go: the partial ones at the ends stay (a few per tensor).
    assert resident_bytes(weight_tensors(engine))[0] < 0.02 * weights_total
    assert state["released_bytes"]["weights"] > 0.95 * weights_total
    assert resident_bytes(kv_tensors(engine))[0] == 0
    # Waking the KV cache alone serves nothing yet.
    assert engine.wake_up(["kv_cache"])["asleep_tags"] == ["weights"]
    with pytest.raises(EngineSleeping, match="weights released"):
        engine.add_request(PROMPTS[0], _params())
    engine.wake_up(["weights"])
    assert engine.sleep_state.num_reloads == 1 and not engine.is_sleeping
    assert resident_bytes(weight_tensors(engine))[0] >= weights_resident * 0.98
    assert _run(engine)[0] == before


def test_an_update_while_asleep_restores_the_weights_without_reading_the_old_ones(checkpoints):  # noqa: F811
    new_dir = checkpoints[("tiny-random", 1)]
    want = _run(make_engine(new_dir, dtype="float32"))[0]
    engine = make_engine("tiny-random", dtype="float32")
    old = _run(engine)[0]
    assert old != want
    engine.sleep(level=2)
    engine.wake_up(["weights"])  # verl's order: the weights first, then the update, then the KV cache
    assert engine.is_sleeping  # the KV cache still is
    engine.update_weights_from_disk(new_dir, "step-1")
    assert not engine.sleep_state.weights_discarded
    engine.wake_up(["kv_cache"])
    assert engine.sleep_state.num_reloads == 0, "the update wrote every weight: nothing read twice"
    assert _run(engine)[0] == want
    # An update while the weights themselves sleep (SGLang's order: release all, update, resume) restores them too.
    engine.sleep(level=2)
    engine.update_weights_from_disk(checkpoints[("tiny-random", 2)], "step-2")
    assert engine.sleep_state.asleep == {"kv_cache"}
    engine.wake_up()
    assert engine.sleep_state.num_reloads == 0
    assert _run(engine)[0] == _run(make_engine(checkpoints[("tiny-random", 2)], dtype="float32"))[0]


def test_weights_whose_files_changed_are_not_read_again(tmp_path):
    served = tmp_path / "served"
    shutil.copytree(perturbed_checkpoint("tiny-random", tmp_path / "a", 1), served)
    engine = make_engine(str(served), dtype="float32")
    engine.sleep(level=2)
    shutil.rmtree(served)  # a trainer writes its next checkpoint where the served one was
    shutil.copytree(perturbed_checkpoint("tiny-random", tmp_path / "b", 2), served)
    with pytest.raises(SleepError, match="no longer holds the checkpoint of weights 'default'"):
        engine.wake_up()
    assert engine.sleep_state.asleep == {"weights"} and resident_bytes(kv_tensors(engine))[0] > 0
    with pytest.raises(EngineSleeping):
        engine.add_request(PROMPTS[0], _params())
    engine.update_weights_from_disk(str(served), "next")  # the way back: serve what is there, under its own name
    assert not engine.is_sleeping
    assert _run(engine)[0] == _run(make_engine(str(served), dtype="float32"))[0]


def test_refusals_release_nothing():
    engine = make_engine("tiny-random", dtype="float32")
    for bad in (0, 3, "1", True):
        with pytest.raises(SleepError, match="level: 1"):
            engine.sleep(level=bad)
    with pytest.raises(SleepError, match="'cuda_graph' is not one of weights, kv_cache"):
        engine.release_memory(["cuda_graph"])
    with pytest.raises(SleepError, match="'everything' is not one of"):
        engine.wake_up(["everything"])
    engine.add_request(PROMPTS[0], _params())
    engine.step()
    with pytest.raises(SleepError, match="1 requests are here: pause generation first"):
        engine.sleep(level=1)
    assert not engine.is_sleeping
    assert resident_bytes(kv_tensors(engine))[0] == resident_bytes(kv_tensors(engine))[1]
    while engine.has_unfinished():
        engine.step()
    # A sleep goes deeper, never shallower; a second wake is a no-op.
    engine.sleep(level=2)
    assert engine.sleep(level=1)["sleep_level"] == 2
    engine.wake_up()
    assert engine.wake_up() == {**engine.wake_up(), "seconds": engine.wake_up()["seconds"]}
    assert not engine.is_sleeping


def test_host_tier_prefixes_hit_again_after_the_wake():
    """Level 1 forgets the device pool, but each cached block goes to the host tier first, as an evicted one does
    (the pool here is large enough that none was evicted before): the prefix hits from there after the wake."""
    engine = make_engine("tiny-random", dtype="float32", enable_prefix_caching=True, num_kv_blocks=64,
                         kv_offload_host_gib=0.05)
    before, _ = _run(engine)
    engine.sleep(level=1)
    engine.wake_up()
    after, cached = _run(engine)
    assert after == before and cached[0] >= 32


def test_a_shared_segments_pages_go_back_for_every_process_that_maps_it():
    """A decode worker's cache over shm (and cuda_ipc on a CPU) is a memfd its prefill peers map: MADV_DONTNEED would
    only unmap it here and free nothing, so the segment's own pages are removed (MADV_REMOVE); a private mapping
    (the cache without those transports) gives back its pages with MADV_DONTNEED."""
    import os

    import torch

    from pdcluster.engine.kv_cache import KVCacheSpec, allocate_kv_cache
    from pdcluster.engine.sleep import release_host_memory
    from pdcluster.kv_transfer.transports.common.memfd import find_segment, shared_tensor

    shared = shared_tensor((256, 4096), torch.float32)  # 4 MiB
    shared.fill_(1.0)
    segment = find_segment(shared)[0]
    assert os.fstat(segment.fd).st_blocks * 512 >= 4 << 20
    assert release_host_memory([shared, shared[3:]]) == 4 << 20  # one storage, counted once
    assert os.fstat(segment.fd).st_blocks * 512 < 64 << 10, "the segment still holds its pages"
    assert float(shared.abs().sum()) == 0.0
    private = allocate_kv_cache(KVCacheSpec(2, 0, 64, 16, 2, 64, torch.float32))
    private.fill_(1.0)
    assert resident_bytes([private])[0] == private.numel() * 4
    release_host_memory([private])
    assert resident_bytes([private])[0] == 0 and float(private.abs().sum()) == 0.0


def test_level_2_discards_a_draft_models_weights_too(tmp_path):
    """A draft model (--spec draft_model) is weights too: level 2 gives back its pages, the wake reads it again (an
    update of the target's weights leaves it as it is: read again when nothing else sleeps)."""
    from conftest import layer_skip_draft_dir

    draft_dir = layer_skip_draft_dir("tiny-random", 3)
    engine = make_engine("tiny-random", dtype="float32", spec_method="draft_model", draft_model=draft_dir,
                         num_spec_tokens=3)
    def counts():
        outs = engine.generate(PROMPTS, _params())
        return [(o.token_ids, o.num_draft_tokens, o.num_accepted_tokens) for o in outs]

    before = counts()
    assert sum(c[2] for c in before) > 0
    draft = engine.runner.proposer.draft
    from pdcluster.engine.weight_update import served_tensors

    draft_tensors = served_tensors(draft)
    total = resident_bytes(draft_tensors)[1]
    state = engine.sleep(level=2)
    assert resident_bytes(draft_tensors)[0] < 0.05 * total
    assert state["released_bytes"]["weights"] > total
    engine.wake_up()
    assert engine.sleep_state.num_reloads == 2  # the target's and the draft's
    assert resident_bytes(draft_tensors)[0] > 0.9 * total
    assert counts() == before, "the draft drafts as before: its weights are back"
    # An update while only the weights sleep: the target's come from it, the draft's are read again at once.
    engine.sleep(level=2)
    engine.wake_up(["kv_cache"])
    engine.update_weights_from_disk(perturbed_checkpoint("tiny-random", tmp_path / "new", 1), "new")
    assert not engine.is_sleeping and not engine.sleep_state.draft_discarded
    assert resident_bytes(draft_tensors)[0] > 0.9 * total


@pytest.mark.parametrize("populate_write", [True, False], ids=["madvise", "zero-fill"])
def test_the_wake_faults_every_page_in_zeroed(monkeypatch, populate_write):
    """MADV_POPULATE_WRITE (Linux 5.14+) where the kernel has it, a zero fill where it refuses (an older kernel)."""
    import torch

    from pdcluster.engine import sleep
    from pdcluster.engine.kv_cache import KVCacheSpec, allocate_kv_cache

    cache = allocate_kv_cache(KVCacheSpec(2, 0, 64, 16, 2, 64, torch.float32))
    cache.fill_(3.0)
    sleep.release_host_memory([cache])
    assert resident_bytes([cache])[0] == 0
    if not populate_write:
        monkeypatch.setattr(sleep, "_MADV_POPULATE_WRITE", -1)  # an advice no kernel takes: EINVAL
    sleep.populate_host_memory([cache])
    assert resident_bytes([cache]) == (cache.numel() * 4,) * 2 and float(cache.abs().sum()) == 0.0
