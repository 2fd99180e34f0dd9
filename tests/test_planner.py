"""`pdcluster plan` and `pdcluster profile`: the simulator against closed-form cases on synthetic cost
models, the CLI's one-line errors, and a real (tiny) profile that the planner then reads."""

from __future__ import annotations

import json

import pytest
import torch

from pdcluster.cli.main import main
from pdcluster.tools.planner.costs import CostModel, EngineLimits, Fit, attn_pairs, fit_linear
from pdcluster.tools.planner.search import Searcher, Target, split_for
from pdcluster.tools.planner.shape import ClusterShape, ShapeError, parse_shape
from pdcluster.tools.planner.simulate import SimConfig, simulate
from pdcluster.tools.planner.summary import summarize
from pdcluster.tools.planner.workload import SimRequest, random_workload, trace_workload, write_trace

# Synthetic worker: prefill step = 10 ms + 1 ms/token; decode step = 20 ms + 1 ms/request + 0.01 ms per
# context token; a transfer costs 5 ms + 1 ns/byte (1000 bytes per token, 10 layers).
PREFILL = Fit(0.010, {"tokens": 0.001, "attn": 0.0})
DECODE = Fit(0.020, {"batch": 0.001, "context": 0.00001})
TRANSFER = Fit(0.005, {"bytes": 1e-9})


def cost_model(decode: Fit = DECODE, transfer: Fit = TRANSFER, slowdown: float = 1.0, **limits) -> CostModel:
    return CostModel(PREFILL, decode, transfer, kv_bytes_per_token=1000, num_layers=10, threads=1,
                     corun_slowdown=slowdown, limits=EngineLimits(**{"kv_capacity_tokens": 0, **limits}), model="synthetic")


def run(shape: str, requests, cost: CostModel | None = None, **config):
    results, workers = simulate(cost or cost_model(), SimConfig(parse_shape(shape), **config), requests)
    return results, workers


def decode_step(batch: int, context: int) -> float:
    return DECODE.predict(batch=batch, context=context)


# ---- closed forms ----------------------------------------------------------------------------------


def test_one_request_alone_disagg_matches_closed_form():
    """TTFT = overhead + prefill; the KV lands the exposed transfer later; each later token one decode
    step at batch 1 over the growing context."""
    cost = cost_model()
    (r,), _ = run("1P1D", [SimRequest(0, 0.0, 256, 8)], overhead_s=0.05)
    prefill = 0.010 + 0.001 * 256
    assert r.t_first_token == pytest.approx(prefill)
    exposed = cost.exposed_transfer_s(256, prefill)
    # Streamed layer by layer: only the last layer's share is left after the forward pass.
    assert exposed == pytest.approx((0.005 + 256 * 1000 * 1e-9) / 10)
    assert r.t_kv_ready == pytest.approx(prefill + exposed)
    steps = [decode_step(1, 256 + k) for k in range(1, 8)]  # outputs 2..8, context prompt + outputs so far
    assert r.t_second_token == pytest.approx(prefill + exposed + steps[0])
    assert r.t_done == pytest.approx(prefill + exposed + sum(steps))
    s = summarize([r], overhead_s=0.05)
    assert s["mean_ttft_ms"] == pytest.approx((prefill + 0.05) * 1e3)
    assert s["mean_tpot_ms"] == pytest.approx((exposed + sum(steps)) / 7 * 1e3)
    assert s["ttft_breakdown"]["kv_transfer_ms"] == pytest.approx(exposed * 1e3)


