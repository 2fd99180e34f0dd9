"""Images in prompts: a LLaVA checkpoint (LlavaForConditionalGeneration: a CLIP tower and an MLP projector over a
Llama) made by transformers, its images encoded by our engine (engine/multimodal/), against transformers' greedy
with the same image processor, offline, batched with text, chunked through an image's placeholders, preempted,
with the prefix cache, disaggregated over tcp, and served (the real HTTP server and the `openai` client)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
import torch

from conftest import engine_config
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.media_policy import MediaPolicy
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.engine.block_manager import block_hash_root, chained_block_hashes
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import InvalidRequestError, LLMEngine
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.multimodal.spec import ImageSpec, image_digest
from pdcluster.engine.multimodal.tiny_llava import build_tiny_llava, png, transformers_greedy
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig
from test_api import serving
from test_kv_transfer_e2e import Events, _collect_tokens, _wait_free, connected_pair

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

NUM_NEW = 8
PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich one is brighter? ASSISTANT:"
TEXT = "USER: Tell me a story about a cat. ASSISTANT:"
IMAGES = [png(1, 40, 36), png(2, 64, 48), png(3, 33, 50)]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava"), resolve_model("tiny-random", progress=False))


@pytest.fixture(scope="module")
def engine(llava_dir) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(llava_dir), dtype="float32", max_model_len=256,
                                              num_kv_blocks=64, block_size=16, max_num_seqs=8), progress=False)


CASES = [(PROMPT, [IMAGES[0]]), (PROMPT, [IMAGES[1]]), (TWO, [IMAGES[2], IMAGES[0]]), (TEXT, [])]


def tiny_image_config(model_dir, **kw) -> EngineConfig:
    """The engine the tiny Qwen-VL and Mistral 3 checkpoints' tests run (float32, a 64-block pool, 8 requests)."""
    return EngineConfig(**{"model": str(model_dir), "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64,
                           "block_size": 16, "max_num_seqs": 8, **kw})


def greedy_references(model_dir, engine, cases, greedy, num_new: int) -> list[list[int]]:
    """transformers' greedy tokens (``greedy``: a tiny builder's oracle) of each (text, images) case, its prompt
    expanded by the engine's image spec."""
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for text, images in cases:
        ids, _ = engine.model.image_encoder.spec.expand(engine.tokenizer.encode(text), images)
        out.append(greedy(model_dir, ids, images, num_new, model=hf))
    return out


def disagg_tokens(cfg: EngineConfig, engine, cases, params) -> tuple[list[list[int]], int]:
    """Each (text, images) case through a prefill / decode pair over tcp (the decode worker submits; the images
    travel in the request's parameters): its tokens, and how many images the prefill worker encoded. Both workers'
    blocks are all free after."""
    events, ids = Events(), [f"r{i}" for i in range(len(cases))]
    with connected_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        for rid, (text, images) in zip(ids, cases):
            prompt, req_params = engine.with_images(_prompt(text, images), params) if images else (
                engine.tokenizer.encode(text), params)
            d.submit(rid, prompt, req_params, "p0")
        tokens = _collect_tokens(events, ids, timeout_s=120)
        for worker in (p, d):
            _wait_free(worker, cfg.num_kv_blocks, 5)
        return [tokens[rid] for rid in ids], p.engine.runner.image_embeds.num_encoded


@pytest.fixture(scope="module")
def reference(llava_dir, engine) -> list[list[int]]:
    return greedy_references(llava_dir, engine, CASES, transformers_greedy, NUM_NEW)


def check_a_widened_prompt_is_taken(engine, cases, reference, params) -> None:
    """Token ids already widened (each image's whole run of placeholders, as the model's processor writes them) with
    their images: the tokens of the same prompt with one image token an image (vLLM takes both forms); a run one
    placeholder short is refused, naming both forms, and nothing is queued."""
    spec = engine.model.image_encoder.spec
    for (text, images), want in zip(cases, reference):
        if images:
            ids, _ = spec.expand(engine.tokenizer.encode(text), images)
            out = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], params)[0]
            assert out.token_ids == want, text
    text, images = next(case for case in cases if case[1])
    ids, items = spec.expand(engine.tokenizer.encode(text), images)
    short = ids[:items[0]["offset"]] + ids[items[0]["offset"] + 1:]
    with pytest.raises(InvalidRequestError, match="whole run of placeholders"):
        engine.generate([{"prompt_token_ids": short, "multi_modal_data": {"image": images}}], params)
    assert not engine.has_unfinished()


def test_a_widened_prompt_is_taken_as_it_is(engine, reference):
    check_a_widened_prompt_is_taken(engine, CASES, reference, SamplingParams(max_tokens=NUM_NEW, temperature=0.0,
                                                                             ignore_eos=True))


def _prompt(text: str, images: list[bytes]):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def test_spec_read_from_the_checkpoint(llava_dir, engine):
    spec = ImageSpec.from_dir(llava_dir)
    # a 32-pixel image in 8-pixel patches: 16 patches, CLIP's class token dropped ("default")
    assert spec.tokens_per_image == 16 and spec.image_token_id == engine.tokenizer.token_to_id("<image>")
    cfg = json.loads((llava_dir / "config.json").read_text())
    assert ImageSpec.from_config({**cfg, "vision_feature_select_strategy": "full"}).tokens_per_image == 17
    with pytest.raises(ValueError, match="'intern_vit_6b' vision tower is not supported"):
        ImageSpec.from_config({**cfg, "vision_config": {"model_type": "intern_vit_6b"}})
    # Pixtral's tower is served (tests/test_mistral3_images.py), with every patch kept: it has no class token.
    with pytest.raises(ValueError, match="Pixtral tower needs vision_feature_select_strategy 'full'"):
        ImageSpec.from_config({**cfg, "vision_config": {"model_type": "pixtral"}})
    assert ImageSpec.from_dir(resolve_model("tiny-random", progress=False)) is None


