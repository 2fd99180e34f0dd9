"""S4 (docs/invariants.md; source report 004): async speculative decoding.

With async scheduling the scheduler schedules step n+1 while step n runs: a decoding request's inputs
are placeholders and its CPU ``num_computed_tokens`` / ``seq_lens`` assume every in-flight draft is
accepted (an upper bound). The runner must

- read the backup (first input) token at ``num_tokens_no_spec - 1``, never at the inflated length,
  which lies past the committed tokens (-1 there);
- move per-request values of the previous step (rejected counts, drafts) to the new batch order through
  ``prev_positions``, new requests (``prev_idx < 0``) getting fresh values, never by row position;
- read a step's outputs only once that step is complete.

End to end: async + a batch reordered every step + requests joining mid-run gives exactly the sync
output. Unit tests pin the backup-token read and the prev_positions mapping; each fails when the code
is broken back to the seed's bug.
"""

import random
import threading
from collections import deque
import time

import numpy as np
import pytest

from conftest import OracleProposer, make_engine
from pdcluster.engine.async_scheduler import (
    PLACEHOLDER,
    PrevStepOutput,
    carry_over,
    fill_placeholder_rows,
    prev_positions,
)
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler_output import ScheduledRequest
from pdcluster.engine.request_slots import RequestStates

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- units ---------------------------------------------------------------------------------------------
def test_S4_prev_positions_follow_requests_not_rows():
    prev_ids = ["A", "B", "C"]
    num_rejected = np.array([1, 2, 0])
    drafts = np.array([[10, 11], [20, 21], [30, 31]])
    # B finished (condensed), the rest reordered, D joined.
    now = ["C", "D", "A"]
    pos = prev_positions(now, prev_ids)
    assert pos.tolist() == [2, -1, 0]
    assert carry_over(num_rejected, pos, 0).tolist() == [0, 0, 1]
    assert carry_over(drafts, pos, PLACEHOLDER).tolist() == [[30, 31], [PLACEHOLDER, PLACEHOLDER], [10, 11]]


def _states_with(requests: dict[str, list[int]]) -> RequestStates:
    st = RequestStates(max_num_reqs=8, max_model_len=64, max_blocks_per_req=8)
    params = SamplingParams(max_tokens=32)
    for rid, tokens in requests.items():
        st.add_request(rid, tokens, params, 0)
    return st


def _placeholder_row(rid: str, upper_bound: int, num_tokens_sched: int, k: int) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid, is_new=False, num_computed_tokens=upper_bound, num_scheduled_tokens=1 + k,
        input_token_ids=[PLACEHOLDER] * (1 + k), block_ids=[0, 1, 2], num_prompt_tokens=4,
        num_tokens=num_tokens_sched, spec_token_ids=[PLACEHOLDER] * k, num_output_tokens=num_tokens_sched - 4,
        placeholder_inputs=True,
    )


def test_S4_backup_token_and_mapping_in_placeholder_rows():
    """Previous step [A, B] with k=3 drafts each: A accepted 1 (2 rejected), B accepted 3. Both were
    scheduled again before that was known: upper bound = committed-before + 1 + 3. This step's batch is
    [B, A] (reordered). The runner must take A's and B's own values, and the last committed token."""
    k = 3
    # committed before the previous step: 6 tokens each, positions 0..5; computed 5.
    a = [1, 2, 3, 4, 50, 51]
    b = [5, 6, 7, 8, 60, 61]
    st = _states_with({"A": a, "B": b})
    idx_a, idx_b = st.req_id_to_index["A"], st.req_id_to_index["B"]
    # What the previous step committed (the runner appended it): A 1 draft + 1 token, B 3 drafts + bonus.
    st.append_tokens(idx_a, [52, 53])
    st.append_tokens(idx_b, [62, 63, 64, 65])
    prev = PrevStepOutput(["A", "B"], np.array([2, 0]), np.array([[70, 71, 72], [80, 81, 82]]))
    upper = 5 + 1 + k  # the scheduler's count: previous start 5, 1 + k scheduled, all assumed accepted
    scheduled = [_placeholder_row("B", upper, 6, k), _placeholder_row("A", upper, 6, k)]
    idx_mapping = np.array([idx_b, idx_a])
    starts = np.array([upper, upper])
    num_tokens = np.array([6, 6])
    num_output = np.array([2, 2])
    inputs = [s.input_token_ids for s in scheduled]
    drafts = [s.spec_token_ids for s in scheduled]

    fill_placeholder_rows(["B", "A"], scheduled, idx_mapping, prev, st, starts, num_tokens, num_output, inputs, drafts)

    # B: nothing rejected; exact start = its last committed token's position.
    assert starts.tolist() == [upper - 0, upper - 2]
    assert starts.tolist() == [len(b) + 4 - 1, len(a) + 2 - 1]
    assert inputs[0] == [65, 80, 81, 82] and drafts[0] == [80, 81, 82]
    assert inputs[1] == [53, 70, 71, 72] and drafts[1] == [70, 71, 72]
    assert num_tokens.tolist() == [10, 8] and num_output.tolist() == [6, 4]
    # The inflated length reads past the committed tokens: that is what must never be used.
    assert st.token_ids_np[idx_a, upper] == PLACEHOLDER


