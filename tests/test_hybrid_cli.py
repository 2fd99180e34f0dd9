"""`pdcluster generate` / `serve` on hybrid models as a user runs them (real subprocesses): the built-in
tiny-hybrid generates; a model directory the engine cannot serve is one clear line and exit 2, never
a traceback, whether the architecture is unsupported, a layer type is (MoE), or a file is missing."""

from __future__ import annotations

import json
import shutil

import pytest

from test_cli import _run


@pytest.fixture(scope="module")
def hybrid_dir():
    from pdcluster.engine.models.registry import resolve_model

    return resolve_model("tiny-hybrid", progress=False)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.timeout(300)
def test_generate_tiny_hybrid(hybrid_dir):
    r = _run("generate", "--model", "tiny-hybrid", "--prompt", "Hello there", "--max-tokens", "6",
             "--temperature", "0", "--json", "--num-kv-blocks", "64", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    (line,) = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert len(line["token_ids"]) == 6


@pytest.mark.timeout(300)
# One model-dir check behind both commands: serve's (before any worker) in the slow pass.
@pytest.mark.parametrize("command", ["generate", pytest.param("serve", marks=pytest.mark.slow)])
def test_unservable_model_dirs_are_one_line(hybrid_dir, tmp_path, command):
    cases = {
        "GPT2LMHeadModel": _copy_with_config(hybrid_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]),
        "n_group": _copy_with_config(hybrid_dir, tmp_path / "moe", hybrid_override_pattern="ME*-",
                                     layers_block_type=None, n_routed_experts=8, n_group=3),
    }
    no_tok = _copy_with_config(hybrid_dir, tmp_path / "notok")
    (no_tok / "tokenizer.json").unlink()
    cases["tokenizer.json"] = no_tok
    for needle, model_dir in cases.items():
        args = ["--prompt", "hi", "--num-kv-blocks", "64"] if command == "generate" else ["--port", "0"]
        r = _run(command, "--model", str(model_dir), *args, timeout=240)
        assert r.returncode == 2, (needle, r.returncode, r.stdout, r.stderr[-2000:])
        assert needle in r.stderr and "Traceback" not in r.stderr, (needle, r.stderr[-2000:])
        errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and needle in errors[0], r.stderr  # one line says what is wrong