def test_equals_transformers_alone_and_batched(engine, reference):
    """Each prompt alone, then all in one batch (images beside a text-only prompt): transformers' tokens; the images
    matter (two images, two answers)."""
    assert reference[0] != reference[1]
    alone = [engine.generate([_prompt(t, i)], PARAMS)[0].token_ids for t, i in CASES]
    assert alone == reference
    assert [o.token_ids for o in engine.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference


def test_chunked_through_the_image_and_preempted(llava_dir, reference):
    """Prefill chunks of 5 tokens cut each image's 16 placeholders across steps, and a pool too small for all at
    once preempts and recomputes: the same tokens. The encoder runs once an image, its cache serving the rest."""
    eng = LLMEngine.from_config(EngineConfig(model=str(llava_dir), dtype="float32", max_model_len=256,
                                             num_kv_blocks=9, block_size=8, max_num_seqs=4, max_num_batched_tokens=5,
                                             enable_prefix_caching=False), progress=False)
    outs = eng.generate([_prompt(t, i) for t, i in CASES], PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert eng.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert eng.runner.image_embeds.num_encoded == 3  # three distinct images, each encoded once


def test_prefix_cache_keeps_images_apart(llava_dir, engine, reference):
    """Two prompts that differ only in their image have the same tokens: their block hashes still differ, and the
    second is not served the first's KV. The same image again is (its blocks cached) and answers the same."""
    spec = engine.model.image_encoder.spec
    ids = engine.tokenizer.encode(PROMPT)
    roots = []
    for image in IMAGES[:2]:
        expanded, items = spec.expand(ids, [image])
        roots.append(chained_block_hashes(expanded, 16, block_hash_root(SamplingParams(mm_inputs=items))))
    assert not set(roots[0]) & set(roots[1])
    engine = LLMEngine.from_config(EngineConfig(model=str(llava_dir), dtype="float32", max_model_len=256,
                                                num_kv_blocks=64, block_size=16), progress=False)  # an empty cache
    first = engine.generate([_prompt(PROMPT, [IMAGES[0]])], PARAMS)[0]
    other = engine.generate([_prompt(PROMPT, [IMAGES[1]])], PARAMS)[0]
    again = engine.generate([_prompt(PROMPT, [IMAGES[0]])], PARAMS)[0]
    assert (first.token_ids, other.token_ids, again.token_ids) == (reference[0], reference[1], reference[0])
    assert other.num_cached_tokens == 0 and again.num_cached_tokens >= 16


def test_image_embeddings_as_input(llava_dir, engine, reference):
    """vLLM's embedding inputs: a tensor of an image's embeddings ([rows, hidden], or [images, rows, hidden]) in
    place of the image; its rows are its placeholders, no tower runs, and the tokens are the image's. They travel as
    bytes in the request's parameters (msgpack) and are kept apart from other images in the prefix cache."""
    import msgpack

    fresh = LLMEngine.from_config(_llava_config(llava_dir), progress=False)
    encoder = fresh.model.image_encoder
    one = encoder.encode([IMAGES[0]])[0]
    two = torch.stack(encoder.encode([IMAGES[2], IMAGES[0]]))
    outs = fresh.generate([{"prompt": PROMPT, "multi_modal_data": {"image": one}},
                           {"prompt": TWO, "multi_modal_data": {"image": two.to(torch.bfloat16).float()}},
                           {"prompt": TWO, "multi_modal_data": {"image": [IMAGES[2], one]}}], PARAMS)
    assert outs[0].token_ids == reference[0] and outs[2].token_ids == reference[2] and len(outs[1].token_ids) == NUM_NEW
    assert fresh.runner.image_embeds.num_encoded == 1  # IMAGES[2] alone went through the tower
    ids, params = fresh.with_images({"prompt": PROMPT, "multi_modal_data": {"image": one.to(torch.bfloat16)}}, PARAMS)
    item = params.mm_inputs[0]
    assert item["embeds"] == ["bfloat16", 16, one.shape[1]] and len(item["data"]) == 16 * one.shape[1] * 2
    assert item["digest"] != image_digest(IMAGES[0])  # its own digest: KV made from it is its own
    wired = SamplingParams(**{**dataclasses.asdict(params), "mm_inputs": msgpack.unpackb(msgpack.packb(
        list(params.mm_inputs), use_bin_type=True), raw=False)})
    assert wired.mm_inputs == params.mm_inputs
    for bad, says in ((torch.zeros(16, 7), "embeddings 7 wide, but this model's hidden size is 64"),
                      (torch.zeros(16, 64, dtype=torch.int32), "tensor of float32, bfloat16, float16")):
        with pytest.raises(InvalidRequestError, match=says):
            fresh.add_request({"prompt": PROMPT, "multi_modal_data": {"image": bad}}, PARAMS)
    with pytest.raises(ValueError, match="embeds must be"):
        SamplingParams(mm_inputs=[{**item, "embeds": ["bfloat16", 15, one.shape[1]]}])
    assert not fresh.has_unfinished()


def test_bad_image_requests_are_refused(engine, tiny_dir):
    with pytest.raises(InvalidRequestError, match=r"1 image token\(s\) .* but 2 image\(s\)"):
        engine.add_request(_prompt(PROMPT, IMAGES[:2]), PARAMS)
    with pytest.raises(InvalidRequestError, match=r"1 image token\(s\) .* and no image"):
        engine.add_request(PROMPT, PARAMS)  # the image token typed in, no image
    with pytest.raises(InvalidRequestError, match="cannot be read as an image"):
        engine.add_request(_prompt(PROMPT, [b"not a png"]), PARAMS)
    with pytest.raises(InvalidRequestError, match="only images are served"):
        engine.add_request({"prompt": PROMPT, "multi_modal_data": {"audio": b"x"}}, PARAMS)
    ids, items = engine.model.image_encoder.spec.expand(engine.tokenizer.encode(PROMPT), [IMAGES[0]])
    shifted = [{**items[0], "offset": items[0]["offset"] + 1}]
    with pytest.raises(InvalidRequestError, match="are not its image token"):
        engine.add_remote_request("r", ids, SamplingParams(mm_inputs=shifted))
    garbage = [{**items[0], "data": b"not a png", "digest": image_digest(b"not a png")}]
    with pytest.raises(InvalidRequestError, match="image 0: cannot be read as an image"):  # a decode worker: its header
        engine.add_remote_request("r", ids, SamplingParams(mm_inputs=garbage))
    # A request resumed on another worker carries its output in its prompt: the model may have written the token.
    engine.check_images(ids + [engine.model.image_encoder.spec.image_token_id], SamplingParams(mm_inputs=items))
    with pytest.raises(ValueError, match="digest does not match"):
        SamplingParams(mm_inputs=[{**items[0], "digest": "0" * 32}])
    checked = SamplingParams(mm_inputs=items)
    assert dataclasses.replace(checked, seed=7).mm_inputs is checked.mm_inputs  # checked once, not at every copy
    assert not engine.has_unfinished()
    text_engine = LLMEngine.from_config(engine_config(), progress=False)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_engine.add_request(_prompt("hello <image>", [IMAGES[0]]), PARAMS)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_engine.add_request([1, 2, 3], SamplingParams(mm_inputs=items))


def test_disaggregated_over_tcp(llava_dir, engine, reference):
    """The prefill worker encodes the images and sends the prompt's KV; the decode worker decodes it: the same tokens
    (the images travel in the request's parameters, over the workers' msgpack messages)."""
    cfg = EngineConfig(model=str(llava_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16)
    tokens, num_encoded = disagg_tokens(cfg, engine, CASES, PARAMS)
    assert num_encoded == 3
    assert tokens == reference


class _ImageServer(BaseHTTPRequestHandler):
    paths: list[str] = []  # every GET, in order

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.paths.append(self.path)
        if self.path == "/redirect":  # to the same server under another host name
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/cat.png")
            self.end_headers()
            return
        if self.path != "/cat.png":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(IMAGES[1])))
        self.end_headers()
        self.wfile.write(IMAGES[1])

    def log_message(self, *args):
        pass


def _data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_served_chat_with_images(llava_dir, reference):
    """The OpenAI client's image_url parts (a data URL, an http URL the server fetches from 127.0.0.1) through the
    real HTTP server: transformers' tokens; bad images are 400s that name the image."""
    images_http = ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    threading.Thread(target=images_http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{images_http.server_address[1]}"
    router = LocalRouter(EngineConfig(model=str(llava_dir), dtype="float32", max_model_len=256, num_kv_blocks=64,
                                      block_size=16), request_timeout_s=60)
    try:
        with serving(build_app(router, "llava")) as base_url:  # the default body limit: 32 MiB with images
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

            def chat(parts, **kw):
                out = client.chat.completions.create(
                    model="llava", messages=[{"role": "user", "content": parts}], max_tokens=NUM_NEW, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
                return out

            text = "What is in this picture?"
            first = chat([{"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}},
                          {"type": "text", "text": text}])
            assert first.choices[0].token_ids == reference[0]
            fetched = chat([{"type": "image_url", "image_url": {"url": f"{url}/cat.png"}},
                            {"type": "text", "text": text}])
            assert fetched.choices[0].token_ids == reference[1]
            assert first.usage.prompt_tokens == fetched.usage.prompt_tokens == len(
                router.tokenizer.encode(PROMPT)) - 1 + 16  # the image token widened to 16 placeholders
            streamed = client.chat.completions.create(
                model="llava", stream=True, max_tokens=NUM_NEW, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}},
                                                       {"type": "text", "text": text}]}])
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == first.choices[0].message.content
            for url_, match in ((f"{url}/missing.png", "answered HTTP 404"), ("data:image/png;base64,@@", "base64"),
                                (_data_url(b"not an image"), "cannot be read as an image"),
                                ("file:///etc/passwd", "file: URLs are off: serve with --allowed-local-media-path"),
                                ("ftp://127.0.0.1/cat.png", r"data: \(base64\), http\(s\): or file:")):
                with pytest.raises(openai.BadRequestError, match=match) as e:
                    chat([{"type": "image_url", "image_url": {"url": url_}}, {"type": "text", "text": text}])
                assert "image 0" in str(e.value)
            with pytest.raises(openai.BadRequestError, match=r"prompt: the prompt has 2 image token\(s\) .* but 0"):
                client.completions.create(model="llava", prompt=PROMPT.replace("<image>", "<image><image>"),
                                          max_tokens=2)
            big = png(5, 640, 640)  # noise: a PNG over 1 MiB, base64 larger still (a text model's whole limit)
            assert len(_data_url(big)) > 1 << 20
            answer = chat([{"type": "image_url", "image_url": {"url": _data_url(big), "detail": "high"}},
                           {"type": "text", "text": text}])
            assert answer.usage.prompt_tokens == first.usage.prompt_tokens
            assert router.worker.engine.runner.image_embeds.num_encoded == 3
            import httpx

            counted = httpx.post(base_url + "/tokenize", timeout=30, json={"model": "llava", "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}},
                                             {"type": "text", "text": text}]}]}).json()
            assert counted["count"] == first.usage.prompt_tokens  # /tokenize counts an image as its placeholders
            answer = client.responses.create(model="llava", max_output_tokens=NUM_NEW, temperature=0,
                                             extra_body={"ignore_eos": True}, input=[{"role": "user", "content": [
                                                 {"type": "input_image", "image_url": _data_url(IMAGES[0])},
                                                 {"type": "input_text", "text": text}]}])
            assert answer.output_text == first.choices[0].message.content  # the Responses API's input_image
    finally:
        router.close()
        images_http.shutdown()


