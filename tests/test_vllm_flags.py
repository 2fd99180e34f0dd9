"""`vllm serve` command lines and config files run as they are (cluster/vllm_flags.py, cli/config_file.py): vLLM's
flags without one of ours are mapped onto ours, accepted with a line saying why they change nothing, or refused in
one line saying what to do instead; never "unrecognized arguments". `--config FILE.yaml` puts a file's flags under
the typed ones."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pdcluster.cli.main import build_parser, main
from pdcluster.cluster.engine_args import engine_config_from_args
from pdcluster.cluster.serve_cli import _check_args
from pdcluster.cluster.vllm_flags import NO_OP_FLAGS, NO_OP_VALUE_FLAGS, REFUSED_FLAGS
from pdcluster.engine.config import ConfigError
from pdcluster.tools.server_process import ServeProcess

pytestmark = pytest.mark.timeout(300)


def _args(*argv):
    parsed = build_parser().parse_args(["serve", "--mode", "local", "--port", "0", "--model", "tiny-random", *argv])
    _check_args(parsed)
    return parsed


# A production manifest's vLLM line (flags as vLLM's docs and Helm charts write them).
VLLM_LINE = ["--enforce-eager", "--swap-space", "4", "--distributed-executor-backend", "mp",
             "--disable-custom-all-reduce", "-tp", "1", "-pp", "1", "--data-parallel-size", "1",
             "--compilation-config", '{"level": 3}', "--cuda-graph-sizes", "1", "2", "4",
             "--max-seq-len-to-capture", "8192", "--tokenizer-mode", "auto", "--load-format", "safetensors",
             "--quantization", "fp8", "--guided-decoding-backend", "xgrammar", "--enable-expert-parallel",
             "--num-scheduler-steps", "1", "--prefix-caching-hash-algo", "sha256", "--tokenizer", "tiny-random",
             "--tokenizer-revision", "main", "--trust-remote-code", "--cpu-offload-gb", "0"]


def test_a_manifests_vllm_line_parses_and_says_what_changes_nothing(capsys):
    args = _args(*VLLM_LINE)
    err = capsys.readouterr().err
    for flag in ("--swap-space", "--distributed-executor-backend", "--disable-custom-all-reduce",
                 "--compilation-config", "--quantization", "--enable-expert-parallel"):
        assert f"pdcluster serve: {flag}: accepted, no effect (" in err, flag
    # Mapped, not announced as a no-op: --enforce-eager is --no-cuda-graphs.
    assert "--enforce-eager" not in err
    config = engine_config_from_args(args)
    assert config.cuda_graphs is False and config.mixed_cuda_graph_tokens == 0
    assert config.max_cuda_graph_batch == 4  # --cuda-graph-sizes 1 2 4: the largest
    assert config.load_format == "auto"  # --load-format safetensors: what auto reads
    assert engine_config_from_args(_args("--load-format", "dummy")).load_format == "dummy"  # tests/test_dummy_weights.py
    assert engine_config_from_args(_args()).cuda_graphs is True
    # vLLM's older name of --pooler-config.
    assert _args("--override-pooler-config", '{"pooling_type": "MEAN"}').pooler_config == '{"pooling_type": "MEAN"}'


def test_every_table_flag_is_a_flag_of_serve():
    """Each no-op and refused flag parses (a typo in a table would leave the flag "unrecognized")."""
    actions = build_parser()._subparsers._group_actions[0].choices["serve"]._option_string_actions
    names = [flag for flag, _ in NO_OP_FLAGS.values()] + [f for flags, *_ in NO_OP_VALUE_FLAGS.values() for f in flags]
    names += [flag for flag, *_ in REFUSED_FLAGS.values()]
    assert [n for n in names if n not in actions] == []


def test_cuda_graph_capture_sizes():
    assert engine_config_from_args(_args()).max_cuda_graph_batch == 512
    assert engine_config_from_args(_args("--max-cudagraph-capture-size", "64")).max_cuda_graph_batch == 64
    assert engine_config_from_args(_args("--cuda-graph-sizes", "8", "256")).max_cuda_graph_batch == 256
    with pytest.raises(ConfigError, match="the same setting twice"):
        _args("--cuda-graph-sizes", "256", "--max-cudagraph-capture-size", "64")
    with pytest.raises(ConfigError, match="max_cuda_graph_batch: must be a positive integer"):
        engine_config_from_args(_args("--max-cudagraph-capture-size", "0"))


def test_kv_offloading_size_is_the_host_tier():
    assert engine_config_from_args(_args("--kv-offloading-size", "2")).kv_offload_host_gib == 2.0
    assert engine_config_from_args(_args("--kv-offloading-size", "2", "--kv-offload-host-gib", "2")) \
        .kv_offload_host_gib == 2.0
    with pytest.raises(ConfigError, match="the same setting twice"):
        _args("--kv-offloading-size", "2", "--kv-offload-host-gib", "3")
    with pytest.raises(ConfigError, match="must be > 0 GiB"):
        _args("--kv-offloading-size", "0")
    with pytest.raises(ConfigError, match="lmcache: not supported here: the native host tier"):
        _args("--kv-offloading-backend", "lmcache")


@pytest.mark.parametrize("argv, message", [
    (["--middleware", "my.module.Middleware"], "--middleware my.module.Middleware: cannot import my.module"),
    (["--enable-ssl-refresh"], "--enable-ssl-refresh: needs HTTPS"),  # served (cluster/ssl_refresh.py) with TLS
    (["--headless"], "--headless: not supported here"),
    (["-pp", "2", "-tp", "2"], "pipeline_parallel_size 2: tensor_parallel_size 2 with pipeline_parallel_size 2: "
                               "split a model one way"),  # -pp alone: tests/test_pipeline_parallel.py
    (["-dp", "4"], "--data-parallel-size 4: --mode local serves one in-process engine; give --mode colocated"),
    (["--cpu-offload-gb", "8"], "--cpu-offload-gb 8: not supported here: weights stay on the device"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: not served here .*: give one of auto, hf, slow"),
    (["--tokenizer-revision", "v2"], "tokenizer_revision 'v2': the revision of a --tokenizer Hub id"),
])
def test_what_would_serve_something_else_is_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        engine_config_from_args(_args(*argv))  # most at parsing, the engine's settings (the tokenizer's) at its config


def _cluster_args(*argv):
    parsed = build_parser().parse_args(["serve", "--port", "0", "--model", "tiny-random", *argv])
    _check_args(parsed)
    return parsed


def test_data_parallel_size_is_that_many_whole_engines(capsys):
    """vLLM's -dp N: N engine replicas, each the whole model: N colocated workers (mode auto serves colocated, as
    vLLM's replicas each prefill and decode); with --mode disagg N workers of each role."""
    args = _cluster_args("-dp", "3")
    assert (args.mode, args.num_decode) == ("colocated", 3)
    assert "--data-parallel-size 3: 3 colocated workers" in capsys.readouterr().err
    args = _cluster_args("--mode", "disagg", "--data-parallel-size", "2")
    assert (args.mode, args.num_prefill, args.num_decode) == ("disagg", 2, 2)
    assert _cluster_args("-dp", "2", "--num-decode", "2").num_decode == 2  # the same, spelled twice
    assert _cluster_args("-dp", "1", "--num-decode", "3").num_decode == 3  # -dp 1: vLLM's default, no say
    with pytest.raises(ConfigError, match="--data-parallel-size 2 and --num-decode 3: the same setting twice"):
        _cluster_args("-dp", "2", "--num-decode", "3")
    with pytest.raises(ConfigError, match="--data-parallel-size 2 and --num-prefill 4: the same setting twice"):
        _cluster_args("--mode", "disagg", "-dp", "2", "--num-prefill", "4")
    with pytest.raises(ConfigError, match="--data-parallel-size: must be at least 1, got 0"):
        _cluster_args("-dp", "0")