def test_transfer_done_does_not_wait_for_the_prefill_workers_running_step():
    """The prefill worker's ack poller sends TransferDone while its engine computes the next prompt:
    A's KV is delivered while B's prompt is computing, and A is ready then, not when B's step ends."""
    cost = cost_model()
    a, b = SimRequest(0, 0.0, 100, 4), SimRequest(1, 0.05, 400, 4)
    results, _ = run("1P1D", [a, b], cost)
    ra, rb = sorted(results, key=lambda r: r.index)
    prefill_a = 0.010 + 0.1
    assert ra.t_first_token == pytest.approx(prefill_a)
    assert rb.t_prefill_start == pytest.approx(prefill_a)  # B waited for A's step (FCFS, one worker)
    assert rb.t_first_token == pytest.approx(prefill_a + 0.010 + 0.4)
    delivered = prefill_a + cost.exposed_transfer_s(100, prefill_a)
    assert delivered < rb.t_first_token
    assert ra.t_kv_ready == pytest.approx(delivered)
    assert rb.t_kv_ready == pytest.approx(rb.t_first_token + cost.exposed_transfer_s(400, 0.41))


def test_decode_cost_table_interpolates_between_measured_batches():
    """A CPU decode step is not linear in the batch (one request runs matrix-vector kernels): the
    profile keeps an intercept per measured batch size and a shared context term, interpolated
    between the sizes and extended past the largest along the last two."""
    from pdcluster.tools.planner.costs import fit_batch_table

    def truth(b, ctx):
        return {1: 0.06, 2: 0.10, 4: 0.11, 8: 0.13}[b] + 2e-6 * ctx

    points = [{"batch": b, "context": ctx * b, "seconds": truth(b, ctx * b)} for b in (1, 2, 4, 8) for ctx in (100, 500, 1000)]
    table = fit_batch_table(points)
    assert table.batches == (1, 2, 4, 8)
    assert table.intercepts == pytest.approx((0.06, 0.10, 0.11, 0.13), rel=1e-6)
    assert table.context_coef == pytest.approx(2e-6, rel=1e-6)
    assert table.max_rel_err < 1e-6
    assert table.predict(3, 0) == pytest.approx(0.105)
    assert table.predict(16, 0) == pytest.approx(0.13 + 8 * 0.005)
    line = fit_linear(points, ("batch", "context"))
    assert line.max_rel_err > 0.1, "a straight line cannot follow the step at batch 2"
    profile = {"fits": {"prefill": PREFILL.__dict__, "decode": line.__dict__, "transfer": TRANSFER.__dict__},
               "kv_bytes_per_token": 1000, "num_layers": 10, "points": {"decode": points}}
    cost = CostModel.from_profile(profile)  # an older profile: the table comes from its raw points
    assert cost.step_s(num_decode=2, context=1000) == pytest.approx(truth(2, 1000))
    profile["fits"]["decode_table"] = {"batches": [1, 2], "intercepts": [0.5], "context_coef": 0}
    with pytest.raises(ValueError, match="decode_table"):
        CostModel.from_profile(profile)


def test_background_load_on_shared_cores():
    """Two busy workers on two cores beside one core of other work get 2/3 of a core each; one busy
    worker still gets a whole one. Profiled beside that same core of load, one worker alone is as fast
    as profiled."""
    one = [SimRequest(0, 0.0, 300, 2)]
    two = [SimRequest(i, 0.0, 300, 2) for i in range(2)]
    prefill = 0.010 + 0.3
    (r,), _ = run("colocatedx2", one, shared_cores=2, background_cores=1.0)
    assert r.t_first_token == pytest.approx(prefill)
    results, _ = run("colocatedx2", two, shared_cores=2, background_cores=1.0)
    assert all(x.t_first_token == pytest.approx(prefill * 1.5) for x in results)
    profiled_loaded = CostModel(PREFILL, DECODE, TRANSFER, 1000, 10, profile_background_cores=1.0,
                                limits=EngineLimits(kv_capacity_tokens=0))
    results, _ = run("colocatedx2", two, profiled_loaded, shared_cores=2, background_cores=1.0)
    assert all(x.t_first_token == pytest.approx(prefill * 1.5) for x in results)  # share 2/3 of share 1
    results, _ = run("colocatedx2", two, profiled_loaded, shared_cores=2, background_cores=0.0)
    assert all(x.t_first_token == pytest.approx(prefill) for x in results)  # a quieter box than profiled


