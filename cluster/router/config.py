"""Every tunable of the cluster router in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    policy: str = "least_loaded"  # cluster/policies.py POLICIES
    mode: str = "disagg"  # "disagg" | "colocated"
    num_spec_tokens: int = 0  # speculative slots each running request reserves (placement load)
    conditional_prefill_tokens: int = 0  # prompts this short prefill on the decode worker
    busy_prefill_tokens: int = 0  # when every prefill worker has this much queued: prefill on D
    request_timeout_s: float = 300.0
    admission_wait_s: float = 30.0  # how long a request waits for a pair with room
    admission_timeout_s: float = 30.0  # one decode worker's verdict on a submit
    # After a worker gave no verdict in time: how long a probe waits for Ray to say whether it is
    # alive (answers), dead (raises: its requests are recovered) or neither (the health check decides).
    silent_probe_timeout_s: float = 120.0
    max_recoveries: int = 3
    health_interval_s: float = 1.0
    ping_timeout_s: float = 5.0
    max_strikes: int = 3  # silent health checks in a row that make a worker dead
    # One engine step longer than this is a stuck worker, not a slow one (a CPU prefill chunk of
    # 512 tokens on SmolLM2 takes about a second here).
    stall_timeout_s: float = 120.0
    # Circuit breakers per (prefill, decode) pair (policies.Breaker).
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    event_host: str = "127.0.0.1"  # where the worker event stream binds