def test_data_parallel_serves_each_request_on_its_own_engine():
    """`serve MODEL -dp 2`, as a vLLM line gives it: two colocated workers in rotation (the admin list, /metrics),
    round robin placing consecutive requests on each; both answer the same prompt alike."""
    flags = ["tiny-random", "-dp", "2", "--router-policy", "round_robin", "--num-kv-blocks", "64",
             "--max-model-len", "256", "--dtype", "float32", "--admin-key", "adm"]
    with ServeProcess(flags) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        r = http.get("/admin/workers", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200, r.text
        workers = r.json()["workers"]
        assert len(workers) == 2 and all(w["role"] == "decode" and w["in_rotation"] for w in workers), workers
        texts = []
        for _ in range(2):
            r = http.post("/v1/completions", json={"model": "tiny-random", "prompt": "one two three", "max_tokens": 6,
                                                    "temperature": 0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        gauge = re.search(r'^pdcluster:num_workers\{[^}]*role="decode"[^}]*\} ([0-9.]+)$', http.get("/metrics").text,
                          re.M)
        assert gauge is not None and float(gauge.group(1)) == 2


def test_a_config_file_is_under_the_typed_flags(tmp_path, capsys):
    from pdcluster.cli.config_file import expand_config_file
    from pdcluster.cli.main import _build_parsers

    path = tmp_path / "vllm.yaml"
    path.write_text("model: tiny-random\nmax_model_len: 256\nenable-prefix-caching: false\nenforce-eager: true\n"
                    "hf-overrides: {rms_norm_eps: 1.0e-5}\nswap-space: 4\ndisable-log-requests: false\n"
                    "port: 0\nmode: local\n")
    parser, serve = _build_parsers()

    def parsed(*typed):
        args = parser.parse_args(["serve", *expand_config_file(["--config", str(path), *typed], serve, "smollm2")])
        _check_args(args)
        return args

    args = parsed()
    config = engine_config_from_args(args)
    assert (args.model, config.max_model_len, config.enable_prefix_caching, config.cuda_graphs) == \
        ("tiny-random", 256, False, False)
    assert json.loads(config.hf_overrides) == {"rms_norm_eps": 1e-5} and args.disable_log_requests is False
    # A typed flag wins over the file's, a typed model over the file's model.
    assert engine_config_from_args(parsed("--max-model-len", "128")).max_model_len == 128
    assert parsed("smollm2").model == "smollm2" and parsed("--model", "smollm2").model == "smollm2"


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "want a mapping of flag names to values, got a list"),
    ("port: [unclosed", "not YAML"),
    ("bogus-flag: 1", "'bogus-flag' is not a flag of `pdcluster serve`"),
    ("enforce-eager: 3", "enforce-eager is a switch: give true or false"),
    ("config: other.yaml", "a config file cannot name another"),
])
def test_a_bad_config_file_is_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdcluster serve: error: --config {path}: ") and message in err
    assert "Traceback" not in err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_a_server_started_from_a_vllm_config_file(tmp_path):
    """The real CLI on a vLLM-style config file and vLLM flags typed beside it: it serves, and says what it ignored."""
    path = tmp_path / "vllm.yaml"
    path.write_text("model: tiny-random\nmode: local\nnum-kv-blocks: 64\nmax-model-len: 512\n"
                    "served-model-name: from-file\nenforce-eager: true\nswap-space: 4\n"
                    "disable-custom-all-reduce: true\ndistributed-executor-backend: mp\n")
    with ServeProcess(["--config", str(path), "--served-model-name", "typed", "--tokenizer-mode", "auto"],
                      timeout_s=240) as server:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["typed"]  # the typed flag over the file's
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"model": "typed", "prompt": "The quick brown fox", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        output = server.output()
    for flag in ("--swap-space", "--disable-custom-all-reduce", "--distributed-executor-backend", "--tokenizer-mode"):
        assert f"{flag}: accepted, no effect" in output, flag


