"""Images on Gemma 3 (Gemma3ForConditionalGeneration): a tiny seeded checkpoint made by transformers
(engine/multimodal/tiny_gemma3.py), its images encoded by transformers' SigLIP tower and Gemma 3's projector in our
engine. The prompt's <start_of_image> framed as Gemma3Processor frames it (newlines merged); the soft tokens attending
to each other both ways, checked on logprobs against transformers with and without its image mask (the greedy tokens
of a tiny model need not move); alone and batched, prefill chunks that never end inside an image, preempted, the
prefix cache, disaggregated over tcp, a tensor-parallel split, bf16 batch-invariant, and served (the `openai`
client)."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.multimodal.chunks import chunk_outside_images
from pdcluster.engine.multimodal.spec import ImageSpec
from pdcluster.engine.multimodal.tiny_gemma3 import (IMAGE_TOKENS, NUM_SOFT_TOKENS, build_tiny_gemma3,
                                                     transformers_greedy)
from pdcluster.engine.multimodal.tiny_llava import png
from pdcluster.engine.sampling_params import SamplingParams
from test_api import serving
from test_multimodal import (_prompt, check_a_widened_prompt_is_taken, disagg_tokens, greedy_references,
                             tiny_image_config as _config)

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

NUM_NEW = 8
PROMPT = "user\n<start_of_image>What is in this picture?\nmodel\n"
TWO = "user\n<start_of_image>and<start_of_image>\n\nWhich one is brighter?\nmodel\n"
TEXT = "user\nTell me a story about a cat.\nmodel\n"
IMAGES = [png(1, 40, 36), png(2, 64, 48), png(3, 33, 50)]
CASES = [(PROMPT, [IMAGES[0]]), (PROMPT, [IMAGES[1]]), (TWO, [IMAGES[2], IMAGES[0]]), (TEXT, [])]
PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
TOP = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), resolve_model("tiny-random", progress=False))


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_config(_config(model_dir), progress=False)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(model_dir, engine) -> list[list[int]]:
    return greedy_references(model_dir, engine, CASES, transformers_greedy, NUM_NEW)


def _hf_logprobs(model_dir, hf, ids: list[int], images: list[bytes], both_ways: bool) -> torch.Tensor:
    """transformers' log-probabilities of the token after ``ids``, with its image mask or without (causal)."""
    processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
    pixels = processor(images=[PIL.open(io.BytesIO(b)).convert("RGB") for b in images],
                       return_tensors="pt")["pixel_values"]
    t = torch.tensor([ids])
    types = {"token_type_ids": (t == hf.config.image_token_index).long()} if both_ways else {}
    with torch.inference_mode():
        return hf(input_ids=t, pixel_values=pixels, **types).logits[0, -1].log_softmax(-1)


def test_frame_equals_gemma3_processor(model_dir, engine):
    """The spec read from the checkpoint; each <start_of_image> becomes the processor's frame ("\\n\\n", itself, the
    soft tokens, <end_of_image>, "\\n\\n"), its newlines merged with the prompt's into the tokenizer's one token (as
    tokenizing the processor's text does): Gemma3Processor's input_ids, its token_type_ids at our images' rows."""
    spec = ImageSpec.from_dir(model_dir)
    tok = engine.tokenizer
    boi, eoi, soft = (tok.token_to_id(t) for t in IMAGE_TOKENS)
    assert (spec.image_token_id, spec.tokens_per_image, spec.bidirectional) == (boi, NUM_SOFT_TOKENS, True)
    assert (spec.frame.eoi_token_id, spec.frame.soft_token_id) == (eoi, soft)
    assert spec.frame.newline_ids == tuple(tok.encode("\n" * k)[0] for k in range(1, 9))
    processor = transformers.AutoProcessor.from_pretrained(str(model_dir))
    for text, images in [(PROMPT, IMAGES[:1]), (TWO, IMAGES[:2]), ("<start_of_image>", IMAGES[:1]),
                         ("a\n\n\n<start_of_image>\nb<start_of_image><start_of_image>\n\n\n\n", IMAGES)]:
        ids, items = spec.expand(tok.encode(text), images)
        out = processor(text=text, images=[PIL.open(io.BytesIO(b)) for b in images], return_tensors="pt")
        assert ids == out["input_ids"][0].tolist(), text
        types = out["token_type_ids"][0].tolist()
        assert [i for i, t in enumerate(types) if t == 1] == [i["offset"] + j for i in items for j in range(i["length"])]
        assert spec.expand(out["input_ids"][0].tolist(), images) == (ids, items), text  # the processor's own, as is
    ids, _ = spec.expand(tok.encode(PROMPT), IMAGES[:1])
    assert tok.encode("\n\n\n")[0] in ids  # "user\n" + the frame's "\n\n": one token


def test_soft_tokens_attend_both_ways(model_dir, engine, hf):
    """The next token's logprobs equal transformers' with its image mask (within 1e-4), which are not those without
    it: each image's soft tokens see the image's later ones. Also where prefill chunks of 18 tokens would end inside
    an image (the scheduler ends them before it) and from the prefix cache."""
    spec = engine.model.image_encoder.spec
    ids, items = spec.expand(engine.tokenizer.encode(TWO), [IMAGES[2], IMAGES[0]])
    assert items[0]["offset"] < 18 < items[0]["offset"] + items[0]["length"]
    both = _hf_logprobs(model_dir, hf, ids, [IMAGES[2], IMAGES[0]], True)
    causal = _hf_logprobs(model_dir, hf, ids, [IMAGES[2], IMAGES[0]], False)
    chunked = LLMEngine.from_config(_config(model_dir, max_num_batched_tokens=18), progress=False)
    cached = []
    for eng in (engine, chunked, chunked):  # the second run on `chunked` reads its images' blocks from the cache
        out = eng.generate([_prompt(TWO, [IMAGES[2], IMAGES[0]])], TOP)[0]
        top = out.logprobs[0]
        want = both[top.top_token_ids]
        assert torch.allclose(torch.tensor(top.top_logprobs), want, atol=1e-4), (top.top_logprobs, want)
        assert (causal[top.top_token_ids] - want).abs().max() > 1e-3
        cached.append(out.num_cached_tokens)
    assert cached[1] == 0 and cached[2] >= 32


