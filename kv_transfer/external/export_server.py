"""The prefill instance's side: finished prompts' blocks held for a decode instance, and the zmq ROUTER that
serves them.

A hold is made on the engine thread (the connector's ``request_finished``) and ends on one of three paths,
each exactly once: a pull served it (the blocks went out, or the pull found nothing to take), a release-only
pull, or its deadline. The engine thread learns of ended holds from ``take_ended`` (the connector's poll) and
frees the blocks then; until it does, no step writes them (they are a finished request's), so the server
thread reads them while the engine steps. A pull with a wrong token, an unknown request or another KV layout
gets an error answer and changes nothing (a wrong token does not end the hold: a stranger cannot release a
proxy's blocks); a malformed message is logged and dropped, and the thread lives on."""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from pdcluster.kv_transfer.external.wire import CODEC, MAX_PULL_BYTES, NOT_HELD, Blocks, Pull
from pdcluster.wire.records import ProtocolError
from pdcluster.wire.sglang_bootstrap import ROOM_PREFIX

log = logging.getLogger(__name__)

_POLL_MS = 100
# A release that came before its hold (SGLang's bootstrap: both legs start at once) is remembered this long.
RELEASED_EARLY_S = 300.0
MAX_RELEASED_EARLY = 100_000


@dataclass
class Hold:
    request_id: str  # the engine's (its blocks go back under it); the hold's key may be another name (a room)
    block_ids: list[int]
    block_hashes: list[int]
    token: str
    deadline: float  # time.monotonic()
    serving: bool = False


class KVExportServer:
    def __init__(self, host: str, port: int, layout: str, block_nbytes: int,
                 read_blocks: Callable[[list[int]], memoryview]) -> None:
        """``read_blocks(block_ids)``: those blocks' KV columns, concatenated, as host bytes (any buffer)."""
        self.layout, self.block_nbytes, self._read_blocks = layout, block_nbytes, read_blocks
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"KV export server: cannot listen on {host}:{port}: {e}") from None
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}  # by key: the request id, or the name a pull asks by (an SGLang room)
        self._ended: list[str] = []
        # Keys released before their hold was made (SGLang's router starts both legs at once: a decode side that
        # found the prompt in its own cache may say so first) -> until when: such a hold ends as soon as it is made.
        self._released_early: dict[str, float] = {}
        self.counters = {"held": 0, "pulled": 0, "released": 0, "expired": 0, "refused": 0, "bytes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-export", daemon=True)
        self._thread.start()

    # ---- engine thread ---------------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: list[int], block_hashes: list[int], timeout_s: float,
             key: str | None = None) -> str:
        """Keep ``block_ids`` (the prompt's full blocks, hashes in the same order) for one pull; returns its token.
        ``key``: the name pulls ask for it by, with no token (an SGLang bootstrap room: random, the router's and the
        two servers' alone); default the request id, with a fresh token."""
        token = "" if key is not None else secrets.token_hex(16)
        key = request_id if key is None else key
        with self._lock:
            self._holds[key] = Hold(request_id, list(block_ids), list(block_hashes), token,
                                    time.monotonic() + timeout_s)
            self.counters["held"] += 1
            if self._released_early.pop(key, None) is not None:
                self._end(key, "released")
        return token

    def take_ended(self) -> list[str]:
        """Holds that ended since the last call (served, released or expired): their blocks may go back."""
        now = time.monotonic()
        with self._lock:
            for key, hold in list(self._holds.items()):
                if not hold.serving and now >= hold.deadline:
                    del self._holds[key]
                    self._ended.append(hold.request_id)
                    self.counters["expired"] += 1
            # Oldest first (each one is put at the end: ``_take``): the expired ones lead.
            while self._released_early and now >= next(iter(self._released_early.values())):
                del self._released_early[next(iter(self._released_early))]
            ended, self._ended = self._ended, []
        return ended

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._holds)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()

    # ---- server thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            try:
                self._answer(frames)
            except Exception:  # noqa: BLE001 - one bad pull must not end the server
                log.exception("KV export: answering a pull failed")

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("KV export: dropped a message of %d frames (want 2: peer, pull)", len(frames))
            return
        peer, body = frames
        try:
            pull = CODEC.decode(body, MAX_PULL_BYTES)
            if not isinstance(pull, Pull):
                raise ProtocolError(f"expected Pull, got {type(pull).__name__}")
        except ProtocolError as e:
            log.warning("KV export: dropped a malformed pull: %s", e)
            return
        header, payload = self._take(pull)
        self._sock.send_multipart([peer, CODEC.encode(header), payload], copy=False)

    def _take(self, pull: Pull) -> tuple[Blocks, memoryview | bytes]:
        def refuse(error: str) -> tuple[Blocks, bytes]:
            self.counters["refused"] += 1
            return Blocks(self.layout, 0, self.block_nbytes, error), b""

        with self._lock:
            hold = self._holds.get(pull.request_id)
            if hold is None and not pull.block_hashes and pull.request_id.startswith(ROOM_PREFIX):
                # A room's release ahead of its hold (bounded: a flood of them forgets the oldest).
                if len(self._released_early) >= MAX_RELEASED_EARLY:
                    self._released_early.pop(next(iter(self._released_early)))
                self._released_early.pop(pull.request_id, None)  # a repeat goes to the end, in deadline order
                self._released_early[pull.request_id] = time.monotonic() + RELEASED_EARLY_S
                return Blocks(self.layout, 0, self.block_nbytes), b""
            if hold is None or hold.serving:
                return refuse(f"{NOT_HELD} for request {pull.request_id!r} (never, pulled already, or expired)")
            if not hmac.compare_digest(hold.token.encode(), pull.token.encode()):
                return refuse(f"wrong token for request {pull.request_id!r}")
            if pull.layout != self.layout:
                # Another model, dtype, block size or split: its KV is not ours to take. The hold ends: the decode
                # instance computes the prompt.
                self._end(pull.request_id, "released")
                return refuse(f"KV layout {pull.layout} differs from this instance's {self.layout} (another model, "
                              "dtype, block size or tensor-parallel split)")
            hold.serving = True
        try:
            first, want = pull.first_block, pull.block_hashes
            num = 0
            while (num < len(want) and 0 <= first + num < len(hold.block_hashes)
                   and hold.block_hashes[first + num] == want[num]):
                num += 1
            payload = self._read_blocks(hold.block_ids[first:first + num]) if num else b""
        finally:
            with self._lock:
                self._end(pull.request_id, "pulled" if pull.block_hashes else "released")
        self.counters["bytes"] += memoryview(payload).nbytes
        return Blocks(self.layout, num, self.block_nbytes), payload

    def _end(self, key: str, how: str) -> None:
        hold = self._holds.pop(key, None)
        if hold is not None:
            self._ended.append(hold.request_id)
            self.counters[how] += 1
