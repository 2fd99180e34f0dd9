"""The engine loop: scheduler + model runner + tokenizer. One object per worker, built in stages: the
model and its KV cache (engine/loaded_model.py), then the KV connector the caller made for that cache
(wire/kv_connector.py; the null one by default), then the scheduler and the runner, whole."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field, replace

import numpy as np

from pdcluster.engine.async_scheduler import AsyncScheduler, AsyncStepper
from pdcluster.engine.beam_search import Beam, BeamSearch, BeamSearches, BeamSearchParams
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.kv_offload.events import KVEventLog, make_offload_manager
from pdcluster.engine.loaded_model import LoadedModel
from pdcluster.engine.lora.runtime import RuntimeLora
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.multimodal.images import image_inputs, image_size, open_image
from pdcluster.engine.multimodal.chunks import check_images_fit_a_chunk
from pdcluster.engine.multimodal.spec import IMAGES_OFF, ImageInputError, ImageSpec, check_image_count
from pdcluster.engine.pooling import finish_embedding, finish_token_embeddings
from pdcluster.engine import prompt_embeds
from pdcluster.engine.proposers import make_proposer
from pdcluster.engine.remote_admission import RemoteReservation
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import TOKEN_POOLINGS, SamplingParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.step_trace import StepTrace
from pdcluster.engine.tokenizer import Detokenizer
from pdcluster.engine.warmup import warmup
from pdcluster.engine import sleep, weight_update
from pdcluster.engine.weight_update import DEFAULT_WEIGHT_VERSION, WeightUpdate
from pdcluster.wire.external_kv import asks_for_split
from pdcluster.wire.kv_connector import KVConnector, LoadedKV
from pdcluster.wire.logprobs import TokenLogprobs


class InvalidRequestError(ValueError):
    """The request can never run (bad prompt, too long, ...). The message says why."""


@dataclass(slots=True)  # one per request per step
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far (only on the finished output: cumulative_outputs False)
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    # Set by ``generate`` (offline) only: the step loop never decodes; text and stop strings belong to
    # whoever reads the tokens (engine/tokenizer.py Detokenizer: the HTTP API, ``generate``).
    text: str = ""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0
    num_offloaded_tokens: int = 0  # of num_cached_tokens, loaded back from a lower tier (host, disk)
    # The scheduler's authoritative count after this step (S1): what routers must mirror.
    num_computed_tokens: int = 0
    num_output_tokens: int = 0  # len(token_ids), also where token_ids is left empty
    # With params.logprobs: one record per token of ``new_token_ids``; ``logprobs`` accumulates them
    # over the request (offline ``generate``). prompt_logprobs: once, with the first token.
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With params.pooling: the prompt's pooled final hidden state (float32, not normalised), with the first token.
    pooled: np.ndarray | None = None
    # On a finished output of a request prefilled for another instance (vLLM's do_remote_decode): where its
    # prompt's blocks are held (the answer's kv_transfer_params).
    kv_transfer_params: dict | None = None


@dataclass
class KVPoll:
    """What ``LLMEngine.poll_kv`` changed (decode side of a KV transfer)."""

    landed: dict[str, LoadedKV]  # requests whose prompt's KV landed, with the transfer's figures
    outputs: list[RequestOutput]  # of those, the ones the producer's first token already ended
    failed: dict[str, str]  # request id -> why its KV will not come (the request is gone)
    # Requests whose offload-tier prefix load ended: ask the prefill worker for the rest now.
    ready_to_ask: dict[str, RemoteReservation] = field(default_factory=dict)


LOAD_WAIT_S = 0.005  # the longest an engine with nothing to run but loads waits for one of them, per step


class LLMEngine:
    encoder_only = False  # an encoder-only model (engine/models/bert.py): pools, never generates

    def __init__(self, loaded: LoadedModel, connector: KVConnector | None = None, cumulative_outputs: bool = True):
        """``connector``: the KV transfer this engine takes part in, made on ``loaded.kv_cache``; the
        same object serves the scheduler (its request hooks) and the runner (its step hooks).
        ``cumulative_outputs`` False (a streaming caller, the workers): a step's outputs carry the new
        tokens and ``num_output_tokens``, and ``token_ids`` only on a request's finished output; copying
        every running request's whole output each step costs O(output length) per row per step."""
        self.cumulative_outputs = cumulative_outputs
        config = self.config = loaded.config
        self.model_dir, self.tokenizer, self.arch = loaded.model_dir, loaded.tokenizer, loaded.arch
        self.model, self.is_hybrid, self.max_model_len = loaded.model, loaded.is_hybrid, loaded.max_model_len
        self.dtype_name, self.deterministic = loaded.dtype_name, loaded.deterministic
        self.kv_spec, self.kv_cache = loaded.kv_spec, loaded.kv_cache
        self.state_shape, self.num_state_blocks = loaded.state_shape, loaded.num_state_blocks
        self.connector = connector or KVConnector()
        if self.model.tp_driver is not None and type(self.connector) is not KVConnector and not loaded.rank_kv_caches:
            self.model.tp_driver.close()
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: a KV connector needs every rank's "
                             "cache in reach of this process: load the model with share_rank_caches=True")
        num_blocks = self.kv_spec.num_blocks
        # KV events (block stored / removed, by tier) for the router's global index, drained by the worker.
        self.kv_events = KVEventLog()
        # A split model's tiers read and write every rank's cache (rank_kv_caches: offload loads it so).
        self.offload = make_offload_manager(config, loaded.rank_kv_caches or (self.kv_cache,), str(self.model_dir),
                                            self.dtype_name, self.kv_events, self.model.kv_fingerprint,
                                            loader=self.connector.fetches_external)
        scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(config, num_blocks, self.max_model_len, set(loaded.eos_token_ids),
                                       self.connector, self.num_state_blocks, self.offload, self.kv_events.record)
        # vLLM's KV events published outside the cluster carry each stored block's tokens and parent: the block
        # manager tells them (node/kv_event_publisher.py reads them off the log).
        self.scheduler.block_manager.describe_stored = config.kv_events() is not None
        encoder = getattr(self.model, "image_encoder", None)
        if encoder is not None and encoder.spec.bidirectional:  # Gemma 3: a step holds an image whole
            check_images_fit_a_chunk(encoder.spec.tokens_per_image, config.prefill_chunk_tokens,
                                     config.max_num_batched_tokens, config.model)
            self.scheduler.whole_images = True
        # An encoder (engine/models/bert.py): each prompt whole in one step.
        self.scheduler.whole_prompts = self.encoder_only = bool(getattr(self.model, "encoder_only", False))
        self.mtp_source = None
        mtp_weights = None
        if config.spec_method == "mtp":
            from pdcluster.engine.models.registry import default_cache_dir
            from pdcluster.engine.models.mtp import resolve_mtp_weights

            # The whole model's arch where it is split: a random head is drawn at the whole model's shapes, as every
            # rank draws it, and each rank then cuts its slice (engine/tensor_parallel/draft.py).
            mtp_weights, self.mtp_source = resolve_mtp_weights(
                config.mtp_checkpoint, config.cache_dir or default_cache_dir(), config.model,
                self.model.unsplit_arch or self.arch, config.seed
            )
        proposer = make_proposer(config, self.model, self.kv_cache, mtp_weights, loaded.draft_model)
        self.runner = ModelRunner(config, self.model, self.kv_cache, self.max_model_len, self.connector, proposer,
                                  eos_token_ids=set(loaded.eos_token_ids), num_state_blocks=self.num_state_blocks)
        # Async scheduling: step n+1 is scheduled while step n runs (engine/async_scheduler.py).
        self._stepper = AsyncStepper(self.scheduler, self.runner) if config.async_scheduling else None
        self.step_trace = StepTrace()  # engine/step_trace.py (synchronous steps)
        self.warmup_batch_kinds = warmup(self.runner, num_blocks=num_blocks)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.runtime_lora = RuntimeLora(self.model, self.scheduler, config)
        # The weights served (engine/weight_update.py): their version roots every request's block hashes.
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.used_weight_versions: dict[str, str] = {}  # version -> the digest of the checkpoint it named
        self.weights_path = str(self.model_dir)
        self.pending_weights: weight_update.PreparedWeights | None = None
        self.sleep_state = sleep.SleepState()  # engine/sleep.py

    @classmethod
    def from_config(cls, config: EngineConfig, connector: KVConnector | None = None,
                    progress: bool = True) -> LLMEngine:
        """All stages at once, for a connector that does not need the KV cache (the null one by default)."""
        return cls(LoadedModel.load(config, progress=progress), connector)

    def close(self) -> None:
        """Stops what the engine started outside this process (a tensor-parallel model's other ranks); the engine
        takes no steps after it. Idempotent; an engine dropped without it stops them when collected."""
        if self.model.tp_driver is not None:
            self.model.tp_driver.close()

    def assign_seed(self, params: SamplingParams) -> SamplingParams:
        if params.seed is None:
            # Deterministic per engine seed and request order; the sampler keys draws by (seed, position).
            params = replace(params, seed=self._rng.randrange(1 << 31))
        return params

    @property
    def shares_prompts(self) -> bool:
        """Can requests with one prompt share its computed KV (prefix cache, n > 1 forks)?"""
        return self.config.enable_prefix_caching

    # ---- decode side of a KV transfer ------------------------------------------------------------
    def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams) -> RemoteReservation | None:
        """A request whose prompt's KV another worker computes. It joins the scheduler now, with its
        prompt, in WAITING_FOR_REMOTE_KV, its blocks taken; returns where the KV is to land and how many
        leading prompt blocks this worker's prefix cache already holds (the producer skips those), or
        None when the pool cannot hold it now (the router then tries another worker).
        The connector reports its KV's arrival (``poll_kv``); ``abort_request`` gives it up."""
        sleep.check_awake(self)
        self.check_task(params)
        # Its images were decoded where it was prefilled (and at the API): their headers suffice here, where they are
        # encoded only if the request is preempted (the same bytes: the digest is checked).
        self.check_images(prompt_token_ids, params, decode_images=False)
        self.check_prompt_embeds(prompt_token_ids, params)  # read again only if the request is preempted
        params = self.bind_weights(self.bind_lora(params))
        self.prepare_grammar(params)
        request = Request(request_id, list(prompt_token_ids), params, arrival_time=time.monotonic())
        return self.scheduler.add_remote_request(request)

    def poll_kv(self) -> KVPoll:
        """Between steps: apply what the KV connector reports since the last call (landed prompts start
        decoding, failed transfers end their requests, blocks held for a transfer that is over go back)."""
        out = self.connector.poll()
        landed, failed = self.scheduler.update_from_kv(out)
        self.scheduler.poll_offload()
        ready, self.scheduler.remote_ready = self.scheduler.remote_ready, {}
        return KVPoll(landed={r.request_id: out.finished_recving[r.request_id] for r in landed},
                      outputs=[self._output(r, True, []) for r in landed if r.is_finished], failed=failed,
                      ready_to_ask=ready)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):  # an encoder reads its [CLS] ... [SEP] (what its tokenizer adds), as vLLM's
            return self.tokenizer.encode(prompt, add_special_tokens=self.encoder_only)
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty: give at least one token of text")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, but max_model_len is {self.max_model_len}: "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {self.arch.vocab_size}): {bad[:5]}")
        need = -(-(n + 1 + self.config.num_spec_steps) // self.config.block_size)
        if need > self.kv_spec.num_blocks:
            raise InvalidRequestError(
                f"prompt needs {need} KV blocks but the pool holds {self.kv_spec.num_blocks}"
            )

    def check_kv_transfer(self, params: SamplingParams) -> None:
        """vLLM's external prefill/decode fields need an engine whose connector takes part in it."""
        if asks_for_split(params.kv_transfer_params) and not self.connector.fetches_external:
            raise InvalidRequestError("kv_transfer_params: this server takes no part in an external prefill/decode "
                                      "split; start it with --kv-transfer-config "
                                      "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'")

    def check_task(self, params: SamplingParams) -> None:
        """A sequence classifier (engine/models/classifier.py) pools and classifies and does not generate; another
        model does not classify. Checked on every worker whatever the edge validated: a request the model cannot
        run is an error for that request, not a failed step."""
        classifier = self.model.classifier
        per_token = classifier is not None and classifier.spec.per_token
        if params.pooling == "classify" and classifier is None:
            raise InvalidRequestError(f"this model ({self.model.architecture_name}) has no classification head: "
                                      "serve a *ForSequenceClassification checkpoint to classify")
        if params.pooling == "classify" and per_token:
            raise InvalidRequestError(f"this model ({self.model.architecture_name}) is a token classifier: it labels "
                                      "each token (token_classify), not the sequence")
        if params.pooling == "token_classify" and not per_token:
            raise InvalidRequestError(f"this model ({self.model.architecture_name}) has no token classification "
                                      "head: serve a *ForTokenClassification checkpoint for token_classify")
        if self.encoder_only and params.pooling is None:
            uses = ("embed or token_classify (a token classifier)" if per_token else
                    "embed, classify or score" if classifier is not None else "embed or score")
            raise InvalidRequestError(f"this model ({self.model.architecture_name}) is encoder-only: it does not "
                                      f"generate; {uses} with it")
        if classifier is not None and params.pooling is None:
            raise InvalidRequestError(f"this model is a {'token' if per_token else 'sequence'} classifier "
                                      f"({classifier.spec.num_labels} labels): it does not generate; "
                                      + ("token_classify or embed" if per_token else "classify, score or embed")
                                      + " with it")

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    validate: bool = True, follow: str | None = None) -> str:
        """``validate=False``: the caller's edge validated the request already (a served request is
        validated once, by the HTTP API). ``follow``: the id of a running request with the same prompt
        (a sibling choice of an n > 1 request): start once its prompt is in the prefix cache.
        ``prompt`` may be vLLM's dict with images, ``{"prompt": text or ids, "multi_modal_data": {"image": one or
        a list}}`` (bytes, file paths or PIL images; one image token in the prompt where each goes), or
        ``{"prompt_embeds": tensor}`` ([num_tokens, hidden]: engine/prompt_embeds.py, with enable_prompt_embeds)."""
        sleep.check_awake(self)
        if isinstance(prompt, dict):
            prompt, params = (self.with_prompt_embeds(prompt, params) if "prompt_embeds" in prompt
                              else self.with_images(prompt, params))
        prompt_token_ids = self.tokenize(prompt)
        if validate:
            self.validate(prompt_token_ids, params)
        self.check_task(params)
        self.check_kv_transfer(params)
        self.check_images(prompt_token_ids, params, client_prompt=validate)
        self.check_prompt_embeds(prompt_token_ids, params)
        params = self.assign_seed(params)
        params = self.bind_weights(self.bind_lora(params))
        self.prepare_grammar(params)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, prompt_token_ids, params, arrival_time=time.monotonic())
        self.scheduler.add_request(request, follow=follow)
        return request_id

    def with_images(self, prompt: dict, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """vLLM's multimodal prompt dict as the expanded prompt's ids and ``params`` carrying its images."""
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequestError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids', and "
                                      f"'multi_modal_data'; got {sorted(prompt)}")
        data = dict(prompt.get("multi_modal_data") or {})
        images = data.pop("image", [])
        if data:
            raise InvalidRequestError(f"multi_modal_data: only images are served, got {sorted(data)}")
        images = images if isinstance(images, (list, tuple)) else [images]
        encoder = getattr(self.model, "image_encoder", None)
        if images and encoder is None:
            raise InvalidRequestError(self._no_images())
        ids = self.tokenize(prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"])
        if not images:
            return ids, params
        try:
            ids, items = encoder.spec.expand(ids, image_inputs(images), self.config.max_images_per_prompt())
        except ImageInputError as e:
            raise InvalidRequestError(str(e)) from None
        return ids, replace(params, mm_inputs=items)

    def with_prompt_embeds(self, prompt: dict, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """vLLM's ``{"prompt_embeds": tensor}`` as the prompt's placeholder ids and ``params`` carrying the rows."""
        if not self.config.enable_prompt_embeds:
            raise InvalidRequestError(prompt_embeds.PROMPT_EMBEDS_OFF.replace(
                "start the server with --enable-prompt-embeds", "set EngineConfig(enable_prompt_embeds=True)"))
        try:
            return prompt_embeds.embeds_prompt(prompt, params)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    def check_prompt_embeds(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """A prompt given as embeddings fits this engine (checked on every worker, as images are)."""
        try:
            prompt_embeds.check_fits(prompt_token_ids, params, enabled=self.config.enable_prompt_embeds,
                                     takes_embeds=self.model.takes_prompt_embeds and not self.encoder_only,
                                     hidden_size=self.arch.hidden_size, model_name=self.model.architecture_name)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    def check_images(self, prompt_token_ids: list[int], params: SamplingParams, client_prompt: bool = False,
                     decode_images: bool = True) -> None:
        """A request's images fit its prompt and this model (checked on every worker: a bad request is an error for
        that request, not a failed step). ``client_prompt``: the prompt is as the client gave it, so a prompt
        without images must hold no image token. ``decode_images``: each image is decoded (bytes that are no image
        fail here, not in a step); False: its header is read (a decode worker's, whose prefill worker decoded it)."""
        encoder = getattr(self.model, "image_encoder", None)
        if encoder is None:
            if params.mm_inputs:
                raise InvalidRequestError(self._no_images())
            return
        try:
            if client_prompt and not params.mm_inputs:
                encoder.spec.check_no_image_tokens(prompt_token_ids)
            check_image_count(len(params.mm_inputs), self.config.max_images_per_prompt())
            encoder.spec.check(prompt_token_ids, params.mm_inputs)
            for i, item in enumerate(params.mm_inputs):  # bytes that are no image fail here, not in a step
                if "embeds" in item:  # embeddings given for the image: they must be the language model's width
                    if item["embeds"][2] != self.arch.hidden_size:
                        raise ImageInputError(f"image {i}: embeddings {item['embeds'][2]} wide, but this model's "
                                              f"hidden size is {self.arch.hidden_size}")
                    continue
                (open_image if decode_images else image_size)(item["data"], f"image {i}")
        except ImageInputError as e:
            raise InvalidRequestError(str(e)) from None

    def _no_images(self) -> str:
        if self.config.max_images_per_prompt() == 0 and self.model_takes_images:
            return IMAGES_OFF
        return f"this model ({self.model.architecture_name}) takes no images"

    @property
    def model_takes_images(self) -> bool:
        """The checkpoint has a vision tower (whether or not this engine loaded it)."""
        return ImageSpec.from_dir(self.model_dir) is not None

    @property
    def max_images_per_prompt(self) -> int:
        """The images one prompt may hold here (0: none; this engine encodes none, or the limit turned them off)."""
        return 0 if getattr(self.model, "image_encoder", None) is None else self.config.max_images_per_prompt()

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name (EngineConfig.lora_modules, and those loaded since)."""
        return self.model.lora.names if self.model.lora is not None else ()

    @property
    def lora_adapters(self) -> dict[str, str]:
        """{adapter name: its content digest} for every adapter a request may name."""
        lora = self.model.lora
        return {} if lora is None else {name: lora.adapters[slot].digest for name, slot in lora.index.items()}

    def bind_lora(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the content digest of the adapter it names (its block hashes start from it), checked
        against the one this engine holds under that name: a request placed with other files under the name
        (the adapter was reloaded meanwhile) is refused, never run with the wrong weights."""
        name = params.lora_name
        if name is None:
            return params
        lora = self.model.lora
        slot = lora.index.get(name) if lora is not None else None
        if slot is None:
            have = ", ".join(self.lora_names) or "none (start with --lora-modules name=path, or --enable-lora)"
            raise InvalidRequestError(f"lora_name: no LoRA adapter {name!r} is loaded; loaded: {have}")
        digest = lora.adapters[slot].digest
        if params.lora_digest is None:
            return replace(params, lora_digest=digest)
        if params.lora_digest != digest:
            raise InvalidRequestError(f"lora_name: LoRA adapter {name!r} here has content {digest}, not the "
                                      f"{params.lora_digest} the request was placed with (it was reloaded meanwhile): "
                                      "send it again")
        return params

    def load_lora(self, name: str, path: str) -> str:
        """Load the PEFT adapter at ``path`` as ``name`` while serving (EngineConfig.enable_lora); returns its
        content digest. LoraAdapterError with the reason otherwise (engine/lora/runtime.py)."""
        return self.runtime_lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """New requests naming ``name`` are refused from now on; those running with it finish with it
        (engine/lora/runtime.py). KeyError if no adapter has that name."""
        self.runtime_lora.unload(name)

    def bind_weights(self, params: SamplingParams) -> SamplingParams:
        """``params`` stamped with the weight version served here (engine/weight_update.py; the default version
        leaves them as they are), or, stamped already (by the router), checked against it: a request placed under
        other weights than these is refused (WeightVersionMismatch), never run on a mix of two."""
        asked, held = params.weight_version, self.weight_version
        if asked is None:
            return params if held == DEFAULT_WEIGHT_VERSION else replace(params, weight_version=held)
        if asked != held:
            raise weight_update.WeightVersionMismatch(f"weight_version: this worker serves weights {held!r}, the "
                                                      f"request was placed under {asked!r}")
        return params

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> WeightUpdate:
        """New weights in place, between requests: ``prepare_weights`` and ``commit_weights`` at once."""
        self.prepare_weights(model_path, weight_version)
        return self.commit_weights()

    def prepare_weights(self, model_path: str, weight_version: str | None = None) -> str:
        """Read and check a checkpoint for this model (engine/weight_update.py ``prepare``), held until
        ``commit_weights`` or ``discard_weights``; returns its contents' digest (``checkpoint_digest``).
        WeightUpdateError where it does not fit. Any thread: it only reads the engine's config."""
        self.pending_weights = None  # a prepare nobody committed: its memory goes first
        self.pending_weights = weight_update.prepare(self, model_path, weight_version)
        return self.pending_weights.digest

    def commit_weights(self) -> WeightUpdate:
        """Serve the prepared weights from now on (engine/weight_update.py ``commit``)."""
        if self.pending_weights is None:
            raise weight_update.WeightUpdateError("no weights were prepared (or they were discarded)")
        try:
            update = weight_update.commit(self, self.pending_weights)
        except BaseException:
            self.discard_weights()  # a split model's other ranks drop theirs too
            raise
        finally:
            self.pending_weights = None
        sleep.weights_restored(self)  # weights a level-2 sleep discarded are all written now
        return update

    def discard_weights(self) -> None:
        if self.pending_weights is not None and self.model.tp_driver is not None:
            self.model.tp_driver.discard_weights()
        self.pending_weights = None

    # ---- sleep mode (engine/sleep.py) ------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        """vLLM's sleep between requests: level 1 gives back the KV cache's memory (its contents forgotten), level 2
        the weights' too (read again at the wake unless a weight update writes them first). SleepError while a
        request is here."""
        return sleep.sleep(self, level)

    def release_memory(self, tags=None) -> dict:
        """SGLang's release_memory_occupation: ``tags`` among "weights", "kv_cache" (None: both)."""
        return sleep.release(self, tags)

    def wake_up(self, tags=None) -> dict:
        """Take back what ``tags`` released (None: all; vLLM's wake_up, SGLang's resume_memory_occupation)."""
        return sleep.wake_up(self, tags)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleep_state.asleep)

    def prepare_grammar(self, params: SamplingParams) -> None:
        """Compile a structured-output spec now (cached per spec), so a spec the grammar engine refuses
        fails this request here, with its reason, and never the step loop."""
        if params.structured_output is None:
            return
        from pdcluster.engine.structured_output import GrammarCompiler, StructuredOutputError

        if self.runner.grammar_compiler is None:
            self.runner.grammar_compiler = GrammarCompiler(self.tokenizer, self.arch.vocab_size,
                                                           sorted(self.runner.eos_token_ids))
        try:
            self.runner.grammar_compiler.compile(params.structured_output)
        except StructuredOutputError as e:
            raise InvalidRequestError(f"structured_output: {e}") from e

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_idle(self) -> bool:
        """No request is here in any state (waiting, running, preempted, parked behind a sibling, waiting for its
        KV), no load from a lower tier is under way, and no block is held (a finished request's, until its KV
        transfer is over or another instance pulled it): the pool is all free."""
        scheduler = self.scheduler
        return (not scheduler.requests and not scheduler.offload.num_loading
                and scheduler.num_free_blocks == scheduler.block_manager.num_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every computed prefix: the device pool's block hashes and every block of the offload tiers (host
        memory, disk), each told removed in the KV events, so the router's index drops them too. SGLang's
        /flush_cache and vLLM's /reset_prefix_cache. Only while ``is_idle``: a request's blocks are in use then
        (SGLang refuses while requests run); False, nothing changed, otherwise. On the engine thread, between
        steps. Nothing else here caches KV by content: a hybrid has no prefix cache (engine/mamba_state.py), and
        a split model's other ranks hold their caches' slices by block id only (the hashes live here, on rank 0)."""
        if not self.is_idle():
            return False
        self.scheduler.block_manager.reset_prefix_cache()
        if self.offload is not None:
            self.offload.clear()
        return True

    def has_pending(self) -> bool:
        """Requests to run, or KV transfers / finish notices still to be driven by steps."""
        return self.scheduler.has_pending()

    def has_work(self) -> bool:
        """A step would compute something (``has_pending`` minus blocks only held for a transfer)."""
        return self.scheduler.has_work() or (self._stepper is not None and self._stepper.in_flight)

    @property
    def num_steps_launched_ahead(self) -> int:
        """Async scheduling: steps launched before the one before them was finished (0 otherwise)."""
        return self._stepper.num_launched_ahead if self._stepper is not None else 0

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler = self.scheduler
        if scheduler.offload.num_loading and not (scheduler.running or scheduler.waiting):
            # Only loads are under way (offload tiers, another instance's KV): wait for one to end instead of spinning
            # empty steps, which would hold the GIL the loader thread needs (a 2,048-token pull took 5x longer).
            self.offload.wait_done(LOAD_WAIT_S)
        if self._stepper is not None:  # async scheduling: step n+1 already runs while the caller reads these outputs
            step_results, kv_output = self._stepper.step()
        else:
            started = time.perf_counter()
            sched = self.scheduler.schedule()
            self.runner.execute_model(sched)
            runner_output, kv_output = self.runner.sample_tokens()
            step_results = self.scheduler.update_from_output(sched, runner_output)
            self.step_trace.record(sched, time.perf_counter() - started)
        # post_forward reports sends only (wire/kv_connector.py); what a consumer receives comes by poll_kv.
        self.scheduler.free_held(kv_output.finished_sending | kv_output.failed)
        if self.runtime_lora.retiring:
            self.runtime_lora.release()
        output = self._output
        return [output(r.request, r.finished, r.new_token_ids, r.new_logprobs, r.prompt_logprobs, r.pooled)
                for r in step_results]

    def _output(self, request: Request, finished: bool, new_token_ids: list[int],
                new_logprobs: list[TokenLogprobs] | None = None,
                prompt_logprobs: list[TokenLogprobs] | None = None, pooled: np.ndarray | None = None) -> RequestOutput:
        output = request.output_token_ids
        return RequestOutput(  # positional, in field order (per request per step: keywords cost twice as much)
            request.request_id,
            request.prompt_token_ids,
            list(output) if finished or self.cumulative_outputs else [],  # token_ids
            finished,
            request.status.value if finished else None,  # finish_reason
            new_token_ids,
            "",  # text
            request.num_draft_tokens,
            request.num_accepted_tokens,
            request.num_cached_tokens,
            request.num_offloaded_tokens,
            request.num_computed_tokens,
            len(output),  # num_output_tokens
            list(new_logprobs) if new_logprobs else [],
            prompt_logprobs,
            [],  # logprobs
            pooled,
            request.kv_transfer_out if finished else None,
        )

    def generate(
        self, prompts: list[str | list[int] | dict], params: SamplingParams | list[SamplingParams],
        max_steps: int = 1_000_000
    ) -> list[RequestOutput]:
        """Run the prompts to completion (offline batch). Outputs in prompt order, with their text; a
        request whose text reaches one of its stop strings ends there (finish_reason "stop"), its
        text cut before it, as the HTTP API does (the same Detokenizer)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        detoks = {i: Detokenizer(self.tokenizer, sp.stop, sp.skip_special_tokens, sp.include_stop_str_in_output)
                  for i, sp in zip(ids, params_list)}
        logprobs: dict[str, list[TokenLogprobs]] = {i: [] for i in ids}
        prompt_logprobs: dict[str, list[TokenLogprobs] | None] = {}
        done: dict[str, RequestOutput] = {}
        # The loop reads each step's new tokens: no copy of every request's whole output each step (a
        # finished output still carries all its tokens).
        cumulative, self.cumulative_outputs = self.cumulative_outputs, False
        try:
            for _ in range(max_steps):
                if not self.has_unfinished():
                    break
                for out in self.step():
                    detok = detoks.get(out.request_id)
                    if detok is None or out.request_id in done:
                        continue
                    logprobs[out.request_id] += out.new_logprobs
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    detok.add(out.new_token_ids, out.finished)
                    if detok.hit_stop:
                        request = self._stop_at_string(out.request_id, detok.stop)
                        if not out.finished:  # its output so far (an unfinished output carries only the new)
                            out = replace(out, token_ids=list(request.output_token_ids if request is not None
                                                              else detok.token_ids))
                        out = replace(out, finished=True, finish_reason=RequestStatus.FINISHED_STOPPED.value)
                    if out.finished:
                        done[out.request_id] = replace(out, text=detok.text, logprobs=logprobs[out.request_id],
                                                       prompt_logprobs=prompt_logprobs.get(out.request_id))
            else:
                raise RuntimeError(f"generate() did not finish within {max_steps} steps")
        finally:
            self.cumulative_outputs = cumulative
        return [done[i] for i in ids]

    def embed(self, prompts: list[str | list[int]], pooling: str = "last", normalize: bool = True,
              request: SamplingParams | None = None) -> list[np.ndarray]:
        """vLLM's ``LLM.embed``: one float32 vector per prompt, the prompt's final hidden states pooled
        (``pooling``: "last" or "mean") and scaled to unit length where ``normalize``. ``request``: where and how
        the prompts run (adapter, cache salt, priority); its sampling fields do not matter."""
        return [finish_embedding(out.pooled, normalize)
                for out in self.generate(prompts, _pooling_params(request, pooling))]

    def classify(self, prompts: list[str | list[int]], activation: bool = True,
                 request: SamplingParams | None = None) -> list[np.ndarray]:
        """vLLM's ``LLM.classify`` for a sequence classifier (engine/models/classifier.py): one float32 vector per
        prompt, its class probabilities (softmax over several labels, a sigmoid for one, as the config's
        problem_type says), or the raw logits where not ``activation``. ``request``: where and how the prompts run."""
        # A model without a head is refused by add_request (check_task) before any step.
        outputs = self.generate(prompts, _pooling_params(request, "classify"))
        logits = [np.asarray(out.pooled, dtype=np.float32) for out in outputs]
        return [self.model.classifier.spec.activate(x) if activation else x for x in logits]

    def encode(self, prompts: list[str | list[int]], pooling_task: str = "token_embed", activation: bool = True,
               request: SamplingParams | None = None) -> list[np.ndarray]:
        """vLLM's ``LLM.encode(prompts, pooling_task=...)`` for the per-token tasks: "token_embed", every prompt
        token's final hidden state (float32 [num_tokens, hidden], each row scaled to unit length where
        ``activation``), or "token_classify", a token classifier's (NER's) label probabilities at every token
        ([num_tokens, num_labels], each row activated as ``classify`` does, the raw logits where not ``activation``).
        "embed" and "classify" answer as ``embed`` (the model's default pooling) and ``classify`` do."""
        if pooling_task == "embed":
            return self.embed(prompts, pooling="cls" if self.encoder_only else "last", normalize=activation,
                              request=request)
        if pooling_task == "classify":
            return self.classify(prompts, activation, request)
        if pooling_task not in TOKEN_POOLINGS:
            raise InvalidRequestError(f"pooling_task must be one of embed, classify, {', '.join(TOKEN_POOLINGS)}; "
                                      f"got {pooling_task!r}")
        rows = [np.asarray(out.pooled, dtype=np.float32) for out in self.generate(prompts, _pooling_params(
            request, pooling_task))]
        if pooling_task == "token_classify":
            return [self.model.classifier.spec.activate(x) if activation else x for x in rows]
        return [finish_token_embeddings(x, activation) for x in rows]

    def score(self, text_1: str | list[str], text_2: str | list[str], pooling: str = "last",
              request: SamplingParams | None = None) -> list[float]:
        """vLLM's ``LLM.score``: one score a pair, the texts paired 1:1, 1:N or N:N. A one-label classifier (a
        cross-encoder) reads each pair as one input (the tokenizer's pair template) and scores it by its head,
        activated (a sigmoid); another model embeds each text (``pooling``) and scores a pair by the cosine of the
        two vectors."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if not firsts or not seconds or (len(firsts) > 1 and len(firsts) != len(seconds)):
            raise InvalidRequestError(f"score: texts pair 1:1, 1:N or N:N, got {len(firsts)}:{len(seconds)}")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        classifier = self.model.classifier
        if classifier is not None:
            if classifier.spec.num_labels != 1:
                raise InvalidRequestError(f"score: a classifier of {classifier.spec.num_labels} labels does not score "
                                          "pairs (a cross-encoder has one label); classify instead")
            pairs = [self.tokenizer.encode_pair(a, b) for a, b in zip(firsts, seconds)]
            return [float(p[0]) for p in self.classify(pairs, request=request)]
        vectors = self.embed(firsts + seconds, pooling=pooling, request=request)
        queries, documents = vectors[: len(firsts)], vectors[len(firsts):]
        return [float(np.dot(q, d)) for q, d in zip(queries, documents)]

    def beam_search(self, prompts: list[str | list[int]], params: BeamSearchParams,
                    request: SamplingParams | None = None) -> list[list[Beam]]:
        """vLLM's ``LLM.beam_search`` (engine/beam_search.py): per prompt, its ``beam_width`` best beams,
        best first, each with its output tokens, text, cumulative logprob and finish reason. Every step
        runs the live beams of all prompts as one batch. ``request``: where and how the steps run (its
        adapter, cache salt, priority, seed: ``BeamSearchParams.step_params``)."""
        end_ids = frozenset(self.tokenizer.stop_token_ids)
        searches = BeamSearches([BeamSearch(self.tokenize(p), params, end_ids) for p in prompts])
        step_params = params.step_params(request)
        for _ in range(params.max_tokens):
            batch = searches.pending()
            if not batch:
                break
            outputs = self.generate([tokens for _, tokens in batch], step_params)
            searches.advance([out.logprobs[0] for out in outputs])
        return searches.best(self.tokenizer.decode)

    def _stop_at_string(self, request_id: str, stop: str) -> Request | None:
        """End a request whose text reached the stop string ``stop`` (frees its blocks once)."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        if request is not None:
            request.stop_reason = stop
        return request


def _pooling_params(request: SamplingParams | None, pooling: str) -> SamplingParams:
    """A pooling request's parameters (embed, classify): ``request``'s placement (adapter, cache salt, priority) with
    one greedy token and nothing else asked of the sampler."""
    return replace(request or SamplingParams(), max_tokens=1, pooling=pooling, temperature=0.0, logprobs=None,
                   prompt_logprobs=None, structured_output=None, stop=[], stop_token_ids=[])
