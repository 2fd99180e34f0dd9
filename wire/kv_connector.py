"""The KV connector contract between an engine and a KV transfer: null objects, so neither the scheduler
nor the runner ever asks "is there a connector?". kv_transfer/ provides the active implementations (a
producer that sends the prompts it computes, a consumer whose prompts arrive from a producer); the
engine is given one at construction and hands the same object to its scheduler and its runner.

Scheduler side (``SchedulerConnector``): ``request_finished`` when a request ends (the connector may
keep its blocks: until they are sent, or until nothing can write them any more), and ``poll`` between
steps, which reports what the transfers did since (``KVConnectorOutput``). The connector is keyed by
request id; it never holds a request, only the state of its transfer.

Runner side (``KVConnector``), call order each step (invariant S2): ``pre_forward`` before the forward
pass; ``save_layer(i)`` as each layer's KV lands in the cache; ``post_forward(finished_req_ids)`` at the
very end of ``sample_tokens``, after the draft proposer has written the draft layer's KV. A step with
nothing to run calls ``no_forward`` instead. ``post_forward`` always clears the step's metadata and is
the only place a request's last sends are issued; the receiver's acknowledgement of them may be
noticed later, between steps or from the worker's ack poller (kv_transfer/connector/prefill.py
``poll_acks``), and only then is the transfer declared complete: never before the sends that follow
the proposer. Its output reports sends only (``finished_sending``, ``failed``); what a consumer
receives is reported by ``poll``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadedKV:
    """A prompt's KV that has landed in the consumer's reserved blocks, with what the producer computed
    past the prompt (the request continues from them) and the transfer's figures (metrics)."""

    first_token_id: int
    draft_token_ids: list[int] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class KVConnectorOutput:
    # Producer: transfers delivered; the finished requests' held blocks go back to the pool.
    finished_sending: set[str] = field(default_factory=set)
    # Consumer: prompts whose KV has landed; their requests leave WAITING_FOR_REMOTE_KV.
    finished_recving: dict[str, LoadedKV] = field(default_factory=dict)
    # Consumer: request id -> why its KV will not come; the request fails.
    failed_recving: dict[str, str] = field(default_factory=dict)
    # Held blocks whose transfer ended without delivery (a producer's failed send; a consumer's failed
    # or aborted receive once nothing can write the blocks any more): they go back to the pool.
    failed: set[str] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving or self.failed)


class SchedulerConnector:
    """Scheduler-side hooks, null by default."""

    # Sends the KV of the prompts it computes to another worker: a hybrid's prompts then also get the
    # blocks their Mamba state travels in (engine/mamba_state_blocks.py).
    is_producer = False

    # Loads prompts' KV from elsewhere before their first step (vLLM's external prefill/decode protocol:
    # kv_transfer/connector/external.py): the engine then keeps an offload loader even without tiers.
    fetches_external = False

    def external_source(self, request):
        """Where a new request's prompt KV may be pulled from (an object with ``num_blocks``, ``fetch`` and
        ``release``: kv_transfer/external/pull.py), or None: the request computes its prompt."""
        return None

    def request_finished(self, request) -> bool:
        """A request just finished (any way: done, aborted, failed). Return True to keep its blocks
        until the connector reports the transfer over (``finished_sending`` or ``failed``)."""
        return False

    def poll(self) -> KVConnectorOutput:
        """Between steps: what the transfers did since the last call."""
        return KVConnectorOutput()


class KVConnector(SchedulerConnector):
    """Does nothing, on both sides. Subclasses override what they need."""

    def pre_forward(self, scheduler_output) -> None:
        pass

    def save_layer(self, layer_idx: int) -> None:
        pass

    def wants_layers(self) -> bool:
        """Whether this step's ``save_layer`` calls do anything (after ``pre_forward``): a step whose
        layers must be handed over one by one cannot run as one CUDA graph. By default: whether a
        subclass overrides ``save_layer``."""
        return type(self).save_layer is not KVConnector.save_layer

    def post_forward(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return KVConnectorOutput()

    def no_forward(self, scheduler_output) -> KVConnectorOutput:
        """A step with nothing to run still finalises the requests that finished (S2)."""
        return self.post_forward(set(scheduler_output.finished_req_ids))

    @property
    def has_step_hooks(self) -> bool:
        """Whether a subclass acts inside steps (``pre_forward``, ``save_layer``, ``post_forward``,
        ``no_forward``): a producer sends from there. Async scheduling launches a step before the
        previous one is finished only with a connector that does not (a consumer's news come by
        ``poll``, between steps)."""
        cls = type(self)
        return any(getattr(cls, name) is not getattr(KVConnector, name)
                   for name in ("pre_forward", "save_layer", "post_forward", "no_forward"))
