"""`pdcluster generate` as a user runs it: a real subprocess, JSON lines out, clear errors in."""

import json
import os
import subprocess
import sys

import pytest


def _run(*args, timeout=300):
    cmd = [sys.executable, "-m", "pdcluster.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


@pytest.mark.timeout(600)
def test_generate_json_lines(smollm2_dir):
    r = _run("generate", "--model", "smollm2", "--prompt", "The capital of France is", "--prompt", "1, 2, 3,",
             "--max-tokens", "8", "--temperature", "0", "--json", "--num-kv-blocks", "128")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [x["prompt"] for x in lines] == ["The capital of France is", "1, 2, 3,"]
    for x in lines:
        assert 0 < len(x["token_ids"]) <= 8 and isinstance(x["text"], str)
    assert lines[0]["text"].startswith(" Paris")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "word " * 300, "--max-model-len", "128"], "max_model_len is 128"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be a positive integer"),
        (["--prompt", "hi", "--max-tokens", "-3"], "max_tokens must be a positive integer"),
        (["--prompt", "hi", "--model", "no-such-model"], "no-such-model"),
        (["--prompt", "hi", "--dtype", "int3"], "invalid choice"),
        (["--prompt", "hi", "--device", "tpu"], "device: 'tpu' is not supported"),
        pytest.param(["--prompt", "hi", "--device", "cuda"], "sees no CUDA device",
                     marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")),
    ],
)
@pytest.mark.timeout(300)
def test_bad_input_is_a_clear_error(tiny_dir, args, message):
    base = ["generate", "--model", "tiny-random", "--num-kv-blocks", "64"]
    r = _run(*base, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["--max-tokens", "0"], ["--top-p", "1.5"], ["--device", "tpu"]])
def test_bad_generate_flags_are_answered_before_torch_is_imported(args):
    """Sampling and engine flags are checked before the engine (and torch, 2-3 s) is imported."""
    argv = ["generate", "--model", "tiny-random", "--prompt", "hi", *args]
    code = f"import sys; from pdcluster.cli.main import main; rc = main({argv!r}); print(rc, 'torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert "error:" in r.stderr and "Traceback" not in r.stderr


