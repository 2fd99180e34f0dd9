"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.engine.multimodal.spec import check_mm_inputs
from pdcluster.engine.prompt_embeds import check_prompt_embeds

# How an embedding request (/v1/embeddings) pools its prompt's final hidden states into one vector: "last" the
# last position's (vLLM's default for a decoder model), "mean" their average over the prompt, "cls" the first
# position's (an encoder's [CLS] token: vLLM's default for BERT-like models).
POOLING_TYPES = ("last", "mean", "cls")
# Per-token outputs (vLLM's pooling tasks of the same names): every prompt position's final hidden state
# ("token_embed": [num_tokens, hidden]) or a token classifier's logits at each ("token_classify": [num_tokens,
# num_labels]); a request computes its whole prompt for them (no prefix-cache hit), as for "mean".
TOKEN_POOLINGS = ("token_embed", "token_classify")
# A request's pooling: an embedding's, "classify" (a sequence classifier's score head on the last position's
# hidden state: its logits; engine/models/classifier.py), or one of TOKEN_POOLINGS.
REQUEST_POOLINGS = (*POOLING_TYPES, "classify", *TOKEN_POOLINGS)
# Poolings that read every prompt position (or the first): such a request takes no prefix-cache hit.
WHOLE_PROMPT_POOLINGS = ("mean", "cls", *TOKEN_POOLINGS)


# The weights a worker started with (SGLang's name for them): requests under them hash as if no version existed.
DEFAULT_WEIGHT_VERSION = "default"

