"""A step's inputs to the device in one copy (engine/step_inputs.py): the packing and its arenas, run on
host memory here (``staged=True`` on the CPU); the same path on CUDA adds only pinned memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_engine
from pdcluster.engine import step_inputs
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.step_inputs import ALIGN_BYTES, HostCopyRing, StepInputs


def _arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "slot_mapping": rng.integers(-1, 1000, size=7, dtype=np.int64),
        "block_tables": rng.integers(0, 99, size=(3, 5), dtype=np.int32),  # 60 bytes: the next is unaligned
        "seq_lens": rng.integers(1, 500, size=3, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.int64),
        "mask": rng.random(5) > 0.5,
        "strided": np.arange(20, dtype=np.int64)[::3],  # not contiguous
    }


def test_put_many_gives_every_array_in_one_copy():
    inputs = StepInputs("cpu", staged=True)
    arrays = _arrays(np.random.default_rng(0))
    inputs.begin_step()
    got = inputs.put_many(arrays)
    assert inputs.num_copies == 1
    for name, a in arrays.items():
        t = got[name]
        assert t.shape == a.shape and t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype, name
        assert np.array_equal(t.numpy(), a), name
        assert t.data_ptr() % ALIGN_BYTES == 0, name
        assert not np.shares_memory(t.numpy(), a), name  # a copy in the arena, not the caller's array


def test_unstaged_inputs_are_the_arrays_themselves():
    inputs = StepInputs("cpu")
    assert not inputs.staged
    a = np.arange(6, dtype=np.int64)
    inputs.begin_step()
    t = inputs.put("x", a)
    assert np.shares_memory(t.numpy(), a) and inputs.num_copies == 0


def test_a_later_put_in_the_step_keeps_the_earlier_tensors(monkeypatch):
    """The sampler's logprob rows are put after the step's inputs: they take the next bytes, and a put
    that outgrows the arenas gets new ones while the earlier tensors keep theirs."""
    monkeypatch.setattr(step_inputs, "MIN_ARENA_BYTES", 64)
    inputs = StepInputs("cpu", staged=True)
    inputs.begin_step()
    first = inputs.put_many({"a": np.arange(4, dtype=np.int64), "b": np.arange(3, dtype=np.int32)})
    second = inputs.put("c", np.arange(10, 16, dtype=np.int64))  # 48 bytes past 48: the arenas grow
    third = inputs.put("d", np.full(200, 7, dtype=np.int64))  # and again
    assert first["a"].tolist() == [0, 1, 2, 3] and first["b"].tolist() == [0, 1, 2]
    assert second.tolist() == list(range(10, 16)) and third.tolist() == [7] * 200
    assert inputs.num_copies == 3


def test_steps_alternate_host_arenas():
    """Step n + 1 fills the other host arena: step n's may still be the source of a pending copy."""
    inputs = StepInputs("cpu", staged=True)
    inputs.begin_step()
    inputs.put("x", np.arange(4, dtype=np.int64))
    arena_n = inputs._host[inputs._set]
    inputs.begin_step()
    inputs.put("x", np.arange(4, 8, dtype=np.int64))
    assert inputs._host[inputs._set] is not arena_n
    assert arena_n[:32].view(torch.int64).tolist() == [0, 1, 2, 3]  # untouched by step n + 1
    inputs.begin_step()
    assert inputs._host[inputs._set] is arena_n  # step n + 2: reused (behind step n's synchronisation)