def test_transfer_longer_than_prefill_is_exposed():
    slow = Fit(0.0, {"bytes": 1e-5})  # 10 ms per token of KV: far slower than the prefill
    cost = cost_model(transfer=slow)
    (r,), _ = run("1P1D", [SimRequest(0, 0.0, 100, 4)], cost)
    prefill = 0.010 + 0.1
    assert r.t_kv_ready - r.t_first_token == pytest.approx(100 * 1000 * 1e-5 - prefill)


def test_one_request_alone_colocated_and_chunked_prefill():
    """With --prefill-chunk-size 512 a 1200-token prompt is three chunks of 512, 512, 176 on one worker; then decode
    at batch 1. With the engine's default (no cap below the 2,048-token step budget) it is one step."""
    (r,), _ = run("colocatedx1", [SimRequest(0, 0.0, 1200, 3)], cost_model(prefill_chunk_size=512))
    prefill = sum(0.010 + 0.001 * n for n in (512, 512, 176))
    assert r.t_first_token == pytest.approx(prefill)
    assert r.t_done == pytest.approx(prefill + decode_step(1, 1201) + decode_step(1, 1202))
    assert r.t_kv_ready < 0  # nothing was transferred
    (r,), _ = run("colocatedx1", [SimRequest(0, 0.0, 1200, 3)])
    assert r.t_first_token == pytest.approx(0.010 + 0.001 * 1200)


def test_attention_term_counts_cached_context():
    cost = cost_model()
    cost = CostModel(Fit(0.0, {"tokens": 0.0, "attn": 1e-6}), cost.decode, cost.transfer, 1000, 10,
                     limits=EngineLimits(prefill_chunk_size=512))
    # Two chunks: the second's queries see the first's 512 keys too (the same pairs as one 1,024-token step).
    assert cost.prefill_s(1024) == pytest.approx(1e-6 * (attn_pairs(512, 0) + attn_pairs(512, 512)))
    assert cost.prefill_s(1024) == pytest.approx(1e-6 * attn_pairs(1024, 0))


def test_saturated_decode_worker_tpot_is_the_step_time_at_that_batch():
    """16 requests at once: the prefill worker computes the 16 prompts in one step (16 x 64 tokens fit
    the 2048-token budget), their KV lands together, and every later step decodes all 16."""
    n, prompt, out = 16, 64, 10
    requests = [SimRequest(i, 0.0, prompt, out) for i in range(n)]
    results, _ = run("1P1D", requests, cost_model(transfer=Fit(0.0, {"bytes": 0.0})))
    prefill = 0.010 + 0.001 * n * prompt
    steps = [decode_step(n, n * (prompt + k)) for k in range(1, out)]
    for r in results:
        assert r.t_first_token == pytest.approx(prefill)
        assert r.t_done == pytest.approx(prefill + sum(steps))
    tpot = summarize(results)["mean_tpot_ms"] / 1e3
    assert tpot == pytest.approx(sum(steps) / (out - 1))
    assert decode_step(n, n * prompt) < tpot < decode_step(n, n * (prompt + out))


def test_queueing_grows_with_rate():
    means = []
    for rate in (1.0, 3.0, 6.0):
        results, _ = run("1P1D", random_workload(200, rate, "256", "32", seed=3))
        s = summarize(results)
        assert s["completed"] == 200
        means.append(s["mean_ttft_ms"])
    assert means[0] < means[1] < means[2]
    assert means[2] > 3 * means[0]  # 6 req/s is past the prefill worker's ~3.7 req/s: the queue builds


def test_more_prefill_workers_cut_ttft_and_least_loaded_spreads_requests():
    requests = random_workload(200, 5.0, "256", "32", seed=1)
    one, _ = run("1P2D", requests)
    two, workers = run("2P2D", requests)
    assert summarize(two)["mean_ttft_ms"] < 0.5 * summarize(one)["mean_ttft_ms"]
    used = {r.decode_worker for r in two} | {r.prefill_worker for r in two}
    assert used == {"decode-0", "decode-1", "prefill-0", "prefill-1"}
    assert all(w["steps"] > 0 for w in workers.values())


