"""Async scheduling's launch-ahead (engine/async_scheduler.py, AsyncStepper): without speculation the runner
launches step n+1 before it finishes step n, and step n+1's placeholder inputs are step n's sampled ids read
on the device. The tokens must be those of the synchronous engine, whatever happens between the two steps:
requests that stop at step n (their rows in n+1 computed and dropped), preemptions (a slot given to another
request before step n is finished), requests joining, a reordered batch, seeded sampling, logprobs, and
penalties (which fall back to finishing step n first).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_engine
from test_invariant_s4_async import PROMPTS as S4_PROMPTS, shuffle_every_schedule
from pdcluster.engine.sampling_params import SamplingParams

# The S4 tests' prompts (one chunked prefill among them) and two more.
PROMPTS = S4_PROMPTS + ["1, 2, 3, 4,", "Roses are red"]
# Small pool and chunks: requests are preempted and resumed while others decode.
CFG = dict(prefill_chunk_size=32, max_num_batched_tokens=80, num_kv_blocks=14, max_num_seqs=6)


def _params(stop_token: int | None) -> list[SamplingParams]:
    out = []
    for i in range(len(PROMPTS)):
        p = dict(max_tokens=14 + 3 * i, ignore_eos=True)
        if i % 3 == 1:  # seeded sampling: position-keyed draws, top-p syncs but stays exact
            p.update(temperature=0.8, top_p=0.9, seed=100 + i)
        if i == 2:
            p.update(logprobs=2, prompt_logprobs=1)
        if i == 0 and stop_token is not None:  # stops mid-stream: step n+1 already holds its row
            p.update(stop_token_ids=[stop_token])
        out.append(SamplingParams(**p))
    return out


def _run(engine, params, shuffle_seed=None, join_every=2):
    if shuffle_seed is not None:
        shuffle_every_schedule(engine, shuffle_seed)
    order, done, logprobs, step = [], {}, {}, 0
    while (len(order) < len(PROMPTS) or engine.has_unfinished()) and step < 2000:
        if len(order) < len(PROMPTS) and step % join_every == 0:
            i = len(order)
            order.append(engine.add_request(PROMPTS[i], params[i]))
        for out in engine.step():
            logprobs.setdefault(out.request_id, []).extend(
                (r.token_id, round(r.logprob, 4)) for r in out.new_logprobs)
            if out.finished:
                done[out.request_id] = out
        step += 1
    # num_computed_tokens too: a request that stops while its next step is launched reports the tokens whose KV
    # was written (its last token's never is), as the synchronous engine does, not the count run ahead.
    return [(done[r].token_ids, done[r].finish_reason, logprobs.get(r, []), done[r].num_computed_tokens)
            for r in order]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The synchronous engine's outputs, and a token request 0 emits mid-stream (its stop token)."""
    free = _run(make_engine("tiny-random", **CFG), _params(None))
    stop_token = free[0][0][5]
    return stop_token, _run(make_engine("tiny-random", **CFG), _params(stop_token))


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_launch_ahead_equals_sync(reference, shuffle_seed):
    stop_token, expected = reference
    assert expected[0][1] == "stop" and len(expected[0][0]) < 14  # request 0 really stops early
    engine = make_engine("tiny-random", async_scheduling=True, **CFG)
    got = _run(engine, _params(stop_token), shuffle_seed=shuffle_seed)
    assert got == expected
    stepper, scheduler = engine._stepper, engine.scheduler
    assert stepper.num_launched_ahead >= 20, stepper.num_launched_ahead
    assert scheduler.num_preemptions_total > 0  # slots were taken from requests between launch and finish
    stepper.drain()
    assert scheduler.block_manager.num_free_blocks == CFG["num_kv_blocks"]


def test_a_cpu_engine_schedules_synchronously_by_default(tiny_dir):
    engine = make_engine("tiny-random", **CFG)
    assert engine.config.async_scheduling is False and engine._stepper is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_launches_ahead_by_default_and_equals_sync(tiny_dir):
    """CUDA's default is async scheduling (EngineConfig.resolve_async_scheduling): the same tokens as the
    synchronous engine on the same GPU, with steps launched ahead."""
    stop_token = None
    expected = _run(make_engine("tiny-random", device="cuda", async_scheduling=False, **CFG), _params(stop_token))
    engine = make_engine("tiny-random", device="cuda", **CFG)
    assert engine.config.async_scheduling is True
    assert _run(engine, _params(stop_token)) == expected
    assert engine._stepper.num_launched_ahead >= 20, engine._stepper.num_launched_ahead
    engine._stepper.drain()
    assert engine.scheduler.block_manager.num_free_blocks == CFG["num_kv_blocks"]


