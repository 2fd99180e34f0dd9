"""vLLM's --chat-template (a template in place of the model's: inline or a file) and --default-chat-template-kwargs
(variables under every request's own): chat completions, /tokenize and chat embeddings render alike with them, a
request's chat_template_kwargs still win, and a bad value is one line at start-up. The API through a real server
and the `openai` client over the scripted router; the flags through `pdcluster serve`.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.api.options import chat_template_text
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.tools.server_process import ServeProcess
from test_api import serving
from test_api_openai import Script, ScriptedRouter

pytestmark = pytest.mark.timeout(120)

TEMPLATE = ("{% for m in messages %}[{{ m.role }}|{{ mood | default('plain') }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello"}]


def test_inline_templates_and_files(tmp_path):
    assert chat_template_text(TEMPLATE) == TEMPLATE
    assert chat_template_text("{{ a }}\\n{{ b }}") == "{{ a }}\n{{ b }}"  # the single-line form's escapes
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_text(str(path)) == TEMPLATE
    with pytest.raises(ValueError, match="looks like a file name"):
        chat_template_text(str(tmp_path / "missing.jinja"))


@pytest.fixture
def served(tiny_dir):
    tokenizer = Tokenizer(tiny_dir)
    router = ScriptedRouter(tokenizer, Script({0: "ok"}))
    app = build_app(router, "scripted", chat_template=TEMPLATE, default_chat_template_kwargs={"mood": "calm"})
    with serving(app) as base_url:
        yield tokenizer, base_url


def test_every_chat_route_renders_the_servers_template(served):
    tokenizer, base_url = served
    want = "[user|calm] Hello\n[assistant]"
    r = httpx.post(f"{base_url}/tokenize", json={"model": "scripted", "messages": MESSAGES}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode(want)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    chat = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(want))
    # The request's own variables win over the server's defaults.
    r = httpx.post(f"{base_url}/tokenize", json={"model": "scripted", "messages": MESSAGES,
                                                 "chat_template_kwargs": {"mood": "loud"}}, timeout=30)
    assert tokenizer.decode(r.json()["tokens"]) == "[user|loud] Hello\n[assistant]"


def test_the_defaults_cannot_replace_the_servers_variables(tiny_dir):
    router = ScriptedRouter(Tokenizer(tiny_dir), Script({0: "ok"}))
    with pytest.raises(ValueError, match=r"\['messages'\] are set by the server"):
        build_app(router, "scripted", default_chat_template_kwargs={"messages": []})


@pytest.mark.timeout(300)
def test_serve_with_a_template_file_and_vllms_tool_flag(tmp_path, tiny_dir):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with ServeProcess(["--model", "tiny-random", "--mode", "local", "--num-kv-blocks", "64", "--max-model-len", "512",
                       "--chat-template", str(path), "--default-chat-template-kwargs", '{"mood": "calm"}',
                       "--enable-auto-tool-choice"], timeout_s=240) as server:
        r = httpx.post(f"{server.base_url}/tokenize", json={"model": "tiny-random", "messages": MESSAGES}, timeout=60)
        assert Tokenizer(tiny_dir).decode(r.json()["tokens"]) == "[user|calm] Hello\n[assistant]"