def test_shared_cores_slow_busy_workers_down():
    """Three workers on two cores, all busy: each runs at 2/3 speed; a co-run slowdown divides further."""
    requests = [SimRequest(i, 0.0, 300, 2) for i in range(3)]  # one per worker (least loaded)
    prefill = 0.010 + 0.3
    alone, _ = run("colocatedx3", requests)
    shared, _ = run("colocatedx3", requests, shared_cores=2)
    slowed, _ = run("colocatedx3", requests, cost_model(slowdown=1.2), shared_cores=2)
    assert {r.decode_worker for r in shared} == {"decode-0", "decode-1", "decode-2"}
    for a, b, c in zip(alone, shared, slowed):
        assert a.t_first_token == pytest.approx(prefill)
        assert b.t_first_token == pytest.approx(prefill * 1.5)
        assert c.t_first_token == pytest.approx(prefill * 1.5 * 1.2)


def test_corun_slowdown_depends_on_what_the_other_worker_computes():
    """A disaggregated pair: while the prefill worker computes B's prompt, the decode worker's steps run
    at the profile's "decode beside prefill" slowdown; once the prefill worker is idle, at full speed.
    A profile with only the single figure applies it to every pairing."""
    from dataclasses import replace

    beside = {"prefill": {"prefill": 1.1, "decode": 1.5}, "decode": {"prefill": 1.05, "decode": 1.2}}
    cost = replace(cost_model(slowdown=1.2), corun_beside=beside)
    assert cost.corun_factor("decode", ["prefill"]) == 1.5
    assert cost.corun_factor("decode", ["decode", "prefill"]) == 1.5
    assert cost.corun_factor("prefill", ["decode"]) == 1.05
    assert cost.corun_factor("decode", []) == 1.0
    assert cost_model(slowdown=1.2).corun_factor("decode", ["prefill"]) == 1.2
    # A decodes 40 tokens; B (a long prompt) arrives after A's first decode step and keeps the
    # prefill worker busy for 1.01 s of full-speed work.
    a, b = SimRequest(0, 0.0, 100, 40), SimRequest(1, 0.2, 1000, 2)
    (ra, rb), _ = run("1P1D", [a, b], cost, shared_cores=2)
    (qa, qb), _ = run("1P1D", [a, b], cost_model(), shared_cores=2)
    assert ra.t_kv_ready == pytest.approx(qa.t_kv_ready)  # A's prompt ran alone in both
    # B's prompt ran beside A's decoding at 1/1.05 speed, and A's decode steps beside it at 1/1.5.
    assert rb.t_first_token - rb.t_prefill_start == pytest.approx(1.01 * 1.05, rel=0.02)
    assert ra.t_done - qa.t_done > 0.4 * (rb.t_first_token - rb.t_prefill_start) * (1 - 1 / 1.5)
    profile = {"fits": {"prefill": PREFILL.__dict__, "decode": DECODE.__dict__, "transfer": TRANSFER.__dict__},
               "kv_bytes_per_token": 1000, "num_layers": 10, "corun": {"slowdown": 1.2, "beside": beside}}
    assert CostModel.from_profile(profile).corun_beside == beside
    profile["corun"]["beside"] = {"prefill": 3}
    with pytest.raises(ValueError, match="corun.beside"):
        CostModel.from_profile(profile)


def test_kv_capacity_makes_requests_wait_at_the_router():
    requests = [SimRequest(i, 0.0, 100, 10) for i in range(2)]
    results, _ = run("colocatedx1", requests, cost_model(), kv_capacity_tokens=150)
    first, second = sorted(results, key=lambda r: r.t_placed)
    assert second.t_placed == pytest.approx(first.t_done)  # placed when the first one freed its KV
    assert second.t_first_token > first.t_done


