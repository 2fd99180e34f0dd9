"""Receiver side, the same for every transport: where a verified chunk's bytes go, and what is
recorded once they are there.

The bytes enter the cache only through the admission gate (admission.py): ``revoke`` takes the same
lock, so it returns once no chunk of the transfer is being scattered and refuses every later one.
A chunk counts toward its ``send()`` call (``poll_received``) before the sender hears of it, so a
sender's delivery always means the receiver can see the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .admission import Admission
from .block_copy import Rows, scatter_rows
from .layout import KVLayout
from .tracking import ReceiveTracker
from .wire import ChunkAck, ChunkHeader


@dataclass
class Landing:
    layout: KVLayout
    rows: Rows  # the receiver's cache as rows (block_copy.rows_view)
    admission: Admission
    received: ReceiveTracker
    _stream: "torch.cuda.Stream | None" = field(default=None, repr=False)

    def scatter(self, header: ChunkHeader, src_rows: Rows) -> str | None:
        """Scatter a chunk's payload (``[rows, block_bytes]``, in header order) into its blocks unless
        admission refuses it. Returns the refusal, None once the bytes are in the cache."""
        with self.admission.gate(header.transfer_id, header.dst_block_ids) as refusal:
            if refusal is not None:
                return refusal
            row_ids = self.layout.row_ids(header.layer_ids, header.dst_block_ids)
            if isinstance(self.rows, torch.Tensor) and self.rows.is_cuda:
                # On a stream of its own: the engine's compute on the default stream neither delays the
                # landing nor waits for it (the blocks are reserved, nothing computes on them yet).
                if self._stream is None:
                    self._stream = torch.cuda.Stream(self.rows.device)
                with torch.cuda.stream(self._stream):
                    scatter_rows(src_rows, self.rows, row_ids)
                self._stream.synchronize()  # in kv_cache before we ack (or revoke)
            else:
                scatter_rows(src_rows, self.rows, row_ids)
        return None

    def settle(self, sender_nonce: bytes, header: ChunkHeader, error: str | None) -> ChunkAck:
        """Record a chunk's outcome (``error`` None: it landed, and counts toward its send() call)
        and return the ack that tells its sender."""
        if error is None:
            self.received.chunk_landed(
                sender_nonce, header.send_seq, header.num_chunks, header.transfer_id, header.layer_ids
            )
        return ChunkAck(header.send_seq, header.chunk_index, error)
