"""Images on Qwen2-VL and Qwen2.5-VL (M-RoPE): tiny seeded checkpoints made by transformers
(engine/multimodal/tiny_qwen2_vl.py), their images encoded by transformers' tower in our engine and placed at M-RoPE
positions on our one-position rotary kernels (engine/multimodal/mrope.py), against transformers' greedy with the same
processor: alone and batched, two images a prompt, chunked through an image's placeholders and preempted, over the
prefix cache, disaggregated over tcp (the decode worker's positions after the images), and served (the real HTTP
server and the `openai` client)."""

from __future__ import annotations

import argparse
import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.engine_args import add_engine_args, engine_config_from_args
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.config import ConfigError
from pdcluster.engine.llm_engine import InvalidRequestError, LLMEngine
from pdcluster.engine.models.llama import RotaryEmbedding
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.multimodal.mrope import MRope, rope_layout
from pdcluster.engine.multimodal.spec import ImageInputError, ImageSpec, MergedPatchGrid
from pdcluster.engine.multimodal.tiny_llava import png
from pdcluster.engine.multimodal.tiny_qwen2_vl import VERSIONS, build_tiny_qwen2_vl, transformers_greedy
from pdcluster.engine.sampling_params import SamplingParams
from test_api import serving
from test_multimodal import (_prompt, check_a_widened_prompt_is_taken, disagg_tokens, greedy_references,
                             tiny_image_config as _config)

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

NUM_NEW = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE}and{IMAGE}Which one is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nTell me a story about a cat.<|im_end|>\n<|im_start|>assistant\n"
# 20 (4 x 5), 24 (4 x 6: wider than high) and 24 (6 x 4: higher than wide) placeholders.
IMAGES = [png(1, 40, 36), png(2, 48, 30), png(3, 33, 50)]
CASES = [(PROMPT, [IMAGES[0]]), (PROMPT, [IMAGES[1]]), (TWO, [IMAGES[2], IMAGES[0]]), (TEXT, [])]
PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=VERSIONS)
def qwen_dir(request, tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), resolve_model("tiny-random", progress=False),
                               request.param)


@pytest.fixture(scope="module")
def engine(qwen_dir) -> LLMEngine:
    return LLMEngine.from_config(_config(qwen_dir), progress=False)


@pytest.fixture(scope="module")
def reference(qwen_dir, engine) -> list[list[int]]:
    return greedy_references(qwen_dir, engine, CASES, transformers_greedy, NUM_NEW)


