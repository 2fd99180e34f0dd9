"""S1 (docs/invariants.md; source report 001): the scheduler's num_computed_tokens is authoritative.

The runner's CPU mirror ``num_computed_tokens_np`` is overwritten from the scheduler every step, never
advanced locally; ``num_computed_prefill_tokens_np == min(computed, prefill_len)``; ``is_prefilling`` is
a per-request array. Driven for 2,000+ steps on tiny-random with MTP-like drafts (always k=3) and a
random-acceptance verifier (0..k drafts accepted per step), with requests joining, chunked prefills,
finishing and being preempted, the mirror equals the scheduler every step. The long run uses a stub
proposer (random drafts, cheap); shorter runs use the real MTP head, sync and async. The same loop with
the seed's bug put back (a refresh that keeps the runner's own count and adds the scheduled tokens,
rejected drafts included) is caught within a few steps.
"""

import random

import numpy as np
import pytest
import torch

from conftest import make_engine
from pdcluster.engine import model_runner as model_runner_module
from pdcluster.engine.proposers import Proposer
from pdcluster.engine.rejection_sampler import PLACEHOLDER
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.request_slots import RequestStates

K = 3
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_acceptance(rng: random.Random):
    """Stands in for the verifier: accept a uniformly random number of drafts, then one token."""

    def verify(target_logits, draft_token_ids, params, seeds, positions, draft_probs=None):
        width = max(len(d) for d in draft_token_ids) + 1
        out = torch.full((len(draft_token_ids), width), PLACEHOLDER, dtype=torch.int64)
        for r, drafts in enumerate(draft_token_ids):
            a = rng.randint(0, len(drafts))
            tokens = list(drafts[:a]) + [rng.randrange(1000, 40000)]
            out[r, : len(tokens)] = torch.tensor(tokens)
        return out

    return verify


class RandomDrafts(Proposer):
    """Always k drafts (as MTP gives), random tokens: the MTP head's cost without its compute."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def propose(self, batch):
        return [[self.rng.randrange(1000, 40000) for _ in range(int(k))] for k in batch.num_drafts_np]


def _drive(monkeypatch, num_steps: int, use_async: bool = False, stub_proposer: bool = True, on_check=None,
           stub_logits: bool = False) -> dict:
    rng = random.Random(1234)
    monkeypatch.setattr(model_runner_module, "rejection_sample", _random_acceptance(rng))
    engine = make_engine(
        "tiny-random", spec_method="mtp", num_spec_tokens=K, mtp_checkpoint="random", async_scheduling=use_async,
        num_kv_blocks=24, prefill_chunk_size=24, max_num_batched_tokens=48, max_num_seqs=6, max_model_len=256,
    )
    runner, scheduler = engine.runner, engine.scheduler
    if stub_proposer:
        runner.proposer = RandomDrafts(rng)
    if stub_logits:  # the verifier is a stub that ignores logits: skip the 49152-wide lm_head
        monkeypatch.setattr(engine.model, "compute_logits", lambda hidden: hidden[:, :64].float())
    stats = {"checked_rows": 0, "mixed_prefill_batches": 0, "rejections": 0, "steps": 0}
    original_update = runner.update_requests

    def checked_update(sched):
        idx_mapping = original_update(sched)
        st = runner.states
        for i, s in enumerate(sched.scheduled):
            idx = idx_mapping[i]
            mirror = int(st.num_computed_tokens_np[idx])
            assert mirror == s.num_computed_tokens, (
                f"step {stats['steps']}: runner mirror {mirror} != scheduler {s.num_computed_tokens} for {s.request_id}"
            )
            if not use_async:  # sync: the scheduler's live count has not moved since it scheduled
                assert mirror == scheduler.requests[s.request_id].num_computed_tokens
            prefill_len = int(st.prefill_len_np[idx])
            assert st.num_computed_prefill_tokens_np[idx] == min(mirror, prefill_len)
            # The block table mirror (written incrementally: RequestStates.set_block_ids) is the scheduler's.
            num_blocks = int(st.num_blocks_np[idx])
            assert st.block_table_np[idx, :num_blocks].tolist() == list(s.block_ids), (
                f"step {stats['steps']}: runner block table != scheduler's for {s.request_id}")
            if not use_async:
                assert list(s.block_ids) == scheduler.requests[s.request_id].block_ids
        if len(idx_mapping):
            prefilling = st.is_prefilling(idx_mapping)
            expected = st.num_computed_tokens_np[idx_mapping] < st.prefill_len_np[idx_mapping]
            assert prefilling.shape == idx_mapping.shape and (prefilling == expected).all()
            stats["mixed_prefill_batches"] += bool(prefilling.any() and not prefilling.all())
        stats["checked_rows"] += len(idx_mapping)
        if on_check is not None:
            on_check(sched, idx_mapping)
        return idx_mapping

    runner.update_requests = checked_update
    next_id = 0
    for step in range(num_steps):
        stats["steps"] = step
        while len(scheduler.waiting) + len(scheduler.running) < 8:
            prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(1, 70))]
            params = SamplingParams(max_tokens=rng.randint(1, 60), temperature=0.0, ignore_eos=True, seed=0)
            engine.add_request(prompt, params, request_id=f"r{next_id}")
            next_id += 1
        if use_async:
            engine._stepper.step()
        else:
            sched = scheduler.schedule()
            runner.execute_model(sched)
            out, _ = runner.sample_tokens()
            scheduler.update_from_output(sched, out)
    for r in list(scheduler.requests.values()):
        stats["rejections"] += r.num_draft_tokens - r.num_accepted_tokens
    stats["requests"] = next_id
    stats["preemptions"] = scheduler.num_preemptions_total
    return stats


def test_S1_mirror_equals_scheduler_over_2000_steps_with_random_acceptance(monkeypatch):
    stats = _drive(monkeypatch, 2000, stub_logits=True)
    assert stats["checked_rows"] > 6000
    assert stats["requests"] > 100 and stats["preemptions"] > 0
    assert stats["mixed_prefill_batches"] > 50  # is_prefilling really differed within a batch


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_S1_mirror_equals_scheduler_with_mtp_head(monkeypatch, use_async):
    # Async: the scheduler's count is an upper bound (placeholders); the mirror still takes it as is,
    # and the runner derives the exact count from the previous step (checked in fill_placeholder_rows).
    stats = _drive(monkeypatch, 250, use_async=use_async, stub_proposer=False)
    assert stats["checked_rows"] > 600


def test_S1_detects_locally_incremented_mirror(monkeypatch):
    """Put source report 001's bug back: the runner keeps its own count and adds what it scheduled."""
    original_refresh = RequestStates.refresh_counts
    scheduled_last = {}

    def incrementing_refresh(self, idx_np, num_computed_tokens_np):
        for idx, num_computed in zip(idx_np.tolist(), num_computed_tokens_np.tolist()):
            req_id = self.index_to_req_id[idx]
            if req_id not in scheduled_last:  # first sight: taken from the scheduler
                original_refresh(self, np.array([idx]), np.array([num_computed]))
            else:
                self.num_computed_tokens_np[idx] += scheduled_last[req_id]  # the bug: += num_scheduled
                self.num_computed_prefill_tokens_np[idx] = min(self.num_computed_tokens_np[idx],
                                                               self.prefill_len_np[idx])

    def remember(sched, idx_mapping):
        for s in sched.scheduled:
            scheduled_last[s.request_id] = s.num_scheduled_tokens

    monkeypatch.setattr(RequestStates, "refresh_counts", incrementing_refresh)
    with pytest.raises(AssertionError, match="runner mirror"):
        _drive(monkeypatch, 2000, on_check=remember, stub_logits=True)


