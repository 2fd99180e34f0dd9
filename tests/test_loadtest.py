"""`pdcluster loadtest` against a real `pdcluster serve --mode local --model tiny-random` subprocess on
127.0.0.1 (CI-sized runs: about 20 requests of 8 tokens), plus unit tests of the pieces whose math a
live run cannot pin down: datasets on the real packages, arrival statistics, goodput.

Tolerance of the TTFT cross-check (client vs the server's own histogram): the client's interval
(request sent -> first SSE chunk read) contains the server's (request parsed -> first token streamed),
so the client's mean must not be below the server's (2 ms slack for clock reads), and may exceed it
by at most 60 ms + 50 % of it: HTTP, JSON validation and SSE framing on a loaded 2-core machine
(measured here: +10..20 ms on a ~50 ms TTFT). A TTFT taken at the wrong chunk (e.g. the last) or from
the wrong start is far outside that.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket

import httpx
import numpy as np
import pytest

from pdcluster.cli.main import main
from pdcluster.tools.loadtest.arrivals import ArrivalProcess, ArrivalError, within_duration
from pdcluster.tools.loadtest.client import RequestRecord, Target, send_request
from pdcluster.tools.loadtest.datasets import (
    DatasetError, DatasetOptions, SampleRequest, load_humaneval_prompts, load_requests,
    load_sharegpt_conversations, sharegpt_path)
from pdcluster.tools.loadtest.lengths import LengthDist, LengthSpecError
from pdcluster.tools.loadtest.metrics import SLO, summarize
from pdcluster.tools.loadtest.runner import run_workload
from pdcluster.tools.loadtest.server_metrics import parse_prometheus
from pdcluster.tools.server_process import ServeProcess

MODEL = "tiny-random"
# The CLI contract: fields other tools read from the result JSON.
CONTRACT_FIELDS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "request_goodput", "slo_attainment", "errors",
    "ttft_breakdown", "server_metrics",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p50", "p90", "p99")),
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ================================================================================ the server


class LocalServer(ServeProcess):
    """`pdcluster serve --mode local` in a subprocess on a free loopback port."""

    def __init__(self, timeout_s: float = 180):
        super().__init__(["--mode", "local", "--model", MODEL, "--num-kv-blocks", "256", "--max-model-len", "512"],
                         timeout_s=timeout_s)

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=30, trust_env=False).text


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = LocalServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from pdcluster.engine.tokenizer import Tokenizer

    return Tokenizer(tiny_dir)


def _sample(text: str, name: str) -> float:
    """One sample of the exposition text, summed over its label sets (independent of the harness's
    own parser, so a parser bug cannot confirm itself)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def _loadtest(*argv: str) -> int:
    return main(["loadtest", "--no-progress", *argv])


def _png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# ================================================================================ live runs


