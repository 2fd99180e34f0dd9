"""vLLM's KV cache events, as its ``--kv-events-config`` publishes them: each worker tells, over a ZeroMQ PUB
socket, which prefix-cache blocks it stored and removed, so a router outside the cluster (llm-d's KV-cache
indexer, NVIDIA Dynamo's KV router, a script) scores workers by the prompt blocks they hold, as it does for
vLLM engines. The payload is byte for byte what vLLM 0.32 encodes (msgspec): a batch is the array
``[ts, events, data_parallel_rank]``; an event is a map tagged by ``"type"`` (BlockStored, BlockRemoved,
AllBlocksCleared) with vLLM's field order, fields that default to None left out. A message is the three
frames ``topic, seq (8 bytes big-endian), payload``.

Block hashes are ours (a 64-bit BLAKE2b chain: engine/block_manager.py) published unsigned, as vLLM publishes
its own (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default). A consumer keys blocks by them and by the token ids
every BlockStored carries.

Plain data only (no zmq, no torch): the CLI checks the config before anything loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from pdcluster.wire.json_config import parse_json_object

MASK_64 = (1 << 64) - 1
# vLLM's media: the engine's own KV pool (GPU, also on a CPU engine: vLLM's CPU build says GPU for its pool),
# the host-memory offload tier, the disk tier.
MEDIUM_BY_TIER = {"device": "GPU", "host": "CPU", "disk": "STORAGE", "shared": "STORAGE"}
PUBLISHERS = ("null", "zmq")
LOCAL_ENDPOINT = "tcp://127.0.0.1:5557"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame set


class KVEventsConfigError(ValueError):
    """``--kv-events-config`` is malformed; the text names the key."""


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, its field names and defaults, but for the endpoint: where a config names none, vLLM
    binds every interface (``tcp://*:5557``) and we bind loopback (``LOCAL_ENDPOINT``), as every server of ours
    does; name ``tcp://*:5557`` to publish to other machines."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = ""  # "": LOCAL_ENDPOINT, bound
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: past it a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it the newest are dropped
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_INT_KEYS = ("buffer_steps", "hwm", "max_queue_size")


def parse_kv_events_config(text: str) -> KVEventsConfig | None:
    """``--kv-events-config`` (vLLM's JSON); "" and a config that publishes nothing are None."""
    if not text:
        return None
    raw = parse_json_object(text, "kv_events_config", KVEventsConfigError, set(KVEventsConfig.__dataclass_fields__))
    enable = raw.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise KVEventsConfigError(f"kv_events_config.enable_kv_cache_events: must be true or false, got {enable!r}")
    publisher = raw.get("publisher") or ("zmq" if enable else "null")  # vLLM's __post_init__
    if publisher not in PUBLISHERS:
        raise KVEventsConfigError(f"kv_events_config.publisher: {publisher!r} is not one of {', '.join(PUBLISHERS)}")
    values: dict[str, Any] = {"enable_kv_cache_events": enable, "publisher": publisher}
    for key in ("endpoint", "replay_endpoint"):
        if raw.get(key) is not None:
            values[key] = check_endpoint(f"kv_events_config.{key}", raw[key])
    for key in _INT_KEYS:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise KVEventsConfigError(f"kv_events_config.{key}: must be a positive integer, got {value!r}")
            values[key] = value
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise KVEventsConfigError(f"kv_events_config.topic: must be a string, got {topic!r}")
    values["topic"] = topic
    config = KVEventsConfig(**values)
    return config if config.enabled else None


def check_endpoint(name: str, endpoint: Any) -> str:
    """A ZeroMQ endpoint this publisher can use: tcp://HOST:PORT, ipc://PATH or inproc://NAME."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise KVEventsConfigError(f"{name}: must be a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH, inproc://NAME), "
                                  f"got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise KVEventsConfigError(f"{name}: {endpoint!r} has no HOST:PORT (a port in [0, 65535])")
    return endpoint


def endpoint_for_rank(endpoint: str | None, rank: int) -> str | None:
    """vLLM's port offset for data-parallel rank ``rank`` (here: a worker's place in the cluster's start order): a
    TCP port + rank (0 stays 0, the OS picks), an ipc/inproc name with ``_dp<rank>`` after it."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule for a named endpoint: a wildcard host (``*``, ``::``) or an ipc/inproc endpoint is bound; any
    other address is a subscriber's, connected to (llm-d's indexer binds, its engines connect). Port 0 is bound
    too (the OS picks a free port; GET /kv_event_sources tells which): there is nothing to connect to there."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    return endpoint.rpartition(":")[2] == "0"


# ---- events ---------------------------------------------------------------------------------------------------

def external_hash(block_hash: int) -> int:
    """Our signed 64-bit chain hash as vLLM publishes its hashes: an unsigned 64-bit integer."""
    return block_hash & MASK_64


def block_stored(block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int], block_size: int,
                 medium: str, lora_id: int | None = None, lora_name: str | None = None,
                 extra_keys: list | None = None) -> dict:
    event = {"type": "BlockStored", "block_hashes": [external_hash(h) for h in block_hashes],
             "parent_block_hash": None if parent_block_hash is None else external_hash(parent_block_hash),
             "token_ids": list(token_ids), "block_size": block_size, "lora_id": lora_id, "medium": medium,
             "lora_name": lora_name}
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    return event


def block_removed(block_hashes: list[int], medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [external_hash(h) for h in block_hashes], "medium": medium}


def all_blocks_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict], data_parallel_rank: int | None) -> bytes:
    """One KVEventBatch's payload (msgspec's bytes for it: a float64 ts, maps in field order)."""
    batch = [float(ts), events] if data_parallel_rank is None else [float(ts), events, data_parallel_rank]
    return msgpack.packb(batch, use_bin_type=True)


_EVENT_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                 "lora_name"),
                 "BlockRemoved": ("block_hashes", "medium"),
                 "AllBlocksCleared": ()}


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """A KVEventBatch payload as (ts, events, data_parallel_rank): what a subscriber reads (tests, tools).
    ValueError on anything that is not one, naming what is wrong."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise ValueError(f"not a KV event batch: {e}") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise ValueError("not a KV event batch: expected [ts, events, data_parallel_rank]")
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if not isinstance(ts, float) or not math.isfinite(ts) or not isinstance(events, list):
        raise ValueError("not a KV event batch: ts must be a float and events a list")
    for event in events:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind not in _EVENT_FIELDS or any(f not in event for f in _EVENT_FIELDS[kind]):
            raise ValueError(f"not a KV event: {event!r}")
    return ts, events, rank
