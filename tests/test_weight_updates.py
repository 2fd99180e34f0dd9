"""New weights while serving (engine/weight_update.py, cluster/generation_control.py, cluster/api/weight_routes.py):
what an RL trainer does between rollouts, on one engine.

- An update serves exactly what a fresh engine on the new checkpoint serves (tokens and logprobs; fp32 and the
  bf16 packed-GEMM path; a Mamba hybrid), with no request ever run on two sets of weights.
- KV computed under the old weights is never a prefix-cache hit afterwards (the version roots the block hashes).
- What cannot be updated is refused with its reason and changes nothing: another architecture, a reserved or reused
  version name, a missing checkpoint, requests still running on the engine, a request placed under other weights.
Served (HTTP, API processes): tests/test_weight_updates_served.py; on a Ray cluster: test_weight_updates_cluster.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import make_engine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.weight_update import WeightUpdateError, WeightVersionMismatch

PROMPTS = [list(range(1, 41)), [7, 8, 9, 10, 11], list(range(100, 133))]
NUM_TOKENS = 12


def perturbed_checkpoint(model: str, out_dir: Path, seed: int = 1) -> str:
    """A copy of built-in ``model`` with other weights (engine/models/perturbed.py)."""
    from pdcluster.engine.models.perturbed import perturb_checkpoint

    return str(perturb_checkpoint(resolve_model(model, progress=False), out_dir, seed))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Perturbed copies of the tiny models: {(model, seed): directory}."""
    root = tmp_path_factory.mktemp("weights")
    return {(m, s): perturbed_checkpoint(m, root / f"{m}-{s}", s)
            for m, s in (("tiny-random", 1), ("tiny-random", 2), ("tiny-hybrid", 1))}


def _add_tensor(model_dir: Path, name: str, like: str, factor: float) -> None:
    """Tensor ``name`` = ``factor`` x tensor ``like``, added to the checkpoint file holding ``like``."""
    from safetensors.torch import load_file, save_file

    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(str(f))
        if like in tensors:
            tensors[name] = tensors[like] * factor
            save_file(tensors, str(f))
            return
    raise AssertionError(f"no tensor {like} in {model_dir}")


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _run(engine, prompts=PROMPTS, **kw):
    outs = engine.generate(prompts, _params(logprobs=2, **kw))
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("model,dtype", [("tiny-random", "float32"), ("tiny-random", "bfloat16"),
                                         ("tiny-hybrid", "float32")])
def test_update_serves_what_a_fresh_engine_on_the_checkpoint_serves(checkpoints, model, dtype):
    engine = make_engine(model, dtype=dtype)
    before = _run(engine)
    new_dir = checkpoints[(model, 1)]
    want = _run(make_engine(new_dir, dtype=dtype))
    assert [t for t, _ in before] != [t for t, _ in want], "the checkpoints answer alike: the test proves nothing"
    update = engine.update_weights_from_disk(new_dir, "step-1")
    assert update.weight_version == engine.weight_version == "step-1" and update.num_tensors > 0
    assert update.num_bytes > 0 and engine.weights_path == new_dir
    assert _run(engine) == want
    # Back to the start-up checkpoint under a new name: its answers again.
    engine.update_weights_from_disk(str(resolve_model(model, progress=False)), "step-2")
    assert _run(engine) == before


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["tiny-random", "tiny-hybrid"])
def test_update_on_cuda_replays_the_graphs_on_the_new_weights(checkpoints, model):
    """On CUDA the decode steps replay CUDA graphs captured on the served tensors: the copy in place reaches them
    (deterministic mode, so the two engines' tokens compare bit for bit)."""
    cfg = dict(device="cuda", deterministic=True, max_num_seqs=8, num_kv_blocks=128, max_model_len=512)
    engine = make_engine(model, **cfg)
    _run(engine)
    replays = engine.runner.graphs.num_replays
    assert replays > 0
    new_dir = checkpoints[(model, 1)]
    engine.update_weights_from_disk(new_dir, "cuda-1")
    assert _run(engine) == _run(make_engine(new_dir, **cfg))
    assert engine.runner.graphs.num_replays > replays


