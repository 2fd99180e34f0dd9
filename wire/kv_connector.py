"""The model runner's view of a KV connector: a null object, so the runner never asks "is there a
connector?". kv_transfer/ provides the active implementations.

Call order each step (invariant S2): ``pre_forward`` before the forward pass; ``save_layer(i)`` as each
layer's KV lands in the cache; ``post_forward(finished_req_ids)`` at the very end of
``sample_tokens``, after the draft proposer has written the draft layer's KV. A step with nothing to run
calls ``no_forward`` instead. ``post_forward`` always clears the step's metadata and is the only place
a request's last sends are issued; the receiver's acknowledgement of them may be noticed later, between
steps or from the worker's ack poller (kv_transfer/connector.py ``poll_acks``), and only then is the
transfer declared complete: never before the sends that follow the proposer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed)


class SchedulerConnector:
    """Scheduler-side hook, null by default."""

    def request_finished(self, request) -> bool:
        """A request just finished. Return True to keep its blocks until the connector reports the
        transfer over (``KVConnectorOutput.finished_sending`` or ``failed``)."""
        return False


class KVConnector:
    """Does nothing. Subclasses override what they need."""

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