def test_a_steady_batch_gets_the_same_views_with_this_steps_values():
    """Views of the device arena are made once per layout (each is three torch calls); a later step with the
    same layout gets the same tensors, holding its own values."""
    inputs = StepInputs("cpu", staged=True)
    inputs.begin_step()
    first = inputs.put_many({"a": np.arange(4, dtype=np.int64), "b": np.arange(3, dtype=np.int32)})
    inputs.begin_step()
    second = inputs.put_many({"a": np.arange(4, 8, dtype=np.int64), "b": np.arange(3, 6, dtype=np.int32)})
    assert second["a"] is first["a"] and second["b"] is first["b"]
    assert second["a"].tolist() == [4, 5, 6, 7] and second["b"].tolist() == [3, 4, 5]
    inputs.begin_step()
    other = inputs.put_many({"a": np.arange(5, dtype=np.int64)})  # another shape: another view
    assert other["a"] is not first["a"] and other["a"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("staged", [True, False])
def test_put_into_writes_each_part_at_its_offset_in_one_copy(staged):
    """A CUDA graph's static inputs take a step's arrays at fixed offsets; bytes outside the parts' span are
    never written."""
    inputs = StepInputs("cpu", staged=staged)
    dst = torch.full((96,), 0xAB, dtype=torch.uint8)
    inputs.begin_step()
    inputs.put_into(dst, [(16, np.array([1, 2], dtype=np.int64)), (64, np.array([7, 8, 9], dtype=np.int32))])
    assert dst[16:32].view(torch.int64).tolist() == [1, 2]
    assert dst[64:76].view(torch.int32).tolist() == [7, 8, 9]
    assert (dst[:16] == 0xAB).all() and (dst[76:] == 0xAB).all()
    assert inputs.num_copies == (1 if staged else 0)
    later = inputs.put("x", np.arange(3, dtype=np.int64))  # the step's next put takes the arena's next bytes
    assert later.tolist() == [0, 1, 2] and dst[16:32].view(torch.int64).tolist() == [1, 2]


def _greedy(engine) -> list[list[int]]:
    prompts = [[5 + (i * 11 + j) % 200 for j in range(6 + 9 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=1 if i % 2 else None)
              for i in range(5)]
    outs = engine.generate(prompts, params)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("cfg", [{}, dict(async_scheduling=True), dict(spec_method="ngram", num_spec_tokens=2)],
                         ids=["sync", "async-launch-ahead", "ngram"])
def test_the_engine_on_staged_inputs_gives_the_same_tokens(tiny_dir, cfg):
    """Every step's inputs through the arenas (as on a GPU): the same tokens as the arrays used in place,
    with one copy a step (and one more for a step's partial logprob rows)."""
    want = _greedy(make_engine("tiny-random", max_num_seqs=8, num_kv_blocks=64, **cfg))
    engine = make_engine("tiny-random", max_num_seqs=8, num_kv_blocks=64, **cfg)
    engine.runner.inputs = StepInputs("cpu", staged=True)
    assert _greedy(engine) == want
    assert engine.runner.inputs.num_copies > 0
    if cfg.get("async_scheduling"):
        assert engine.num_steps_launched_ahead > 0  # the previous step's ids gathered on the "device"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_put_many_on_cuda_through_pinned_memory():
    inputs = StepInputs("cuda")
    assert inputs.staged
    for step in range(3):  # both host arenas, then the first again
        arrays = _arrays(np.random.default_rng(step))
        inputs.begin_step()
        got = inputs.put_many(arrays)
        assert inputs._host[inputs._set].is_pinned()
        for name, a in arrays.items():
            assert got[name].is_cuda and np.array_equal(got[name].cpu().numpy(), a), (step, name)
    assert inputs.num_copies == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_arena_is_refilled_only_after_its_copy_ran():
    """Three steps' puts with the GPU held busy and no synchronisation between them (steps that sample
    nothing, launched ahead): step 2 refills step 0's host arena, which must wait for step 0's copy; refilled
    at once, step 0's device inputs would be step 2's values (on an H200: another step's block tables)."""
    inputs = StepInputs("cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning queued ahead of the copies
    got = []
    for step in range(3):
        inputs.begin_step()
        got.append(inputs.put("x", np.full(4096, step, dtype=np.int64)).clone())  # queued behind the copy
    torch.cuda.synchronize()
    assert [t.unique().tolist() for t in got] == [[0], [1], [2]]


def test_host_copy_ring_returns_a_cpu_tensor_as_it_is():
    x = torch.arange(5)
    host, event = HostCopyRing().copy(x)
    assert host is x and event is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_copy_ring_reuses_its_pinned_buffers_and_never_returns_stale_ids():
    """Ten steps' sampled ids copied with the GPU held busy (each copy queued behind the spin): every host tensor,
    read after its own event, holds its own step's ids, though the ring allocated only its slots' buffers."""
    ring = HostCopyRing()
    torch.cuda._sleep(100_000_000)
    pending = [(step, *ring.copy(torch.full((3,), step, dtype=torch.int64, device="cuda"))) for step in range(3)]
    for step, host, event in pending:
        event.synchronize()
        assert host.is_pinned() and host.tolist() == [step] * 3
    for step in range(3, 10):  # slots refilled: each waits for its previous copy
        host, event = ring.copy(torch.full((step % 4 + 1,), step, dtype=torch.int64, device="cuda"))
        event.synchronize()
        assert host.tolist() == [step] * (step % 4 + 1)
    assert ring.num_allocations == HostCopyRing.NUM_SLOTS


def test_host_to_device_on_a_cpu_is_the_array_itself():
    from pdcluster.engine.step_inputs import host_to_device

    a = np.arange(6, dtype=np.int64)
    t = host_to_device(a, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == a.tolist() and t.data_ptr() == a.ctypes.data  # no copy
    x = torch.arange(3)
    assert host_to_device(x, torch.device("cpu")) is x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_to_device_does_not_wait_for_the_queued_work():
    """The Mamba row plan, MTP's metadata and LoRA rows go to the GPU while a step launched ahead runs: the copy
    returns at once (a pageable copy would wait for the spin), and lands the values once the stream gets there."""
    import time

    from pdcluster.engine.step_inputs import host_to_device

    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of spinning queued ahead of the copy
    t0 = time.perf_counter()
    got = [host_to_device(np.full(64, i, dtype=np.int64), "cuda") for i in range(4)]
    waited_s = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, f"the copies waited for the queued work ({waited_s:.3f} s)"
    assert [t.unique().tolist() for t in got] == [[0], [1], [2], [3]]