@pytest.mark.parametrize("model", ["tiny-random", "tiny-hybrid"])
def test_a_split_model_updates_every_rank(checkpoints, model, tmp_path):
    """Tensor parallelism over two ranks: each rank reads its slice of the checkpoint (checked against rank 0's
    digest) and copies it in, so the split answers as a fresh split on the checkpoint; a checkpoint a rank cannot
    read changes no rank, and the split serves on."""
    engine = make_engine(model, tensor_parallel_size=2)
    try:
        before = _run(engine)
        new_dir = checkpoints[(model, 1)]
        fresh = make_engine(new_dir, tensor_parallel_size=2)
        try:
            want = _run(fresh)
        finally:
            fresh.close()
        assert [t for t, _ in before] != [t for t, _ in want]
        broken = tmp_path / "broken"  # rank 0 reads it whole; the file is cut short once rank 0 has read it
        shutil.copytree(new_dir, broken)
        real_read = engine.model.tp_driver.read_weights

        def cut_then_read(model_dir, digest):
            for f in Path(model_dir).glob("*.safetensors"):
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            return real_read(model_dir, digest)

        engine.model.tp_driver.read_weights = cut_then_read
        with pytest.raises(WeightUpdateError, match="tensor-parallel rank 1: .*other contents here"):
            engine.update_weights_from_disk(str(broken), "broken")
        engine.model.tp_driver.read_weights = real_read
        assert _run(engine) == before and engine.weight_version == "default"
        engine.update_weights_from_disk(new_dir, "v1")
        assert _run(engine) == want
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
def test_a_model_serving_images_updates_its_tower_too(family, tmp_path):
    """A LLaVA (its CLIP tower and projector) and a Qwen2-VL (its own tower, M-RoPE) answer image prompts after an
    update as a fresh engine on the new checkpoint: the tower's weights were copied with the text model's."""
    from pdcluster.engine.models.perturbed import perturb_checkpoint
    from pdcluster.engine.multimodal.tiny_llava import build_tiny_llava, png
    from pdcluster.engine.multimodal.tiny_qwen2_vl import build_tiny_qwen2_vl

    tokenizer_dir = resolve_model("tiny-random", progress=False)
    built = (build_tiny_llava(tmp_path / "llava", tokenizer_dir) if family == "llava"
             else build_tiny_qwen2_vl(tmp_path / "qwen2-vl", tokenizer_dir))
    other = perturb_checkpoint(built, tmp_path / "other", seed=3, scale=0.2)
    cfg = dict(max_model_len=256, num_kv_blocks=64, max_num_seqs=8)
    engine = make_engine(str(built), **cfg)
    prompt = ("USER: <image>\nWhat is in this picture? ASSISTANT:" if family == "llava" else
              "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this picture?<|im_end|>\n"
              "<|im_start|>assistant\n")
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": [png(seed, 40, 36)]}} for seed in (1, 2)]

    def run(e):
        return [o.token_ids for o in e.generate(prompts, _params())]

    before = run(engine)
    want = run(make_engine(str(other), **cfg))
    assert before != want
    engine.update_weights_from_disk(str(other), "vlm-1")
    assert run(engine) == want


@pytest.mark.parametrize("model,mtp_checkpoint", [("tiny-hybrid-moe", "")])
def test_the_draft_follows_the_update(model, mtp_checkpoint, tmp_path):
    """MTP speculation after an update drafts as a fresh engine on the checkpoint does (the same tokens accepted):
    a NemotronH's own MTP layers come from the new checkpoint (any other draft is built again on the new target:
    our MTP head holds a copy of a slice of its LM head)."""
    import torch

    from pdcluster.engine.models.perturbed import perturb_checkpoint
    from pdcluster.engine.weight_update import _tensors

    new_dir = str(perturb_checkpoint(resolve_model(model, progress=False), tmp_path / "new", seed=1, scale=0.1))
    cfg = dict(spec_method="mtp", num_spec_tokens=2, mtp_checkpoint=mtp_checkpoint)

    def run(e):
        outs = e.generate(PROMPTS, _params())
        return [o.token_ids for o in outs], sum(o.num_accepted_tokens for o in outs)

    engine = make_engine(model, **cfg)
    before = run(engine)
    fresh = make_engine(new_dir, **cfg)
    want = run(fresh)
    assert before[0] != want[0] and want[1] > 0
    engine.update_weights_from_disk(new_dir, "v1")
    assert run(engine) == want
    # Every tensor of the draft is the fresh engine's (the draft's own layers by their place in it): on a model this
    # small, the acceptance alone cannot tell a stale draft.
    got = {path: t for path, t in _tensors(engine.runner.proposer.head).values()}
    fresh_draft = {path: t for path, t in _tensors(fresh.runner.proposer.head).values()}
    assert got.keys() == fresh_draft.keys()
    assert [p for p in got if not torch.equal(got[p], fresh_draft[p])] == []


def test_old_kv_is_never_a_hit_after_an_update(checkpoints):
    engine = make_engine("tiny-random", enable_prefix_caching=True)
    prompt = PROMPTS[0]
    engine.generate([prompt], _params())
    again = engine.generate([prompt], _params())[0]
    assert again.num_cached_tokens >= 32, "the prompt was not cached: the test proves nothing"
    new_dir = checkpoints[("tiny-random", 1)]
    engine.update_weights_from_disk(new_dir, "v1")
    after = engine.generate([prompt], _params())[0]
    assert after.num_cached_tokens == 0
    want = make_engine(new_dir).generate([prompt], _params())[0].token_ids
    assert after.token_ids == want
    # Under the new weights their own KV is cached as usual, and stamped requests hash by their version.
    assert engine.generate([prompt], _params())[0].num_cached_tokens >= 32


