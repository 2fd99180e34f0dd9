"""Images on Mistral 3 (Pixtral's tower): a tiny seeded Mistral3ForConditionalGeneration, and Pixtral-12B's LLaVA
form of it (LlavaForConditionalGeneration with a Pixtral tower), made by transformers
(engine/multimodal/tiny_mistral3.py), its images encoded by transformers' tower and projector in our engine, each
image's run of placeholders (rows of image tokens closed by break tokens, the last by an end token) against
transformers' greedy with the same processor: alone and batched, two images a prompt, fast mode's batched tower
calls, chunked through a run and preempted, disaggregated over tcp, and served (the `openai` client)."""

from __future__ import annotations

import base64

import openai
import pytest
import torch

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.llm_engine import InvalidRequestError, LLMEngine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.multimodal.spec import ImageSpec, PixtralGrid
from pdcluster.engine.multimodal.tiny_llava import png
from pdcluster.engine.multimodal.tiny_mistral3 import CELL, build_tiny_mistral3, transformers_greedy
from pdcluster.engine.sampling_params import SamplingParams
from test_api import serving
from test_multimodal import (_prompt, check_a_widened_prompt_is_taken, disagg_tokens, greedy_references,
                             tiny_image_config as _config)

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

NUM_NEW = 8
PROMPT = "[INST][IMG]What is in this picture?[/INST]"
TWO = "[INST][IMG]and[IMG]Which one is brighter?[/INST]"
TEXT = "[INST]Tell me a story about a cat.[/INST]"
# 5 x 5 cells (30 placeholders), 64 x 48 shrunk to 48 x 36 (5 rows of 6: 35) and 33 x 50 shrunk to 31 x 48 (6 x 4: 30).
IMAGES = [png(1, 40, 36), png(2, 64, 48), png(3, 33, 50)]
CASES = [(PROMPT, [IMAGES[0]]), (PROMPT, [IMAGES[1]]), (TWO, [IMAGES[2], IMAGES[0]]), (TEXT, [])]
PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mistral3", "pixtral-llava"])
def model_dir(request, tmp_path_factory):
    return build_tiny_mistral3(tmp_path_factory.mktemp(request.param), resolve_model("tiny-random", progress=False),
                               llava=request.param == "pixtral-llava")


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_config(_config(model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(model_dir, engine) -> list[list[int]]:
    return greedy_references(model_dir, engine, CASES, transformers_greedy, NUM_NEW)


def test_runs_follow_transformers_processor(model_dir, engine):
    """An image's cells are the processor's image_sizes / cell for sizes inside and above the longest edge; the run
    is rows of image tokens each closed by [IMG_BREAK], the last by [IMG_END], as PixtralProcessor writes it."""
    from PIL import Image

    spec = ImageSpec.from_dir(model_dir)
    tok = engine.tokenizer
    assert spec.pixtral == PixtralGrid(CELL, 48, tok.token_to_id("[IMG_BREAK]"), tok.token_to_id("[IMG_END]"))
    assert spec.image_token_id == tok.token_to_id("[IMG]")
    processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
    for width, height in ((40, 36), (64, 48), (33, 50), (8, 8), (3, 100), (300, 200), (17, 23)):
        size = processor(images=[Image.new("RGB", (width, height))], patch_size={"height": CELL, "width": CELL},
                         return_tensors="pt")["image_sizes"][0].tolist()
        rows, cols = size[0] // CELL, size[1] // CELL
        assert spec.pixtral.cells(height, width) == (rows, cols), (width, height)
        assert spec.tokens_for_size(width, height) == rows * (cols + 1)
    ids, items = spec.expand(tok.encode(PROMPT), [IMAGES[0]])
    run = ids[items[0]["offset"]:items[0]["offset"] + items[0]["length"]]
    img, brk, end = (tok.token_to_id(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
    assert run == ([img] * 5 + [brk]) * 4 + [img] * 5 + [end]


def test_a_widened_prompt_is_taken_as_it_is(engine, reference):
    """Token ids from the model's processor (each image's run written out) with the images: the same tokens."""
    check_a_widened_prompt_is_taken(engine, CASES, reference, PARAMS)


def test_equals_transformers_alone_and_batched(engine, reference):
    assert reference[0] != reference[1]
    assert [engine.generate([_prompt(t, i)], PARAMS)[0].token_ids for t, i in CASES] == reference
    assert [o.token_ids for o in engine.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference


def test_fast_mode_and_chunked_with_preemption(model_dir, reference):
    """Outside deterministic mode a step's images go through the tower as one batch (padded to the largest, as
    transformers pads them); prefill chunks of 5 cut the runs across steps and a small pool preempts: the same
    tokens, each image encoded once."""
    fast = LLMEngine.from_config(_config(model_dir, deterministic=False), progress=False)
    assert [o.token_ids for o in fast.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    eng = LLMEngine.from_config(_config(model_dir, num_kv_blocks=11, block_size=8, max_num_seqs=4,
                                        max_num_batched_tokens=5, enable_prefix_caching=False), progress=False)
    assert [o.token_ids for o in eng.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    assert eng.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert eng.runner.image_embeds.num_encoded == 3


def test_bad_runs_and_embeddings_are_refused(engine):
    """A request built elsewhere whose run lacks its break tokens is refused where it is checked; embeddings carry no
    grid: refused by name; nothing queued."""
    spec = engine.model.image_encoder.spec
    ids, items = spec.expand(engine.tokenizer.encode(PROMPT), [IMAGES[0]])
    flat = [spec.image_token_id if i in range(items[0]["offset"], items[0]["offset"] + items[0]["length"]) else t
            for i, t in enumerate(ids)]
    with pytest.raises(InvalidRequestError, match="are not its image token"):
        engine.add_remote_request("r", flat, SamplingParams(mm_inputs=items))
    with pytest.raises(InvalidRequestError, match="takes images, not their embeddings"):
        engine.add_request({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(30, 64)}}, PARAMS)
    assert not engine.has_unfinished()


def test_disaggregated_over_tcp(model_dir, engine, reference):
    tokens, num_encoded = disagg_tokens(_config(model_dir), engine, CASES, PARAMS)
    assert tokens == reference


def test_served_chat_with_images(model_dir, reference):
    """The OpenAI client's image_url part through the real HTTP server and the checkpoint's chat template:
    transformers' tokens, usage counting the image's whole run."""
    router = LocalRouter(_config(model_dir), request_timeout_s=60)
    try:
        with serving(build_app(router, "mistral3")) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
            out = client.chat.completions.create(
                model="mistral3", max_tokens=NUM_NEW, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "What is in this picture?"}]}])
            assert out.choices[0].token_ids == reference[0]
            assert out.usage.prompt_tokens == len(router.tokenizer.encode(PROMPT)) - 1 + 30
    finally:
        router.close()
