"""Adapters loaded and unloaded while an engine serves (EngineConfig.enable_lora; vLLM's runtime LoRA updating).

A load checks the adapter against the model and puts it in a free slot between steps, so the next step can run
it. An unload takes the name away at once (a new request naming it is refused), but the weights stay until the
last request running with them ends, whether it is decoding, waiting, preempted or held for a KV transfer:
nothing that was admitted is cut short or runs with other weights. Requests carry their adapter's content
digest (SamplingParams.lora_digest), so an adapter unloaded and loaded again under its name with other files is
another slot and other block hashes, and the two never mix. On a split model (tensor parallelism) the other ranks
take the same step in the same order: the files' bytes as read here, cut to each rank's slice, in the same slot.
"""

from __future__ import annotations

import logging

from pdcluster.engine.lora.adapter import LoraAdapterError, parse_adapter, read_adapter_files

log = logging.getLogger(__name__)


class RuntimeLora:
    def __init__(self, model, scheduler, config):
        self.model = model
        self.scheduler = scheduler
        self.config = config
        self.retiring = False  # unloaded adapters are still held for requests that run with them

    def load(self, name: str, path: str) -> str:
        """Hold the PEFT adapter at ``path`` under ``name``; returns its content digest. LoraAdapterError
        (with the reason) for an adapter that cannot run here, a name in use, or max_loras adapters held."""
        lora = self.model.lora
        if lora is None or not lora.runtime:
            raise LoraAdapterError("adapters are loaded while serving only with --enable-lora "
                                   "(EngineConfig.enable_lora)")
        if not name or name == self.config.model:
            raise LoraAdapterError(f"LoRA adapter name {name!r}: give a non-empty name other than the base model's")
        if name in lora.index:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        self.release()
        held = sum(a is not None for a in lora.adapters)
        if held >= self.config.max_loras:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {held} adapters are held (max_loras {self.config.max_loras},"
                                   " unloaded ones included until their requests end): unload one, or raise --max-loras")
        from pdcluster.engine.lora import add

        files = read_adapter_files(name, path)
        adapter = parse_adapter(name, path, *files, self.config.max_lora_rank)
        slot = add(self.model, adapter)
        driver = self.model.tp_driver
        if driver is not None:  # a split model: every other rank holds its slice of the same bytes in the same slot
            driver.add_lora(slot, name, str(path), files, self.config.max_lora_rank)
        return adapter.digest

    def unload(self, name: str) -> None:
        lora = self.model.lora
        if lora is None or name not in lora.index:
            loaded = ", ".join(lora.names) if lora is not None and lora.names else "none"
            raise KeyError(f"no LoRA adapter {name!r} is loaded; loaded: {loaded}")
        del lora.index[name]
        self.retiring = True
        self.release()

    def release(self) -> None:
        """Empty the slots of unloaded adapters that no request of this engine runs with any more."""
        lora = self.model.lora
        if lora is None:
            return
        named = set(lora.index.values())
        retired = [i for i, a in enumerate(lora.adapters) if a is not None and i not in named]
        if not retired:
            self.retiring = False
            return
        from pdcluster.engine.lora import remove

        scheduler = self.scheduler
        in_use = {(r.sampling_params.lora_name, r.sampling_params.lora_digest)
                  for r in [*scheduler.requests.values(), *scheduler.held.values()]}
        kept = 0
        for slot in retired:
            adapter = lora.adapters[slot]
            if (adapter.name, adapter.digest) in in_use:
                kept += 1
                continue
            remove(self.model, slot)
            if self.model.tp_driver is not None:
                self.model.tp_driver.remove_lora(slot)
            log.info("LoRA adapter %s (%s) unloaded: no request runs with it any more", adapter.name, adapter.digest)
        self.retiring = kept > 0
