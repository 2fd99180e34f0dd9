"""Speculative decoding is lossless: with greedy sampling, output with --spec ngram, --spec mtp
(random head, and the trained one when its checkpoint exists) and --spec draft_model (the model's first layers as
the draft: tests/conftest.py layer_skip_draft_dir), k in {1, 3, 5}, async scheduling on and
off, equals output without speculation, token for token, for batches of mixed prompts (chunked
prefill, prefix-cache hits, preemption). Proposers are exercised as they are (mostly rejected drafts on
tiny-random) and wrapped in an oracle that drafts the true continuation with random corruption (long
accepted runs, bonus tokens, stops inside an accepted run). Sampling: the rejection sampler preserves
the target distribution (TV distance on a tiny vocabulary). Plus unit tests of the n-gram lookup, the MTP
module (training form == paged inference form), checkpoints and the draft counters.
"""

import numpy as np
import pytest
import torch

from conftest import OracleProposer, make_engine
from pdcluster.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = " ".join(f"step {i}: mix {'flour' if i % 2 else 'water'} and stir;" for i in range(24))
TINY_PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "one two three one two three one two",
    LONG,  # ~190 tokens: several prefill chunks
    "Hi",
    LONG[:200],  # shares a prefix with LONG: prefix-cache hit once LONG's blocks are cached
]
MAX_TOKENS = [20, 24, 33, 16, 7, 20]  # mixed lengths: the draft caps near max_tokens are exercised
# Chunked prefill and mixed prefill/decode batches.
TINY_CFG = dict(prefill_chunk_size=32, max_num_batched_tokens=96, num_kv_blocks=256)


def _params(max_tokens=MAX_TOKENS, **kw):
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw) for n in max_tokens]


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    engine = make_engine("tiny-random", **TINY_CFG)
    outs = engine.generate(TINY_PROMPTS, _params())
    return [o.token_ids for o in outs], [o.prompt_token_ids + o.token_ids for o in outs]


def _spec_engine(model, spec, k, use_async, oracle_refs=None, corrupt=0.25, **cfg):
    if spec == "mtp":
        cfg.setdefault("mtp_checkpoint", "random")
    engine = make_engine(model, spec_method=spec, num_spec_tokens=k, async_scheduling=use_async, **cfg)
    if oracle_refs is not None:
        engine.runner.proposer = OracleProposer(engine.runner.proposer, oracle_refs, corrupt=corrupt, seed=k)
    return engine


def _check_counters(outs, drafts_expected=True):
    for o in outs:
        assert 0 <= o.num_accepted_tokens <= o.num_draft_tokens
    if drafts_expected:
        assert sum(o.num_draft_tokens for o in outs) > 0


def _assert_same(outs, expected, label):
    for i, (o, ref) in enumerate(zip(outs, expected)):
        assert o.token_ids == ref, f"{label}: prompt {i} diverged\n spec {o.token_ids}\n ref  {ref}"


