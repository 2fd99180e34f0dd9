"""The model creator's sampling defaults (vLLM's --generation-config / --override-generation-config,
cluster/api/generation_defaults.py): read from generation_config.json by vLLM's rules, given to the fields a request
leaves out (the request's own values win), and refused in one line when bad. The API through a real server and the
`openai` client over the scripted router, which records the parameters each request reached the router with.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.generation_defaults import NO_DEFAULTS, SamplingDefaults, sampling_defaults
from pdcluster.engine.tokenizer import Tokenizer
from test_api import serving
from test_api_openai import Script, ScriptedRouter

pytestmark = pytest.mark.timeout(120)

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def _model_dir(tmp_path, tiny_dir, generation_config: dict | None):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


# ================================================================================== the rules


def test_the_models_recommendations_are_read(tmp_path, tiny_dir):
    d = _model_dir(tmp_path, tiny_dir, QWEN3)
    assert sampling_defaults(d) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert sampling_defaults(d, "vllm") == NO_DEFAULTS  # vLLM's own defaults, the file unread
    assert sampling_defaults(d, "auto", {"temperature": 0.2, "max_new_tokens": 7}) == \
        SamplingDefaults(temperature=0.2, top_p=0.95, top_k=20, max_tokens=7)
    assert sampling_defaults(d, "vllm", {"min_p": 0.05}) == SamplingDefaults(min_p=0.05)
    assert sampling_defaults(d, str(d)) == sampling_defaults(d)  # a directory holding the file


def test_transformers_own_defaults_are_no_recommendation(tmp_path, tiny_dir):
    """vLLM reads the file's differences from transformers' GenerationConfig: top_k 50 and temperature 1.0 are what
    transformers assumes anyway, not what the model's creator asks for."""
    d = _model_dir(tmp_path, tiny_dir, {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.1,
                                        "max_new_tokens": 256})
    assert sampling_defaults(d) == SamplingDefaults(repetition_penalty=1.1, max_tokens=256)
    (tmp_path / "none").mkdir()
    assert sampling_defaults(_model_dir(tmp_path / "none", tiny_dir, None)) == NO_DEFAULTS  # no file: none


@pytest.mark.parametrize("source,overrides,message", [
    ("/nonexistent/dir", None, "--generation-config: /nonexistent/dir/generation_config.json does not exist"),
    ("vllm", {"temperature": -1}, "temperature must be >= 0"),
    ("vllm", {"top_p": 0}, "top_p must be in (0, 1]"),
    ("vllm", {"top_k": 2.5}, "top_k must be an integer"),
    ("vllm", {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ("vllm", {"repetition_penalty": "high"}, "repetition_penalty must be > 0"),
    ("vllm", [1, 2], "want a JSON object"),
])
def test_bad_sources_and_values_name_the_flag(source, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        sampling_defaults(None, source, overrides)


def test_other_generation_settings_are_ignored_with_a_warning(caplog):
    assert sampling_defaults(None, "vllm", {"do_sample": True, "top_k": 5}) == SamplingDefaults(top_k=5)
    assert "ignoring do_sample" in caplog.text


# ================================================================================== the API


@pytest.fixture
def served(tmp_path, tiny_dir):
    """A server on a model whose generation config is Qwen3's, with max_new_tokens 5 over it."""
    router = ScriptedRouter(Tokenizer(_model_dir(tmp_path, tiny_dir, QWEN3)), Script({0: "x " * 40}))
    app = build_app(router, "scripted", override_generation_config={"max_new_tokens": 5})
    with serving(app) as base_url:
        yield router, openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)


def _params(router):
    (params,) = router.params.values()
    router.params.clear()
    return params


def test_a_request_without_sampling_fields_gets_the_models(served):
    router, client = served
    client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    p = _params(router)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.6, 0.95, 20, 0.0, 1.0, 5)
    client.completions.create(model="scripted", prompt="hi")
    p = _params(router)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 16)  # OpenAI's 16 for completions


def test_the_requests_own_values_win(served):
    router, client = served
    client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                   top_p=0.5, max_tokens=9, extra_body={"top_k": -1, "repetition_penalty": 1.2})
    p = _params(router)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.0, 0.5, 0, 1.2, 9)


def test_without_a_generation_config_nothing_changes(tiny_dir):
    router = ScriptedRouter(Tokenizer(tiny_dir), Script({0: "x y z"}))
    with serving(build_app(router, "scripted")) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    p = _params(router)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert 16 < p.max_tokens < router.max_model_len  # up to the context's end
