"""Piecewise CUDA graphs for prefill and mixed steps: the forward between attention calls, captured per
token-count bucket; attention itself runs eagerly between the pieces (vLLM's piecewise mode).

Why: a prefill or mixed step (decode rows plus a prompt's chunk) cannot replay a whole-forward graph, since its
attention depends on each row's query and context lengths. Run eagerly, a 1.1B Llama's step on the H200 of s51
cost ~10.7 ms of host time for ~260 kernel launches, whatever its token count: every served step that takes a
new prompt in paid that, against ~2 ms for a decode step. Everything but attention is token-wise (norms,
projections, RoPE with the KV write, the MLP) and takes the same kernels for any token count of a bucket, so those
stretches are captured once per bucket and a step replays them, with one eager attention call per layer between.

How:
- buckets of token counts (16, 32, 64, ... doubling to 512, then every 512, up to ``max_tokens``); a step runs in
  the smallest bucket that holds its tokens, the tokens past it padded (slot -1: no KV write; token 0 at position
  0). Steps with more tokens run eager: their kernels' time dwarfs the launches.
- the step's token ids, positions and slot mapping go into static buffers the pieces were captured over; the
  attention calls get the step's own metadata (block tables, lengths, query starts) and its real tokens only.
- capture: ``engine.attention.attend`` hands each call to the active recorder (``attention_breaks``), which ends
  the current piece's capture, records the call's (static) query, key and value, and starts the next piece. The
  attention output is a static buffer shared by every layer and bucket: the piece after a call reads it first,
  before the next call writes it.
- before capturing, a bucket's forward runs once live (the recorder calls attention with the step's metadata):
  it warms the kernels and records each call's output shape; the pieces are then captured and replayed.
Not taken: hybrids (the Mamba layers read a per-step host plan), MLA, MoE layers (their routing may read counts on
the host), LoRA adapters, and steps whose KV connector sends layers as they finish. A bucket whose capture raises
runs eager from then on.

``emulate=True`` (the CPU tests): a replay calls the forward again over the static buffers with the recorder live:
every buffer, padding, metadata and output path runs; only the CUDA capture does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdcluster.kernels.graph_region import graph_region
from pdcluster.engine.attention import AttentionMetadata, attend_now, attention_breaks
from pdcluster.engine.graph_capture import capture_or_eager
from pdcluster.engine.cuda_graphs import PAD_SLOT


def token_buckets(max_tokens: int) -> list[int]:
    small = [t for t in (16, 32, 64, 128, 256, 512) if t < max_tokens]
    return small + list(range(1024, max_tokens, 512)) + [max_tokens]


def takes_model(model) -> str | None:
    """Why ``model``'s forward cannot be split into pieces (None: it can)."""
    if hasattr(model.arch, "mamba_state_shape"):
        return "a hybrid (its Mamba layers read a per-step host plan)"
    if getattr(model.arch, "mla", None) is not None:
        return "multi-head latent attention"
    if any(getattr(layer, "moe", None) is not None for layer in getattr(model, "layers", ())):
        return "MoE layers"
    return None


@dataclass
class AttentionCall:
    """One attention call of a captured bucket: static buffers for its query, key, value (the piece before it
    copies them in) and output (the piece after it reads it), and the call's other arguments."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    layer_cache: torch.Tensor
    kwargs: dict
    out: torch.Tensor

    def run(self, num_tokens: int, meta: AttentionMetadata) -> None:
        """The call over the step's real tokens, with its metadata, into the static output."""
        n = num_tokens
        o = attend_now(self.query[:n], self.key[:n], self.value[:n], self.layer_cache, meta, **self.kwargs)
        self.out[:n].copy_(o)


@dataclass
class _Recorder:
    """The attention calls of one forward over a bucket, as ``attention_breaks`` hands them over."""

    graphs: "PiecewiseGraphs"
    bucket: int
    mode: str  # "live": attention runs now, with ``meta`` over the step's ``num_tokens``; "capture": piece breaks
    num_tokens: int = 0
    meta: AttentionMetadata | None = None
    calls: list[AttentionCall] = field(default_factory=list)
    pieces: list = field(default_factory=list)  # the finished pieces' CUDA graphs (capture)
    current: object = None  # the piece being captured

    def attention(self, query, key, value, layer_cache, kwargs: dict) -> torch.Tensor:
        """Ends a piece at an attention call: its inputs are copied into static buffers (inside the piece), so
        the piece's own tensors may be freed and their memory reused by the next pieces and buckets."""
        i, g, t = len(self.calls), self.graphs, self.bucket
        q, k, v = g.buffer("query", query)[:t], g.buffer("key", key)[:t], g.buffer("value", value)[:t]
        q.copy_(query)
        k.copy_(key)
        v.copy_(value)
        n, first = self.num_tokens, None
        if self.mode == "live" and i not in g.out_specs:  # the first run of all: the output's shape from the call
            first = attend_now(q[:n], k[:n], v[:n], layer_cache, self.meta, **kwargs)
            g.out_specs[i] = (first.shape[1:], first.dtype)
        elif self.mode == "capture":
            self.current.capture_end()
            self.pieces.append(self.current)
        call = AttentionCall(q, k, v, layer_cache, kwargs, g.out_buffer(i)[:t])
        if first is not None:
            call.out[:n].copy_(first)
        elif self.mode == "live":  # as a replay runs it
            call.run(n, self.meta)
        else:
            self.current = g.begin_piece()
        self.calls.append(call)
        return call.out