# ---- lossless on tiny-random -------------------------------------------------------------------------
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("spec", ["ngram", "mtp", "draft_model"])
def test_spec_lossless_tiny(tiny_reference, spec, k, use_async):
    expected, _ = tiny_reference
    engine = _spec_engine("tiny-random", spec, k, use_async, **TINY_CFG)
    outs = engine.generate(TINY_PROMPTS, _params())
    _assert_same(outs, expected, f"{spec} k={k} async={use_async}")
    _check_counters(outs, drafts_expected=spec != "ngram" or use_async)
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("spec", ["ngram", "mtp", "draft_model"])
def test_spec_lossless_tiny_high_acceptance(tiny_reference, spec, k, use_async):
    expected, refs = tiny_reference
    engine = _spec_engine("tiny-random", spec, k, use_async, oracle_refs=refs, **TINY_CFG)
    outs = engine.generate(TINY_PROMPTS, _params())
    _assert_same(outs, expected, f"oracle {spec} k={k} async={use_async}")
    _check_counters(outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    drafted = sum(o.num_draft_tokens for o in outs)
    assert accepted > 0.4 * drafted, (accepted, drafted)  # long accepted runs really happened


def test_spec_counters_add_up(tiny_reference):
    """Every sampling step emits 1 + (accepted drafts kept), so len(output) == steps + accepted."""
    expected, refs = tiny_reference
    engine = _spec_engine("tiny-random", "mtp", 3, False, oracle_refs=refs, **TINY_CFG)
    ids = [engine.add_request(p, sp) for p, sp in zip(TINY_PROMPTS, _params())]
    steps = {i: 0 for i in ids}
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            steps[out.request_id] += bool(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out
    for i, ref in zip(ids, expected):
        o = done[i]
        assert o.token_ids == ref
        assert len(o.token_ids) == steps[i] + o.num_accepted_tokens
        assert o.num_accepted_tokens <= o.num_draft_tokens


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_spec_stop_token_inside_accepted_run(tiny_reference, use_async):
    expected, refs = tiny_reference
    stop = expected[2][9]  # a token the third prompt emits mid-way: drafts past it are accepted, then cut
    params = _params(stop_token_ids=[stop])
    base = make_engine("tiny-random", **TINY_CFG).generate(TINY_PROMPTS, params)
    engine = _spec_engine("tiny-random", "mtp", 5, use_async, oracle_refs=refs, corrupt=0.0, **TINY_CFG)
    outs = engine.generate(TINY_PROMPTS, params)
    _assert_same(outs, [o.token_ids for o in base], "stop token")
    assert outs[2].token_ids[-1] == stop and outs[2].finish_reason == "stop"
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_spec_lossless_under_preemption(tiny_reference, use_async):
    expected, refs = tiny_reference
    cfg = dict(TINY_CFG, num_kv_blocks=24)  # too small for all six at once: preemption by recompute
    engine = _spec_engine("tiny-random", "mtp", 3, use_async, oracle_refs=refs, **cfg)
    outs = engine.generate(TINY_PROMPTS, _params())
    assert engine.scheduler.num_preemptions_total > 0
    _assert_same(outs, expected, f"preemption async={use_async}")
    assert engine.scheduler.num_free_blocks == 24


def test_spec_requests_joining_mid_run(tiny_reference):
    """New requests arrive while others are decoding speculatively (async: while a step is in flight)."""
    expected, refs = tiny_reference
    for use_async in (False, True):
        engine = _spec_engine("tiny-random", "mtp", 3, use_async, oracle_refs=refs, **TINY_CFG)
        params = _params()
        ids, done, pending = [], {}, list(range(len(TINY_PROMPTS)))
        step = 0
        while pending or engine.has_unfinished():
            if pending and step % 3 == 0:
                i = pending.pop(0)
                ids.append((i, engine.add_request(TINY_PROMPTS[i], params[i])))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            step += 1
        for i, rid in ids:
            assert done[rid] == expected[i], f"async={use_async} prompt {i}"


# ---- lossless on SmolLM2 -------------------------------------------------------------------------------
SMOL_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n",
    "The capital of France is",
    "List the days of the week: Monday, Tuesday,",
]


@pytest.fixture(scope="module")
def smol_engine(smollm2_dir):
    return make_engine("smollm2", num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def smol_reference(smol_engine):
    return [o.token_ids for o in smol_engine.generate(SMOL_PROMPTS, _params([24, 16, 24]))]


def _trained_checkpoint():
    from pdcluster.engine.models.registry import default_cache_dir
    from pdcluster.engine.models.mtp import default_mtp_checkpoint

    from pathlib import Path

    for cache in (default_cache_dir(), Path.home() / ".cache" / "pdcluster"):
        path = default_mtp_checkpoint(cache, "smollm2")
        if path.is_file():
            return str(path)
    return None


def _smol_case(smol_reference, spec, k, use_async, head="random"):
    cfg = dict(num_kv_blocks=256, max_model_len=512)
    if spec == "mtp":
        if head == "trained":
            path = _trained_checkpoint()
            if path is None:
                pytest.skip("no trained MTP checkpoint (run bench/train_mtp.py)")
            cfg["mtp_checkpoint"] = path
        else:
            cfg["mtp_checkpoint"] = "random"
    engine = _spec_engine("smollm2", spec, k, use_async, **cfg)
    outs = engine.generate(SMOL_PROMPTS, _params([24, 16, 24]))
    _assert_same(outs, smol_reference, f"smollm2 {spec}/{head} k={k} async={use_async}")
    _check_counters(outs)
    return outs


@pytest.mark.parametrize(
    "spec, k, use_async, head",
    [("ngram", 3, False, None), ("mtp", 3, True, "random"), ("mtp", 3, False, "trained"),
     ("draft_model", 3, False, None)],
)
def test_spec_lossless_smollm2(smol_reference, spec, k, use_async, head):
    outs = _smol_case(smol_reference, spec, k, use_async, head)
    if spec == "ngram":  # the code prompt repeats itself: n-gram drafts do get accepted
        assert outs[0].num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("spec, head", [("ngram", None), ("mtp", "random"), ("mtp", "trained"), ("draft_model", None)])
def test_spec_lossless_smollm2_matrix(smol_reference, spec, head, k, use_async):
    _smol_case(smol_reference, spec, k, use_async, head)


# ---- sampling: distribution preserved --------------------------------------------------------------
def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


@pytest.mark.parametrize("draft_kind", ["sampled_from_q", "deterministic"])
def test_spec_sampling_preserves_distribution(draft_kind):
    """Speculative sampling's first token and (after an accepted draft) its second token follow the
    target distribution p, like plain sampling does. Tolerance: TV distance < 0.03 with N = 6000
    trials on a 5-token vocabulary (expected TV from sampling noise alone is ~0.01; accepting every
    draft instead, the broken control below, gives TV ~0.3)."""
    from pdcluster.engine.rejection_sampler import rejection_sample
    from pdcluster.engine.sampler import sample

    torch.manual_seed(0)
    vocab, n_trials = 5, 6000
    target = torch.randn(3, vocab) * 1.5  # positions 0, 1 and the bonus position
    q = torch.softmax(torch.randn(2, vocab), -1)
    q_np = q.numpy().astype(np.float64)
    q_np /= q_np.sum(1, keepdims=True)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    p = torch.softmax(target, -1).numpy()
    rng = np.random.default_rng(1)
    first, second, plain = np.zeros(vocab), np.zeros(vocab), np.zeros(vocab)
    for seed in range(n_trials):
        if draft_kind == "sampled_from_q":
            drafts = [int(rng.choice(vocab, p=q_np[0])), int(rng.choice(vocab, p=q_np[1]))]
            out = rejection_sample([target], [drafts], [params], [seed], [0], draft_probs=[q])
        else:  # a greedy drafter's guess (n-gram, MTP argmax): q is a point mass
            drafts = [int(p[0].argmax()), int(p[1].argmax())]
            out = rejection_sample([target], [drafts], [params], [seed], [0])
        row = out[0].tolist()
        first[row[0]] += 1
        if row[0] == drafts[0]:  # accepted: the next position is sampled against the same p_1
            second[row[1]] += 1
        plain[sample(target[:1], [params], [seed], [0])[0]] += 1
    assert _tv(plain, p[0]) < 0.03
    assert _tv(first, p[0]) < 0.03, (first / first.sum(), p[0])
    assert second.sum() > 500 and _tv(second, p[1]) < 0.04, (second / second.sum(), p[1])
    # Control: the test has the power to see a biased verifier (always accepting the draft).
    if draft_kind == "sampled_from_q":
        biased = np.bincount(
            [int(rng.choice(vocab, p=q_np[0])) for _ in range(n_trials)], minlength=vocab
        ).astype(float)
        assert _tv(biased, p[0]) > 0.1


def test_spec_sampling_reproducible_with_seed(tiny_dir):
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=7 + i, ignore_eos=True) for i in range(3)]
    runs = []
    for _ in range(2):
        engine = _spec_engine("tiny-random", "mtp", 3, False)
        runs.append([o.token_ids for o in engine.generate(TINY_PROMPTS[:3], params)])
    assert runs[0] == runs[1]