@pytest.mark.timeout(240)
def test_run_writes_every_field_and_agrees_with_server_metrics(server, tmp_path):
    num_prompts, input_len, output_len = 20, 32, 8
    before = server.metrics()
    rc = _loadtest("--base-url", server.base_url, "--model", MODEL, "--dataset", "random",
                   "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                   "--num-prompts", str(num_prompts), "--request-rate", "20", "--seed", "1",
                   "--num-warmups", "0",  # so this test's own /metrics deltas cover exactly the run
                   "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500",
                   "--result-json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    after = server.metrics()
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    missing = [f for f in CONTRACT_FIELDS if f not in result]
    assert not missing, f"result JSON lacks {missing}"

    # Counts: ours, the server's usage, and the server's own counter agree.
    assert result["completed"] == num_prompts and result["failed"] == 0 and result["errors"] == {}
    served = _sample(after, "pdcluster:request_success_total") - _sample(before, "pdcluster:request_success_total")
    assert result["completed"] == served
    assert result["input_lens"] == [input_len] * num_prompts  # usage.prompt_tokens, request by request
    assert result["total_input_tokens"] == num_prompts * input_len
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["prompt_len_mismatches"] == 0

    # TTFT: the client's mean vs the server's histogram mean (tolerance in the module docstring).
    d_sum = (_sample(after, "pdcluster:time_to_first_token_seconds_sum")
             - _sample(before, "pdcluster:time_to_first_token_seconds_sum"))
    d_count = (_sample(after, "pdcluster:time_to_first_token_seconds_count")
               - _sample(before, "pdcluster:time_to_first_token_seconds_count"))
    assert d_count == num_prompts
    server_ttft_ms = d_sum / d_count * 1e3
    assert server_ttft_ms - 2 <= result["mean_ttft_ms"] <= server_ttft_ms + 60 + 0.5 * server_ttft_ms, \
        (result["mean_ttft_ms"], server_ttft_ms)
    assert result["ttft_breakdown"]["count"] == num_prompts
    assert result["ttft_breakdown"]["total_ms"] == pytest.approx(server_ttft_ms, rel=1e-6)
    assert result["ttft_breakdown"]["prefill_ms"] > 0
    assert result["server_metrics"]["request_success"] == num_prompts

    # Internal consistency of the statistics.
    assert result["request_throughput"] == pytest.approx(num_prompts / result["duration"])
    assert result["output_throughput"] == pytest.approx(num_prompts * output_len / result["duration"])
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
    assert result["mean_e2el_ms"] > result["mean_ttft_ms"]
    assert 0 <= result["request_goodput"] <= result["request_throughput"]
    assert len(result["ttfts"]) == len(result["e2els"]) == num_prompts

    w, h = _png_size(tmp_path / "r.png")
    assert os.path.getsize(tmp_path / "r.png") > 10_000 and w > 500 and h > 200


@pytest.mark.timeout(240)
def test_embeddings_endpoint_is_timed_as_one_answer(server, tmp_path):
    """--endpoint embeddings: each request one JSON answer (TTFT = E2E, no output tokens), counted by the server."""
    num_prompts, input_len = 12, 24
    before = server.metrics()
    rc = _loadtest("--base-url", server.base_url, "--model", MODEL, "--endpoint", "embeddings",
                   "--random-input-len", str(input_len), "--num-prompts", str(num_prompts), "--request-rate", "inf",
                   "--num-warmups", "0", "--result-json", str(tmp_path / "e.json"))
    assert rc == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["completed"] == num_prompts and result["failed"] == 0
    assert result["input_lens"] == [input_len] * num_prompts and result["total_output_tokens"] == 0
    assert result["ttfts"] == result["e2els"] and result["mean_ttft_ms"] > 0 and result["tpots"] == []
    served = _sample(server.metrics(), "pdcluster:request_success_total") - \
        _sample(before, "pdcluster:request_success_total")
    assert served == num_prompts


@pytest.mark.timeout(240)
def test_sweep_over_two_rates_writes_both_runs_and_a_sweep_plot(server, tmp_path):
    before = server.metrics()
    rc = _loadtest("--base-url", server.base_url, "--model", MODEL, "--random-input-len", "16",
                   "--random-output-len", "4", "--num-prompts", "8", "--sweep", "4,16", "--num-warmups", "3",
                   "--slo-ttft-ms", "1000", "--slo-tpot-ms", "200",
                   "--result-json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"))
    assert rc == 0
    sweep = json.loads((tmp_path / "s.json").read_text())["sweep"]
    assert [r["request_rate"] for r in sweep] == [4.0, 16.0]
    assert sweep[0]["seed"] == 0 and sweep[1]["seed"] != 0  # fresh prompts per rate: no prefix-cache carry-over
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in sweep)
    # Warm-ups reach the server but no number of ours.
    name = "pdcluster:request_success_total"
    assert _sample(server.metrics(), name) - _sample(before, name) == 3 + 2 * 8
    assert [r["server_metrics"]["request_success"] for r in sweep] == [8, 8]
    _, single_height = _png_size(_one_run_plot(tmp_path))
    _, sweep_height = _png_size(tmp_path / "s.png")
    assert os.path.getsize(tmp_path / "s.png") > 10_000
    assert sweep_height > 1.5 * single_height  # the second row: goodput and p99s against rate


def _one_run_plot(tmp_path):
    from pdcluster.tools.loadtest.plot import plot_run

    result = summarize([_record(0.1, 0.3, 5)], 1.0, SLO())
    plot_run({**result, "request_rate": 1.0}, tmp_path / "one.png")
    return tmp_path / "one.png"