def test_vllms_api_key_variable_is_the_api_key(monkeypatch):
    """A deployment moved from vLLM keeps its key in VLLM_API_KEY; ours and the flag win over it."""
    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _args().api_key == "from-vllm"
    monkeypatch.setenv("PDCLUSTER_API_KEY", "ours")
    assert _args().api_key == "ours" and _args("--api-key", "typed").api_key == "typed"
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.delenv("PDCLUSTER_API_KEY")
    assert _args().api_key is None


def _expanded(*typed):
    from pdcluster.cli.json_args import expand_dotted_json_args
    from pdcluster.cli.main import _build_parsers

    _, serve = _build_parsers()
    return expand_dotted_json_args(list(typed), serve)


def test_dotted_json_flags_fold_into_their_json():
    """vLLM's `--json-flag.key value` (newer manifests): folded into the flag's JSON, over its plain form."""
    argv = _expanded("--hf-overrides.rms_norm_eps", "1e-5", "--port", "0", "--hf-overrides", '{"a": {"b": 1}}',
                     "--hf-overrides.a.c=true", "--speculative-config.method=ngram",
                     "--speculative-config.num_speculative_tokens", "3", "--override-generation-config.stop+", "x",
                     "--override-generation-config.stop+=y,z", "--limit-mm-per-prompt.image", "2")
    assert argv == ["--hf-overrides", json.dumps({"a": {"b": 1, "c": True}, "rms_norm_eps": 1e-5}), "--port", "0",
                    "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
                    "--override-generation-config", json.dumps({"stop": ["x", "y", "z"]}),
                    "--limit-mm-per-prompt", json.dumps({"image": 2})]
    args = _args(*argv[:6])
    assert args.spec == "ngram" and engine_config_from_args(args).num_spec_tokens == 3
    assert json.loads(engine_config_from_args(args).hf_overrides)["rms_norm_eps"] == 1e-5
    plain = ["--hf-overrides", "{not json"]  # no dotted form: left to the flag's own check, untouched
    assert _expanded(*plain) == plain


@pytest.mark.parametrize("argv, message", [
    (["--port.x", "1"], "--port.x: --port takes no JSON object, so it has no keys to set"),
    (["--hf-overrides.a"], "--hf-overrides.a: give a value"),
    (["--hf-overrides.a", "1", "--hf-overrides", "[1]"], "--hf-overrides: want a JSON object"),
    (["--hf-overrides.a", "1", "--hf-overrides.a.b", "2"], "--hf-overrides.a.b: a is already set to 1"),
])
def test_a_bad_dotted_flag_is_one_line(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdcluster serve: error: ") and message in err and "Traceback" not in err


def test_a_config_files_list_gives_a_repeated_flag_once_per_item(tmp_path):
    """`middleware: [a.B, c.d]` is --middleware given twice (the flag is repeated, not given a list)."""
    from pdcluster.cli.config_file import expand_config_file
    from pdcluster.cli.main import _build_parsers

    path = tmp_path / "vllm.yaml"
    path.write_text("middleware: [site.Tenant, site.stamp]\nallowed-origins: '[\"http://a\"]'\n")
    parser, serve = _build_parsers()
    argv = expand_config_file(["--config", str(path)], serve, "smollm2")
    assert parser.parse_args(["serve", *argv]).middleware == ["site.Tenant", "site.stamp"]