def test_refusals_change_nothing(checkpoints, tmp_path):
    engine = make_engine("tiny-random")
    before = _run(engine)
    refusals = [
        ((checkpoints[("tiny-hybrid", 1)], "v1"), "holds a"),
        ((str(tmp_path / "nowhere"), "v1"), "model_path"),
        ((checkpoints[("tiny-random", 1)], "default"), "names the weights the server started with"),
        ((checkpoints[("tiny-random", 1)], " "), "non-empty"),
    ]
    for args, message in refusals:
        with pytest.raises(WeightUpdateError, match=message):
            engine.update_weights_from_disk(*args)
    other = tmp_path / "wider"
    shutil.copytree(checkpoints[("tiny-random", 1)], other)
    config = (other / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
    assert config != (other / "config.json").read_text(), "the config edit missed"
    (other / "config.json").write_text(config)
    with pytest.raises(WeightUpdateError, match="rms_norm_eps"):
        engine.update_weights_from_disk(str(other), "v1")
    engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")
    with pytest.raises(WeightUpdateError, match="was given to other weights by an earlier update here"):
        engine.update_weights_from_disk(checkpoints[("tiny-random", 2)], "v1")
    engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")  # the same name, the same checkpoint
    engine.update_weights_from_disk(str(resolve_model("tiny-random", progress=False)), "v2")
    assert _run(engine) == before and engine.weight_version == "v2"


def test_a_checkpoint_that_unties_what_the_served_model_ties_is_refused(checkpoints, tmp_path):
    """NemotronH's loader ties the LM head to the embedding where the checkpoint's are equal (one tensor): a
    checkpoint whose two differ cannot go into that one tensor."""
    engine = make_engine("tiny-hybrid")
    assert engine.model.lm_head is engine.model.embed_tokens, "not tied: the test proves nothing"
    before = _run(engine)
    untied = tmp_path / "untied"
    shutil.copytree(checkpoints[("tiny-hybrid", 1)], untied)
    _add_tensor(untied, "lm_head.weight", "lm_head.weight", 2.0)
    with pytest.raises(WeightUpdateError, match="are one tensor in the served model .* differ in the new"):
        engine.update_weights_from_disk(str(untied), "v1")
    assert _run(engine) == before and engine.weight_version == "default"


def test_no_update_under_a_running_request_and_no_request_under_other_weights(checkpoints):
    engine = make_engine("tiny-random")
    engine.add_request(PROMPTS[0], _params())
    engine.step()
    with pytest.raises(WeightUpdateError, match="1 requests are running: pause generation first"):
        engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")
    assert engine.weight_version == "default" and engine.pending_weights is None
    while engine.has_unfinished():
        engine.step()
    engine.update_weights_from_disk(checkpoints[("tiny-random", 1)], "v1")
    with pytest.raises(WeightVersionMismatch, match="serves weights 'v1', the request was placed under 'default'"):
        engine.add_request(PROMPTS[0], _params(weight_version="default"))
    rid = engine.add_request(PROMPTS[0], _params(weight_version="v1"))
    assert engine.scheduler.requests[rid].sampling_params.weight_version == "v1"
    rid = engine.add_request(PROMPTS[1], _params())  # unstamped: stamped with what is served
    assert engine.scheduler.requests[rid].sampling_params.weight_version == "v1"


def test_a_checkpoints_digest_follows_its_contents(checkpoints, tmp_path):
    from pdcluster.engine.weight_update import checkpoint_digest

    one, two = checkpoints[("tiny-random", 1)], checkpoints[("tiny-random", 2)]
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)
    assert checkpoint_digest(copy) == checkpoint_digest(one) != checkpoint_digest(two)
    _add_tensor(copy, "model.embed_tokens.weight", "model.embed_tokens.weight", 1.0001)  # a small training step
    assert checkpoint_digest(copy) != checkpoint_digest(one)


def test_block_hashes_are_rooted_in_the_version():
    from pdcluster.engine.block_manager import block_hash_root, chained_block_hashes

    plain = chained_block_hashes(list(range(64)), 16, block_hash_root(_params()))
    assert chained_block_hashes(list(range(64)), 16, block_hash_root(_params(weight_version="default"))) == plain
    v1 = chained_block_hashes(list(range(64)), 16, block_hash_root(_params(weight_version="v1")))
    v2 = chained_block_hashes(list(range(64)), 16, block_hash_root(_params(weight_version="v2")))
    assert len({plain[0], v1[0], v2[0]}) == 3
    salted = block_hash_root(_params(weight_version="v1", cache_salt="s"))
    assert salted not in (block_hash_root(_params(weight_version="v1")), block_hash_root(_params(cache_salt="s")))
