"""The serving package: what `pdcluster serve` runs (load tests and capacity planning live in tools/,
above it; the `pdcluster` command in cli/).

- api/: the OpenAI-compatible HTTP API, over any router of api/router_contract.py;
- router/: the Ray cluster's router (placement, health, the worker event stream, recovery), with
  policies.py (placement policies, circuit breakers) and token_deltas.py (worker events -> deltas);
- local_router.py: the same contract over one in-process engine (``--mode local``, the HTTP tests);
- frontend/: ``--api-servers N``: N API processes over one router (the router behind a zmq socket in
  this process, the contract again in each API process);
- launcher.py: the workers as Ray actors in a placement group, wired to each other and the router;
- autoscale.py: adds and drains workers to hold the SLOs (``--autoscale``);
- metrics.py: what /metrics serves;
- pd_proxy.py: ``pdcluster pd-proxy``, vLLM's proxy of an external prefill/decode split over instances started
  with ``serve --kv-transfer-config`` (wire/external_kv.py);
- serve_cli.py: the ``serve`` subcommand, with engine_args.py (the engine flags, shared with
  ``generate``) and http_server.py (uvicorn on a socket bound first).
"""