def _llava_config(llava_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(llava_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16, **kw)


def test_limit_mm_per_prompt(llava_dir, reference):
    """vLLM's --limit-mm-per-prompt: a prompt with more images is refused offline and on a worker (whatever its edge
    checked); '{"image": 0}' serves the LLaVA as a text model, its vision tower not loaded."""
    one = LLMEngine.from_config(_llava_config(llava_dir, limit_mm_per_prompt='{"image": 1, "video": 0}'),
                                progress=False)
    assert one.max_images_per_prompt == 1
    with pytest.raises(InvalidRequestError, match=r"2 images in one prompt: at most 1 \(--limit-mm-per-prompt\)"):
        one.add_request(_prompt(TWO, IMAGES[:2]), PARAMS)
    ids, items = one.model.image_encoder.spec.expand(one.tokenizer.encode(TWO), IMAGES[:2])  # the default limit
    with pytest.raises(InvalidRequestError, match="at most 1"):
        one.add_remote_request("r", ids, SamplingParams(mm_inputs=items))
    assert not one.has_unfinished()
    assert one.generate([_prompt(PROMPT, [IMAGES[0]])], PARAMS)[0].token_ids == reference[0]
    off = LLMEngine.from_config(_llava_config(llava_dir, limit_mm_per_prompt='{"image": 0}'), progress=False)
    assert off.model.image_encoder is None and off.max_images_per_prompt == 0
    for refused in (lambda: off.add_request(_prompt(PROMPT, [IMAGES[0]]), PARAMS),
                    lambda: off.add_remote_request("r", ids, SamplingParams(mm_inputs=items))):
        with pytest.raises(InvalidRequestError, match=r"images are off on this server \(--limit-mm-per-prompt"):
            refused()
    assert off.generate([TEXT], PARAMS)[0].token_ids == reference[3]
    with pytest.raises(ValueError, match="'video': this engine serves images only"):
        _llava_config(llava_dir, limit_mm_per_prompt='{"video": 1}')


def test_served_image_limit_and_media_policy(llava_dir, reference, tmp_path):
    """Served: more images than --limit-mm-per-prompt is a 400 before any image is fetched; file: URLs are read under
    --allowed-local-media-path only (a symlink out of it refused); --allowed-media-domains refuses other hosts, a
    redirect to one too."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(IMAGES[1])
    (tmp_path / "secret.png").write_bytes(IMAGES[1])
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    images_http = ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    threading.Thread(target=images_http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{images_http.server_address[1]}"
    router = LocalRouter(_llava_config(llava_dir, limit_mm_per_prompt='{"image": 1}'), request_timeout_s=60)
    policy = MediaPolicy.from_flags(str(media), ["127.0.0.1"])
    try:
        with serving(build_app(router, "llava", media=policy)) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

            def chat(*urls):
                parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
                return client.chat.completions.create(
                    model="llava", max_tokens=NUM_NEW, temperature=0, extra_body={"ignore_eos": True,
                                                                                  "return_token_ids": True},
                    messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}])

            assert chat((media / "cat.png").as_uri()).choices[0].token_ids == \
                chat(f"{url}/cat.png").choices[0].token_ids
            _ImageServer.paths.clear()
            with pytest.raises(openai.BadRequestError, match=r"2 images in one prompt: at most 1"):
                chat(f"{url}/cat.png", f"{url}/cat.png")
            assert _ImageServer.paths == []  # refused before fetching
            for url_, match in (((tmp_path / "secret.png").as_uri(), "outside --allowed-local-media-path"),
                                ((media / "link.png").as_uri(), "outside --allowed-local-media-path"),
                                ((media / "none.png").as_uri(), "no such file"),
                                ((media / "cat.png").as_uri() + "%00.png", "holds a NUL byte"),
                                ("file://otherhost/cat.png", "names a file of this machine"),
                                (f"{url}/redirect", r"http://localhost:\d+/cat.png is not on an allowed host"),
                                ("http://localhost:9/cat.png", r"not on an allowed host \(--allowed-media-domains: "
                                                               r"127.0.0.1\)")):
                with pytest.raises(openai.BadRequestError, match=match) as e:
                    chat(url_)
                assert "image 0" in str(e.value)
            assert _ImageServer.paths == ["/redirect"]  # the redirect's target was never asked for
            assert router.worker.engine.runner.image_embeds.num_encoded == 1
    finally:
        router.close()
        images_http.shutdown()


def test_sglang_generate_with_image_data(llava_dir, reference, tmp_path):
    """SGLang's /generate with ``image_data`` (verl's and slime's rollouts of a vision model): text or input_ids with
    the model's image token, the images as a data URL, bare base64, an http URL the server fetches, or a path under
    --allowed-local-media-path, one prompt or a batch (one entry per prompt), each equal to transformers' tokens;
    an image count that does not match the prompt's image tokens, undecodable base64 and a path outside the
    directory are 400s naming image_data, and nothing runs for them."""
    import httpx

    media = tmp_path / "media"
    media.mkdir()
    (media / "first.png").write_bytes(IMAGES[0])
    (tmp_path / "secret.png").write_bytes(IMAGES[0])
    images_http = ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    threading.Thread(target=images_http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{images_http.server_address[1]}"
    router = LocalRouter(_llava_config(llava_dir), request_timeout_s=60)
    policy = MediaPolicy.from_flags(str(media), ["127.0.0.1"])
    try:
        with serving(build_app(router, "llava", media=policy)) as base_url:
            def generate(**body) -> httpx.Response:
                body["sampling_params"] = {"max_new_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True}
                return httpx.post(base_url + "/generate", json=body, timeout=60)

            one = generate(text=PROMPT, image_data=_data_url(IMAGES[0]))
            assert one.status_code == 200, one.text
            assert one.json()["output_ids"] == reference[0]
            assert one.json()["meta_info"]["prompt_tokens"] == len(router.tokenizer.encode(PROMPT)) - 1 + 16
            bare = generate(input_ids=router.tokenizer.encode(PROMPT),
                            image_data=[base64.b64encode(IMAGES[1]).decode()])
            assert bare.status_code == 200 and bare.json()["output_ids"] == reference[1], bare.text
            widened, _ = router.worker.engine.model.image_encoder.spec.expand(router.tokenizer.encode(TWO),
                                                                             [IMAGES[2], IMAGES[0]])
            taken = generate(input_ids=widened, image_data=[_data_url(IMAGES[2]), _data_url(IMAGES[0])])
            assert taken.status_code == 200 and taken.json()["output_ids"] == reference[2], taken.text
            batch = generate(text=[PROMPT, TWO, TEXT, PROMPT],
                             image_data=[f"{url}/cat.png", [_data_url(IMAGES[2]), str(media / "first.png")], None,
                                         (media / "first.png").as_uri()])
            assert batch.status_code == 200, batch.text
            assert [a["output_ids"] for a in batch.json()] == [reference[1], reference[2], reference[3], reference[0]]
            # A JPEG's base64 starts with "/" (and holds many): base64, never a path, however long.
            jpeg = io.BytesIO()
            PIL.open(io.BytesIO(IMAGES[0])).convert("RGB").save(jpeg, format="JPEG")
            as_b64 = base64.b64encode(jpeg.getvalue()).decode()
            assert as_b64.startswith("/9j/")
            r = generate(text=PROMPT, image_data=as_b64)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == NUM_NEW, r.text
            num_encoded = router.worker.engine.runner.image_embeds.num_encoded
            for body, says in (
                    (dict(text=PROMPT, image_data="/" + "A/" * 300_000), r"image_data\[0\]: "),
                    (dict(text=PROMPT, image_data=str(media / "first.png") + "\x00"), r"image_data\[0\]: "),
                    (dict(text=PROMPT, image_data=[_data_url(IMAGES[0])] * 2), r"1 image token\(s\) .* but 2"),
                    (dict(text=TEXT, image_data=_data_url(IMAGES[0])), r"0 image token\(s\) .* but 1"),
                    (dict(text=PROMPT), r"1 image token\(s\) .* but 0"),
                    (dict(text=PROMPT, image_data="@@not base64@@"), r"image_data\[0\]: an image is an http"),
                    (dict(text=PROMPT, image_data=str(tmp_path / "secret.png")), r"image_data\[0\]: an image is"),
                    (dict(text=[TEXT, PROMPT], image_data=[None, f"{url}/missing.png"]),
                     r"image_data\[1\]\[0\]: fetching .* answered HTTP 404")):
                r = generate(**body)
                assert r.status_code == 400, (body, r.text)
                assert re.search(says, r.json()["error"]["message"]), (says, r.text)
            assert router.worker.engine.runner.image_embeds.num_encoded == num_encoded
    finally:
        router.close()
        images_http.shutdown()


def _torch_b64(tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


class _Reduces:
    """Unpickling this calls os.mkdir(path): what a weights-only load must refuse to do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.path),)