@pytest.mark.parametrize("needs", ["penalty", "grammar"])
def test_penalties_fall_back_to_finishing_first(reference, tiny_dir, needs):
    """A batch with a penalty (or a grammar) needs step n's token on the host before step n+1 is launched: those
    steps are not launched ahead, and the tokens are the synchronous engine's."""
    host_tokens = (dict(repetition_penalty=1.3, ignore_eos=True) if needs == "penalty" else
                   dict(structured_output='{"type": "regex", "pattern": "[a-z]{5,11}"}'))  # ends at its EOS
    params = [SamplingParams(max_tokens=12, **host_tokens),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    prompts = PROMPTS[:2]
    expected = [o.token_ids for o in make_engine("tiny-random", **CFG).generate(prompts, params)]
    engine = make_engine("tiny-random", async_scheduling=True, **CFG)
    stepper, ahead_rows = engine._stepper, []
    launch = engine.runner.launch

    def watched(sched, ahead=False):
        if ahead:
            ahead_rows.extend(engine.scheduler.requests[s.request_id].sampling_params for s in sched.scheduled)
        return launch(sched, ahead=ahead)

    engine.runner.launch = watched
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    # Launched ahead only once the penalised (constrained) request had finished.
    assert stepper.num_launched_ahead > 0 and ahead_rows
    assert not any(p.has_penalties or p.structured_output is not None for p in ahead_rows)


def test_finished_step_appends_only_to_slots_still_held(tiny_dir):
    """A launched step finished after the next launch dropped one of its requests (preempted) and gave the
    slot to another (or to the same request, resumed from scratch): the late token must not land there."""
    engine = make_engine("tiny-random", num_kv_blocks=64)
    runner, scheduler, st = engine.runner, engine.scheduler, engine.runner.states
    a = engine.add_request("The capital of France is", SamplingParams(max_tokens=8, ignore_eos=True))
    sched = scheduler.schedule()
    runner.launch(sched)
    scheduler.update_from_output(sched, runner.finish()[0])
    sched_a = scheduler.schedule()  # a decode step of `a`, launched and left unfinished
    slot = st.req_id_to_index[a]
    runner.launch(sched_a)
    scheduler._preempt(scheduler.requests[a])
    scheduler.running.remove(scheduler.requests[a])
    engine.add_request("Roses are red", SamplingParams(max_tokens=4, ignore_eos=True))
    sched_b = scheduler.schedule()
    assert [(s.request_id, s.is_new) for s in sched_b.scheduled][0] == (a, True)  # resumed: rebuilt from scratch
    epoch = int(st.epoch_np[slot])
    runner.launch(sched_b, ahead=True)
    # The slot changed hands (here: back to `a` itself, rebuilt; only the epoch tells the two apart).
    assert st.epoch_np[slot] > epoch and st.index_to_req_id[slot] == a
    held = st.token_ids_np[slot, : st.num_tokens_np[slot]].copy()
    out, _ = runner.finish()  # step `a`: its token is reported, but not appended to the slot
    assert out.sampled_token_ids[0]
    assert np.array_equal(st.token_ids_np[slot, : st.num_tokens_np[slot]], held)
    runner.finish()


def test_idle_engine_keeps_nothing_in_flight(tiny_dir):
    """Once every request has finished, the async engine settles: no step stays in flight, has_work() is false
    (a worker loop idles instead of stepping empty batches), and the runner has dropped every request."""
    engine = make_engine("tiny-random", async_scheduling=True, num_kv_blocks=64)
    outs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    for _ in range(4):  # a bounded number of steps settles it
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and not engine._stepper.in_flight
    assert engine.runner.states.num_reqs == 0 and engine.runner.num_launched == 0
    # And it starts again from there.
    again = engine.generate(PROMPTS[3:4], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(again[0].token_ids) == 5


@pytest.mark.timeout(300)
def test_a_decode_worker_launches_ahead_and_equals_the_colocated_engine(tiny_dir):
    """A real prefill/decode pair over tcp on 127.0.0.1, both with async scheduling: the decode worker's
    consumer connector acts only between steps, so its engine launches ahead (prompts landing, requests
    joining and ending while a step is queued); the prefill worker's producer finishes each step first.
    Tokens equal the synchronous colocated engine's, every block comes back on both sides."""
    from test_kv_transfer_e2e import run_on_pair
    from conftest import engine_config
    from pdcluster.kv_transfer.config import TransferConfig

    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate([3, 16, 17, 45, 100, 7])]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5)
    num_blocks = 64
    colocated = make_engine("tiny-random", num_kv_blocks=num_blocks, max_model_len=512)
    expected = [o.token_ids for o in colocated.generate(prompts, params)]
    cfg = engine_config("tiny-random", num_kv_blocks=num_blocks, max_model_len=512, async_scheduling=True)
    run = run_on_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), prompts, params, num_blocks)
    assert run.tokens == expected
    assert run.decode_engine.num_steps_launched_ahead >= 10, run.decode_engine.num_steps_launched_ahead
    assert run.stats[1]["num_steps_launched_ahead"] == run.decode_engine.num_steps_launched_ahead
    assert run.prefill_engine.num_steps_launched_ahead == 0  # its connector sends from inside steps
    assert run.stats[0]["num_free_blocks"] == run.stats[1]["num_free_blocks"] == num_blocks


