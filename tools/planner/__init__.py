"""Capacity planning: measure a worker's costs on the real engine (`pdcluster profile`), then simulate
a cluster of such workers under a workload (`pdcluster plan`).

- ``profile.py``: runs the measurements below and fits them: ``grid.py`` (what to measure), ``steps.py``
  (prefill, decode and mixed step times), ``transfer.py`` (KV transfer times), ``corun.py`` (co-run
  slowdown), ``served.py`` (a real prefill/decode pair's steps over the bare engine's)
- ``costs.py``: least-squares fits of those points and the cost of any step (CostModel)
- ``workload.py``: the requests to simulate (random dataset + arrivals, or a recorded trace)
- ``shape.py``: cluster shapes ("1P1D", "4P12D", "colocatedx2")
- ``simulate.py``: the discrete-event simulation (router, prefill, transfer, decode)
- ``summary.py``: TTFT/TPOT percentiles, throughput, goodput and SLO attainment of a simulated run
- ``search.py``: the xPyD that meets the SLOs with the most goodput per device
- ``cli.py``: the two commands
"""
