"""Tools around the serving package, a layer above it (they may import cluster/; cluster/ never imports
them): the load tester and its chaos runs (loadtest/), capacity planning from measured costs
(planner/: `pdcluster profile`, `pdcluster plan`), and ServeProcess (server_process.py: `pdcluster serve`
in a subprocess, as tests and benchmarks run it)."""