def test_summary_goodput_and_attainment():
    results, _ = run("1P1D", [SimRequest(i, i * 10.0, 64, 4) for i in range(4)])
    ttft_ms = (0.010 + 0.064) * 1e3
    met = summarize(results, slo_ttft_ms=ttft_ms + 1)
    missed = summarize(results, slo_ttft_ms=ttft_ms - 1)
    assert met["slo_attainment"] == 1.0 and met["request_goodput"] == pytest.approx(met["request_throughput"])
    assert missed["slo_attainment"] == 0.0 and missed["request_goodput"] == 0.0


# ---- fits, shapes, workloads ----------------------------------------------------------------------


def test_fit_linear_recovers_coefficients_and_stays_non_negative():
    points = [{"batch": b, "context": c, "seconds": 0.02 + 0.001 * b + 1e-6 * c}
              for b in (1, 4, 16) for c in (100, 1000, 8000)]
    fit = fit_linear(points, ("batch", "context"))
    assert fit.intercept == pytest.approx(0.02, rel=1e-6)
    assert fit.coef["batch"] == pytest.approx(0.001, rel=1e-6)
    assert fit.max_rel_err < 1e-9
    flat = fit_linear([{"x": x, "seconds": 1.0 - 0.001 * x} for x in (1, 2, 3)], ("x",))
    assert flat.coef["x"] == 0.0 and flat.intercept > 0


def test_parse_shape():
    assert parse_shape("1P2D") == ClusterShape("disagg", 1, 2)
    assert parse_shape("12p52d").num_workers == 64
    assert parse_shape("colocatedx2") == ClusterShape("colocated", 0, 2)
    assert parse_shape("colocated").name == "colocatedx1"
    for bad in ("1P", "0P1D", "colocatedx0", "PD", "2x"):
        with pytest.raises(ShapeError):
            parse_shape(bad)


def test_random_workload_matches_the_load_tester_draws():
    from pdcluster.tools.loadtest.arrivals import ArrivalProcess

    reqs = random_workload(50, 2.0, "100:300", "10:20", seed=7)
    assert [r.arrival_s for r in reqs] == ArrivalProcess("poisson", 2.0).send_times_s(50, 7).tolist()
    import numpy as np

    from pdcluster.tools.loadtest.lengths import LengthDist

    rng = np.random.default_rng(7)
    ins = LengthDist.parse("100:300").sample(rng, 50).tolist()
    outs = LengthDist.parse("10:20").sample(rng, 50).tolist()
    assert [r.input_len for r in reqs] == ins and [r.output_len for r in reqs] == outs


