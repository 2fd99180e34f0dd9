"""bench/gpu_check.py's dry run here (``--device cpu --quick --simulate-gpu-box``): the one device check a GPU
session runs must work before it travels. Its correctness section runs in child processes so that a CUDA fault
(on an H200 an illegal address poisoned the context: every later family and the speed section failed with it)
costs only the model that met it; ``--crash-in`` makes the first child die there as such a process does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _gpu_check(tmp_path: Path, sections: str, *flags: str) -> dict:
    """The dry run of ``sections`` as a clean checkout runs it: its tokenizer assets prepared first (a clone has none:
    they are carried to the GPU machine), in a scratch temp dir; the sections' results."""
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PDCLUSTER_GPU_ASSETS"] = str(tmp_path / "assets")  # the tokenizer files the GPU machine is carried
    scratch = tmp_path / "tmp"  # the check's temporary folders, to see that it removes them
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--prepare-assets"], cwd=ROOT, env=env,
                   check=True, timeout=300, capture_output=True)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--simulate-gpu-box", "--sections", sections, "--out", str(out), *flags],
                         cwd=ROOT, env=env, check=False, timeout=540, capture_output=True, text=True)
    assert out.is_file(), f"gpu_check wrote no result (exit {run.returncode}): {run.stderr[-3000:]}"
    # Its models are hundreds of MB: a child that aborts, or a finished check, leaves none of them behind.
    leftover = [p.name for p in scratch.iterdir() if p.name.startswith("pdcluster-gpu-check")]
    assert not leftover, leftover
    return json.loads(out.read_text())["sections"]


def _dry_run(tmp_path: Path, *flags: str) -> dict:
    return _gpu_check(tmp_path, "env,correctness", *flags)["correctness"]


def test_a_process_that_dies_in_one_model_costs_only_that_model(tmp_path):
    got = _dry_run(tmp_path, "--models", "tiny-random,gemma2,mixtral", "--crash-in", "gemma2")
    assert got["processes"] == 2
    assert got["gemma2"] == {"ok": False, "error": "the check's process ended with status 134 inside this model"}
    for name in ("tiny-random", "mixtral"):  # before the crash, in the first process; after it, in the second
        variants = {k: v for k, v in got[name].items() if isinstance(v, dict)}
        assert variants and all(v["ok"] for v in variants.values()), (name, got[name])
    assert got["ok"] is False


def test_every_model_in_one_process_when_none_dies(tmp_path):
    got = _dry_run(tmp_path, "--models", "tiny-hybrid,gemma2")
    assert got["processes"] == 1 and got["ok"] is True
    assert set(got) >= {"tiny-hybrid", "gemma2"}


def test_every_gpu_marked_module_imports_on_the_gpu_machine(tmp_path):
    """gpu_check runs every gpu-marked module on the GPU machine, which lacks the serving packages (GPU_BOX_MISSING:
    FastAPI, openai, Ray, ...): collected here with those refused, each imports. A gpu-marked test in a module that
    imports them at its top would fail the whole device test run (tests/test_prompt_embeds_cuda.py is its own module
    for that reason)."""
    entry = _gpu_check(tmp_path, "kernel_tests")["kernel_tests"]
    assert entry["collect_only"] and entry["ok"], entry.get("output_tail", entry)
    assert "tests/test_prompt_embeds_cuda.py" in entry["files"]