def test_served_image_embeds(llava_dir, engine, reference, tmp_path):
    """vLLM's image_embeds parts (--enable-mm-embeds): an image's embeddings, base64 of torch.save's bytes or of a
    .npy array, in place of the image: the image's tokens and token count, /tokenize agreeing. Refused with a 400
    that says why: the flag off, images mixed with embeddings, the dict form, a pickle that calls a function (never
    run), a sparse or 3-D tensor, the wrong width, more than --limit-mm-per-prompt."""
    import pickle

    import numpy as np

    one = engine.model.image_encoder.encode([IMAGES[0]])[0]  # [16, 64] float32, what the tower makes of it
    npy = io.BytesIO()
    np.save(npy, one.numpy())
    npy_b64 = base64.b64encode(npy.getvalue()).decode()
    text = {"type": "text", "text": "What is in this picture?"}
    router = LocalRouter(_llava_config(llava_dir, limit_mm_per_prompt='{"image": 1}'), request_timeout_s=60)
    try:
        for media in (MediaPolicy(), MediaPolicy(enable_mm_embeds=True)):
            with serving(build_app(router, "llava", media=media)) as base_url:
                client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)

                def chat(*parts):
                    return client.chat.completions.create(
                        model="llava", messages=[{"role": "user", "content": [*parts, text]}], max_tokens=NUM_NEW,
                        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})

                embeds = {"type": "image_embeds", "image_embeds": _torch_b64(one)}
                if not media.enable_mm_embeds:
                    with pytest.raises(openai.BadRequestError, match="serve with --enable-mm-embeds"):
                        chat(embeds)
                    continue
                by_image = chat({"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}, "uuid": "cat"})
                assert by_image.choices[0].token_ids == reference[0]
                encoded_before = router.worker.engine.runner.image_embeds.num_encoded
                for part in (embeds, {"type": "image_embeds", "image_embeds": npy_b64, "uuid": "cat-0"}):
                    answer = chat(part)
                    assert answer.choices[0].token_ids == reference[0]
                    assert answer.usage.prompt_tokens == by_image.usage.prompt_tokens
                assert router.worker.engine.runner.image_embeds.num_encoded == encoded_before  # no tower ran
                import httpx

                counted = httpx.post(base_url + "/tokenize", timeout=30, json={
                    "model": "llava", "messages": [{"role": "user", "content": [embeds, text]}]}).json()
                assert counted["count"] == by_image.usage.prompt_tokens
                evil = base64.b64encode(pickle.dumps(_Reduces(tmp_path / "ran"))).decode()
                sparse = one.to_sparse()
                for parts, match in (
                        ([embeds, {"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}}],
                         "2 images in one prompt: at most 1"),
                        ([{"type": "image_embeds", "image_embeds": {"image_embeds": _torch_b64(one)}}],
                         "dict form .* is not supported"),
                        ([{"type": "image_embeds", "image_embeds": evil}], "neither torch.save'd tensor bytes"),
                        ([{"type": "image_embeds", "image_embeds": "@@"}], "base64 does not decode"),
                        ([{"type": "image_embeds", "image_embeds": _torch_b64(sparse)}], "one dense tensor"),
                        ([{"type": "image_embeds", "image_embeds": _torch_b64(one[None])}], r"\[rows, hidden\]"),
                        ([{"type": "image_embeds", "image_embeds": _torch_b64(one[:, :7])}],
                         "7 wide, but this model's hidden size is 64"),
                        ([{"type": "image_embeds", "image_embeds": _torch_b64(one.int())}],
                         "float32, bfloat16, float16")):
                    with pytest.raises(openai.BadRequestError, match=match):
                        chat(*parts)
                assert not (tmp_path / "ran").exists()  # the pickle's call never ran
        mixed = LocalRouter(_llava_config(llava_dir), request_timeout_s=60)
        try:
            with serving(build_app(mixed, "llava", media=MediaPolicy(enable_mm_embeds=True))) as base_url:
                client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
                with pytest.raises(openai.BadRequestError, match="mixing image_url and image_embeds"):
                    client.chat.completions.create(model="llava", max_tokens=2, messages=[{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}},
                        {"type": "image_embeds", "image_embeds": _torch_b64(one)}, text]}])
                assert mixed.worker.engine.runner.image_embeds.num_encoded == 0
        finally:
            mixed.close()
    finally:
        router.close()


def test_api_processes_learn_the_image_limit(tiny_dir):
    """Behind --api-servers, each API process's RemoteRouter learns the image limit and the image processor's settings
    (--mm-processor-kwargs, which the placeholders it counts follow) from the router's Welcome."""
    from pdcluster.cluster.frontend.protocol import FRONTEND_CODEC, MAX_FRONTEND_BYTES, Welcome
    from pdcluster.cluster.frontend.remote_router import RemoteRouter

    sent = Welcome("m", 64, str(tiny_dir), [], 3, '{"max_pixels": 784}')
    welcome = FRONTEND_CODEC.decode(FRONTEND_CODEC.encode(sent), MAX_FRONTEND_BYTES)
    router = RemoteRouter("ipc:///nowhere", "ipc:///nowhere-either", 0, welcome)
    assert (router.max_images_per_prompt, router.mm_processor_kwargs) == (3, '{"max_pixels": 784}')


def test_media_policy_flags(tmp_path):
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.launcher import spec_from_args
    from pdcluster.cluster.serve_cli import _check_args
    from pdcluster.engine.config import ConfigError

    def checked(*argv):
        args = build_parser().parse_args(["serve", "--port", "0", "--device", "cpu", *argv])
        _check_args(args)
        return args

    args = checked("--mode", "disagg", "--allowed-local-media-path", str(tmp_path), "--allowed-media-domains",
                   "Upload.Wikimedia.org", "127.0.0.1", "--limit-mm-per-prompt", '{"image": 3}')
    assert args.media_policy == MediaPolicy(tmp_path.resolve(), ("upload.wikimedia.org", "127.0.0.1"))
    assert spec_from_args(args).engine.max_images_per_prompt() == 3
    assert checked("--mode", "local").media_policy == MediaPolicy()
    assert checked("--enable-mm-embeds").media_policy == MediaPolicy(enable_mm_embeds=True)
    with pytest.raises(ConfigError, match="--allowed-local-media-path: .* is not a directory"):
        checked("--allowed-local-media-path", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--allowed-media-domains: 'http://x.org' is not a host name"):
        checked("--allowed-media-domains", "http://x.org")


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava_next"), resolve_model("tiny-random", progress=False),
                            next_=True)


# Sizes that pick each pinpoint, wide and tall, with padding dropped in rows and in columns.
NEXT_IMAGES = [png(11, 40, 36), png(12, 64, 48), png(13, 33, 90), png(14, 100, 20), png(15, 70, 70)]


@pytest.fixture(scope="module")
def next_engine(next_dir) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(next_dir), dtype="float32", max_model_len=512,
                                              num_kv_blocks=128, block_size=16, max_num_seqs=8), progress=False)


