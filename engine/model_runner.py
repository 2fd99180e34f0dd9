"""Tensors in, tokens out. A step is split in two (as in vLLM's model runner v2):

- ``execute_model(scheduler_output)``: refresh per-request state from the scheduler, build the packed
  inputs (engine/input_batch.py), run the forward pass (the KV connector may send each layer as it
  finishes).
- ``sample_tokens()``: compute logits, sample / verify, run the draft proposer, and only then finalise
  the KV connector with ``post_forward(finished_req_ids)`` (invariant S2).

What crosses between the two halves is one small dataclass, ``ExecuteModelState``.

With speculative decoding a decode row runs the target over 1 + k tokens (the last committed token and
k drafts); the proposer (engine/proposers/) drafts the next k from the verified tokens. With async
scheduling (engine/async_scheduler.py) a row may arrive with placeholder inputs and an upper-bound
``num_computed_tokens``; ``step_rows`` (engine/input_batch.py) makes it exact from the previous step's
outputs (S4).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from pdcluster.engine import skinny_linear
from pdcluster.kernels import launch_pdl
from pdcluster.engine.async_scheduler import PLACEHOLDER, LaunchedTokens, PrevStepOutput
from pdcluster.engine.batch_classifier import BatchKind, uniform_decode_query_len
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.cuda_graphs import DecodeGraphs
from pdcluster.engine.input_batch import StepRows, prepare_inputs, step_rows
from pdcluster.engine.multimodal.step import ImageEmbeds
from pdcluster.engine import prompt_embeds
from pdcluster.engine.logits_processors import RowContext, apply_penalties
from pdcluster.engine.logprobs import PendingLogprobs, launch_token_logprobs, token_logprobs
from pdcluster.engine.mamba_state import MambaStatePool
from pdcluster.engine.models.llama import LlamaModel
from pdcluster.engine.piecewise_graphs import PiecewiseGraphs, takes_model
from pdcluster.engine.proposers import ProposeBatch, Proposer, make_proposer
from pdcluster.engine.rejection_sampler import num_valid_tokens, rejection_sample
from pdcluster.engine.sampler import sample, sample_draw_rows
from pdcluster.engine.sampling_params import TOKEN_POOLINGS
from pdcluster.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pdcluster.engine.mamba_state_blocks import pack_state, state_block_ids, unpack_state
from pdcluster.engine.request_slots import RequestStates
from pdcluster.engine.step_inputs import HostCopyRing, StepInputs
from pdcluster.wire.kv_connector import KVConnector, KVConnectorOutput
from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.kernels import ops

log = logging.getLogger(__name__)

_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions per logits matrix (256 x 49k x 4 B = 50 MB)


@dataclass
class ExecuteModelState:
    scheduler_output: SchedulerOutput
    req_ids: list[str]
    idx_mapping_np: np.ndarray
    batch_kind: BatchKind | None
    hidden_states: torch.Tensor | None
    # Per request: first row in ``logits_indices`` and how many rows (0 = mid-prefill, nothing to sample).
    logits_start_np: np.ndarray
    logits_count_np: np.ndarray
    logits_indices: torch.Tensor
    finished_req_ids: set[str] = field(default_factory=set)
    rows: StepRows | None = None
    query_start_loc_np: np.ndarray | None = None  # [num_rows + 1]: each row's tokens in hidden_states
    logits_all_tokens: bool = False  # logits_indices is every token in order

    def logits_hidden(self) -> torch.Tensor:
        """The hidden states of the logits rows (no gather where every token is one: a device op saved)."""
        return self.hidden_states if self.logits_all_tokens else self.hidden_states[self.logits_indices]


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; ``ModelRunner.finish`` completes it."""

    state: ExecuteModelState
    output: tuple[ModelRunnerOutput, KVConnectorOutput] | None = None  # complete already (speculation)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # pooling requests' vectors, on the device
    rows: list[int] = field(default_factory=list)  # rows that sample
    logprobs: PendingLogprobs | None = None  # of the sampled tokens, for the rows in ``logprob_rows``
    logprob_rows: list[int] = field(default_factory=list)  # indices into ``rows``
    epochs_np: np.ndarray | None = None  # RequestStates.epoch_np of each row's slot at launch
    tokens: LaunchedTokens | None = None  # the sampled ids on the device
    tokens_host: torch.Tensor | None = None  # their copy on the host (pinned on a GPU)
    copied: object = None  # torch.cuda.Event recorded after the copy (None on a CPU)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        max_model_len: int,
        connector: KVConnector | None = None,
        proposer: Proposer | None = None,
        eos_token_ids: set[int] | None = None,
        num_state_blocks: int = 0,
    ):
        """``eos_token_ids``: what min_tokens masks. ``num_state_blocks``: a hybrid's blocks after each
        prompt's that carry its Mamba state in a KV transfer (engine/mamba_state_blocks.py): read when a
        request arrives with its prompt computed elsewhere, and written for every finished prompt when
        ``connector`` is a producer."""
        config.require_batch_limits()  # its request slots and graph buckets are sized by them
        self.config = config
        self.model = model
        self.kv_cache = kv_cache
        skinny_linear.set_enabled(config.skinny_gemm)  # before the first forward (warm-up) measures anything
        launch_pdl.set_enabled(config.pdl)
        skinny_linear.set_epilogues(config.skinny_epilogues)
        self.device = kv_cache.device
        self.inputs = StepInputs(self.device)  # host numpy -> device, through pinned buffers on a GPU
        self._sampled_ids_host = HostCopyRing()  # device -> host: the sampled ids' pinned buffers and events
        self.block_size = config.block_size
        self.num_spec_steps = config.num_spec_steps
        self.max_model_len = max_model_len
        # A hybrid's transfer holds its state blocks right after the prompt's (engine/mamba_state_blocks.py).
        max_blocks = -(-(max_model_len + self.num_spec_steps + 1) // self.block_size) + num_state_blocks
        self.states = RequestStates(config.max_num_seqs, max_model_len + self.num_spec_steps + 1, max_blocks)
        self.connector = connector or KVConnector()
        self.proposer = proposer or make_proposer(config, model, kv_cache)
        # A model that takes images: its encoder's outputs by image digest (engine/multimodal/step.py).
        self.image_embeds = ImageEmbeds(encoder) if (encoder := getattr(model, "image_encoder", None)) is not None else None
        # M-RoPE (Qwen2-VL): each slot's image layout and the shift its positions after the images take.
        self.mrope = getattr(model, "mrope", None)
        self._rope_layouts: list = [None] * config.max_num_seqs
        self._rope_delta_np = np.zeros(config.max_num_seqs, dtype=np.int64)
        self._rope_end_np = np.zeros(config.max_num_seqs, dtype=np.int64)  # where the slot's last image ends
        # Async scheduling schedules exactly min(k, room) draft placeholders per decode row, so every
        # sampling row must then come with that many drafts (a short n-gram match is padded).
        self.fixed_num_drafts = config.async_scheduling
        self._prev = PrevStepOutput.empty(self.num_spec_steps)  # read by the next step (S4)
        self.eos_token_ids: set[int] = set(eos_token_ids or ())
        # Structured output: the engine installs a GrammarCompiler when a request first asks for one.
        self.grammar_compiler = None
        self.grammars: dict[str, object] = {}  # request id -> GrammarState (engine/structured_output.py)
        # Prompt logprobs of requests whose prompt is still being prefilled (chunk by chunk).
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        # Mean pooling's running sum (float32, on the device) of a prompt still being prefilled; per-token pooling's rows
        # so far (TOKEN_POOLINGS); cls pooling's first row.
        self._pooling_sums: dict[str, torch.Tensor] = {}
        self.last_batch_kind: BatchKind | None = None
        self._state: ExecuteModelState | None = None
        self._launched: deque[LaunchedStep] = deque()  # launched, not yet finished: oldest first
        # Hybrid models: the Mamba layers' per-request state, indexed by the request's slot in
        # ``states`` (engine/mamba_state.py). None for attention-only models.
        self.mamba_pool: MambaStatePool | None = None
        if hasattr(model.arch, "mamba_state_shape"):
            # One slot more than requests: a CUDA graph's padded rows update that one (engine/cuda_graphs.py).
            self.mamba_pool = MambaStatePool(model.arch.mamba_state_shape(), config.max_num_seqs + 1,
                                             1 + self.num_spec_steps, kv_cache.device)
        self.num_state_blocks = num_state_blocks
        self.num_state_blocks_out = num_state_blocks if self.connector.is_producer else 0
        # Per request slot: the index of its LoRA adapter in model.lora, -1 for the base model (engine/lora/).
        self._lora_index_np = np.full(self.states.client_prompt_len_np.shape[0], -1, dtype=np.int32)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: PiecewiseGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            # MLA's latents (DeepSeek) have their own kernel (ops.latent_attention), any width.
            if ops.triton_attention_takes(model.arch.head_dim) or getattr(model.arch, "mla", None) is not None:
                self.use_decode_graphs()
                if config.mixed_cuda_graph_tokens > 0:
                    self.use_mixed_graphs(config.mixed_cuda_graph_tokens)
            else:  # the torch attention these heads take reads lengths on the host: not capturable
                log.info("CUDA graphs off: %d-wide attention heads run the torch attention (kernels/ops.py)",
                         model.arch.head_dim)

    def use_mixed_graphs(self, max_tokens: int, emulate: bool = False) -> None:
        """Run prefill and mixed steps of up to ``max_tokens`` tokens through piecewise CUDA graphs
        (engine/piecewise_graphs.py) where the model's forward can be split; ``emulate``: as use_decode_graphs."""
        why = takes_model(self.model)
        if why is not None:
            log.info("piecewise CUDA graphs off: %s", why)
            return
        self.mixed_graphs = PiecewiseGraphs(
            lambda ids, pos, meta: self.model.forward(ids, pos, self.kv_cache, meta, None), self.device,
            min(max_tokens, self.config.max_num_batched_tokens), self.model.scale, emulate=emulate)

    def use_decode_graphs(self, emulate: bool = False) -> None:
        """Run uniform decode batches through per-bucket CUDA graphs (engine/cuda_graphs.py); ``emulate``
        runs the same static-buffer path without capturing (tests on a CPU)."""
        self.graphs = DecodeGraphs(
            lambda ids, pos, meta: self.model.forward(ids, pos, self.kv_cache, meta, None), self.device,
            self.config.max_num_seqs, uniform_decode_query_len(self.num_spec_steps),
            self.states.block_table_np.shape[1], self.model.scale, emulate=emulate, mamba_pool=self.mamba_pool,
            lora=self.model.lora if self.model.lora is not None and not self.model.lora.grouped else None,
            max_graph_batch=self.config.max_cuda_graph_batch)

    # ---- state -----------------------------------------------------------------------------------
    def update_requests(self, sched: SchedulerOutput) -> np.ndarray:
        """Apply the scheduler's view: drop finished/preempted requests, add new ones, and overwrite
        every scheduled request's mirror from the scheduler (S1). Returns the slot of each request."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.states.remove_request(req_id)
            self.grammars.pop(req_id, None)
            self._prompt_logprobs.pop(req_id, None)
            self._pooling_sums.pop(req_id, None)
        st = self.states
        scheduled = sched.scheduled
        # Requests (re)added to the runner first, in row order (a decode step has none); then every row's
        # values in one column pass each (a comprehension per field costs a fraction of a loop's appends).
        for s in [s for s in scheduled if s.is_new]:
            st.remove_request(s.request_id)  # resumed after preemption
            idx = st.add_request(s.request_id, s.all_token_ids, s.sampling_params, s.sampling_params.seed)
            self._add_request_extras(s, idx)
            if self.mamba_pool is not None:
                self._init_state(s, idx)
        columns = sched.columns()
        req_id_to_index = st.req_id_to_index
        idx_list = [req_id_to_index[req_id] for req_id in columns.req_ids]
        idx_mapping = np.array(idx_list, dtype=np.int32)
        num_computed, num_tokens = columns.num_computed_np, columns.num_tokens_np
        q_lens, placeholder = columns.q_lens_np, columns.placeholder_np
        # Block tables: only the rows whose table grew since the slot's last write (a decode step: few).
        num_blocks = np.array([len(s.block_ids) for s in scheduled], dtype=np.int32)
        for r in np.flatnonzero(num_blocks != st.num_blocks_np[idx_mapping]).tolist():
            st.set_block_ids(idx_list[r], scheduled[r].block_ids)
        # The mirror overwritten from the scheduler (S1), every scheduled row at once.
        st.refresh_counts(idx_mapping, num_computed)
        # Committed tokens come from the scheduler too; drafts never enter token_ids_np. A placeholder row's
        # inputs are all past its committed tokens (the in-flight step's).
        num_committed_inputs = np.minimum(q_lens, num_tokens - num_computed)
        one_rows = np.flatnonzero(num_committed_inputs == 1)
        if len(one_rows):  # one committed input: a decode row's token, written together
            tokens = [scheduled[r].input_token_ids[0] for r in one_rows.tolist()]
            st.token_ids_np[idx_mapping[one_rows], num_computed[one_rows]] = tokens
        for r in np.flatnonzero(num_committed_inputs > 1).tolist():  # prompt chunks
            start, n = int(num_computed[r]), int(num_committed_inputs[r])
            st.token_ids_np[idx_list[r], start : start + n] = scheduled[r].input_token_ids[:n]
        if placeholder.any():  # the scheduler's count lags the in-flight step's tokens: the runner's stays
            st.num_tokens_np[idx_mapping[~placeholder]] = num_tokens[~placeholder]
        else:
            st.num_tokens_np[idx_mapping] = num_tokens
        return idx_mapping

    def _init_state(self, s, idx: int) -> None:
        """A hybrid request's Mamba state when it takes slot ``idx``: from zero when it starts at token
        0 (new, or resumed after preemption: recompute); from the state blocks when its prompt was
        computed by a prefill worker (KV transfer: the only way a hybrid starts past token 0, prefix
        caching being off), before this step's forward can write KV into those blocks."""
        if s.num_computed_tokens == 0:
            self.mamba_pool.reset(idx)
            return
        if not self.num_state_blocks:
            raise RuntimeError(f"{s.request_id}: hybrid request starts at token {s.num_computed_tokens} "
                               "without a transferred state")
        blocks = state_block_ids(s.block_ids, s.num_prompt_tokens, self.block_size, self.num_state_blocks)
        unpack_state(self.kv_cache, blocks, self.mamba_pool, idx)
        if self.model.tp_driver is not None:  # the other ranks' heads' states came in their own caches' blocks
            self.model.tp_driver.unpack_states(np.array([idx], dtype=np.int64), np.array([blocks], dtype=np.int64),
                                               self._pool_size())

    def _pack_states(self, state: ExecuteModelState, sampled: list[list[int]]) -> None:
        """Producer: the state of every prompt finished this step goes into its state blocks, after the
        proposer and before post_forward sends them (S2)."""
        slots, all_blocks = [], []
        for i, s in enumerate(state.scheduler_output.scheduled):
            if sampled[i]:
                slot = int(state.idx_mapping_np[i])
                blocks = state_block_ids(s.block_ids, s.num_prompt_tokens, self.block_size, self.num_state_blocks_out)
                pack_state(self.mamba_pool, slot, self.kv_cache, blocks)
                slots.append(slot)
                all_blocks.append(blocks)
        if slots and self.model.tp_driver is not None:  # each rank packs its heads' states into its own cache
            self.model.tp_driver.pack_states(np.array(slots, dtype=np.int64), np.array(all_blocks, dtype=np.int64),
                                             self._pool_size())

    def _pool_size(self) -> tuple[int, int]:
        return self.mamba_pool.num_slots, self.mamba_pool.max_positions_per_step

    def _add_request_extras(self, s, idx: int) -> None:
        """Per-request state beside the token arrays: the client's prompt length (penalties), the
        grammar (replayed over the outputs the request already has: after preemption, on the decode
        worker after the prefill worker's first token, after a recovery), prompt logprobs restarted."""
        params = s.sampling_params
        if self.model.lora is not None:
            self._lora_index_np[idx] = -1 if params.lora_name is None else self._lora_slot(params)
        num_client_prompt = s.num_prompt_tokens - params.output_position_offset
        self.states.client_prompt_len_np[idx] = num_client_prompt
        if self.mrope is not None:
            layout = self._rope_layouts[idx] = self.mrope.layout(params)
            self._rope_delta_np[idx] = 0 if layout is None else layout.delta
            self._rope_end_np[idx] = 0 if layout is None else layout.end
        self._prompt_logprobs.pop(s.request_id, None)
        self._pooling_sums.pop(s.request_id, None)  # recomputed from its first token (no prefix hit for "mean")
        self.grammars.pop(s.request_id, None)
        if params.structured_output is not None:
            from pdcluster.engine.structured_output import GrammarState

            state = GrammarState(self.grammar_compiler.compile(params.structured_output))
            state.replay(list(s.all_token_ids[num_client_prompt:]))
            self.grammars[s.request_id] = state

    # ---- the two halves of a step ---------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, ahead: LaunchedTokens | None = None) -> None:
        """``ahead``: the previous step, launched and not yet finished (its sampled ids still on the
        device): this step's placeholder rows read their input token from it there."""
        idx_mapping = self.update_requests(sched)
        req_ids = sched.columns().req_ids
        if sched.is_empty:
            self._state = ExecuteModelState(
                sched, req_ids, idx_mapping, None, None, np.zeros(0, np.int32), np.zeros(0, np.int32),
                torch.zeros(0, dtype=torch.int64, device=self.device), set(sched.finished_req_ids),
            )
            return
        rows = step_rows(sched, idx_mapping, self.states, self._prev, ahead)
        sends_layers = self.connector.wants_layers()  # layer callbacks run Python mid-forward: no graph then
        images = given = None
        params = self.states.sampling_params
        if self.image_embeds is not None:  # prompt chunks over image placeholders (engine/multimodal/)
            images = self.image_embeds.for_step(rows.starts_np, rows.q_lens_np, lambda i: params[idx_mapping[i]])
        if self.config.enable_prompt_embeds:  # prompt chunks given as embeddings (engine/prompt_embeds.py)
            given = prompt_embeds.rows_for_step(rows.starts_np, rows.q_lens_np, lambda i: params[idx_mapping[i]],
                                                self.device, self.model.dtype)
        # A step with adapter rows replays only where the graphs hold the updates (the stacked way); one with
        # image rows or rows given as embeddings runs eagerly.
        eager_rows = images is not None or given is not None
        graphs = self.graphs if (self.graphs is not None and not sends_layers and not eager_rows and (
            self.graphs.lora is not None or not self._has_lora_rows(idx_mapping))) else None
        batch = prepare_inputs(rows, idx_mapping, self.states, self.inputs, self.block_size, self.num_spec_steps,
                               self.model.scale, self.mamba_pool, graphs,
                               None if self.mrope is None else self._rope_positions)
        kind, meta = batch.batch_kind, batch.attn_metadata
        self.last_batch_kind = kind
        self.connector.pre_forward(sched)
        with self._lora_rows(idx_mapping, batch.query_start_loc_np):
            hidden = None
            if graphs is not None and kind == BatchKind.UNIFORM_DECODE:
                hidden = graphs.run(batch.input_ids, batch.positions, meta)
            # The pieces read no adapter slots: steps run them only while no adapter is held.
            if (hidden is None and self.mixed_graphs is not None and self.model.lora is None and not sends_layers
                    and not eager_rows):
                hidden = self.mixed_graphs.run(batch.input_ids, batch.positions, meta)
            if hidden is None:
                self.model.image_rows, self.model.prompt_rows = images, given
                try:
                    hidden = self.model.forward(batch.input_ids, batch.positions, self.kv_cache, meta,
                                                self.connector.save_layer)
                finally:
                    self.model.image_rows = self.model.prompt_rows = None
        self._state = ExecuteModelState(
            sched, req_ids, idx_mapping, kind, hidden, batch.logits_start_np, batch.logits_count_np,
            batch.logits_indices, set(sched.finished_req_ids), rows, batch.query_start_loc_np,
            batch.logits_all_tokens,
        )

    def _rope_positions(self, positions_np: np.ndarray, query_start_loc_np: np.ndarray,
                        idx_mapping: np.ndarray) -> np.ndarray:
        """M-RoPE's rotary positions of a step's tokens (engine/multimodal/mrope.py)."""
        layouts = self._rope_layouts
        return self.mrope.rope_positions(positions_np, query_start_loc_np, self._rope_delta_np[idx_mapping],
                                         self._rope_end_np[idx_mapping], lambda row: layouts[idx_mapping[row]])

    def _lora_slot(self, params) -> int:
        """The slot of the adapter a request runs with: by name and content (an adapter unloaded meanwhile is
        held until its requests end; another may hold the name by then: LLMEngine.unload_lora)."""
        slot = self.model.lora.slot_of(params.lora_name, params.lora_digest)
        if slot is None:  # bind_lora checked it at entry and unloading keeps it: a broken invariant
            raise RuntimeError(f"LoRA adapter {params.lora_name!r} ({params.lora_digest}) is not held")
        return slot

    def _has_lora_rows(self, idx_mapping: np.ndarray) -> bool:
        return self.model.lora is not None and bool((self._lora_index_np[idx_mapping] >= 0).any())

    def _lora_rows(self, idx_mapping: np.ndarray, query_start_loc_np: np.ndarray):
        """The step's LoRA rows for the model's adapters (engine/lora/) over one forward; yields whether any."""
        lora = self.model.lora
        if lora is None:
            return contextlib.nullcontext(False)
        return lora.step(self._lora_index_np[idx_mapping], query_start_loc_np, self.device)

    @torch.inference_mode()
    def sample_tokens(self) -> tuple[ModelRunnerOutput, KVConnectorOutput]:
        state, self._state = self._state, None
        assert state is not None, "sample_tokens() without execute_model()"
        return self._finish(self._launch_sampling(state))

    # ---- launched steps (async scheduling's launch-ahead, engine/async_scheduler.py) ---------------
    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, ahead: bool = False) -> None:
        """``execute_model`` and the sampling, queued on the device without waiting for them; ``finish``
        collects the oldest launched step. ``ahead``: launch while the previous step is still unfinished
        (its sampled ids are read on the device); only without speculation, penalties or grammars in
        this step (their inputs need the previous step's tokens on the host)."""
        prev = None
        if ahead:
            if not self._launched or self.num_spec_steps:
                raise RuntimeError("launch ahead: needs an unfinished launched step and no speculative decoding")
            # A previous step that sampled nothing leaves no ids: a placeholder row then fails loudly.
            prev = self._launched[-1].tokens or LaunchedTokens([], np.zeros(0, np.int64), None)
        self.execute_model(sched, prev)
        state, self._state = self._state, None
        self._launched.append(self._launch_sampling(state))

    @torch.inference_mode()
    def finish(self) -> tuple[ModelRunnerOutput, KVConnectorOutput]:
        """The oldest launched step's outputs (waits for its sampled ids)."""
        launched = self._launched.popleft()
        return self._finish(launched, check_slots=bool(self._launched))

    @property
    def num_launched(self) -> int:
        return len(self._launched)

    def _launch_sampling(self, state: ExecuteModelState) -> LaunchedStep:
        """Everything of a step's second half that needs no host copy of its sampled ids: prompt
        logprobs, logits, and (without speculation) the sampled ids on the device, with their copy
        to the host started. Speculative steps verify, propose and finalise here at once."""
        if state.hidden_states is None:
            return LaunchedStep(state)
        if self.num_spec_steps:
            return LaunchedStep(state, output=self._sample_and_propose(state))
        prompt_logprobs = self._prompt_logprobs_step(state)
        pooled = self._pooling_step(state) if self._has_pooling_rows(state) else {}
        st, n = self.states, len(state.req_ids)
        rows = np.flatnonzero(state.logits_count_np > 0)
        sample_index_np = np.full(n, -1, dtype=np.int64)
        sample_index_np[rows] = np.arange(len(rows))
        launched = LaunchedStep(state, prompt_logprobs=prompt_logprobs, pooled=pooled, rows=rows.tolist(),
                                epochs_np=st.epoch_np[state.idx_mapping_np])
        if not launched.rows:
            return launched
        # One logits row per sampling row, in order (no drafts: every count is 1).
        raw_logits = self.model.compute_logits(state.logits_hidden())
        # What the rows ask of the sampler, from the slots' flags: a greedy batch without penalties, grammars
        # or logprobs reads no row's parameters.
        slots, slot_params = state.idx_mapping_np[rows], st.sampling_params
        logits = raw_logits
        if self.grammars or st.has_penalties_np[slots].any():
            params = [slot_params[idx] for idx in slots.tolist()]
            logits = self._process_logits(state, raw_logits, launched.rows, params, [[] for _ in launched.rows])
        draw = np.flatnonzero(st.draws_np[slots])
        draw_params = [slot_params[idx] for idx in slots[draw].tolist()]
        tokens_dev = sample_draw_rows(logits, draw.tolist(), draw_params, [p.seed for p in draw_params],
                                      state.rows.num_output_np[rows[draw]].tolist()).to(torch.int64)
        launched.tokens = LaunchedTokens(list(state.req_ids), sample_index_np, tokens_dev)
        want = np.flatnonzero(st.wants_logprobs_np[slots]).tolist()
        if want:  # on the device too, their host copies behind the same event
            if len(want) == len(rows):
                lp_logits, lp_ids = raw_logits, tokens_dev
            else:
                sel = self.inputs.put("logprob_rows", np.asarray(want, dtype=np.int64))
                lp_logits, lp_ids = raw_logits[sel], tokens_dev[sel]
            launched.logprobs = launch_token_logprobs(lp_logits, lp_ids,
                                                      [slot_params[idx].logprobs for idx in slots[want].tolist()])
            launched.logprob_rows = want
        # The step's one synchronisation, deferred to finish().
        launched.tokens_host, launched.copied = self._sampled_ids_host.copy(tokens_dev)
        return launched

    def _finish(self, launched: LaunchedStep, check_slots: bool = False) -> tuple[ModelRunnerOutput, KVConnectorOutput]:
        """``check_slots``: a later step was launched before this one is finished (its update may have
        dropped requests of this step and reused their slots)."""
        state = launched.state
        if launched.output is not None:
            return launched.output
        if state.hidden_states is None:
            self._prev = PrevStepOutput.empty(self.num_spec_steps)
            return ModelRunnerOutput([], []), self.connector.no_forward(state.scheduler_output)
        st, rows, num_rows = self.states, launched.rows, len(state.req_ids)
        sampled: list[list[int]] = []
        # Empty when no row asked for logprobs (ModelRunnerOutput's "none"), else one list per row.
        logprobs: list[list[TokenLogprobs]] = []
        if rows:
            if launched.copied is not None:
                launched.copied.synchronize()
            per_req = [[t] for t in launched.tokens_host.tolist()]
            if len(rows) == num_rows:  # a decode batch: every row sampled
                sampled = per_req
            else:
                sampled = [[] for _ in state.req_ids]
                for i, tokens in zip(rows, per_req):
                    sampled[i] = tokens
            # A step launched ahead of this one may have dropped a request (finished, preempted) and
            # given its slot to another: only slots the same request has held since launch take tokens.
            idx, appended = state.idx_mapping_np[rows], per_req
            if check_slots:
                held = st.epoch_np[idx] == launched.epochs_np[rows]
                index_to_req_id, req_ids = st.index_to_req_id, state.req_ids
                held &= np.array([index_to_req_id[j] == req_ids[i] for i, j in zip(rows, idx.tolist())])
                if not held.all():
                    idx, appended = idx[held], [t for t, h in zip(per_req, held) if h]
            st.append_sampled(idx, appended)
            if self.grammars:
                for i, tokens in zip(rows, per_req):
                    grammar = self.grammars.get(state.req_ids[i])
                    if grammar is not None:
                        grammar.accept(tokens)
            if launched.logprobs is not None:
                logprobs = [[] for _ in state.req_ids]
                records = launched.logprobs.records([per_req[j][0] for j in launched.logprob_rows])
                for j, record in zip(launched.logprob_rows, records):
                    logprobs[rows[j]] = [record]
        else:
            sampled = [[] for _ in state.req_ids]
        if self.num_state_blocks_out:
            self._pack_states(state, sampled)
        self._prev = self._step_output(state, sampled, [])  # no speculation here: a speculative step finished at launch
        kv_output = self.connector.post_forward(state.finished_req_ids)  # last: S2
        pooled = {req_id: v.cpu().numpy() for req_id, v in launched.pooled.items()}  # after the sync above
        return ModelRunnerOutput(state.req_ids, sampled, [], logprobs, launched.prompt_logprobs, pooled), kv_output

    def _sample_and_propose(self, state: ExecuteModelState) -> tuple[ModelRunnerOutput, KVConnectorOutput]:
        """A speculative step's second half, all at once: verify, propose from the verified tokens,
        finalise (S2)."""
        prompt_logprobs = self._prompt_logprobs_step(state)
        pooled = self._pooling_step(state) if self._has_pooling_rows(state) else {}
        sampled, logprobs = self._sample(state)
        # The proposer runs after verification and before post_forward: MTP writes its draft layer's KV
        # for this step's verified positions here, and the connector may only finalise complete KV (S2).
        drafts = self._propose(state, sampled)
        if self.num_state_blocks_out:
            self._pack_states(state, sampled)
        self._prev = self._step_output(state, sampled, drafts)
        kv_output = self.connector.post_forward(state.finished_req_ids)  # last: S2
        pooled_np = {req_id: v.cpu().numpy() for req_id, v in pooled.items()}
        return ModelRunnerOutput(state.req_ids, sampled, drafts, logprobs, prompt_logprobs, pooled_np), kv_output

    def _propose(self, state: ExecuteModelState, sampled: list[list[int]]) -> list[list[int]]:
        if self.num_spec_steps == 0:
            return [[] for _ in sampled]
        st, rows, idx = self.states, state.rows, state.idx_mapping_np
        num_sampled = np.array([len(t) for t in sampled], dtype=np.int64)
        new_num_tokens = st.num_tokens_np[idx].astype(np.int64)  # this step's tokens appended
        # Verified inputs: up to (excluding) the newest committed token for a row that sampled; the
        # whole chunk for a prefill still in progress.
        num_verified = np.where(num_sampled > 0, new_num_tokens - 1 - rows.starts_np, rows.q_lens_np)
        # num_output_np is an output *position*: a resumed request's counts from its original start
        # (output_position_offset), its max_tokens from where it resumed.
        params = [st.sampling_params[i] for i in idx]
        last_position = np.array([p.max_tokens + p.output_position_offset for p in params], dtype=np.int64)
        room = np.minimum(self.max_model_len - new_num_tokens, last_position - rows.num_output_np - num_sampled) - 1
        num_drafts = np.where(num_sampled > 0, np.clip(room, 0, self.num_spec_steps), 0)
        batch = ProposeBatch(idx, rows.starts_np, state.query_start_loc_np, num_verified, num_drafts,
                             state.hidden_states, st)
        drafts = self.proposer.propose(batch)
        if self.fixed_num_drafts:
            for i, d in enumerate(drafts):
                if len(d) < num_drafts[i]:  # a short n-gram match: pad with the last token (any token is lossless)
                    drafts[i] = d + [sampled[i][-1]] * int(num_drafts[i] - len(d))
        return drafts

    def _step_output(self, state: ExecuteModelState, sampled: list[list[int]], drafts: list[list[int]]) -> PrevStepOutput:
        """This step's per-row values, in this batch's order, for the next step (S4). Without speculation nothing
        is rejected and there are no drafts (``drafts`` may then be empty): no pass over the rows."""
        k, num_rows = self.num_spec_steps, len(state.req_ids)
        draft_np = np.full((num_rows, k), PLACEHOLDER, dtype=np.int64)
        if not k:
            return PrevStepOutput(list(state.req_ids), np.zeros(num_rows, dtype=np.int64), draft_np)
        num_rejected = np.array(
            [len(state.rows.draft_token_ids[i]) + 1 - len(t) if t else 0 for i, t in enumerate(sampled)], dtype=np.int64
        )
        for i, d in enumerate(drafts):
            draft_np[i, : len(d)] = d[:k]
        return PrevStepOutput(list(state.req_ids), num_rejected, draft_np)

    def _sample(self, state: ExecuteModelState) -> tuple[list[list[int]], list[list[TokenLogprobs]]]:
        st = self.states
        sampled: list[list[int]] = [[] for _ in state.req_ids]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in state.req_ids]
        rows = [i for i in range(len(state.req_ids)) if state.logits_count_np[i] > 0]
        if not rows:
            return sampled, logprobs
        raw_logits = self.model.compute_logits(state.logits_hidden())
        step_rows = state.rows
        params = [st.sampling_params[state.idx_mapping_np[i]] for i in rows]
        seeds = [p.seed for p in params]
        positions = [int(step_rows.num_output_np[i]) for i in rows]
        starts, counts = state.logits_start_np, state.logits_count_np
        drafts = [step_rows.draft_token_ids[i] for i in rows]
        logits = self._process_logits(state, raw_logits, rows, params, drafts)
        if not any(drafts):
            tokens = sample(logits[starts[rows]], params, seeds, positions)
            per_req = [[t] for t in tokens]
        else:
            target = [logits[starts[i] : starts[i] + counts[i]] for i in rows]
            output_token_ids = rejection_sample(target, drafts, params, seeds, positions)
            num_valid = num_valid_tokens(output_token_ids).tolist()  # S3
            per_req = [output_token_ids[r, : num_valid[r]].tolist() for r in range(len(rows))]
            self._keep_accepted_states(state, rows, drafts, num_valid)
        for i, tokens in zip(rows, per_req):
            sampled[i] = tokens
        st.append_sampled(state.idx_mapping_np[rows], per_req)
        if self.grammars:
            for i, tokens in zip(rows, per_req):
                grammar = self.grammars.get(state.req_ids[i])
                if grammar is not None:
                    grammar.accept(tokens)
        self._sampled_logprobs(raw_logits, rows, params, per_req, starts, logprobs)
        return sampled, logprobs

    def _keep_accepted_states(self, state: ExecuteModelState, rows: list[int], drafts: list[list[int]],
                              num_valid: list[int]) -> None:
        """Hybrid models: a verification row's Mamba state must be the one after its last accepted
        input (the committed token and ``num_valid - 1`` drafts), never after a rejected draft. The count
        is S3's ``(ids != -1).sum(1)`` of this very step, keyed by the request's slot, so a reordered
        or condensed batch (async scheduling, S4) cannot hand one request another's count."""
        if self.mamba_pool is None:
            return
        verify = [r for r in range(len(rows)) if drafts[r]]
        slots = np.array([state.idx_mapping_np[rows[r]] for r in verify], dtype=np.int64)
        position_index = np.array([num_valid[r] - 1 for r in verify], dtype=np.int64)
        self.mamba_pool.select(slots, position_index)
        if self.model.tp_driver is not None and len(slots):  # the other ranks hold their heads' states
            self.model.tp_driver.keep_states(slots, position_index)

    def _process_logits(self, state: ExecuteModelState, logits: torch.Tensor, rows: list[int],
                        params: list, drafts: list[list[int]]) -> torch.Tensor:
        """Penalties, logit bias, min_tokens and grammars on the logits rows (one per output position;
        a verification row j sees drafts[:j] as outputs). The raw logits stay for logprobs."""
        grammars = [self.grammars.get(state.req_ids[i]) for i in rows]
        if not any(p.has_penalties for p in params) and not any(grammars):
            return logits
        st, starts, counts = self.states, state.logits_start_np, state.logits_count_np
        logits = logits.float().clone()
        contexts: list[RowContext | None] = [None] * logits.shape[0]
        for r, i in enumerate(rows):
            if not params[r].has_penalties:
                continue
            idx = int(state.idx_mapping_np[i])
            num_prompt = int(st.client_prompt_len_np[idx])
            tokens = st.token_ids_np[idx, : int(state.rows.num_tokens_np[i])].tolist()
            # A prompt's rows given as embeddings have placeholder ids: they are no prompt tokens to penalise (vLLM's
            # penalises token 0 for each).
            embeds = params[r].prompt_embeds
            prompt = tokens[:num_prompt] if embeds is None else embeds.outside_rows(tokens[:num_prompt])
            for j in range(int(counts[i])):
                contexts[starts[i] + j] = RowContext(params[r], prompt, tokens[num_prompt:] + drafts[r][:j])
        active = [k for k, c in enumerate(contexts) if c is not None]
        if active:
            logits[active] = apply_penalties(logits[active], [contexts[k] for k in active], self.eos_token_ids)
        for r, i in enumerate(rows):
            if grammars[r] is not None:
                block = logits[starts[i] : starts[i] + counts[i]]
                grammars[r].apply(block, drafts[r][: int(counts[i]) - 1])
        return logits

    @staticmethod
    def _sampled_logprobs(raw_logits: torch.Tensor, rows: list[int], params: list, per_req: list[list[int]],
                          starts: np.ndarray, out: list[list[TokenLogprobs]]) -> None:
        """Raw-distribution logprobs of each sampled token (row j of a request = its j-th token)."""
        want = [r for r, p in enumerate(params) if p.logprobs is not None and per_req[r]]
        if not want:
            return
        row_index = [int(starts[rows[r]]) + j for r in want for j in range(len(per_req[r]))]
        token_ids = [t for r in want for t in per_req[r]]
        num_top = [params[r].logprobs for r in want for _ in per_req[r]]
        records = token_logprobs(raw_logits[row_index], token_ids, num_top)
        k = 0
        for r in want:
            out[rows[r]] = records[k : k + len(per_req[r])]
            k += len(per_req[r])

    def _has_pooling_rows(self, state: ExecuteModelState) -> bool:
        """Whether a row of this step is a pooling request's prompt (a flag per slot: no Python per row; nothing
        at all while no slot holds one)."""
        st = self.states
        return st.num_pooling > 0 and bool(st.pools_np[state.idx_mapping_np].any())

    def _pooling_step(self, state: ExecuteModelState) -> dict[str, torch.Tensor]:
        """The pooled vectors (float32, on the device) of the pooling requests whose prompt this step completes:
        the last prompt position's final hidden state ("last"), the first one's ("cls", an encoder's), or the mean over
        the prompt's ("mean", summed chunk by chunk: such a request takes no prefix-cache hit, so every position passes
        here), a classifier's logits from the last one ("classify"; an encoder's head reads the first or the mean), or
        every position's row ("token_embed", "token_classify": [num_tokens, width], gathered chunk by chunk)."""
        st, rows, done = self.states, state.rows, {}
        for i in np.flatnonzero(st.pools_np[state.idx_mapping_np] & (rows.num_output_np == 0)).tolist():
            req_id, idx = state.req_ids[i], int(state.idx_mapping_np[i])
            pooling = st.sampling_params[idx].pooling
            first, q_len = int(state.query_start_loc_np[i]), int(rows.q_lens_np[i])
            completes = state.logits_count_np[i] > 0  # the row samples: its prompt ends in this chunk
            if pooling == "last":
                if completes:  # a copy: the hidden states may be a CUDA graph's buffer, which the next step rewrites
                    done[req_id] = state.hidden_states[first + q_len - 1].to(torch.float32, copy=True)
                continue
            if pooling == "classify":  # a sequence classifier's logits (engine/models/classifier.py): a new tensor
                if completes:  # an encoder's head reads the first token ([CLS]), a decoder's the last
                    classifier = self.model.classifier
                    if getattr(classifier, "reads_prompt_mean", False):  # ModernBERT's mean pooling: an encoder's
                        # prompt is whole in this step (the scheduler's whole_prompts)
                        done[req_id] = classifier.logits(state.hidden_states[first:first + q_len].float().mean(0))
                        continue
                    row = first if getattr(classifier, "reads_first_token", False) else first + q_len - 1
                    done[req_id] = classifier.logits(state.hidden_states[row])
                continue
            if pooling in TOKEN_POOLINGS:  # every position's row (a token classifier's logits at each), chunk by chunk
                rows_now = state.hidden_states[first : first + q_len]
                rows_now = (self.model.classifier.logits(rows_now) if pooling == "token_classify"
                            else rows_now.to(torch.float32, copy=True))
                so_far = self._pooling_sums.pop(req_id, None)
                rows_now = rows_now if so_far is None else torch.cat([so_far, rows_now])
                if completes:
                    done[req_id] = rows_now[: int(st.client_prompt_len_np[idx])]
                else:
                    self._pooling_sums[req_id] = rows_now
                continue
            if pooling == "cls":  # position 0's ([CLS] in an encoder), kept from the prompt's first chunk
                if int(rows.starts_np[i]) == 0:
                    self._pooling_sums[req_id] = state.hidden_states[first].to(torch.float32, copy=True)
                if completes:
                    done[req_id] = self._pooling_sums.pop(req_id)
                continue
            chunk_sum = state.hidden_states[first : first + q_len].float().sum(0)
            total = self._pooling_sums.pop(req_id, None)
            total = chunk_sum if total is None else total + chunk_sum
            if completes:
                done[req_id] = total / float(st.client_prompt_len_np[idx])
            else:
                self._pooling_sums[req_id] = total
        return done

    def _prompt_logprobs_step(self, state: ExecuteModelState) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of the prompt tokens this step's chunks predict (position p scores token p + 1),
        kept per request until its prompt is complete; returns the completed ones, in the step that
        samples the first token: they travel with it (a chunk before it reports no tokens)."""
        st, rows, done = self.states, state.rows, {}
        # Rows still in their prompt only (a decode batch has none: no Python per row there).
        for i in np.flatnonzero(rows.num_output_np == 0).tolist():
            req_id = state.req_ids[i]
            idx = int(state.idx_mapping_np[i])
            params = st.sampling_params[idx]
            if params is None or params.prompt_logprobs is None:
                continue
            start, q_len = int(rows.starts_np[i]), int(rows.q_lens_np[i])
            num_prompt = int(st.client_prompt_len_np[idx])
            acc = self._prompt_logprobs.setdefault(req_id, [])
            end = min(start + q_len, num_prompt - 1)  # the last prompt position predicts the first output
            for lo in range(start, end, _PROMPT_LOGPROBS_CHUNK):
                hi = min(end, lo + _PROMPT_LOGPROBS_CHUNK)
                first = int(state.query_start_loc_np[i]) + lo - start
                logits = self.model.compute_logits(state.hidden_states[first : first + hi - lo])
                next_ids = st.token_ids_np[idx, lo + 1 : hi + 1].tolist()
                acc += token_logprobs(logits, next_ids, [params.prompt_logprobs] * len(next_ids))
            if state.logits_count_np[i] > 0:  # the prompt is complete: this row samples
                done[req_id] = self._prompt_logprobs.pop(req_id)
        return done
