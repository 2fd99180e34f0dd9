"""/metrics as llm-d's endpoint picker reads a model server (the Gateway API Inference Extension's model server
protocol): `--metrics-prefix vllm` names every metric as vLLM does (vllm:num_requests_waiting, vllm:num_requests_running,
vllm:kv_cache_usage_perc, ...), and either way the KV block size and pool size are labels of cache_config_info and the
LoRA adapters running and waiting are labels of lora_requests_info (its value: when it was set)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_engine
from pdcluster.cluster.api.app import build_app
from pdcluster.cluster.local_router import LocalRouter
from pdcluster.cluster.metrics import Metrics
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.worker_loop import lora_usage
from test_api import serving
from test_lora import MODEL, adapters  # noqa: F401

pytestmark = pytest.mark.timeout(240)


def _samples(text: str) -> dict[str, list]:
    """Metric family name -> its samples, from a Prometheus exposition."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_vllm_names_and_the_info_gauges():
    metrics = Metrics("m", prefix="vllm")
    stats = {"num_requests_running": 3, "num_requests_waiting": 2, "kv_cache_usage_perc": 0.25, "block_size": 16,
             "num_gpu_blocks": 64, "lora": {"max_lora": 4, "running": ["a1", "a2"], "waiting": ["a3"]}}
    before = time.time()
    metrics.refresh(stats)
    text = metrics.render().decode()
    assert "pdcluster:" not in text
    families = _samples(text)
    assert families["vllm:num_requests_waiting"][0].value == 2 and families["vllm:num_requests_running"][0].value == 3
    assert families["vllm:kv_cache_usage_perc"][0].value == 0.25
    assert "vllm:time_to_first_token_seconds" in families and "vllm:ttft_kv_transfer_seconds" in families
    (info,) = families["vllm:cache_config_info"]
    assert info.labels == {"block_size": "16", "num_gpu_blocks": "64"} and info.value == 1
    (lora,) = families["vllm:lora_requests_info"]
    assert lora.labels == {"max_lora": "4", "running_lora_adapters": "a1,a2", "waiting_lora_adapters": "a3"}
    assert before <= lora.value <= time.time()
    # A pool that grew (a worker added): still one cache_config_info series, the new size.
    metrics.refresh({**stats, "num_gpu_blocks": 128})
    (info,) = _samples(metrics.render().decode())["vllm:cache_config_info"]
    assert info.labels["num_gpu_blocks"] == "128"
    # Ours by default; no LoRA in the stats, no lora_requests_info.
    default = Metrics("m")
    default.refresh({k: v for k, v in stats.items() if k != "lora"})
    families = _samples(default.render().decode())
    assert "pdcluster:num_requests_waiting" in families and "pdcluster:cache_config_info" in families
    assert not any(name.startswith("vllm:") for name in families) and not families.get("pdcluster:lora_requests_info")
    with pytest.raises(ValueError, match="--metrics-prefix: 'sglang' is not one of pdcluster, vllm"):
        Metrics("m", prefix="sglang")


def test_engine_reports_the_adapters_of_its_running_and_waiting_requests(adapters):  # noqa: F811
    engine = make_engine(MODEL, dtype="float32", max_num_seqs=1,
                         lora_modules=tuple(f"{n}={p}" for n, p in adapters.items()), max_loras=2)
    assert lora_usage(engine) == {"lora": {"max_lora": 2, "running": [], "waiting": []}}
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8, lora_name="a1"))
    engine.add_request([5, 6, 7, 9], SamplingParams(max_tokens=8, lora_name="a2"))
    engine.add_request([5, 6, 7, 10], SamplingParams(max_tokens=8))
    engine.step()  # one request runs (max_num_seqs 1), the others wait
    assert lora_usage(engine) == {"lora": {"max_lora": 2, "running": ["a1"], "waiting": ["a2"]}}
    assert lora_usage(make_engine(MODEL, dtype="float32")) == {}  # no LoRA served: no lora_requests_info


def test_served_local_mode_with_vllm_names(tiny_dir):
    router = LocalRouter(EngineConfig(model="tiny-random", num_kv_blocks=96, max_model_len=256), request_timeout_s=60)
    try:
        with serving(build_app(router, "tiny-random", metrics_prefix="vllm")) as base_url:
            httpx.post(f"{base_url}/v1/completions", timeout=60, json={
                "model": "tiny-random", "prompt": "a b c", "max_tokens": 2, "ignore_eos": True}).raise_for_status()
            httpx.post(f"{base_url}/v1/completions", timeout=60,
                       json={"model": "tiny-random", "prompt": "d e", "max_tokens": 3, "n": 2,
                             "ignore_eos": True}).raise_for_status()
            families = _samples(httpx.get(f"{base_url}/metrics", timeout=30).text)
        assert families["vllm:request_success"][0].value == 3  # a choice each
        # vLLM's dashboard's per-request panels: the phases of every choice, the parameters once per request.
        counts = {name: next(s.value for s in families[name] if s.name.endswith("_count")) for name in (
            "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
            "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds",
            "vllm:request_params_max_tokens", "vllm:request_params_n")}
        assert counts == {"vllm:request_queue_time_seconds": 3, "vllm:request_prefill_time_seconds": 3,
                          "vllm:request_decode_time_seconds": 3, "vllm:request_inference_time_seconds": 3,
                          "vllm:request_time_per_output_token_seconds": 3, "vllm:request_params_max_tokens": 2,
                          "vllm:request_params_n": 2}
        assert next(s.value for s in families["vllm:request_params_n"] if s.name.endswith("_sum")) == 3  # 1 + 2
        assert families["vllm:num_requests_waiting"][0].value == 0
        (info,) = families["vllm:cache_config_info"]
        assert info.labels == {"block_size": str(router.worker.engine.config.block_size), "num_gpu_blocks": "96"}
        with pytest.raises(ValueError, match="metrics named pdcluster:"):
            build_app(router, "tiny-random", metrics=Metrics("tiny-random"), metrics_prefix="vllm")
    finally:
        router.close()