# ---- units -------------------------------------------------------------------------------------------
def test_ngram_lookup():
    from pdcluster.engine.proposers.ngram import ngram_lookup

    t = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2])
    # longest suffix with an earlier match: [1, 2] (n=2) -> latest earlier match at 6 -> followed by 3, 7
    assert ngram_lookup(t, 1, 4, 2) == [3, 7]
    assert ngram_lookup(t, 1, 4, 5) == [3, 7, 1, 2]  # runs to the end of the tokens
    assert ngram_lookup(np.array([1, 2, 3, 4]), 1, 3, 3) == []  # no earlier match
    assert ngram_lookup(np.array([4, 4, 4]), 2, 2, 3) == [4]  # overlapping match, suffix itself excluded
    assert ngram_lookup(np.array([8, 3, 8]), 2, 4, 3) == []  # below ngram_min
    assert ngram_lookup(t, 1, 4, 0) == []


def test_mtp_training_form_matches_paged_inference(tiny_dir):
    """MTPTrainModule (dense, for training) and MTPHead on the paged cache compute the same g."""
    from pdcluster.engine.attention import AttentionMetadata
    from pdcluster.engine.models.mtp import MTPHead, MTPTrainModule, random_mtp_weights

    engine = make_engine("tiny-random", num_kv_blocks=64)
    model = engine.model
    weights = random_mtp_weights(model.arch, seed=3)
    length, bs = 37, engine.config.block_size
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, length, model.arch.hidden_size, generator=gen)
    next_ids = torch.randint(0, model.arch.vocab_size, (1, length), generator=gen)
    dense = MTPTrainModule(model, weights)(hidden, next_ids)[0]

    head = MTPHead(model, weights)
    cache = torch.zeros((1, 2, 8, bs, model.arch.num_kv_heads, model.arch.head_dim))
    table = torch.tensor([[3, 1, 5, 0, 2, 4, 6, 7]], dtype=torch.int32)
    pos = torch.arange(length)
    split = 20  # two chunks, like a chunked prefill
    outs = []
    for lo, hi in ((0, split), (split, length)):
        p = pos[lo:hi]
        slots = table[0, p // bs].long() * bs + p % bs
        meta = AttentionMetadata(slots, table, torch.tensor([hi], dtype=torch.int32),
                                 torch.tensor([0, hi - lo], dtype=torch.int32), None, model.scale)
        outs.append(head.forward(hidden[0, lo:hi], next_ids[0, lo:hi], p, cache[0], meta))
    torch.testing.assert_close(torch.cat(outs), dense, atol=2e-4, rtol=1e-4)
    k_ref, v_ref = head.reference_kv(hidden[0], next_ids[0], pos)
    slots = table[0, pos // bs].long() * bs + pos % bs
    flat = cache[0].view(2, -1, model.arch.num_kv_heads, model.arch.head_dim)
    torch.testing.assert_close(flat[0, slots], k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat[1, slots], v_ref, atol=1e-5, rtol=1e-5)


def test_mtp_checkpoint_roundtrip_and_mismatch(tmp_path, tiny_dir, smollm2_dir):
    from pdcluster.engine.models.llama import ModelArch
    from pdcluster.engine.models.mtp import (
        MTPCheckpointError,
        MTPHeadMissing,
        load_mtp_weights,
        random_mtp_weights,
        resolve_mtp_weights,
        save_mtp_weights,
    )

    tiny, smol = ModelArch.from_dir(tiny_dir), ModelArch.from_dir(smollm2_dir)
    w = random_mtp_weights(tiny, seed=5)
    path = tmp_path / "mtp" / "tiny-random-mtp.safetensors"
    save_mtp_weights(path, w, {"base_model": "tiny-random"})
    back = load_mtp_weights(path, tiny)
    assert all(torch.equal(back[n], w[n]) for n in w)
    # "" finds the cache's checkpoint by model name; "random" ignores it; a wrong model is a clear error.
    assert resolve_mtp_weights("", tmp_path, "tiny-random", tiny, 0)[1] == str(path)
    assert resolve_mtp_weights("random", tmp_path, "tiny-random", tiny, 0)[1] == "random(seed=0)"
    with pytest.raises(MTPHeadMissing, match="no trained MTP head for 'tiny-random'.*bench/train_mtp.py"):
        resolve_mtp_weights("", tmp_path / "none", "tiny-random", tiny, 4)  # never a silent random head
    with pytest.raises(MTPCheckpointError, match="trained for another model"):
        load_mtp_weights(path, smol)
    with pytest.raises(MTPHeadMissing, match="mtp_checkpoint"):
        resolve_mtp_weights(str(tmp_path / "missing.safetensors"), tmp_path, "tiny-random", tiny, 0)


def test_mtp_kv_layer_is_allocated(tiny_dir):
    engine = _spec_engine("tiny-random", "mtp", 2, False, num_kv_blocks=32)
    assert engine.kv_spec.num_draft_layers == 1
    assert engine.kv_spec.num_layers == engine.arch.num_layers + 1
    assert engine.kv_cache.shape[0] == engine.arch.num_layers + 1
    assert engine.scheduler.num_lookahead_tokens == 1
    plain = make_engine("tiny-random", num_kv_blocks=32)
    assert plain.kv_spec.num_draft_layers == 0 and plain.kv_cache.shape[0] == plain.arch.num_layers


def test_spec_cli_json_counters(tiny_dir):
    import contextlib
    import io
    import json

    from pdcluster.cli.main import main

    def run(*extra):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["generate", "--model", "tiny-random", "--num-kv-blocks", "64", "--max-tokens", "12",
                       "--ignore-eos", "--json", "--prompt", "a b c a b c a b", "--prompt", "Hello", *extra])
        assert rc == 0
        return [json.loads(line) for line in buf.getvalue().splitlines()]

    plain = run()
    spec = run("--spec", "mtp", "--num-spec-tokens", "3", "--mtp-checkpoint", "random")
    for a, b in zip(plain, spec):
        assert a["token_ids"] == b["token_ids"]
        assert a["num_draft_tokens"] == 0 and a["num_accepted_tokens"] == 0
        # random head on tiny-random: 3 drafts per decode step, 11 decode steps unless some are accepted
        assert 0 <= b["num_accepted_tokens"] <= b["num_draft_tokens"] <= 3 * 11
        assert b["num_draft_tokens"] > 0


@pytest.mark.parametrize("model", ["tiny-random", "tiny-hybrid"])
def test_sampled_speculation_gives_the_tokens_of_no_speculation_seed_for_seed(model):
    """Single-token drafts are verified by drawing the target's token with the uniform the request uses
    without speculation and accepting on equality: lossless, and the same seeded tokens. (Accepting with
    probability p(draft) from another stream and resampling the residual changed them: on these
    repetitive prompts, with padded async drafts, a draft equal to the token the plain run drew was
    rejected and the residual, without it, drew another.)"""
    gen = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(3, 500, (6,), generator=gen).tolist() * 6)[:30] for _ in range(8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11)
    plain = make_engine(model, num_kv_blocks=512).generate(prompts, params)
    spec = make_engine(model, num_kv_blocks=512, spec_method="ngram", num_spec_tokens=3,
                       async_scheduling=True).generate(prompts, params)
    assert sum(o.num_draft_tokens for o in spec) > 100  # every decode row verified padded drafts
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