def test_block_table_mirror_detects_missed_growth(monkeypatch):
    """The runner writes only a table's new entries; a runner that missed a request's growth (here: one
    that writes a slot's table only when the slot is taken) is caught by the mirror check."""
    original = RequestStates.set_block_ids

    def write_once(self, idx, block_ids):
        if self.num_blocks_np[idx] == 0:
            original(self, idx, block_ids)

    monkeypatch.setattr(RequestStates, "set_block_ids", write_once)
    with pytest.raises(AssertionError, match="block table"):
        _drive(monkeypatch, 300, stub_logits=True)


def test_block_table_snapshot_is_shared_until_the_table_changes():
    """Request.block_table(): one tuple while the list neither grows nor is replaced (a decode step
    copies nothing), a new one after either; a replaced list of the same length is seen too."""
    from pdcluster.engine.request import Request

    r = Request("r", [1, 2, 3], SamplingParams(), block_ids=[7, 8])
    first = r.block_table()
    assert first == (7, 8) and r.block_table() is first
    r.block_ids.append(9)
    assert r.block_table() == (7, 8, 9)
    r.block_ids = [4, 5, 6]  # freed and allocated anew: same length, other ids
    assert r.block_table() == (4, 5, 6)
    r.block_ids = []
    assert r.block_table() == ()


def test_scheduled_inputs_are_the_window_of_prompt_output_and_drafts():
    """ScheduledRequest.of takes a step's input tokens as a window of prompt + output + drafts without
    building the whole list (Request.token_window): every window equals the slice of the concatenation."""
    import itertools

    from pdcluster.engine.request import Request
    from pdcluster.engine.sampling_params import SamplingParams

    for num_prompt, num_output, num_spec in itertools.product((0, 1, 5), (0, 1, 4), (0, 2)):
        if num_prompt == 0:
            continue
        r = Request("r", list(range(100, 100 + num_prompt)), SamplingParams(),
                    output_token_ids=list(range(200, 200 + num_output)), spec_token_ids=list(range(300, 300 + num_spec)))
        whole = r.prompt_token_ids + r.output_token_ids + r.spec_token_ids
        for start in range(len(whole) + 1):
            for num in range(len(whole) - start + 2):
                assert r.token_window(start, num) == whole[start : start + num], (num_prompt, num_output, num_spec,
                                                                                 start, num)