def test_trace_round_trip(tmp_path):
    reqs = random_workload(5, 1.0, "64", "8", seed=0)
    path = tmp_path / "trace.jsonl"
    write_trace(reqs, path)
    assert trace_workload(path) == reqs
    path.write_text('{"arrival_s": 0, "input_len": 5}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        trace_workload(path)


def test_search_finds_fewest_devices_for_the_slos():
    cost = cost_model()
    searcher = Searcher(cost, lambda rate: random_workload(max(100, int(rate * 40)), rate, "256", "32", seed=0),
                        Target(slo_ttft_ms=800, slo_tpot_ms=60))
    caps = searcher.capacities()
    assert 2.0 < caps["prefill"] < 1 / 0.266  # a prefill worker at 100% would do 3.76 req/s
    best = searcher.fewest_disagg(8.0, caps, gpus=64)
    assert best is not None and searcher.ok(best)
    x, y = parse_shape(best["config"]).num_prefill, parse_shape(best["config"]).num_decode
    assert x >= 3  # 8 req/s of 266 ms prefills need at least 2.1 workers at 100%
    fewer = [searcher.run(ClusterShape("disagg", x - 1, y), 8.0)] if x > 1 else []
    assert all(not searcher.ok(s) for s in fewer)
    assert split_for(64, {"prefill": 1.0, "decode": 3.0}) == (48, 16)


# ---- CLI ---------------------------------------------------------------------------------------------


def _write_synthetic_profile(path) -> None:
    cost = cost_model(kv_capacity_tokens=100_000)
    fits = {name: {"intercept": f.intercept, "coef": f.coef} for name, f in
            (("prefill", cost.prefill), ("decode", cost.decode), ("transfer", cost.transfer))}
    path.write_text(json.dumps({"model": "tiny-random", "threads": 1, "kv_bytes_per_token": 1000, "num_layers": 10,
                                "engine": {"kv_capacity_tokens": 100_000}, "fits": fits}))


def test_plan_cli_compares_configs(tmp_path, capsys):
    profile = tmp_path / "p.json"
    _write_synthetic_profile(profile)
    out = tmp_path / "plan.json"
    rc = main(["plan", "--profile", str(profile), "--config", "1P1D", "--config", "colocatedx2", "--rate", "2",
               "--num-prompts", "30", "--input-len", "128", "--output-len", "16", "--slo-ttft-ms", "1000",
               "--slo-tpot-ms", "100", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data == json.loads(capsys.readouterr().out)
    for name in ("1P1D", "colocatedx2"):
        r = data["results"][name]
        assert r["completed"] == 30
        for key in ("mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                    "request_throughput", "request_goodput", "slo_attainment"):
            assert r[key] is not None, key


def test_plan_cli_search(tmp_path, capsys):
    profile = tmp_path / "p.json"
    _write_synthetic_profile(profile)
    assert main(["plan", "--profile", str(profile), "--search", "--gpus", "8", "--rate", "6", "--num-prompts", "100",
                 "--input-len", "256", "--output-len", "16", "--slo-ttft-ms", "800", "--slo-tpot-ms", "60"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["fewest_gpus"]["disagg"]
    assert best["num_gpus"] <= 8 and best["slo_attainment"] >= 0.9
    assert out["best"]["config"] in (best["config"], (out["fewest_gpus"]["colocated"] or {}).get("config"))
    full = out["at_gpus"]["disagg"]
    assert parse_shape(full["config"]).num_workers == 8 and full["max_rate"] > 6
    assert full["at_max_rate"]["slo_attainment"] >= 0.9
    assert out["at_gpus"]["colocated"]["config"] == "colocatedx8"


@pytest.mark.parametrize("argv, message", [
    (["--config", "3X4Y", "--rate", "1"], "--config: cannot read '3X4Y'"),
    (["--rate", "0"], "--rate: give a request rate > 0"),
    (["--rate", "1", "--search", "--slo-ttft-ms", "100"], "--search: give both"),
    (["--rate", "1", "--shared-cores", "-1"], "--shared-cores"),
])
def test_plan_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    profile = tmp_path / "p.json"
    _write_synthetic_profile(profile)
    assert main(["plan", "--profile", str(profile), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdcluster plan: error: ") and message in err and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_profile_refuses_a_device_torch_cannot_see(tmp_path, capsys):
    """`pdcluster profile --device cuda` without a GPU: one line naming the flag and what torch sees,
    before anything is loaded or measured."""
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny-random", "--quick", "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdcluster profile: error: --device: ") and "sees no CUDA device" in err and "\n" not in err
    assert not out.exists()
    assert main(["profile", "--model", "tiny-random", "--device", "tpu", "--out", str(out)]) == 2
    assert "--device: " in capsys.readouterr().err


def test_plan_cli_missing_or_bad_profile(tmp_path, capsys):
    assert main(["plan", "--profile", str(tmp_path / "none.json"), "--rate", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not exist" in err and "pdcluster profile" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"fits": {"prefill": {}}}')
    assert main(["plan", "--profile", str(bad), "--rate", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad.json" in err


def test_profile_tiny_random_writes_a_usable_profile(tmp_path, capsys):
    """A real (quick) profile on the tiny model: every fit present and positive where it must be, the
    raw points kept, and the planner runs on it."""
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", "tiny-random", "--quick", "--no-corun", "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["model"] == "tiny-random" and profile["threads"] == 1
    assert profile["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    assert profile["kv_bytes_per_token"] > 0 and profile["num_layers"] == 4
    for name in ("prefill", "decode", "transfer"):
        fit = profile["fits"][name]
        assert fit["num_points"] >= 2 and fit["intercept"] >= 0
        assert all(c >= 0 for c in fit["coef"].values())
    assert {p["batch"] for p in profile["points"]["decode"]} >= {1, 4, 8}
    assert all(p["seconds"] > 0 for p in profile["points"]["transfer"])
    cost = CostModel.from_profile(profile)
    # The prefill cost grows with the prompt: what the planner needs. Which term carries it (tokens or attention
    # pairs) is timing noise's choice on a model this small: on a fast AMX box the tokens term came out 0 once.
    assert cost.prefill_s(128) > cost.prefill_s(16) > 0
    capsys.readouterr()
    assert main(["plan", "--profile", str(out), "--config", "1P1D", "--rate", "5", "--num-prompts", "20",
                 "--input-len", "64", "--output-len", "8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["results"]["1P1D"]["completed"] == 20


@pytest.mark.timeout(300)
def test_served_probe_times_a_real_pair_and_the_planner_applies_it(tmp_path):
    """The profile's served probe runs a real prefill worker (here) and decode worker (its own process)
    over tcp: it records the prefill worker's prompt steps and the decode worker's batched decode steps
    with their features, and the factors (served over bare, >= 1) reach the simulator's step costs."""
    from dataclasses import replace

    from pdcluster.tools.planner.grid import ProfileGrid
    from pdcluster.tools.planner.profile import run_profile
    from pdcluster.tools.planner.served import DECODE_BATCHES, PREFILL_SIZES, measure_served

    profile = run_profile("tiny-random", 1, ProfileGrid.quick(), "tcp", 0, "float32", log=lambda m: None)
    cost = CostModel.from_profile(profile)
    served = measure_served(cost, "tiny-random", "float32", 1, "tcp", 0, log=print)
    assert served["measured"], served
    prompts = {r["prefill_tokens"] for r in served["prefill_steps"]}
    assert set(PREFILL_SIZES) <= prompts, prompts  # every lone prompt in one step
    batches = {r["num_decode"] for r in served["decode_steps"]}
    assert 1 in batches and max(batches) == max(DECODE_BATCHES), batches
    assert all(r["seconds"] > 0 and r["context"] > 0 for r in served["decode_steps"])
    assert served["prefill_factor"] >= 1.0 and served["decode_factor"] >= 1.0
    profile["served"] = {**served, "prefill_factor": 1.5, "decode_factor": 2.0}
    slow = CostModel.from_profile(profile)
    assert (slow.served_prefill_factor, slow.served_decode_factor) == (1.5, 2.0)
    assert slow.served_step_s(64, 2048.0) == pytest.approx(1.5 * cost.step_s(64, 2048.0))
    assert slow.served_step_s(0, 0.0, 4, 400) == pytest.approx(2.0 * cost.step_s(0, 0.0, 4, 400))
    (a,), _ = run("1P1D", [SimRequest(0, 0.0, 64, 4)], replace(cost, corun_beside=None))
    (b,), _ = run("1P1D", [SimRequest(0, 0.0, 64, 4)], replace(slow, corun_beside=None))
    assert b.t_first_token == pytest.approx(1.5 * a.t_first_token)
    profile["served"]["decode_factor"] = "fast"
    with pytest.raises(ValueError, match="served"):
        CostModel.from_profile(profile)


def test_profile_fits_the_least_disturbed_repetition():
    from pdcluster.tools.planner.steps import least_disturbed

    points = [{"tokens": 128, "attn": 1.0, "num_requests": 1, "seconds": s} for s in (0.9, 0.5, 0.7)]
    points.append({"tokens": 256, "attn": 2.0, "num_requests": 1, "seconds": 1.2})
    kept = least_disturbed(points, ("tokens", "attn", "num_requests"))
    assert sorted(p["seconds"] for p in kept) == [0.5, 1.2]