def test_placeholders_follow_transformers_processor(qwen_dir):
    """An image's count of placeholders is the processor's grid / merge^2 for sizes inside, below and above the pixel
    budget, wide and tall; an image past 200:1 is refused with a clear error."""
    from PIL import Image

    spec = ImageSpec.from_dir(qwen_dir)
    assert spec.patches == MergedPatchGrid(4, 2, 256, 1600)
    processor = transformers.AutoImageProcessor.from_pretrained(str(qwen_dir))
    for width, height in ((40, 36), (48, 30), (33, 50), (8, 8), (3, 100), (300, 200), (1000, 64), (17, 23)):
        grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        assert spec.tokens_for_size(width, height) == int(grid.prod()) // 4, (width, height)
    with pytest.raises(ImageInputError, match="aspect ratio must be at most 200:1"):
        spec.tokens_for_size(1000, 4)
    # The Hub's Qwen2-VL preprocessor configs: min_pixels / max_pixels over size's (transformers' order).
    hub = MergedPatchGrid.from_configs({"patch_size": 14, "spatial_merge_size": 2}, {
        "min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1, "longest_edge": 2}})
    assert hub == MergedPatchGrid(14, 2, 3136, 12845056)
    assert hub.num_tokens(1080, 1920) == 39 * 69  # 1092 x 1932 pixels


def test_a_widened_prompt_is_taken_as_it_is(engine, reference):
    """Token ids from the model's processor (each image's run written out) with the images: the same tokens."""
    check_a_widened_prompt_is_taken(engine, CASES, reference, PARAMS)


def test_equals_transformers_alone_and_batched(engine, reference):
    """Each prompt alone, then all in one batch beside a text-only prompt: transformers' tokens (its own M-RoPE
    positions from the processor's grids); the images matter."""
    assert reference[0] != reference[1]
    alone = [engine.generate([_prompt(t, i)], PARAMS)[0].token_ids for t, i in CASES]
    assert alone == reference
    assert [o.token_ids for o in engine.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference


def test_mrope_positions_equal_transformers_rope_index(qwen_dir):
    """Every token's rotary row (text shifted after each image, image placeholders at scratch rows mixed from their
    time / row / column positions) equals the row transformers' get_rope_index positions give, for a prompt cut
    into chunks anywhere; decode rows take the request's shift."""
    from PIL import Image

    spec = ImageSpec.from_dir(qwen_dir)
    images = [IMAGES[2], IMAGES[1]]
    ids, items = spec.expand([5, 5, 5, 7, spec.image_token_id, 8, 9, 7, spec.image_token_id, 8, 3, 3], images)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(qwen_dir), dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(str(qwen_dir))
    grids = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                      return_tensors="pt")["image_grid_thw"]
    t = torch.tensor([ids])
    want_np, delta = hf.model.get_rope_index(t, (t == spec.image_token_id).int(), grids)
    want_np = want_np[:, 0].numpy()
    layout = rope_layout(spec, items)
    assert layout.delta == int(delta) < 0
    rope = RotaryEmbedding(16, 10000.0, 256, torch.float32)
    table = rope.cos_sin.clone()
    mrope = MRope(spec, rope, (2, 3, 3), 64)
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor([2, 3, 3])).repeat(2)
    for cuts in ((0, len(ids)), (0, 5, 17, 30, len(ids)), (0, 1, 2, 40, len(ids))):
        for lo, hi in zip(cuts, cuts[1:]):
            got = mrope.rope_positions(np.arange(lo, hi), np.array([0, hi - lo]), np.array([layout.delta]),
                                       np.array([layout.end]), lambda row: layout)
            for i, row in zip(range(lo, hi), got.tolist()):
                want = table[torch.from_numpy(want_np[:, i])][axis, torch.arange(16)]
                assert torch.equal(rope.cos_sin[row], want), (cuts, i)
    decode = mrope.rope_positions(np.array([len(ids) + 3, 9]), np.array([0, 1, 2]), np.array([layout.delta, 0]),
                                  np.array([layout.end, 0]), lambda row: pytest.fail("no row covers an image"))
    assert decode.tolist() == [len(ids) + 3 + layout.delta, 9]


def test_chunked_through_the_image_and_preempted(qwen_dir, reference):
    """Prefill chunks of 5 tokens cut each image's placeholders across steps and a pool too small for all at once
    preempts and recomputes: the same tokens; each image encoded once."""
    eng = LLMEngine.from_config(_config(qwen_dir, num_kv_blocks=10, block_size=8, max_num_seqs=4,
                                        max_num_batched_tokens=5, enable_prefix_caching=False), progress=False)
    outs = eng.generate([_prompt(t, i) for t, i in CASES], PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert eng.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert eng.runner.image_embeds.num_encoded == 3


def test_prefix_cache_hit_keeps_the_positions(qwen_dir, reference):
    """The same image again is served from the prefix cache (its blocks' KV, rotated at M-RoPE positions) and the
    rest of the prompt continues at the shifted positions: the same tokens."""
    eng = LLMEngine.from_config(_config(qwen_dir, enable_prefix_caching=True), progress=False)
    first = eng.generate([_prompt(*CASES[2])], PARAMS)[0]
    again = eng.generate([_prompt(*CASES[2])], PARAMS)[0]
    assert first.token_ids == again.token_ids == reference[2]
    assert again.num_cached_tokens >= 16


def test_image_embeddings_are_refused(engine):
    """Embeddings carry no grid, which M-RoPE needs: a clear error, nothing queued."""
    with pytest.raises(InvalidRequestError, match="takes images, not their embeddings"):
        engine.add_request({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(20, 64)}}, PARAMS)
    assert not engine.has_unfinished()


def test_disaggregated_over_tcp(qwen_dir, engine, reference):
    """The prefill worker encodes the images and sends the prompt's KV; the decode worker continues at the request's
    shifted positions (its layout from the images in the request's parameters): the same tokens."""
    tokens, num_encoded = disagg_tokens(_config(qwen_dir), engine, CASES, PARAMS)
    assert num_encoded == 3
    assert tokens == reference


def test_served_chat_with_images(qwen_dir, reference):
    """The OpenAI client's image_url parts through the real HTTP server and the checkpoint's chat template:
    transformers' tokens, usage counting the image's placeholders."""
    router = LocalRouter(_config(qwen_dir), request_timeout_s=60)
    try:
        with serving(build_app(router, "qwen")) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
            out = client.chat.completions.create(
                model="qwen", max_tokens=NUM_NEW, temperature=0, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "What is in this picture?"}]}])
            assert out.choices[0].token_ids == reference[0]
            assert out.usage.prompt_tokens == len(router.tokenizer.encode(PROMPT)) - 1 + 20
            with pytest.raises(openai.BadRequestError, match="aspect ratio must be at most 200:1"):
                thin = "data:image/png;base64," + base64.b64encode(png(4, 1000, 4)).decode()
                client.chat.completions.create(model="qwen", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": thin}}, {"type": "text", "text": "hi"}]}])
    finally:
        router.close()


def test_mm_processor_kwargs_set_the_pixel_budget(qwen_dir, engine):
    """--mm-processor-kwargs '{"max_pixels": 784}' (vLLM's flag): each image resized within 784 pixels, so the
    40 x 36 image takes 9 placeholders, not 20; transformers' tokens with its processor given that budget, served
    (usage and /tokenize count them) and offline; a key the processor does not take here, or bad JSON, is refused by
    name; the flag reaches the config from the command line."""
    small = _config(qwen_dir, mm_processor_kwargs='{"max_pixels": 784}')
    eng = LLMEngine.from_config(small, progress=False)
    spec = eng.model.image_encoder.spec
    assert (spec.patches.max_pixels, spec.tokens_for_size(40, 36)) == (784, 9)
    ids, items = spec.expand(eng.tokenizer.encode(PROMPT), IMAGES[:1])
    want = transformers_greedy(qwen_dir, ids, IMAGES[:1], NUM_NEW,
                               processor_kwargs={"size": {"shortest_edge": 256, "longest_edge": 784}})
    assert eng.generate([_prompt(PROMPT, IMAGES[:1])], PARAMS)[0].token_ids == want
    assert items[0]["length"] == 9
    router = LocalRouter(small, request_timeout_s=60)
    try:
        with serving(build_app(router, "qwen")) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "What is in this picture?"}]}]
            out = client.chat.completions.create(model="qwen", max_tokens=NUM_NEW, temperature=0, messages=messages,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].token_ids == want
            assert out.usage.prompt_tokens == len(ids)
            counted = httpx.post(base_url + "/tokenize", json={"model": "qwen", "messages": messages}, timeout=30)
            assert counted.json()["count"] == len(ids)
    finally:
        router.close()
    with pytest.raises(ValueError, match="'do_pan_and_scan' is not a setting of a .* image processor here"):
        LLMEngine.from_config(_config(qwen_dir, mm_processor_kwargs='{"do_pan_and_scan": false}'), progress=False)
    with pytest.raises(ConfigError, match="mm_processor_kwargs: not JSON"):
        _config(qwen_dir, mm_processor_kwargs="max_pixels=784")
    with pytest.raises(ValueError, match="min_pixels 900 is more than max_pixels 784"):
        LLMEngine.from_config(_config(qwen_dir, mm_processor_kwargs='{"min_pixels": 900, "max_pixels": 784}'),
                              progress=False)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(qwen_dir), "--mm-processor-kwargs", '{"max_pixels": 784}'])
    assert engine_config_from_args(args).image_processor_kwargs() == {"max_pixels": 784}