def test_dtype_auto_takes_the_checkpoints_dtype(monkeypatch):
    """`--dtype auto` (the CLI default) runs a model in the dtype its config.json names, as vLLM does:
    smollm2's checkpoint is bf16 (the fast CPU path where the CPU has bf16 instructions); fp16
    checkpoints run as bf16 on CPU; without avx512_bf16/AMX both run in float32."""
    from pdcluster.engine import config
    from pdcluster.engine.config import EngineConfig

    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)
    assert EngineConfig(dtype="auto").resolve_dtype({"torch_dtype": "bfloat16"}) == "float32"
    assert EngineConfig(dtype="auto").resolve_dtype({"torch_dtype": "float16"}) == "float32"
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: True)
    auto = EngineConfig(dtype="auto")
    assert auto.resolve_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert auto.resolve_dtype({"dtype": "float32"}) == "float32"
    assert auto.resolve_dtype({"torch_dtype": "float16"}) == "bfloat16"
    assert auto.resolve_dtype({}) == "float32"
    assert EngineConfig(dtype="float32").resolve_dtype({"torch_dtype": "bfloat16"}) == "float32"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "local", "--autoscale"], "--autoscale: needs --mode disagg or colocated"),
        (["--mode", "disagg", "--autoscale", "--min-decode", "3", "--max-decode", "2"], "--min-decode/--max-decode"),
        (["--mode", "disagg", "--autoscale", "--slo-ttft-ms", "0"], "--slo-ttft-ms"),
        (["--mode", "local", "--pooler-config", '{"pooling_type": "MAX"}'], "--pooler-config: pooling_type must be"),
        # vLLM's generation-config and chat-template flags (tests/test_generation_defaults.py, test_chat_template_flags.py)
        (["--mode", "local", "--override-generation-config", "{temperature"], "--override-generation-config: not JSON"),
        (["--mode", "local", "--override-generation-config", '{"top_p": 2}'], "top_p must be in (0, 1]"),
        (["--mode", "local", "--generation-config", "/nonexistent"], "/nonexistent/generation_config.json does not exist"),
        (["--mode", "local", "--chat-template", "/nonexistent/t.jinja"], "--chat-template: '/nonexistent/t.jinja' looks "
                                                                         "like a file name"),
        (["--mode", "local", "--chat-template", "{% for m in messages %}"], "--chat-template does not compile"),
        (["--mode", "local", "--default-chat-template-kwargs", "{mood"], "--default-chat-template-kwargs: not JSON"),
        (["--mode", "local", "--default-chat-template-kwargs", '{"tools": []}'], "['tools'] are set by the server"),
        (["--mode", "local", "--default-chat-template-kwargs", "[1]"], "want a JSON object"),
        # vLLM's external prefill/decode flag (tests/test_external_pd_serve.py)
        (["--mode", "local", "--kv-transfer-config", "{"], "--kv-transfer-config: kv_transfer_config: not JSON"),
        (["--mode", "local", "--kv-transfer-config", '{"kv_connector": "Nope"}'], "is not one of PdclusterConnector"),
        (["--mode", "disagg", "--kv-transfer-config", "{}"], "each instance serves --mode colocated or local"),
        (["--mode", "local", "--kv-transfer-config", "{}", "--no-enable-prefix-caching"], "turn prefix caching on"),
        (["--mode", "disagg", "-tp", "2", "--transport", "cuda_ipc"], "tensor_parallel_size 2: cuda_ipc moves one cache on one GPU"),
        pytest.param(["--mode", "disagg", "--device", "cuda"], "sees no CUDA device",
                     marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")),
    ],
)
@pytest.mark.timeout(120)
def test_bad_serve_flags_are_one_line_before_anything_starts(args, message):
    r = _run("serve", "--model", "tiny-random", "--port", "0", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(300)
def test_generate_with_tensor_parallelism_prints_what_the_whole_model_does(tiny_dir):
    common = ("generate", "--model", "tiny-random", "--dtype", "float32", "--num-kv-blocks", "64", "--max-tokens", "12",
              "--prompt", "The quick brown fox")
    whole, split = _run(*common), _run(*common, "-tp", "2")
    assert whole.returncode == 0 and split.returncode == 0, (whole.stderr, split.stderr)
    assert split.stdout == whole.stdout and whole.stdout.strip()
    refused = _run(*common, "--tensor-parallel-size", "3")
    assert refused.returncode == 2 and "4 attention heads do not split 3 ways" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--num-kv-blocks", "64"],
                                     ["serve", "--port", "0", "--mode", "local"],
                                     # the same check before serve's workers, whichever the mode: slow
                                     pytest.param(["serve", "--port", "0", "--mode", "colocated"],
                                                  marks=pytest.mark.slow)])
