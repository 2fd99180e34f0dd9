"""The decode instance's side: one request's pull from the prefill instance that holds its prompt's blocks.

``PullSource`` is what the engine's offload gate loads from (engine/kv_offload/gate.py): ``fetch`` runs on the
loader thread and returns the leading blocks whose hashes matched, as host tensors in the cache's column shape;
anything else (the prefill instance gone, slow, holding another prompt or another model's KV) is fewer blocks or
none, and the engine computes the rest, so the answer is the same either way, only slower. ``release`` tells the
prefill instance its blocks are not wanted (a request that found its prefix here, or ended first)."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import torch
import zmq

from pdcluster.kv_transfer.external.wire import CODEC, NOT_HELD, Blocks, Pull
from pdcluster.wire.external_kv import RemotePrefill
from pdcluster.wire.records import ProtocolError

log = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 1 << 16
# A bootstrap pull whose hold is not there yet asks again after these waits, doubling (wire/sglang_bootstrap.py).
FIRST_WAIT_S = 0.01
MAX_WAIT_S = 0.2


@dataclass
class PullStats:
    num_pulls: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    num_failed: int = 0


class PullSource:
    def __init__(self, remote: RemotePrefill, layout: str, block_shape: tuple[int, ...], dtype: torch.dtype,
                 block_nbytes: int, timeout_s: float, ctx: zmq.Context, stats: PullStats) -> None:
        self.remote, self.layout, self.block_shape, self.dtype = remote, layout, tuple(block_shape), dtype
        self.block_nbytes, self.timeout_s, self._ctx, self._stats = block_nbytes, timeout_s, ctx, stats

    @property
    def num_blocks(self) -> int:
        return self.remote.num_blocks

    def fetch(self, first_block: int, block_hashes: list[int]) -> torch.Tensor:
        """Blocks ``first_block`` on whose hashes are ``block_hashes`` (leading matches only), as one host tensor
        [num_blocks, *column shape] (no blocks: empty)."""
        none = torch.empty((0, *self.block_shape), dtype=self.dtype)
        deadline = time.monotonic() + self.timeout_s
        wait_s = FIRST_WAIT_S
        while True:  # bounded: by the deadline
            answer = self._ask(first_block, block_hashes, deadline)
            if answer is None:
                return none
            header, payload = answer
            if not (self.remote.wait_for_hold and header.error.startswith(NOT_HELD)
                    and time.monotonic() + wait_s < deadline):
                break
            time.sleep(wait_s)  # the prefill side is still computing the prompt (both legs started together)
            wait_s = min(2 * wait_s, MAX_WAIT_S)
        size = memoryview(payload).nbytes
        if header.error:
            log.warning("KV pull for %s from %s:%d: %s; computing the prompt here", self.remote.request_id,
                        self.remote.host, self.remote.port, header.error)
            self._stats.num_failed += 1
            if self.remote.wait_for_hold:
                self.release()  # its hold may still come: it ends as soon as it does
            return none
        num = header.num_blocks
        if (header.layout != self.layout or header.block_nbytes != self.block_nbytes or num > len(block_hashes)
                or size != num * self.block_nbytes):
            log.warning("KV pull for %s: answer does not fit (%d blocks of %d bytes in %d bytes, layout %s); "
                        "computing the prompt here", self.remote.request_id, num, header.block_nbytes,
                        size, header.layout)
            self._stats.num_failed += 1
            return none
        self._stats.num_pulls += 1
        self._stats.num_blocks += num
        self._stats.num_bytes += size
        if not num:
            return none
        with warnings.catch_warnings():  # zmq's frame is read-only, and only read (copied into the cache)
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(payload, dtype=torch.uint8)
        return data.view(self.dtype).view(num, *self.block_shape)

    def release(self) -> None:
        self._ask(0, [])

    def _ask(self, first_block: int, block_hashes: list[int],
             deadline: float | None = None) -> tuple[Blocks, memoryview] | None:
        r = self.remote
        timeout_s = self.timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{r.host}:{r.port}")
            sock.send(CODEC.encode(Pull(r.request_id, r.token, self.layout, first_block, list(block_hashes))))
            if not sock.poll(int(timeout_s * 1000)):
                log.warning("KV pull for %s: %s:%d did not answer in %.1f s; computing the prompt here",
                            r.request_id, r.host, r.port, self.timeout_s)
                self._stats.num_failed += 1
                return None
            frames = sock.recv_multipart(copy=False)  # the KV frame is read in place (one copy: into the cache)
            if len(frames) != 2:
                raise ProtocolError(f"answer of {len(frames)} frames (want 2)")
            header = CODEC.decode(frames[0].bytes, _MAX_HEADER_BYTES)
            if not isinstance(header, Blocks):
                raise ProtocolError(f"expected Blocks, got {type(header).__name__}")
            return header, frames[1].buffer
        except (zmq.ZMQError, ProtocolError) as e:
            log.warning("KV pull for %s from %s:%d failed: %s; computing the prompt here", r.request_id, r.host,
                        r.port, e)
            self._stats.num_failed += 1
            return None
        finally:
            sock.close(linger=0)
