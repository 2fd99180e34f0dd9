"""The pull's two messages (records over msgpack, wire/records.py). A decode instance's ``Pull`` names a held
prompt (request id and the one-time token from the prefill instance's answer), the KV layout it expects, and the
chained hashes of the blocks it wants from ``first_block`` on; the answer is a ``Blocks`` header and, where
blocks matched, one frame of raw KV (``num_blocks`` columns of ``block_nbytes`` bytes each, block order). A
``Pull`` without hashes only releases the hold (the decode instance computes the prompt itself)."""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.wire.records import Codec, Record

MAX_PULL_BYTES = 1 << 20  # a Pull's size bound: hashes of ~100k blocks
NOT_HELD = "no blocks held"  # how a refusal for a name with no hold begins (a bootstrap pull asks again)


@dataclass(frozen=True)
class Pull(Record):
    request_id: str
    token: str
    layout: str
    first_block: int
    block_hashes: list[int]


@dataclass(frozen=True)
class Blocks(Record):
    layout: str
    num_blocks: int
    block_nbytes: int
    error: str = ""


CODEC = Codec(1, [Pull, Blocks])
