"""Hugging Face Hub ids, as `vllm serve Qwen/Qwen3-0.6B` takes them (engine/models/hub.py), and the rest of a vLLM
command line (cluster/vllm_flags.py).

No test reaches the Hub: each builds a Hugging Face cache of its own (HF_HOME) holding the tiny model as a snapshot
of ``testorg/tiny``, exactly as huggingface_hub lays one out, and runs the real CLI in a subprocess with
HF_HUB_OFFLINE=1, so the real huggingface_hub finds it there (or says it cannot).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from pdcluster.engine.models.hub import is_hub_id
from pdcluster.tools.server_process import ServeProcess

pytestmark = pytest.mark.timeout(300)

MAIN, V1 = "a" * 40, "b" * 40


def _snapshot(hub_dir, repo_id: str, commit: str, src, ref: str = "main", drop: tuple[str, ...] = ()):
    """``src``'s files as the snapshot ``commit`` of ``repo_id`` in the cache ``hub_dir``, ``ref`` naming it."""
    repo = hub_dir / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit, ignore=shutil.ignore_patterns(*drop, ".pdcluster*"))


@pytest.fixture
def hf_home(tmp_path, tiny_dir):
    home = tmp_path / "hf"
    _snapshot(home / "hub", "testorg/tiny", MAIN, tiny_dir)
    _snapshot(home / "hub", "testorg/noweights", MAIN, tiny_dir, drop=("*.safetensors",))
    return home


def _env(hf_home) -> dict:
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def _cli(hf_home, *args):
    return subprocess.run([sys.executable, "-m", "pdcluster.cli", *args], capture_output=True, text=True,
                          timeout=240, env=_env(hf_home))


GENERATE = ("generate", "--num-kv-blocks", "64", "--max-tokens", "8", "--temperature", "0", "--json",
            "--prompt", "The quick brown fox")


def test_hub_ids():
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    assert not is_hub_id("smollm2") and not is_hub_id("/abs/dir") and not is_hub_id("a/b/c") and not is_hub_id("./x")


def test_a_hub_id_serves_the_snapshot_in_the_cache(hf_home, tiny_dir):
    local = _cli(hf_home, *GENERATE, "--model", "tiny-random")
    hub = _cli(hf_home, *GENERATE, "--model", "testorg/tiny")
    assert local.returncode == 0 and hub.returncode == 0, hub.stderr
    assert json.loads(hub.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]


def test_revision_and_download_dir(hf_home, tiny_dir, tmp_path):
    _snapshot(hf_home / "hub", "testorg/tiny", V1, tiny_dir, ref="v1")
    code = ("from pdcluster.engine.models.registry import resolve_model; import sys; "
            "print(resolve_model(sys.argv[1], revision=sys.argv[2] or None, download_dir=sys.argv[3] or None))")

    def resolve(revision="", download_dir=""):
        return subprocess.run([sys.executable, "-c", code, "testorg/tiny", revision, download_dir],
                              capture_output=True, text=True, timeout=120, env=_env(hf_home))

    assert resolve().stdout.strip().endswith(MAIN) and resolve("v1").stdout.strip().endswith(V1)
    missing = resolve("v2")
    assert missing.returncode != 0 and "testorg/tiny at revision 'v2' is not in the Hugging Face cache" in missing.stderr
    _snapshot(tmp_path / "downloads", "testorg/tiny", V1, tiny_dir)  # --download-dir is a cache of its own
    assert resolve("", str(tmp_path / "downloads")).stdout.strip() == str(
        tmp_path / "downloads" / "models--testorg--tiny" / "snapshots" / V1)


@pytest.mark.parametrize("model,message", [
    ("testorg/missing", "model 'testorg/missing': testorg/missing is not in the Hugging Face cache and the Hub "
                        "cannot be reached"),
    ("testorg/noweights", "model 'testorg/noweights' from the Hugging Face Hub: its files"),
])
def test_what_cannot_be_served_is_one_line(hf_home, model, message):
    r = _cli(hf_home, *GENERATE, "--model", model)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr


def test_a_repository_without_weights_serves_dummy_weights(hf_home):
    """--load-format dummy: a Hub id's configs and tokenizer alone are fetched (a repository without weights is served,
    engine/models/dummy_weights.py)."""
    r = _cli(hf_home, *GENERATE, "--model", "testorg/noweights", "--load-format", "dummy")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 8


def test_a_vllm_serve_command_line(hf_home):
    """`serve MODEL` with vLLM's flags: the model named as the Hub id, the no-op flags said so, prefix caching off."""
    flags = ["testorg/tiny", "--mode", "local", "--num-kv-blocks", "64", "--max-model-len", "512",
             "--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill", "--no-enable-prefix-caching"]
    with ServeProcess(flags, timeout_s=240, extra_env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}) as server:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["testorg/tiny"]
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"model": "testorg/tiny", "prompt": "The quick brown fox", "max_tokens": 4})
        assert r.status_code == 200, r.text
        output = server.output()
    assert "--trust-remote-code: accepted, no effect" in output and "--disable-log-requests: accepted" in output


def test_a_load_tests_tokenizer_from_the_hub(hf_home):
    """`pdcluster loadtest --model owner/name` counts with the Hub's tokenizer files (no weights fetched); a model
    the Hub cannot give leaves the run without exact counts, a --tokenizer it cannot give is an error."""
    code = ("from pdcluster.tools.loadtest.tokenizer_source import load_tokenizer, TokenizerSourceError\n"
            "print(load_tokenizer(None, 'testorg/tiny').encode('hello world'))\n"
            "print(load_tokenizer(None, 'testorg/missing'))\n"
            "try:\n    load_tokenizer('testorg/missing', 'x')\nexcept TokenizerSourceError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(hf_home))
    assert r.returncode == 0, r.stderr
    counted, missing, refused = r.stdout.strip().splitlines()
    assert counted == "[28120, 905]" and missing == "None"
    assert refused.startswith("--tokenizer: testorg/missing is not in the Hugging Face cache")


def test_the_model_given_twice_and_prefix_caching_both_ways():
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.engine_args import engine_config_from_args
    from pdcluster.cluster.serve_cli import _check_args
    from pdcluster.engine.config import ConfigError

    def args(*argv):
        parsed = build_parser().parse_args(["serve", "--mode", "local", "--port", "0", *argv])
        _check_args(parsed)
        return parsed

    assert args("tiny-random").model == "tiny-random" == args("tiny-random", "--model", "tiny-random").model
    with pytest.raises(ConfigError, match="the model is given twice"):
        args("tiny-random", "--model", "smollm2x")
    assert not engine_config_from_args(args("--no-enable-prefix-caching")).enable_prefix_caching
    assert engine_config_from_args(args("--enable-prefix-caching")).enable_prefix_caching
    with pytest.raises(ConfigError, match="--enable-prefix-caching and --no-prefix-caching: give one"):
        engine_config_from_args(args("--enable-prefix-caching", "--no-prefix-caching"))