class PiecewiseGraphs:
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 device: torch.device, max_tokens: int, scale: float, emulate: bool = False):
        self.forward = forward  # (input_ids, positions, meta) -> hidden [num_tokens, H]
        self.device, self.scale, self.emulate = device, scale, emulate
        self.buckets = token_buckets(max_tokens)
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), PAD_SLOT, dtype=torch.int64, device=device)
        self.out_specs: dict[int, tuple[torch.Size, torch.dtype]] = {}  # attention call -> its output's shape
        self._buffers: dict[tuple, torch.Tensor] = {}  # (role, row shape, dtype) -> [top, *row shape] (``buffer``)
        self._pieces: dict[int, list] = {}  # bucket -> its pieces' CUDA graphs (one more than calls)
        self._calls: dict[int, list[AttentionCall]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._failed: set[int] = set()
        self._pool = None
        self.num_replays = 0
        self.num_captures = 0

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def num_pieces(self, bucket: int) -> int:
        return len(self._pieces.get(bucket, ())) if not self.emulate else len(self._calls.get(bucket, ())) + 1

    def buffer(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """[top bucket, *like's row shape] of like's dtype for ``role`` (query, key, value, out): one per role
        and shape, shared by every call and bucket (a call's piece fills it, the call reads it before the next
        piece runs). Made outside any capture, at the live run before it: plain device memory, kept."""
        key = (role, tuple(like.shape[1:]), like.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.zeros((self.buckets[-1], *like.shape[1:]), dtype=like.dtype,
                                                   device=self.device)
        return buf

    def out_buffer(self, call: int) -> torch.Tensor:
        """The static output of attention call ``call`` (its shape recorded by the first live run)."""
        shape, dtype = self.out_specs[call]
        return self.buffer("out", torch.empty(0, *shape, dtype=dtype))

    def begin_piece(self):
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: see engine/cuda_graphs.py (a transport thread's synchronisation must not fail the capture).
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        return graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states of this step through its bucket's pieces (None: no bucket holds it, or its capture
        failed: run it eager)."""
        n = input_ids.shape[0]
        bucket = self.bucket(n)
        if bucket is None or bucket in self._failed:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(PAD_SLOT)
        if bucket not in self._outputs and not self._capture_or_eager(bucket, n, meta):
            return None
        if self.emulate:
            self._outputs[bucket] = self._live(bucket, n, meta)
        else:
            pieces, calls = self._pieces[bucket], self._calls[bucket]
            for i, piece in enumerate(pieces):
                piece.replay()
                if i < len(calls):
                    calls[i].run(n, meta)
        self.num_replays += 1
        return self._outputs[bucket][:n]

    def _call(self, bucket: int, recorder: _Recorder) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:bucket], block_tables=None, seq_lens=None,
                                 query_start_loc=None, uniform_q_len=None, scale=self.scale)
        with attention_breaks(recorder), graph_region():  # buckets of up to 128 tokens may take the skinny kernel
            return self.forward(self.input_ids[:bucket], self.positions[:bucket], meta)

    def _live(self, bucket: int, n: int, meta: AttentionMetadata) -> torch.Tensor:
        recorder = _Recorder(self, bucket, "live", n, meta)
        out = self._call(bucket, recorder)
        self._calls[bucket] = recorder.calls
        return out

    def _capture_or_eager(self, bucket: int, n: int, meta: AttentionMetadata) -> bool:
        """Capture ``bucket``'s pieces; False: it runs eager from then on (engine/graph_capture.py)."""

        def undo() -> None:
            for d in (self._pieces, self._calls, self._outputs):
                d.pop(bucket, None)
            self._pool = None

        what = f"the pieces for {bucket} tokens"
        if capture_or_eager(self.device, lambda: self._capture(bucket, n, meta), undo, what):
            return True
        self._failed.add(bucket)
        return False

    def _capture(self, bucket: int, n: int, meta: AttentionMetadata) -> None:
        """Run the bucket live once (kernels warmed, output shapes known; its KV writes are this step's own,
        written again by the replay after), then capture its pieces (on a CUDA device). Both on a side stream,
        as engine/cuda_graphs.py warms its buckets: lazily made per-stream state (cuBLAS workspaces) exists
        before the capture."""
        self.num_captures += 1
        if self.emulate:
            self._outputs[bucket] = self._live(bucket, n, meta)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        recorder = _Recorder(self, bucket, "capture")
        with torch.cuda.stream(stream):
            self._live(bucket, n, meta)
            stream.synchronize()
            recorder.current = self.begin_piece()
            try:
                out = self._call(bucket, recorder)
            except BaseException:
                try:  # end the capture the failure left open (it raises too: the capture is invalid)
                    recorder.current.capture_end()
                except Exception:  # noqa: BLE001
                    pass
                raise
            recorder.current.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._pieces[bucket] = recorder.pieces + [recorder.current]
        self._calls[bucket] = recorder.calls
        self._outputs[bucket] = out
