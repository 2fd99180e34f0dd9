"""A worker's KV events published as vLLM publishes its engines' (``--kv-events-config``; the format is
wire/kv_events.py): a ZeroMQ PUB socket sends one batch per engine turn that changed the prefix cache or an
offload tier, frames ``topic, seq, payload``; a ROUTER socket (``replay_endpoint``) sends a subscriber the
batches it missed from a sequence number on, then the END_SEQ frame set. A router outside the cluster (llm-d's
indexer, Dynamo) subscribes to every worker's endpoint and learns which worker holds which prompt blocks.

The engine thread only queues a turn's log entries (never blocks: a full queue drops the batch and counts it);
this publisher's own thread turns them into events, encodes them and owns both sockets. Its first batch is
AllBlocksCleared: a worker that restarted on the same endpoint holds nothing of what it said before."""

from __future__ import annotations

import hashlib
import itertools
import logging
import queue
import threading
import time
from collections import deque

import zmq

from pdcluster.wire.kv_events import (END_SEQ, LOCAL_ENDPOINT, MEDIUM_BY_TIER, KVEventsConfig, all_blocks_cleared,
                                      binds, block_removed, block_stored, encode_batch, endpoint_for_rank)

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
POLL_S = 0.05  # the thread's wait for a batch, between looks at the replay socket


def lora_id(lora_name: str | None) -> int | None:
    """A LoRA adapter's id in events (vLLM's deprecated ``lora_id``: consumers that key on it still tell adapters
    apart): a positive 31-bit number made from its name, the same on every worker and every run."""
    if lora_name is None:
        return None
    return int.from_bytes(hashlib.blake2b(lora_name.encode(), digest_size=4).digest(), "big") & 0x7FFFFFFF or 1


def extra_keys(run, block_size: int) -> list | None:
    """vLLM's per-block ``extra_keys`` of a StoredRun (engine/block_manager.py), as it publishes them untagged: the
    LoRA name, (image digest, its offset from the block's start) for each image the block holds part of, ("prompt_embeds",
    its rows' digest) where the block's rows were given as embeddings, and the cache salt on the prompt's first block. None where no block has any."""
    keys_per_block = []
    for k in range(len(run.block_hashes)):
        start = run.first_token + k * block_size
        end = start + block_size
        keys: list = [] if run.lora_name is None else [run.lora_name]
        for item in run.mm_inputs:
            offset, length = item["offset"], item["length"]
            if offset < end and start < offset + length:
                keys.append((item["digest"], offset - start))
        block_index = start // block_size
        if block_index < len(run.prompt_embeds_keys):  # vLLM's ("prompt_embeds", the block's rows' digest)
            keys.append(("prompt_embeds", run.prompt_embeds_keys[block_index].hex()))
        if run.cache_salt is not None and start == 0:
            keys.append(run.cache_salt)
        keys_per_block.append(tuple(keys) if keys else None)
    return keys_per_block if any(k is not None for k in keys_per_block) else None


def to_vllm_events(entries: list, block_size: int) -> list[dict]:
    """A turn's KVEventLog entries (kind, tier, hashes, runs) as vLLM events, in order. A store the block manager
    described is one BlockStored per run (its tokens, its parent); a store without runs (an offload tier's, or
    blocks announced again after a restart) carries no tokens, as vLLM's offloading connector publishes its."""
    events = []
    for kind, tier, block_hashes, runs in entries:
        medium = MEDIUM_BY_TIER[tier]
        if kind == "removed":
            events.append(block_removed(block_hashes, medium))
        elif runs:
            for run in runs:
                events.append(block_stored(run.block_hashes, run.parent_hash, run.token_ids, block_size, medium,
                                           lora_id(run.lora_name), run.lora_name, extra_keys(run, block_size)))
        else:
            events.append(block_stored(block_hashes, None, [], 0, medium))
    return events


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, rank: int, block_size: int, worker_id: str) -> None:
        self.config, self.rank, self.block_size, self.worker_id = config, rank, block_size, worker_id
        self.num_dropped = 0  # batches the queue had no room for
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            named = config.endpoint  # "": our default, bound on loopback
            self.endpoint = self._open(self._pub, endpoint_for_rank(named or LOCAL_ENDPOINT, rank), "endpoint",
                                       bind=not named or binds(named))
            self.replay_endpoint = None
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._open(self._replay, endpoint_for_rank(config.replay_endpoint, rank),
                                                  "replay_endpoint", bind=True)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._send(encode_batch(time.time(), [all_blocks_cleared()], rank))
        # Sockets made on this thread, used only by the publisher's from here on (thread start is a memory barrier).
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{worker_id}", daemon=True)
        self._thread.start()
        log.info("worker %s publishes KV events on %s (rank %d, topic %r)", worker_id, self.endpoint, rank,
                 config.topic)

    def _open(self, sock, endpoint: str, key: str, bind: bool) -> str:
        """Bind (or connect) ``sock``; the endpoint as bound (port 0 resolved)."""
        try:
            if bind:
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            raise RuntimeError(f"kv_events_config.{key}: worker {self.worker_id} cannot use {endpoint} ({e}); "
                               f"worker k of the cluster takes the port + k: leave that range free or name port 0"
                               ) from None

    def source(self) -> dict:
        """What vLLM's GET /kv_event_sources says of an engine (its KVEventsConfig, endpoints as bound), plus
        its rank (the batches' data_parallel_rank) and which worker it is."""
        c = self.config
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "buffer_steps": c.buffer_steps, "hwm": c.hwm,
                "max_queue_size": c.max_queue_size, "topic": c.topic, "rank": self.rank, "worker_id": self.worker_id}

    def publish(self, ts: float, entries: list) -> None:
        """Engine thread: a turn's KVEventLog entries (``drain_described``) as one batch. Never blocks."""
        try:
            self._queue.put_nowait((ts, entries))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 10_000 == 0:
                log.warning("worker %s: KV events queue full (%d batches), %d batches dropped", self.worker_id,
                            self.config.max_queue_size, self.num_dropped)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    # ---- the publisher's thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, entries = item
            try:
                events = to_vllm_events(entries, self.block_size)
                if events:
                    self._send(encode_batch(ts, events, self.rank))
            except Exception:  # noqa: BLE001 - a batch that cannot go out must not end the events that follow
                log.exception("worker %s: a KV event batch could not be published", self.worker_id)

    def _send(self, payload: bytes) -> None:
        seq = next(self._seq)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            pass  # a connected PUB past its high-water mark: subscribers that keep up lose nothing else
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """One replay request: frames (client, b"", start seq as 8 bytes big-endian); the buffered batches from it
        on, then the END_SEQ frame set. A malformed request is logged and left unanswered."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("worker %s: malformed KV events replay request (%d frames) ignored", self.worker_id,
                        len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def make_kv_event_publisher(engine, worker_id: str) -> KVEventPublisher | None:
    """The publisher of ``engine``'s config (EngineConfig.kv_events_config, .kv_events_rank), or None where off."""
    config = engine.config.kv_events()
    if config is None:
        return None
    return KVEventPublisher(config, engine.config.kv_events_rank, engine.config.block_size, worker_id)