def test_llava_next_tiles_equal_transformers(next_dir, next_engine):
    """LLaVA-NeXT (anyres tiles): each image's count of placeholders follows its size (AnyResGrid, the same layout
    transformers picks), and the tokens equal transformers' LlavaNextForConditionalGeneration greedy, alone, two
    images in one prompt batched with others and with text, and chunked through the images (prefill chunks of 16)."""
    from transformers.image_processing_utils import select_best_resolution

    spec = ImageSpec.from_dir(next_dir)
    rng = torch.Generator().manual_seed(0)
    for height, width in torch.randint(1, 400, (300, 2), generator=rng).tolist():
        assert spec.grid.best_resolution(height, width) == tuple(select_best_resolution(
            (height, width), [list(p) for p in spec.grid.pinpoints]))
    engine = next_engine
    hf = transformers.LlavaNextForConditionalGeneration.from_pretrained(str(next_dir), dtype=torch.float32).eval()
    cases = [(PROMPT, [image]) for image in NEXT_IMAGES] + [(TWO, NEXT_IMAGES[2:4]), (TEXT, [])]
    lengths, reference = [], []
    for text, images in cases:
        ids, items = spec.expand(engine.tokenizer.encode(text), images)
        lengths.append([item["length"] for item in items])
        reference.append(transformers_greedy(next_dir, ids, images, NUM_NEW, model=hf))
    assert lengths[:5] == [[88], [70], [66], [42], [88]]  # 16 for the whole image, the tiles' kept rows + newlines
    outs = engine.generate([_prompt(text, images) for text, images in cases], PARAMS)
    assert [o.token_ids for o in outs] == reference
    chunked = LLMEngine.from_config(EngineConfig(model=str(next_dir), dtype="float32", max_model_len=512,
                                                 num_kv_blocks=128, block_size=16, prefill_chunk_size=16,
                                                 max_num_batched_tokens=32), progress=False)
    outs = chunked.generate([_prompt(text, images) for text, images in cases[4:]], PARAMS)
    assert [o.token_ids for o in outs] == reference[4:]
    ids, items = spec.expand(engine.tokenizer.encode(PROMPT), [NEXT_IMAGES[0]])
    swapped = [{**items[0], "data": NEXT_IMAGES[1], "digest": image_digest(NEXT_IMAGES[1])}]  # 70 placeholders, not 88
    with pytest.raises(InvalidRequestError, match="88 placeholders at .* do not fit this model \\(70 for this image"):
        engine.add_remote_request("r", ids, SamplingParams(mm_inputs=swapped))