@pytest.mark.timeout(120)
def test_random_prompts_have_exact_lengths_for_tokenizer_and_server(server, tokenizer):
    lengths = LengthDist.parse("1:96")
    text_opts = DatasetOptions(num_prompts=12, seed=7, input_len=lengths, prompt_format="text")
    texts = load_requests("random", text_opts, tokenizer)
    ids = load_requests("random", DatasetOptions(num_prompts=12, seed=7, input_len=lengths, prompt_format="ids"),
                        tokenizer)
    assert len({r.prompt_len for r in texts}) > 3  # the lengths really vary
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as http:
        for t, i in zip(texts, ids):
            assert isinstance(t.prompt, str) and len(tokenizer.encode(t.prompt)) == t.prompt_len
            assert tokenizer.encode(t.prompt) == i.prompt  # the ids are the text's own tokens
            for prompt in (t.prompt, i.prompt):
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] == t.prompt_len


@pytest.mark.timeout(120)
def test_client_records_errors_by_kind(server):
    sample = SampleRequest([5, 6, 7, 8], 4, 64)

    async def go():
        async with httpx.AsyncClient(trust_env=False) as http:
            wrong_model = await send_request(http, Target(server.base_url, "no-such-model"), sample)
            too_slow = await send_request(http, Target(server.base_url, MODEL, timeout_s=0.001), sample)
            closed = await send_request(http, Target(f"http://127.0.0.1:{_closed_port()}", MODEL), sample)
            fine = await send_request(http, Target(server.base_url, MODEL), sample)
        return wrong_model, too_slow, closed, fine

    wrong_model, too_slow, closed, fine = asyncio.run(go())
    assert (wrong_model.ok, wrong_model.error_kind) == (False, "http_404") and "no-such-model" in wrong_model.error
    assert (too_slow.ok, too_slow.error_kind) == (False, "timeout")
    assert (closed.ok, closed.error_kind) == (False, "connection")
    assert fine.ok and fine.output_len == 64 and fine.server_prompt_len == 4
    assert len(fine.chunk_times_s) >= 2 and fine.chunk_times_s == sorted(fine.chunk_times_s)


@pytest.mark.timeout(120)
def test_max_concurrency_caps_requests_in_flight(server):
    requests = [SampleRequest([11, 12, 13, 14, 15, 16], 6, 6) for _ in range(4)]
    outcome = asyncio.run(run_workload(Target(server.base_url, MODEL), requests, np.zeros(4), max_concurrency=1,
                                       progress=False))
    spans = sorted((r.send_time_s, r.send_time_s + r.e2e_s) for r in outcome.records)
    assert all(r.ok for r in outcome.records)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans


# ================================================================================ CLI without a server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nobody listens there


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, says", [
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "-2"], "--request-rate"),
    (["--sweep", "1,fast"], "--sweep"),
    (["--dataset", "no-such-dataset"], "unknown dataset"),
    (["--random-input-len", "9:3"], "--random-input-len"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--random-images", "1"], "--random-images: for --dataset random on --endpoint chat"),
    (["--endpoint", "chat", "--random-images", "1", "--random-image-size", "big"], "--random-image-size"),
    ([], "cannot reach"),  # nobody listens at the base URL
])
def test_bad_arguments_give_one_clear_line(capsys, argv, says):
    rc = _loadtest("--base-url", f"http://127.0.0.1:{_closed_port()}", "--model", MODEL, *argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("pdcluster loadtest: error:") and says in err[0], err


@pytest.mark.timeout(60)
def test_compare_prints_side_by_side_and_plots(tmp_path, capsys):
    slo = SLO(ttft_ms=200, tpot_ms=30)
    fast = summarize([_record(0.05, 0.25, 11) for _ in range(4)], 2.0, slo)
    slow = summarize([_record(0.40, 1.40, 11) for _ in range(4)], 4.0, slo)
    (tmp_path / "a.json").write_text(json.dumps({**fast, "label": "disagg", "request_rate": 2.0}))
    (tmp_path / "b.json").write_text(json.dumps({**slow, "label": "colocated", "request_rate": 2.0}))
    rc = _loadtest("--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--plot", str(tmp_path / "c.png"))
    assert rc == 0
    table = capsys.readouterr().err
    assert "disagg" in table and "colocated" in table
    goodput_row = next(line for line in table.splitlines() if line.startswith("request goodput"))
    assert goodput_row.split()[-3:] == ["2.000", "0.000", "0.00x"]
    _png_size(tmp_path / "c.png")
    assert os.path.getsize(tmp_path / "c.png") > 10_000


# ================================================================================ datasets


@pytest.mark.timeout(120)
def test_sharegpt_truncated_file_yields_every_complete_conversation_only():
    text = sharegpt_path().read_text(encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # the packaged file really is cut off mid-record
    records = load_sharegpt_conversations()
    assert len(records) > 10_000
    assert len(records) == text.count('"conversations"') - 1  # all but the cut-off one
    for record in records:
        assert isinstance(record["conversations"], list)
        assert all(isinstance(t["from"], str) and isinstance(t["value"], str) for t in record["conversations"])
    requests = load_requests("sharegpt", DatasetOptions(num_prompts=50, seed=3), None)
    assert len(requests) == 50 and all(isinstance(r.prompt, str) and r.output_len >= 4 for r in requests)


@pytest.mark.timeout(30)
def test_sharegpt_reader_drops_a_cut_off_tail(tmp_path):
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi, ] {"}, {"from": "gpt", "value": "ok"}]}
    broken_turns = {"id": "b", "conversations": "not a list"}
    path = tmp_path / "cut.json"
    path.write_text("[\n" + json.dumps(good) + ",\n" + json.dumps(broken_turns) + ",\n" + json.dumps(good)
                    + ',\n  {"id": "c", "conversations": [{"from": "human", "val')
    assert load_sharegpt_conversations(path) == (good, good)


@pytest.mark.timeout(30)
def test_humaneval_has_164_prompts(tokenizer):
    prompts = load_humaneval_prompts()
    assert len(prompts) == 164 and all(isinstance(p, str) and "def " in p for p in prompts)
    requests = load_requests("humaneval", DatasetOptions(num_prompts=200, seed=0, fixed_output_len=16), tokenizer)
    assert len(requests) == 200 and len({r.prompt for r in requests}) == 164
    assert all(r.output_len == 16 and r.prompt_len == len(tokenizer.encode(r.prompt)) for r in requests)


@pytest.mark.timeout(30)
def test_jsonl_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [1, 2, 3]}\n')
    requests = load_requests(str(path), DatasetOptions(num_prompts=3), None)
    assert [(r.prompt, r.output_len) for r in requests] == [("hello", 3), ([1, 2, 3], 128), ("hello", 3)]
    assert requests[1].prompt_len == 3
    path.write_text('{"prompt": "x"}\n{"prompt": ""}\n')
    with pytest.raises(DatasetError, match=r"p.jsonl:2"):
        load_requests(str(path), DatasetOptions(num_prompts=1), None)


@pytest.mark.timeout(30)
def test_length_distributions():
    rng = np.random.default_rng(0)
    assert (LengthDist.parse("7").sample(rng, 5) == 7).all()
    uniform = LengthDist.parse("3:9").sample(rng, 5000)
    assert uniform.min() == 3 and uniform.max() == 9
    normal = LengthDist.parse("normal:100:10").sample(rng, 5000)
    assert abs(normal.mean() - 100) < 1 and abs(normal.std() - 10) < 1
    for bad in ("0", "5:2", "normal:0:1", "x", "1:2:3"):
        with pytest.raises(LengthSpecError):
            LengthDist.parse(bad)


# ================================================================================ arrivals


@pytest.mark.timeout(30)
def test_poisson_arrivals_have_the_requested_mean_rate():
    rate, n = 5.0, 20_000
    times = ArrivalProcess("poisson", rate).send_times_s(n, seed=0)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all()
    # Mean gap of n exponentials: relative std 1/sqrt(n) ~ 0.7 %; 3 % is > 4 sigma.
    assert (n - 1) / times[-1] == pytest.approx(rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1
    assert np.array_equal(times, ArrivalProcess("poisson", rate).send_times_s(n, seed=0))  # seeded
    assert not np.array_equal(times, ArrivalProcess("poisson", rate).send_times_s(n, seed=1))


@pytest.mark.timeout(30)
def test_constant_and_burst_arrivals_and_duration_bound():
    assert np.allclose(ArrivalProcess("constant", 4.0).send_times_s(5, 0), [0, 0.25, 0.5, 0.75, 1.0])
    burst = ArrivalProcess("burst", 4.0, burst_size=3).send_times_s(7, 0)
    assert np.allclose(burst, [0, 0, 0, 0.75, 0.75, 0.75, 1.5])  # 3 per 0.75 s = 4 req/s
    assert (ArrivalProcess("poisson", float("inf")).send_times_s(4, 0) == 0).all()
    assert within_duration(np.array([0, 0.5, 1.0, 1.5]), 1.0) == 3
    assert within_duration(np.array([0, 0.5]), None) == 2
    for kind, rate in (("poisson", 0.0), ("poisson", -1.0), ("sometimes", 1.0)):
        with pytest.raises(ArrivalError):
            ArrivalProcess(kind, rate)


# ================================================================================ goodput


def _record(ttft_s, e2e_s, output_len, ok=True, error_kind=""):
    r = RequestRecord(prompt_len=10, max_tokens=output_len, ok=ok, ttft_s=ttft_s, e2e_s=e2e_s,
                      output_len=output_len, error_kind=error_kind, server_prompt_len=10 if ok else None)
    if ok:
        r.chunk_times_s = list(np.linspace(ttft_s, e2e_s, output_len)) if output_len > 1 else [ttft_s]
    return r


@pytest.mark.timeout(30)
def test_goodput_on_hand_made_records():
    records = [
        _record(0.100, 0.100 + 9 * 0.020, 10),  # TTFT 100 ms, TPOT 20 ms: meets both
        _record(0.300, 0.300 + 9 * 0.020, 10),  # TTFT 300 ms: misses TTFT
        _record(0.100, 0.100 + 9 * 0.050, 10),  # TPOT 50 ms: misses TPOT
        _record(0.150, 0.150, 1),  # one token: no TPOT, meets on TTFT
        _record(0, 0, 0, ok=False, error_kind="http_503"),
        _record(0, 0, 0, ok=False, error_kind="timeout"),
    ]
    result = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=30))
    assert (result["completed"], result["failed"]) == (4, 2)
    assert result["errors"] == {"http_503": 1, "timeout": 1}
    assert result["request_throughput"] == pytest.approx(4 / 2.0)
    assert result["request_goodput"] == pytest.approx(2 / 2.0)  # records 0 and 3
    assert result["slo_attainment"] == pytest.approx(2 / 6)  # failures count as misses
    assert result["mean_ttft_ms"] == pytest.approx(np.mean([100, 300, 100, 150]))
    assert result["mean_tpot_ms"] == pytest.approx(np.mean([20, 20, 50]))  # the 1-token answer has none
    assert result["p99_tpot_ms"] == pytest.approx(np.percentile([20, 20, 50], 99))
    assert result["mean_itl_ms"] == pytest.approx(np.mean([20] * 18 + [50] * 9))
    assert result["total_output_tokens"] == 31 and result["total_input_tokens"] == 40
    assert result["output_throughput"] == pytest.approx(31 / 2.0)
    # No SLO is no constraint; a TTFT-only SLO ignores TPOT.
    assert summarize(records, 2.0, SLO())["request_goodput"] == pytest.approx(4 / 2.0)
    assert summarize(records, 2.0, SLO(ttft_ms=200))["request_goodput"] == pytest.approx(3 / 2.0)
    empty = summarize([], 1.0, SLO())
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["slo_attainment"] is None


@pytest.mark.timeout(30)
def test_prometheus_parser_sums_label_sets():
    text = ('# HELP x\n# TYPE pdcluster:request_success_total counter\n'
            'pdcluster:request_success_total{finished_reason="length",model_name="m"} 3.0\n'
            'pdcluster:request_success_total{finished_reason="a b}",model_name="m"} 2.0\n'
            'pdcluster:ttft_prefill_seconds_sum 0.5\n')
    assert parse_prometheus(text) == {"pdcluster:request_success_total": 5.0,
                                      "pdcluster:ttft_prefill_seconds_sum": 0.5}