def test_a_widened_prompt_is_taken_as_it_is(engine, reference):
    """Token ids from the model's processor (each image's frame and soft tokens written out) with the images: the
    same tokens; soft tokens that are no image's whole run are refused, not widened again."""
    check_a_widened_prompt_is_taken(engine, CASES, reference, PARAMS)


def test_equals_transformers_alone_and_batched(engine, reference):
    assert reference[0] != reference[1]
    assert [engine.generate([_prompt(t, i)], PARAMS)[0].token_ids for t, i in CASES] == reference
    assert [o.token_ids for o in engine.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference


def test_chunks_end_outside_images():
    """A chunk that would end inside an image ends at its start; one that would start an image it cannot hold waits
    (0); a chunk from inside an image (a prefix-cache hit) to past it, or ending on an image's last token, stands."""
    items = [{"offset": 10, "length": 16}, {"offset": 30, "length": 16}]
    assert chunk_outside_images(items, 0, 20) == 10
    assert chunk_outside_images(items, 10, 8) == 0
    assert chunk_outside_images(items, 0, 26) == 26
    assert chunk_outside_images(items, 16, 20) == 14  # 16 .. 36 ends inside the second image: to 30
    assert chunk_outside_images(items, 16, 12) == 12
    assert chunk_outside_images(items, 46, 3) == 3


def test_images_must_fit_a_step(model_dir):
    with pytest.raises(ValueError, match="at least 16"):
        LLMEngine.from_config(_config(model_dir, max_num_batched_tokens=12), progress=False)
    text_only = LLMEngine.from_config(_config(model_dir, max_num_batched_tokens=12,
                                              limit_mm_per_prompt='{"image": 0}'), progress=False)
    assert text_only.max_images_per_prompt == 0


def test_fast_mode_chunked_with_preemption(model_dir, reference):
    """Outside deterministic mode a step's images go through the tower together; prefill chunks of 20 tokens and a
    small pool that preempts: the same tokens, each image encoded once."""
    fast = LLMEngine.from_config(_config(model_dir, deterministic=False), progress=False)
    assert [o.token_ids for o in fast.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    eng = LLMEngine.from_config(_config(model_dir, num_kv_blocks=13, block_size=8, max_num_seqs=4,
                                        max_num_batched_tokens=20, enable_prefix_caching=False), progress=False)
    assert [o.token_ids for o in eng.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    assert eng.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert eng.runner.image_embeds.num_encoded == 3


def test_async_scheduling_and_image_embeddings(model_dir, engine, reference):
    """Async scheduling in prefill chunks of 18 (the next step scheduled while this one runs: the same cut before an
    image); an image given as its embeddings (the encoder's rows) framed as an image and giving its tokens."""
    eng = LLMEngine.from_config(_config(model_dir, async_scheduling=True, max_num_batched_tokens=18), progress=False)
    assert [o.token_ids for o in eng.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    rows = engine.model.image_encoder.encode([IMAGES[0]])[0]
    assert rows.shape == (NUM_SOFT_TOKENS, 64)
    out = engine.generate([{"prompt": PROMPT, "multi_modal_data": {"image": rows}}], PARAMS)[0]
    assert out.token_ids == reference[0]


def test_disaggregated_over_tcp(model_dir, engine, reference):
    tokens, num_encoded = disagg_tokens(_config(model_dir), engine, CASES, PARAMS)
    assert tokens == reference and num_encoded == 3


def test_tensor_parallel_split(model_dir, reference):
    """Two CPU ranks: rank 0 encodes, the other gets the rows with each forward and runs the both-ways attention on
    its heads: transformers' tokens."""
    split = LLMEngine.from_config(_config(model_dir, tensor_parallel_size=2), progress=False)
    try:
        assert [o.token_ids for o in split.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    finally:
        split.close()


def test_bf16_deterministic_batch_invariant(model_dir):
    eng = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="bfloat16", deterministic=True,
                                             max_model_len=256, num_kv_blocks=64, block_size=16,
                                             enable_prefix_caching=False), progress=False)
    prompts = [_prompt(t, i) for t, i in CASES]
    batched = [o.token_ids for o in eng.generate(prompts, PARAMS)]
    eng.runner.image_embeds.clear()
    assert [eng.generate([p], PARAMS)[0].token_ids for p in prompts] == batched


def test_served_chat_with_images(model_dir, reference):
    """The OpenAI client's image_url part through the real HTTP server and the checkpoint's chat template:
    transformers' tokens, usage counting the frame and the soft tokens."""
    router = LocalRouter(_config(model_dir), request_timeout_s=60)
    try:
        with serving(build_app(router, "gemma3")) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
            out = client.chat.completions.create(
                model="gemma3", max_tokens=NUM_NEW, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "What is in this picture?"}]}])
            assert out.choices[0].token_ids == reference[0]
            spec = ImageSpec.from_dir(model_dir)
            assert out.usage.prompt_tokens == len(spec.expand(router.tokenizer.encode(PROMPT), IMAGES[:1])[0])
    finally:
        router.close()
