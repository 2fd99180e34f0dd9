"""vLLM's `--tokenizer` / `--tokenizer-revision` (engine/models/tokenizer_overlay.py): a model served with another
directory's, built-in model's or Hub repository's tokenizer and chat template.

Real engines and servers on tiny-random: a checkpoint without a tokenizer of its own is served (the same tokens as
the model with its own), the tokenizer's chat template renders chats and the model's does not leak through (offline,
and served by the router and Ray workers, each resolving the overlay), a Hub repository of tokenizer files at a
revision (an offline Hugging Face cache built here), and what cannot be served is one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdcluster.engine.config import ConfigError, EngineConfig
from pdcluster.engine.models.tokenizer_overlay import is_tokenizer_file, with_tokenizer
from pdcluster.tools.server_process import ServeProcess

pytestmark = pytest.mark.timeout(300)

TOKENIZER_TEMPLATE = "TOKENIZER-TEMPLATE {% for m in messages %}[{{ m['content'] }}]{% endfor %}"
MODEL_TEMPLATE = "MODEL-TEMPLATE {% for m in messages %}<{{ m['content'] }}>{% endfor %}"
CHAT = [{"role": "user", "content": "hello there"}]


def _weights_only(src: Path, dst: Path) -> Path:
    """``src``'s model without its tokenizer files (a converted copy shipped as weights and config)."""
    dst.mkdir()
    for f in src.iterdir():
        if not is_tokenizer_file(f.name):
            os.symlink(f, dst / f.name)
    return dst


def _with_own_template(src: Path, dst: Path, chat_template: str) -> Path:
    """``src``'s model with its tokenizer and ``chat_template`` as its chat_template.jinja (none in its config)."""
    _weights_only(src, dst)
    shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    (dst / "chat_template.jinja").write_text(chat_template)
    return dst