def test_llava_next_served(next_dir, next_engine):
    """Served: a chat's image becomes its own count of placeholders (usage and /tokenize agree) and the tokens are
    those of the offline engine."""
    router = LocalRouter(EngineConfig(model=str(next_dir), dtype="float32", max_model_len=512, num_kv_blocks=128,
                                      block_size=16), request_timeout_s=60)
    try:
        engine = next_engine
        want = [engine.generate([_prompt(PROMPT, [image])], PARAMS)[0].token_ids for image in NEXT_IMAGES[:2]]
        with serving(build_app(router, "llava-next")) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            import httpx

            for image, tokens in zip(NEXT_IMAGES[:2], want):
                messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                                         {"type": "text", "text": "What is in this picture?"}]}]
                out = client.chat.completions.create(model="llava-next", messages=messages, max_tokens=NUM_NEW,
                                                     temperature=0, extra_body={"ignore_eos": True,
                                                                                "return_token_ids": True})
                assert out.choices[0].token_ids == tokens
                counted = httpx.post(base_url + "/tokenize", timeout=30,
                                     json={"model": "llava-next", "messages": messages}).json()
                assert counted["count"] == out.usage.prompt_tokens == len(
                    engine.tokenizer.encode(PROMPT)) - 1 + engine.model.image_encoder.spec.tokens_for(image)
    finally:
        router.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_tensor_parallel_split_takes_images(llava_dir, reference):
    """On a tensor-parallel split (2 CPU ranks) rank 0 encodes the images and the other rank gets their embeddings
    with each forward: transformers' tokens, as the whole model's."""
    split = LLMEngine.from_config(_llava_config(llava_dir, tensor_parallel_size=2, max_num_seqs=8), progress=False)
    try:
        assert split.model.tp_driver is not None and split.max_images_per_prompt == 16
        assert [o.token_ids for o in split.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    finally:
        split.close()


def test_bf16_deterministic_batch_invariant(llava_dir):
    """bf16 in deterministic mode (the CPU default where it has avx512_bf16): a request with images gets its tokens
    alone, bit for bit, in a batch with other images and text (each image encoded alone, its rows the same)."""
    eng = LLMEngine.from_config(EngineConfig(model=str(llava_dir), dtype="bfloat16", deterministic=True,
                                             max_model_len=256, num_kv_blocks=64, block_size=16,
                                             enable_prefix_caching=False), progress=False)
    prompts = [_prompt(t, i) for t, i in CASES]
    batched = [o.token_ids for o in eng.generate(prompts, PARAMS)]
    eng.runner.image_embeds.clear()
    assert [eng.generate([p], PARAMS)[0].token_ids for p in prompts] == batched


@pytest.mark.timeout(400)
def test_disagg_ray_cluster(ray_session, llava_dir, engine, reference):  # noqa: F811
    """Through the router of a disaggregated Ray cluster (prefill and decode actors, KV over tcp): the images ride
    in the request's parameters to both actors; the same tokens as transformers."""
    import asyncio

    from pdcluster.cluster.launcher import Cluster, ClusterSpec

    cluster = Cluster(ClusterSpec(engine=engine_config(str(llava_dir), dtype="float32", max_model_len=256,
                                                       num_kv_blocks=64, limit_mm_per_prompt='{"image": 2}'),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg"))
    assert cluster.router.max_images_per_prompt == 2  # what the API checks a chat's images against

    async def main():
        cluster.router.start(asyncio.get_running_loop())

        async def one(k, text, images):
            prompt, params = engine.with_images(_prompt(text, images), PARAMS) if images else (
                engine.tokenizer.encode(text), PARAMS)
            return [t async for d in cluster.router.generate(f"img-{k}", prompt, params) for t in d.new_token_ids]

        return await asyncio.gather(*[one(k, t, i) for k, (t, i) in enumerate(CASES)])

    try:
        assert asyncio.run(main()) == reference
    finally:
        cluster.shutdown()


@pytest.mark.timeout(300)
def test_recovery_after_a_decode_worker_dies_keeps_the_images(ray_session, llava_dir, engine):  # noqa: F811
    """A decode worker killed mid-stream: the request is re-prefilled, prompt and streamed tokens, on a healthy pair,
    its images encoded again there (they ride in its parameters): the client's tokens equal an uninterrupted run."""
    import asyncio

    from pdcluster.cluster.launcher import Cluster, ClusterSpec
    from test_recovery import _stream_and_kill

    prompt, params = engine.with_images(_prompt(TWO, IMAGES[1:3]), SamplingParams(max_tokens=40, temperature=0.0,
                                                                                   ignore_eos=True))
    expected = engine.generate([_prompt(TWO, IMAGES[1:3])], params)[0].token_ids
    cluster = Cluster(ClusterSpec(engine=engine_config(str(llava_dir), dtype="float32", max_model_len=256,
                                                       num_kv_blocks=64, prefill_chunk_size=16),
                                  transfer=TransferConfig(transport="tcp"), mode="disagg", num_prefill=1,
                                  num_decode=2))
    try:
        tokens, last, _, _ = asyncio.run(_stream_and_kill(cluster, ray_session, prompt, params, kill_after=10,
                                                          kill_role="decode"))
        assert last.finished and last.finish_reason == "length", (last.finish_reason, last.error)
        assert cluster.router.recorder.recoveries, "the request was never recovered"
        assert tokens == expected
    finally:
        cluster.shutdown()


def test_generate_cli_with_an_image(llava_dir, reference, tmp_path):
    """`pdcluster generate --image` as a user runs it: the image fills the prompt's image token."""
    import os
    import subprocess
    import sys

    image = tmp_path / "cat.png"
    image.write_bytes(IMAGES[0])
    cmd = [sys.executable, "-m", "pdcluster.cli", "generate", "--model", str(llava_dir), "--dtype", "float32",
           "--prompt", PROMPT, "--image", str(image), "--max-tokens", str(NUM_NEW), "--ignore-eos", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["token_ids"] == reference[0]
    no_token = [("no image token here" if a == PROMPT else a) for a in cmd]
    run = subprocess.run(no_token, capture_output=True, text=True, timeout=300, env=os.environ.copy(), cwd=tmp_path)
    assert run.returncode != 0 and "put one <image> where each image goes" in run.stderr


def test_text_model_refuses_images_at_the_api():
    """A model without a vision tower: an image part is a 400 naming the reason, and the body limit stays 1 MiB."""
    import httpx

    router = LocalRouter(engine_config(num_kv_blocks=64, max_model_len=256), request_timeout_s=30)
    try:
        with serving(build_app(router, "tiny")) as base_url:
            client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
            with pytest.raises(openai.BadRequestError, match="this model takes no images"):
                client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(IMAGES[0])}}, {"type": "text", "text": "hi"}]}])
            with pytest.raises(openai.BadRequestError, match="audio and file parts are not supported"):
                client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (1 << 20)}]})
            r = httpx.post(base_url + "/v1/chat/completions", content=body,
                           headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == 413 and str(1 << 20) in r.json()["error"]["message"]
    finally:
        router.close()


def test_fast_mode_encodes_a_steps_images_together(llava_dir, reference):
    """Outside deterministic mode (a GPU's default) the step's images go through the tower as one batch: the same
    tokens as transformers."""
    eng = LLMEngine.from_config(EngineConfig(model=str(llava_dir), dtype="float32", deterministic=False,
                                             max_model_len=256, num_kv_blocks=64, block_size=16), progress=False)
    encoder = eng.model.image_encoder
    batches = []
    encode = encoder._encode
    encoder._encode = lambda images, first: batches.append(len(images)) or encode(images, first)
    assert [o.token_ids for o in eng.generate([_prompt(t, i) for t, i in CASES], PARAMS)] == reference
    assert batches == [3]  # the first step's three distinct images (one is in two prompts), one tower call


@pytest.mark.timeout(300)
def test_loadtest_with_images_against_a_served_llava(llava_dir, tmp_path):
    """`pdcluster loadtest --random-images` (vLLM's random-mm) against `pdcluster serve` of a LLaVA, both as a user
    runs them: every request carries its own images, all complete, and the input tokens are the server's count
    (each image's 16 placeholders included); more images than the server's --limit-mm-per-prompt all fail as 400s."""
    from pdcluster.cli.main import main
    from pdcluster.tools.server_process import ServeProcess

    server = ServeProcess(["--mode", "local", "--model", str(llava_dir), "--dtype", "float32", "--num-kv-blocks", "128",
                           "--max-model-len", "256", "--limit-mm-per-prompt", '{"image": 2}'])
    try:
        def run(images: int, out: Path) -> dict:
            rc = main(["loadtest", "--no-progress", "--base-url", server.base_url, "--model", str(llava_dir),
                       "--tokenizer", str(llava_dir), "--endpoint", "chat", "--random-input-len", "12",
                       "--random-output-len", "4", "--num-prompts", "6", "--num-warmups", "0",
                       "--random-images", str(images), "--random-image-size", "64x48", "--result-json", str(out)])
            assert rc in (0, 1)
            return json.loads(out.read_text())

        ok = run(2, tmp_path / "two.json")
        assert (ok["completed"], ok["failed"]) == (6, 0), ok["errors"]
        assert ok["total_input_tokens"] >= 6 * (2 * 16 + 12)
        refused = run(3, tmp_path / "three.json")
        assert (refused["completed"], refused["failed"]) == (0, 6)
        assert refused["errors"] == {"http_400": 6}
    finally:
        server.close()