def test_the_flag_reaches_every_engine_config():
    """`--async-scheduling` / `--no-async-scheduling` for generate and serve (one set of engine flags; the
    Ray launcher rebuilds every worker's config from them); unset by default, which each engine resolves
    by its device: on for CUDA, off on a CPU."""
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.engine_args import engine_config_from_args

    for command in (["generate", "--prompt", "x"], ["serve"]):
        parse = lambda *a: engine_config_from_args(build_parser().parse_args([*command, *a]))  # noqa: E731
        assert parse("--async-scheduling").async_scheduling is True
        assert parse("--no-async-scheduling").async_scheduling is False
        assert parse().async_scheduling is None
        assert parse().resolve_async_scheduling("cpu") is False
        assert parse().resolve_async_scheduling("cuda:1") is True
        assert parse("--no-async-scheduling").resolve_async_scheduling("cuda") is False
        assert parse("--async-scheduling").resolve_async_scheduling("cpu") is True


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_a_hybrid_launches_ahead_and_equals_sync(graphs):
    """tiny-hybrid (Mamba2 + attention): the recurrent state advances in place step after step, so a
    step launched ahead must find the state its predecessor left (same device queue), and a slot a
    finished request leaves is reset only for its next owner, two steps later. Seeded sampling, chunked
    prompts, more requests than slots; with graphs, the Mamba updates replay over static slots."""
    prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(4 + 9 * i)] for i in range(7)]
    params = [SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, temperature=0.7, seed=i) for i in range(7)]
    cfg = dict(max_num_seqs=4, num_kv_blocks=64, max_model_len=512, prefill_chunk_size=16)
    expected = [o.token_ids for o in make_engine("tiny-hybrid", **cfg).generate(prompts, params)]
    engine = make_engine("tiny-hybrid", async_scheduling=True, **cfg)
    if graphs:
        engine.runner.use_decode_graphs(emulate=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.num_steps_launched_ahead >= 20
    assert not graphs or engine.runner.graphs.num_replays >= 20


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_a_resumed_request_keeps_its_seeded_draws_under_async_scheduling(tiny_dir, spec):
    """A request resumed elsewhere (its earlier outputs in its prompt, ``output_position_offset`` = how many: the
    router's recovery) draws by its original output positions, also in the steps scheduled behind an in-flight one
    (their placeholder rows): its tokens continue the uninterrupted request's exactly. Launched ahead without
    speculation; with n-gram drafts the placeholder rows are filled from the finished step."""
    cfg = dict(async_scheduling=True, **({"spec_method": spec, "num_spec_tokens": 3} if spec else {}))
    engine = make_engine("tiny-random", **cfg)
    prompt = [5 + j for j in range(12)]
    params = SamplingParams(max_tokens=14, temperature=1.0, seed=1234, ignore_eos=True)
    full = engine.generate([prompt], params)[0].token_ids
    k = 4
    resumed = SamplingParams(max_tokens=14 - k, temperature=1.0, seed=1234, ignore_eos=True, output_position_offset=k)
    launched_before = engine.num_steps_launched_ahead
    assert engine.generate([prompt + full[:k]], resumed)[0].token_ids == full[k:]
    if spec is None:
        assert engine.num_steps_launched_ahead - launched_before >= 5  # the placeholder rows were exercised