def test_decode_graphs_and_async_scheduling_keep_the_positions(qwen_dir, reference):
    """Decode steps replayed through (emulated) CUDA graphs and launched ahead (async scheduling): each decode row's
    static position buffer holds its shifted position, the same tokens."""
    eng = LLMEngine.from_config(_config(qwen_dir, async_scheduling=True), progress=False)
    eng.runner.use_decode_graphs(emulate=True)
    outs = eng.generate([_prompt(t, i) for t, i in CASES], PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert eng.runner.graphs.num_replays > 0 and eng.num_steps_launched_ahead > 0


def test_bf16_deterministic_batch_invariant(qwen_dir):
    """bf16 in deterministic mode (the CPU default with avx512_bf16): a request with images gets its tokens alone, bit
    for bit, in a batch with other images and text (the scratch rows of one step hold every row's image tokens)."""
    eng = LLMEngine.from_config(_config(qwen_dir, dtype="bfloat16", deterministic=True, enable_prefix_caching=False),
                                progress=False)
    prompts = [_prompt(t, i) for t, i in CASES]
    batched = [o.token_ids for o in eng.generate(prompts, PARAMS)]
    eng.runner.image_embeds.clear()
    assert [eng.generate([p], PARAMS)[0].token_ids for p in prompts] == batched


def test_tensor_parallel_images_refused_before_loading(qwen_dir, reference):
    """A split's other ranks would need the image rows' rotary rows too: refused by name before any rank starts; for
    text (images off) the split is served."""
    with pytest.raises(ValueError, match="tensor-parallel split of an M-RoPE model"):
        LLMEngine.from_config(_config(qwen_dir, tensor_parallel_size=2), progress=False)
    split = LLMEngine.from_config(_config(qwen_dir, tensor_parallel_size=2, limit_mm_per_prompt='{"image": 0}'),
                                  progress=False)
    try:
        assert split.generate([CASES[3][0]], PARAMS)[0].token_ids == reference[3]
    finally:
        split.close()