def _tokenizer_dir(src: Path, dst: Path, chat_template: str) -> Path:
    """``src``'s tokenizer with ``chat_template`` in its tokenizer_config.json."""
    dst.mkdir()
    for f in src.iterdir():
        if is_tokenizer_file(f.name):
            shutil.copyfile(f, dst / f.name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return dst


@pytest.fixture(scope="module")
def dirs(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer_flag")
    return {"bare": _weights_only(tiny_dir, root / "bare"),
            "templated": _with_own_template(tiny_dir, root / "templated", MODEL_TEMPLATE),
            "tokenizer": _tokenizer_dir(tiny_dir, root / "tokenizer", TOKENIZER_TEMPLATE)}


def _engine(model: str, **config):
    from conftest import make_engine

    return make_engine(model, num_kv_blocks=64, max_model_len=256, **config)


def _greedy(engine, prompt: str) -> list[int]:
    from pdcluster.engine.sampling_params import SamplingParams

    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    return list(out[0].token_ids)


def test_a_checkpoint_without_a_tokenizer_is_served_with_another(dirs, tiny_dir):
    from pdcluster.engine.models.registry import UnknownModelError, resolve_model

    with pytest.raises(UnknownModelError, match="directory lacks tokenizer.json"):
        resolve_model(str(dirs["bare"]))
    own = _engine("tiny-random")
    try:
        want = _greedy(own, "The quick brown fox")
    finally:
        own.close()
    for tokenizer in (str(tiny_dir), "tiny-random"):  # a directory, a built-in name
        engine = _engine(str(dirs["bare"]), tokenizer=tokenizer)
        try:
            assert _greedy(engine, "The quick brown fox") == want
        finally:
            engine.close()


def test_the_tokenizers_chat_template_renders_and_the_models_does_not_leak(dirs, tmp_path):
    from pdcluster.engine.models.registry import resolve_model
    from pdcluster.engine.tokenizer import Tokenizer

    assert Tokenizer(resolve_model(str(dirs["templated"]))).chat_template == MODEL_TEMPLATE  # its own, alone
    overlay = resolve_model(str(dirs["templated"]), tokenizer=str(dirs["tokenizer"]), cache_dir=tmp_path)
    tokenizer = Tokenizer(overlay)
    assert tokenizer.chat_template == TOKENIZER_TEMPLATE
    assert not (overlay / "chat_template.jinja").exists()  # the model's tokenizer files are all hidden
    assert (overlay / "model.safetensors").resolve() == (dirs["templated"] / "model.safetensors").resolve()
    assert (overlay / "tokenizer_config.json").resolve() == (dirs["tokenizer"] / "tokenizer_config.json").resolve()
    # Resolved again (another process, another worker): the same overlay, built once.
    assert resolve_model(str(dirs["templated"]), tokenizer=str(dirs["tokenizer"]), cache_dir=tmp_path) == overlay
    # The tokenizer directory changes (a file added): the overlay follows.
    (dirs["tokenizer"] / "special_tokens_map.json").write_text("{}")
    try:
        again = with_tokenizer(dirs["templated"], dirs["tokenizer"], tmp_path)
        assert again == overlay and (again / "special_tokens_map.json").is_symlink()
    finally:
        (dirs["tokenizer"] / "special_tokens_map.json").unlink()
    # hf_overrides go over the tokenizer's overlay.
    both = resolve_model(str(dirs["templated"]), tokenizer=str(dirs["tokenizer"]), cache_dir=tmp_path,
                         hf_overrides={"rms_norm_eps": 1e-5})
    assert json.loads((both / "config.json").read_text())["rms_norm_eps"] == 1e-5
    assert Tokenizer(both).chat_template == TOKENIZER_TEMPLATE


def test_serve_renders_chats_with_the_tokenizers_template_on_ray_workers(dirs, tiny_dir):
    """Colocated on Ray: the router renders the chat, each worker resolves the overlay itself."""
    from pdcluster.engine.tokenizer import Tokenizer

    flags = ["--model", str(dirs["templated"]), "--tokenizer", str(dirs["tokenizer"]), "--mode", "colocated",
             "--num-decode", "1", "--num-kv-blocks", "64", "--max-model-len", "256"]
    want = Tokenizer(tiny_dir).encode("TOKENIZER-TEMPLATE [hello there]")
    with ServeProcess(flags) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        tokens = http.post("/tokenize", json={"messages": CHAT})
        assert tokens.status_code == 200 and tokens.json()["tokens"] == want, tokens.text
        model = str(dirs["templated"])
        chat = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 4,
                                                       "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(want)


def _snapshot(hub_dir: Path, repo_id: str, commit: str, src: Path, ref: str) -> None:
    repo = hub_dir / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit)


def test_a_hub_tokenizer_at_a_revision(dirs, tmp_path):
    """`generate --model DIR --tokenizer owner/name --tokenizer-revision v1` from an offline Hugging Face cache
    holding only the repository's tokenizer files (no weights are fetched for a tokenizer)."""
    home = tmp_path / "hf"
    _snapshot(home / "hub", "testorg/tok", "c" * 40, dirs["tokenizer"], ref="v1")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    code = ("import sys; from pdcluster.engine.models.registry import resolve_model; "
            "from pdcluster.engine.tokenizer import Tokenizer; "
            "print(Tokenizer(resolve_model(sys.argv[1], tokenizer='testorg/tok', tokenizer_revision=sys.argv[2] or "
            "None)).chat_template)")

    def resolve(revision):
        return subprocess.run([sys.executable, "-c", code, str(dirs["bare"]), revision], capture_output=True,
                              text=True, timeout=120, env=env)

    found = resolve("v1")
    assert found.returncode == 0 and found.stdout.strip() == TOKENIZER_TEMPLATE, found.stderr[-2000:]
    missing = resolve("")  # main is not in the cache
    assert missing.returncode != 0 and "--tokenizer 'testorg/tok'" in missing.stderr, missing.stderr[-2000:]
    cli = subprocess.run([sys.executable, "-m", "pdcluster.cli", "generate", "--model", str(dirs["bare"]),
                          "--tokenizer", "testorg/tok", "--tokenizer-revision", "v1", "--num-kv-blocks", "64",
                          "--max-tokens", "4", "--temperature", "0", "--json", "--prompt", "The quick brown fox"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert cli.returncode == 0 and len(json.loads(cli.stdout)["token_ids"]) == 4, cli.stderr[-2000:]


def test_what_cannot_be_served_is_one_line(dirs, tmp_path, tiny_dir):
    from tokenizers import Tokenizer as HFTokenizer

    from pdcluster.engine.models.registry import UnknownModelError, resolve_model

    with pytest.raises(UnknownModelError, match="--tokenizer '/no/such/dir': no such directory"):
        resolve_model(str(dirs["bare"]), tokenizer="/no/such/dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnknownModelError, match="has no tokenizer.json"):
        resolve_model(str(dirs["bare"]), tokenizer=str(empty))
    with pytest.raises(ConfigError, match="tokenizer_revision 'v2': the revision of a --tokenizer Hub id"):
        EngineConfig(tokenizer_revision="v2")
    # A vocabulary larger than the model's embedding: one line at start-up, not an index error mid-request.
    big = _tokenizer_dir(tiny_dir, tmp_path / "big", TOKENIZER_TEMPLATE)
    tok = HFTokenizer.from_file(str(big / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(3)])
    tok.save(str(big / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"--tokenizer .*big: its vocabulary has 49155 tokens .* more than the "
                                         r"model's 49152 embedding rows"):
        _engine(str(dirs["bare"]), tokenizer=str(big))
    r = subprocess.run([sys.executable, "-m", "pdcluster.cli", "serve", "--model", str(dirs["bare"]), "--mode", "local",
                        "--port", "0", "--tokenizer", str(big)], capture_output=True, text=True, timeout=240)
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 2 and len(errors) == 1 and "embedding rows" in errors[0], r.stderr[-2000:]


def test_a_weight_update_from_a_checkpoint_without_a_tokenizer(dirs, tiny_dir, tmp_path):
    """Served with --tokenizer, a trainer's checkpoint need not carry a tokenizer either (RL rollouts)."""
    from pdcluster.engine.models.perturbed import perturb_checkpoint

    perturbed = perturb_checkpoint(tiny_dir, tmp_path / "perturbed", 1)
    bare = _weights_only(Path(perturbed), tmp_path / "perturbed-bare")
    want = _engine(str(perturbed))
    try:
        want_ids = _greedy(want, "The quick brown fox")
    finally:
        want.close()
    engine = _engine(str(dirs["bare"]), tokenizer="tiny-random")
    try:
        before = _greedy(engine, "The quick brown fox")
        engine.update_weights_from_disk(str(bare), "step-1")
        after = _greedy(engine, "The quick brown fox")
    finally:
        engine.close()
    assert before != want_ids and after == want_ids
