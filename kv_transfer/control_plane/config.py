"""What a control-plane endpoint says about itself in the handshake, and its timing and size limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol import KVLayout

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # a prompt's logprobs (top-20 of 4k positions) take ~1 MB


@dataclass
class EndpointConfig:
    """What an endpoint says about itself in the handshake, and its timing and size limits."""

    worker_id: str
    layout: KVLayout
    model_fingerprint: str
    transport: str = "tcp"
    transport_descriptor: dict[str, Any] = field(default_factory=dict)
    secret: bytes | str | None = field(default=None, repr=False)  # never in a repr or a log line
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 2.5
    handshake_timeout_s: float = 5.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    numerics: str = ""  # which arithmetic this worker's kernels do (kernels/numerics.py), told to peers

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "peer_timeout_s", "handshake_timeout_s", "max_message_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EndpointConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"EndpointConfig.peer_timeout_s ({self.peer_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or live peers are declared dead between heartbeats"
            )