@dataclass
class SamplingParams:
    """What to generate and when to stop.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible per request regardless of
    batch composition or which worker runs the step: the random draw for output position ``n`` is a pure
    function of ``(seed, n)`` (see engine/sampler.py).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities returned with each sampled token: None = none; k >= 0 = the sampled token's
    # and the k most likely tokens'. ``prompt_logprobs`` the same for every prompt position after the
    # first (computed where the prompt is prefilled). Both come from the model's raw distribution
    # (log_softmax of the logits before penalties, temperature, top-k/p), as vLLM's default
    # ``logprobs_mode="raw_logprobs"``: a property of the model, not of the sampling settings.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Penalties as vLLM applies them (engine/logits_processors.py): presence/frequency over output
    # tokens, repetition over prompt + output tokens; ``logit_bias`` maps token id -> added bias
    # (kept as [[id, bias], ...] so it crosses msgpack, whose map keys are strings here).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[list[float]] = field(default_factory=list)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many output tokens exist
    # Structured output: a JSON string naming the grammar (engine/structured_output.py), e.g.
    # '{"type": "json_object"}' or '{"type": "json_schema", "schema": {...}}'; None = free text.
    structured_output: str | None = None
    # The n choices of one request share this key (any string unique to the request): the router puts
    # them on one worker pair and the prompt is computed and transferred once (engine/forks.py).
    fork_group: str | None = None
    # Output tokens produced before this request started (a request resumed elsewhere after a worker
    # died carries them in its prompt): random draws stay keyed by the *original* output position.
    output_position_offset: int = 0
    # The LoRA adapter to run with (a name from EngineConfig.lora_modules); None: the base model.
    lora_name: str | None = None
    # The content digest of that adapter (LoraAdapter.digest), set where the request enters (the router, the
    # engine): its block hashes start from it, and a worker holding other files under that name refuses it.
    lora_digest: str | None = None
    # The weights the request runs under (engine/weight_update.py), set where it enters (the router, the engine): a
    # version other than the start-up weights' roots its block hashes, and a worker serving other weights refuses it.
    weight_version: str | None = None
    # vLLM's extensions, with its meanings:
    # min_p: tokens below min_p x the most likely token's probability are not sampled (after temperature).
    min_p: float = 0.0
    # Only these tokens may be generated (None: any); EOS is not added for you, as in vLLM.
    allowed_token_ids: list[int] | None = None
    # Token sequences that must not be generated: a sequence's last token is masked where the output so far
    # ends with the rest of it (the API tokenizes vLLM's ``bad_words`` with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Salts the prefix cache: the request's block hashes start from it, so requests with another salt (or
    # none) never share its cached KV (vLLM's cache_salt against prompt-guessing across tenants).
    cache_salt: str | None = None
    # Detokenization (engine/tokenizer.Detokenizer): special tokens shown or not; the stop string kept.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Scheduling priority (vLLM's): a lower value is admitted first and preempted last; equal values are
    # served first come, first served (engine/waiting_queue.py).
    priority: int = 0
    # An embedding: the prompt's final hidden states pooled (one of POOLING_TYPES), or a classifier's logits
    # ("classify"), returned with the one token such a request samples (RequestOutput.pooled; max_tokens 1: it is
    # computed where the prompt is). None: a generation.
    pooling: str | None = None
    # The prompt's images (engine/multimodal/): each {"offset", "length": its placeholder tokens in the prompt,
    # "digest": its content digest, "data": its encoded bytes}, in prompt order. Carried here because they go
    # wherever the parameters go (router, prefill and decode workers, a request resumed elsewhere).
    mm_inputs: list[dict] = field(default_factory=list, repr=False)
    # Prompt rows given as embeddings (engine/prompt_embeds.py: vLLM's prompt_embeds): {"dtype", "num_tokens",
    # "hidden", "data": their raw bytes, "digest", "spans": where they stand in the prompt}; the prompt's token ids
    # there are placeholders. Carried here for the same reason as the images.
    prompt_embeds: dict | None = field(default=None, repr=False)
    # vLLM's thinking_token_budget (engine/thinking_budget.py): at most this many tokens inside a thinking
    # section, between the model's reasoning start and end markers (token ids, set where the request enters from
    # the server's reasoning parser), then the end marker is forced. None: no limit.
    thinking_token_budget: int | None = None
    reasoning_start_token_ids: list[int] = field(default_factory=list)
    reasoning_end_token_ids: list[int] = field(default_factory=list)
    # vLLM's external prefill/decode protocol (wire/external_kv.py): do_remote_decode (prefill this prompt for
    # another instance, keep its blocks for it) or do_remote_prefill with the prefill instance's answer.
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        self.logit_bias = [[int(t), float(b)] for t, b in self.logit_bias]
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output: the grammar's end is the "
                             "end-of-sequence token")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        self.bad_words_token_ids = [[int(t) for t in seq] for seq in self.bad_words_token_ids]
        if any(not seq for seq in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids: every sequence needs at least one token")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.mm_inputs:
            self.mm_inputs = check_mm_inputs(self.mm_inputs)
        if self.prompt_embeds is not None:
            self.prompt_embeds = check_prompt_embeds(self.prompt_embeds)
            if self.mm_inputs:
                raise ValueError("prompt_embeds: a prompt given as embeddings holds no images")
            if self.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs is not compatible with prompt embeds: the prompt has no tokens")
        if self.thinking_token_budget is not None:
            self._check_thinking_budget()
        if self.pooling is not None:
            if self.pooling not in REQUEST_POOLINGS:
                raise ValueError(f"pooling must be one of {', '.join(REQUEST_POOLINGS)}, got {self.pooling!r}")
            if self.max_tokens != 1:
                raise ValueError(f"a pooling request samples one token (max_tokens 1), got max_tokens={self.max_tokens}")

    def _check_thinking_budget(self) -> None:
        budget = self.thinking_token_budget
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
        self.reasoning_start_token_ids = [int(t) for t in self.reasoning_start_token_ids]
        self.reasoning_end_token_ids = [int(t) for t in self.reasoning_end_token_ids]
        if not self.reasoning_start_token_ids or not self.reasoning_end_token_ids:
            raise ValueError("thinking_token_budget needs the model's reasoning start and end markers "
                             "(reasoning_start_token_ids, reasoning_end_token_ids)")
        if self.structured_output is not None:
            raise ValueError("thinking_token_budget cannot be combined with structured output: a grammar forces "
                             "the output from its first token, which holds no thinking section")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Anything that changes the logits before sampling (engine/logits_processors.py)."""
        return self.has_logit_changes or self.thinking_token_budget is not None

    @property
    def has_logit_changes(self) -> bool:
        """The penalties, biases and masks that apply at every position (a thinking budget only at some)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None
                    or self.bad_words_token_ids)