@pytest.mark.timeout(300)
def test_spec_mtp_without_a_trained_head_is_refused_in_one_line(tiny_dir, tmp_path, command):
    """A random MTP head drafts nothing the target accepts (0 of 261 on SmolLM2) and decodes slower than
    no speculation: refused at start-up, before any worker, naming the ways out."""
    r = _run(*command, "--model", "tiny-random", "--spec", "mtp", "--cache-dir", str(tmp_path))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no trained MTP head for 'tiny-random'" in lines[0] and "--spec ngram" in lines[0]
    assert "bench/train_mtp.py" in lines[0] and "--mtp-checkpoint PATH" in lines[0]
    missing = _run(*command, "--model", "tiny-random", "--spec", "mtp", "--mtp-checkpoint", str(tmp_path / "x"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_serve_port_defaults_to_the_environment(monkeypatch, capsys):
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.serve_cli import _check_args
    from pdcluster.engine.config import ConfigError

    def port(*argv):
        args = build_parser().parse_args(["serve", "--mode", "local", *argv])
        _check_args(args)
        return args.port

    monkeypatch.delenv("PDCLUSTER_PORT", raising=False)
    assert port() == 8000
    monkeypatch.setenv("PDCLUSTER_PORT", "18123")
    assert port() == 18123 and port("--port", "0") == 0  # the flag wins
    monkeypatch.setenv("PDCLUSTER_PORT", "eighty")
    with pytest.raises(SystemExit) as exit_info:  # argparse: one line naming the variable, status 2
        port()
    assert exit_info.value.code == 2
    assert "want a port number (from --port or $PDCLUSTER_PORT), got 'eighty'" in capsys.readouterr().err
    monkeypatch.setenv("PDCLUSTER_PORT", "70000")
    with pytest.raises(ConfigError, match="--port: must be in 0..65535, got 70000"):
        port()


def test_serve_api_servers_flag():
    """--api-servers (and vLLM's spelling) reach the args; fewer than one is a ConfigError naming it."""
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.serve_cli import _check_args
    from pdcluster.engine.config import ConfigError

    def api_servers(*argv):
        args = build_parser().parse_args(["serve", "--mode", "local", "--port", "0", *argv])
        _check_args(args)
        return args.api_servers

    assert api_servers("--device", "cpu") == 1 and api_servers("--device", "cpu", "--api-servers", "auto") == 1
    assert api_servers("--api-servers", "3") == 3 and api_servers("--api-server-count", "2") == 2
    with pytest.raises(ConfigError, match="--api-servers: must be at least 1, got 0"):
        api_servers("--api-servers", "0")
    with pytest.raises(SystemExit):
        api_servers("--api-servers", "many")


def test_serve_role_tensor_parallel_flags(capsys):
    """--prefill/--decode-tensor-parallel-size: each role's split (disagg), the engine's otherwise; auto with either
    serves disaggregated; a role the mode has no workers of, or fewer than one rank, is a ConfigError naming the
    flag. The cluster spec gives each role its own split."""
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.launcher import ClusterSpec, spec_from_args
    from pdcluster.cluster.serve_cli import _check_args
    from pdcluster.engine.config import ConfigError, EngineConfig

    def checked(*argv):
        args = build_parser().parse_args(["serve", "--port", "0", "--device", "cpu", *argv])
        _check_args(args)
        return args

    args = checked("--mode", "auto", "--prefill-tensor-parallel-size", "2")
    assert args.mode == "disagg" and "--mode auto -> disagg" in capsys.readouterr().err
    spec = spec_from_args(args)
    assert [spec.role_tensor_parallel_size(r) for r in ("prefill", "decode")] == [2, 1]
    spec = spec_from_args(checked("--mode", "disagg", "-tp", "2", "--decode-tensor-parallel-size", "1"))
    assert [spec.role_tensor_parallel_size(r) for r in ("prefill", "decode")] == [2, 1]
    for argv, says in ((["--mode", "colocated", "--prefill-tensor-parallel-size", "2"],
                        "--prefill-tensor-parallel-size: --mode colocated has no prefill workers"),
                       (["--mode", "local", "--decode-tensor-parallel-size", "2"],
                        "--decode-tensor-parallel-size: --mode local has no decode workers"),
                       (["--mode", "disagg", "--decode-tensor-parallel-size", "0"],
                        "--decode-tensor-parallel-size: must be at least 1, got 0")):
        with pytest.raises(ConfigError, match=says):
            checked(*argv)
    assert checked("--mode", "colocated", "--decode-tensor-parallel-size", "2").mode == "colocated"
    with pytest.raises(ValueError, match="colocated mode has no prefill workers"):
        ClusterSpec(EngineConfig(), None, mode="colocated", prefill_tensor_parallel_size=2)


def test_api_servers_auto_streams_from_two_processes_only_on_a_gpu_machine_with_cores():
    """auto: a GPU's steps outrun one process streaming every token; a CPU's cores go to the model."""
    from pdcluster.cluster.serve_cli import GPU_API_SERVERS, resolve_api_servers

    assert GPU_API_SERVERS == 2
    assert resolve_api_servers(16, serves_from_gpu=True) == 2
    assert resolve_api_servers(2, serves_from_gpu=True) == 1  # no core to spare for a second process
    assert resolve_api_servers(64, serves_from_gpu=False) == 1
