"""Several tokens in one delta count as several inter-token intervals (cluster/metrics.py ``observe_many``): one
increment of the histogram's sum and bucket must expose exactly what as many ``observe`` calls do, in one process
and in prometheus_client's multiprocess mode (several API processes), or the ITL panels would drift."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import sys
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from pdcluster.cluster import metrics

    multiprocess_dir = sys.argv[1]
    if multiprocess_dir != "-":
        metrics.enable_multiprocess(multiprocess_dir)

    def exposition(batched):
        registry = CollectorRegistry()
        hist = Histogram("itl_" + str(batched).lower(), "doc", ["model_name"], buckets=metrics.ITL_BUCKETS,
                         registry=registry).labels("m")
        # exact binary fractions: the sum's float is the same either way; one value on a bucket bound (0.5), one past
        # every bound (+Inf), and counts of 1
        for value, count in ((0.25, 4), (0.5, 1), (0.0625, 7), (100.0, 3), (0.015625, 2)):
            if batched:
                metrics.observe_many(hist, value, count)
            else:
                for _ in range(count):
                    hist.observe(value)
        if multiprocess_dir == "-":
            return generate_latest(registry).decode()
        from prometheus_client.multiprocess import MultiProcessCollector
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=multiprocess_dir)
        return generate_latest(merged).decode()

    one, many = exposition(True), exposition(False)
    lines = lambda text, name: sorted(l.replace(name, "X") for l in text.splitlines()
                                      if l.startswith(name) and "_created" not in l)
    got, want = lines(one, "itl_true"), lines(many, "itl_false")
    assert got and got == want, (got, want)
    assert any("_count" in l and l.endswith(" 17.0") for l in got), got
    print("ok")
""")


@pytest.mark.parametrize("multiprocess", [False, True])
def test_many_observations_at_once_expose_as_one_at_a_time(tmp_path, multiprocess):
    # A fresh interpreter: multiprocess mode is chosen per process, before any metric exists.
    arg = str(tmp_path) if multiprocess else "-"
    out = subprocess.run([sys.executable, "-c", _SCRIPT, arg], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
