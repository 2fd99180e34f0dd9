"""The two messages every transport exchanges: a chunk header (sender -> receiver, ahead of or
alongside the payload) and an ack (receiver -> sender, once the chunk is in the receiver's cache).

Both are msgpack arrays, not maps: they go out once per chunk and the field names would double their
size. Block ids travel as raw int32 bytes for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np


@dataclass
class ChunkHeader:
    sender_id: str
    send_seq: int  # the sender's number for one send() call
    chunk_index: int
    num_chunks: int  # chunks of this send() call
    transfer_id: str
    layer_ids: list[int]
    dst_block_ids: np.ndarray  # int64 in memory, int32 on the wire
    payload_bytes: int
    extra: dict = field(default_factory=dict)  # transport specific (UCX tag, ring offset, ...)

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                self.sender_id,
                self.send_seq,
                self.chunk_index,
                self.num_chunks,
                self.transfer_id,
                self.layer_ids,
                self.dst_block_ids.astype("<i4").tobytes(),
                self.payload_bytes,
                self.extra,
            ]
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ChunkHeader:
        f = msgpack.unpackb(data)
        return cls(
            sender_id=f[0],
            send_seq=f[1],
            chunk_index=f[2],
            num_chunks=f[3],
            transfer_id=f[4],
            layer_ids=list(f[5]),
            dst_block_ids=np.frombuffer(f[6], dtype="<i4").astype(np.int64),
            payload_bytes=f[7],
            extra=f[8],
        )


@dataclass
class ChunkAck:
    send_seq: int
    chunk_index: int
    error: str | None = None  # set when the receiver rejected the chunk (bad ids, short payload)

    def encode(self) -> bytes:
        return msgpack.packb([self.send_seq, self.chunk_index, self.error])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ChunkAck:
        f = msgpack.unpackb(data)
        return cls(send_seq=f[0], chunk_index=f[1], error=f[2])