def test_S4_new_request_gets_fresh_values():
    st = _states_with({"A": [1, 2, 3, 4, 5], "N": [9, 9, 9]})
    prev = PrevStepOutput(["A"], np.array([3]), np.array([[7, 7, 7]]))
    new = ScheduledRequest(request_id="N", is_new=True, num_computed_tokens=0, num_scheduled_tokens=3,
                           input_token_ids=[9, 9, 9], block_ids=[3], num_prompt_tokens=3, num_tokens=3,
                           spec_token_ids=[], all_token_ids=[9, 9, 9], sampling_params=SamplingParams())
    idx_mapping = np.array([st.req_id_to_index["N"]])
    starts, num_tokens, num_output = np.array([0]), np.array([3]), np.array([0])
    inputs, drafts = [[9, 9, 9]], [[]]
    fill_placeholder_rows(["N"], [new], idx_mapping, prev, st, starts, num_tokens, num_output, inputs, drafts)
    assert starts.tolist() == [0] and inputs == [[9, 9, 9]]  # untouched: nothing carried from "A"


@pytest.mark.parametrize("spec", ["mtp", "none"])
def test_S4_outputs_read_only_after_the_step_completed(tiny_dir, spec):
    """schedule(n+1) overlaps step n; update_from_output(n) runs only once step n is finished, also
    when step n+1 is launched before step n is finished (launch-ahead: no speculation)."""
    kwargs = dict(spec_method="mtp", num_spec_tokens=2, mtp_checkpoint="random") if spec == "mtp" else {}
    engine = make_engine("tiny-random", async_scheduling=True, num_kv_blocks=64, **kwargs)
    runner, scheduler, stepper = engine.runner, engine.scheduler, engine._stepper
    state = {"overlapped": 0, "updates": 0}
    in_flight: deque = deque()  # launched steps, oldest first: from submission until finish() returns
    execute, finish = runner.execute_model, runner.finish
    submit, launch_here = stepper._submit_launch, stepper._launch_ahead_here
    schedule = scheduler.schedule
    update = scheduler.update_from_output

    def flagged_submit(sched, *args, **kwargs):
        in_flight.append(id(sched))
        return submit(sched, *args, **kwargs)

    def flagged_launch_here(sched, *args, **kwargs):  # launch-ahead runs on the caller's thread
        in_flight.append(id(sched))
        return launch_here(sched, *args, **kwargs)

    def slow_execute(sched, *args):
        time.sleep(0.02)
        return execute(sched, *args)

    def watched_finish():
        try:
            return finish()
        finally:
            in_flight.popleft()

    def watched_schedule():
        state["overlapped"] += bool(in_flight)
        return schedule()

    def watched_update(sched, out):
        assert id(sched) not in in_flight, "update_from_output read a step still in flight"
        state["updates"] += 1
        return update(sched, out)

    stepper._submit_launch = flagged_submit
    stepper._launch_ahead_here = flagged_launch_here
    runner.execute_model = slow_execute
    runner.finish = watched_finish
    scheduler.schedule = watched_schedule
    scheduler.update_from_output = watched_update
    engine.generate(["Hello there", "one two three"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert state["updates"] >= 8 and state["overlapped"] >= 3
    # Without speculation the runner launched steps ahead of finishing the previous one.
    assert (stepper.num_launched_ahead >= 5) == (spec == "none")
    assert threading.current_thread() is threading.main_thread()


# ---- end to end -----------------------------------------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    " ".join(f"item{i}" for i in range(40)),  # chunked prefill
    "a b c a b c a b",
    "Hi",
    "def f(x):\n    return x * 2\n\ndef g(",
    "Once upon a time, there",
]
MAX_TOKENS = [18, 12, 25, 9, 20, 15]
CFG = dict(prefill_chunk_size=32, max_num_batched_tokens=80, num_kv_blocks=128)


def shuffle_every_schedule(engine, seed: int) -> None:
    """From now on every schedule's batch order, and the scheduler's running list, is shuffled."""
    rng = random.Random(seed)
    schedule = engine.scheduler.schedule

    def shuffled():
        out = schedule()
        rng.shuffle(out.scheduled)
        rng.shuffle(engine.scheduler.running)
        return out

    engine.scheduler.schedule = shuffled


def _run(engine, shuffle_seed=None, join_every=2):
    """Requests join two steps apart (while others decode); the batch order is shuffled every step."""
    if shuffle_seed is not None:
        shuffle_every_schedule(engine, shuffle_seed)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    order, done, step = [], {}, 0
    while len(order) < len(PROMPTS) or engine.has_unfinished():
        if len(order) < len(PROMPTS) and step % join_every == 0:
            i = len(order)
            order.append(engine.add_request(PROMPTS[i], params[i]))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return [done[r] for r in order]


@pytest.fixture(scope="module")
def sync_reference(tiny_dir):
    outs = _run(make_engine("tiny-random", **CFG))
    return [o.token_ids for o in outs], [o.prompt_token_ids + o.token_ids for o in outs]


@pytest.mark.parametrize("spec, k", [("mtp", 3), ("ngram", 2), ("none", 0)])
def test_S4_async_reordered_joining_equals_sync(sync_reference, spec, k):
    expected, refs = sync_reference
    extra = dict(mtp_checkpoint="random") if spec == "mtp" else {}
    sync = make_engine("tiny-random", spec_method=spec, num_spec_tokens=k, **extra, **CFG)
    asyn = make_engine("tiny-random", spec_method=spec, num_spec_tokens=k, async_scheduling=True, **extra, **CFG)
    if spec != "none":  # varied acceptance per step: the rejected counts the mapping must carry differ
        sync.runner.proposer = OracleProposer(sync.runner.proposer, refs, corrupt=0.3, seed=1)
        asyn.runner.proposer = OracleProposer(asyn.runner.proposer, refs, corrupt=0.3, seed=1)
    sync_out = _run(sync)
    async_out = _run(asyn, shuffle_seed=5)
    assert [o.token_ids for o in sync_out] == expected
    assert [o.token_ids for o in async_out] == expected
    if spec != "none":
        assert sum(o.num_accepted_tokens for o in async_out) > 0
        assert any(o.num_draft_tokens > o.num_accepted_tokens for o in async_out)
    assert asyn.scheduler.num_free_blocks == asyn.kv_spec.num_blocks


@pytest.mark.parametrize("spec, k", [("none", 0), ("ngram", 2)])
def test_S4_async_prefix_cache_never_shares_uncomputed_kv(tiny_dir, spec, k):
    """A request that stops on a stop token may end with a full block whose newest position's KV the
    next step would have written, and never will. With async scheduling that next step is already
    scheduled (its count optimistic): the block must not enter the prefix cache, or a later request
    continuing that exact text reads a position nobody computed."""
    probe = make_engine("tiny-random", num_kv_blocks=64)
    prompt = probe.tokenize("The quick brown fox jumps over the lazy dog")
    ref = probe.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    stop_at = 32 - len(prompt) - 1  # the stop token lands at position 31: two full blocks of 16
    assert ref[stop_at] not in ref[:stop_at]
    outs = {}
    for use_async in (False, True):
        engine = make_engine("tiny-random", spec_method=spec, num_spec_tokens=k, async_scheduling=use_async,
                             num_kv_blocks=64)
        stop = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[ref[stop_at]])
        first = engine.generate([prompt], stop)[0]
        assert len(first.prompt_token_ids) + len(first.token_ids) == 32
        follow = first.prompt_token_ids + first.token_ids + [1000, 1001, 1002]
        second = engine.generate([follow], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        outs[use_async] = (first.token_ids, second.token_ids, second.num_cached_tokens)
    assert outs[True][:2] == outs[False][:2]
    assert outs[True][2] == outs[False][2] == 16  # the block holding the unwritten position is recomputed


# ---- a NemotronH's own MTP layers (engine/models/nemotron_mtp.py), random acceptance ---------------------
class PositionalOracle:
    """Drafts the reference continuation, each draft replaced by a wrong token with probability ``corrupt`` drawn
    from its request and absolute position alone (not from the call order), so a batch shuffled every step sees
    the same draft at the same position. The model's own MTP proposer runs first (it writes its draft layer's KV),
    its drafts discarded."""

    def __init__(self, inner, references: list[list[int]], corrupt: float = 0.3):
        self.inner, self.references, self.corrupt = inner, references, corrupt
        self.num_draft_layers = inner.num_draft_layers

    def propose(self, batch):
        self.inner.propose(batch)
        st, drafts = batch.states, []
        for idx, k in zip(batch.idx_mapping_np, batch.num_drafts_np):
            n = int(st.num_tokens_np[idx])
            ref = next(r for r in self.references if r[:n] == st.token_ids_np[idx, :n].tolist())
            wrong = [random.Random(f"{len(ref)}:{ref[:6]}:{pos}").random() < self.corrupt for pos in range(n, n + k)]
            drafts.append([(t + 1) % 49152 if w else t for t, w in zip(ref[n : n + k], wrong)])
        return drafts


class CountingRecorder:
    """Around the runner's speculative second half (``_sample_and_propose``, what sample_tokens and the async
    stepper's launch both run for a speculative step): per request, the drafts each step verified and how many of them the
    step kept, checked against the reference (S3: the accepted count is the run of leading drafts that equal
    the target's tokens, every kept token is the reference's). The engine's counters must add up to these."""

    def __init__(self, runner, references: list[list[int]]):
        self.runner, self.references = runner, references
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.steps = {"none": 0, "partial": 0, "all": 0}  # verification steps by how many drafts they kept
        self.sample, runner._sample_and_propose = runner._sample_and_propose, self.sample_and_propose

    def sample_and_propose(self, state):
        out, kv = self.sample(state)
        for i, rid in enumerate(out.req_ids):
            drafts, kept = state.rows.draft_token_ids[i], out.sampled_token_ids[i]
            if not kept:
                continue
            n = int(state.rows.num_tokens_np[i])
            committed = self.runner.states.token_ids_np[state.idx_mapping_np[i], :n].tolist()
            ref = next(r for r in self.references if r[:n] == committed)
            assert kept == ref[n : n + len(kept)], f"{rid}: kept tokens are not the target's"
            leading = next((j for j, d in enumerate(drafts) if d != ref[n + j]), len(drafts))
            assert len(kept) - 1 == leading, f"{rid}: {len(kept) - 1} accepted of drafts {drafts}, {leading} right"
            if drafts:
                self.steps["none" if leading == 0 else "all" if leading == len(drafts) else "partial"] += 1
            self.drafted[rid] = self.drafted.get(rid, 0) + len(drafts)
            self.accepted[rid] = self.accepted.get(rid, 0) + len(kept) - 1
        return out, kv


@pytest.fixture(scope="module")
def hybrid_reference():
    outs = _run(make_engine("tiny-hybrid-moe", **CFG))
    return [o.token_ids for o in outs], [o.prompt_token_ids + o.token_ids for o in outs]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_S3_S4_own_mtp_layers_counts_exact_under_random_acceptance(hybrid_reference, use_async):
    """tiny-hybrid-moe drafting with its own MTP layers (attention + latent MoE, their KV in the paged cache), the
    drafts corrupted at random positions; async: the batch shuffled every step and requests joining. The tokens
    are the plain greedy ones, every step keeps exactly its leading right drafts (S3), and each request's
    num_draft_tokens / num_accepted_tokens are exactly the sums of what its steps verified and kept (S4: the
    optimistic async counts are taken back)."""
    expected, refs = hybrid_reference
    engine = make_engine("tiny-hybrid-moe", spec_method="mtp", num_spec_tokens=3, mtp_checkpoint="",
                         async_scheduling=use_async, **CFG)
    assert "its own MTP layers" in engine.mtp_source
    engine.runner.proposer = PositionalOracle(engine.runner.proposer, refs)
    recorder = CountingRecorder(engine.runner, refs)
    outs = _run(engine, shuffle_seed=5 if use_async else None)
    assert [o.token_ids for o in outs] == expected
    for o in outs:
        assert (o.num_draft_tokens, o.num_accepted_tokens) == (recorder.drafted[o.request_id],
                                                                recorder.accepted[o.request_id]), o.request_id
    assert min(recorder.steps.values()) > 0, recorder.steps  # random acceptance: none, partial and all happen
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks
