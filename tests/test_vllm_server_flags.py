"""vLLM's server flags that set a policy for every request (cluster/api/validation.py ServerPolicy): --max-logprobs,
--enable-force-include-usage, --return-tokens-as-token-ids. A real server and the `openai` client over the scripted
router (its logprob records are made up, so every position has them); the flags' parsing in-process.
"""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.options import ApiOptions
from pdcluster.engine.tokenizer import Tokenizer
from test_api import serving
from test_api_openai import Script, ScriptedRouter, _sse_events

pytestmark = pytest.mark.timeout(120)

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@contextlib.contextmanager
def _server(tiny_dir, **kwargs):
    router = ScriptedRouter(Tokenizer(tiny_dir), Script({0: "one two three four"}))
    with serving(build_app(router, "scripted", **kwargs)) as base_url:
        yield (openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30),
               httpx.Client(base_url=base_url, timeout=30))


def test_max_logprobs_bounds_every_kind(tiny_dir):
    with _server(tiny_dir, max_logprobs=5) as (client, _):
        client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=5)
        with pytest.raises(openai.BadRequestError, match=r"top_logprobs: must be in \[0, 5\], got 6 \(the server's "
                                                         r"--max-logprobs\)"):
            client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=6)
        with pytest.raises(openai.BadRequestError, match=r"prompt_logprobs: must be in \[0, 5\]"):
            client.completions.create(model="scripted", prompt="hi", max_tokens=2, extra_body={"prompt_logprobs": 6})
        with pytest.raises(openai.BadRequestError, match=r"n: is the beam width .* at most 2"):
            client.completions.create(model="scripted", prompt="hi", max_tokens=2, n=3,
                                      extra_body={"use_beam_search": True})
    with _server(tiny_dir, max_logprobs=-1) as (client, _):  # the whole vocabulary
        r = client.completions.create(model="scripted", prompt="hi", max_tokens=2, logprobs=40)
        assert len(r.choices[0].logprobs.top_logprobs[0]) >= 1
    with _server(tiny_dir) as (client, _):  # vLLM's default, 20
        with pytest.raises(openai.BadRequestError, match=r"must be in \[0, 20\], got 21$"):
            client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=21)


def test_force_include_usage(tiny_dir):
    with _server(tiny_dir, force_include_usage=True) as (_, http):
        events = _sse_events(http, "/v1/chat/completions", CHAT)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    with _server(tiny_dir) as (_, http):
        assert all(e.get("usage") is None for e in _sse_events(http, "/v1/chat/completions", CHAT))


def test_return_tokens_as_token_ids_by_default(tiny_dir):
    with _server(tiny_dir, return_tokens_as_token_ids=True) as (client, _):
        r = client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=1)
        assert all(t.token.startswith("token_id:") for t in r.choices[0].logprobs.content)
        r = client.chat.completions.create(**CHAT, logprobs=True, extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.token.startswith("token_id:") for t in r.choices[0].logprobs.content)


def test_the_flags_reach_the_app_options():
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.serve_cli import _check_args
    from pdcluster.engine.config import ConfigError

    def options(*argv):
        args = build_parser().parse_args(["serve", "--mode", "local", "--port", "0", *argv])
        _check_args(args)
        return ApiOptions.from_args(args, runtime_lora=False)

    got = options("--max-logprobs", "7", "--enable-force-include-usage", "--return-tokens-as-token-ids")
    assert (got.max_logprobs, got.force_include_usage, got.return_tokens_as_token_ids) == (7, True, True)
    assert (options().max_logprobs, options().force_include_usage) == (20, False)
    with pytest.raises(ConfigError, match="--max-logprobs: must be >= 0"):
        options("--max-logprobs", "-2")
