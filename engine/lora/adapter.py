"""A LoRA adapter read from a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, what
``PeftModel.save_pretrained`` writes), checked against the base model it will run on.

What is served: LoRA (not DoRA) on a decoder layer's projections: q/k/v/o and gate/up/down of a Llama-family or
Qwen3 model; q/k/v/o, up/down and the Mamba in_proj / out_proj of a NemotronH; q/k/v/o, the Mamba in_proj / out_proj
and the shared MLP's input_linear / output_linear of a Granite 4.0 hybrid; the routed experts of a Qwen3-MoE,
Qwen2-MoE, Mixtral or NemotronH layer, in either form PEFT writes: per expert (``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``, NemotronH's
``mixer.experts.{e}.up_proj`` / ``down_proj``: checkpoints that keep an expert's projections as modules) or stacked
(``target_parameters`` on transformers 5's fused expert parameters: one ParamWrapper per parameter, nested as
``experts.lora_A`` / ``experts.base_layer.lora_A``; engine/lora/experts.py ``unstack``); the shared expert (Qwen2-MoE's
``mlp.shared_expert.*``, NemotronH's ``mixer.shared_experts.*``); any rank up to the engine's ``max_lora_rank``
(PEFT's ``rank_pattern`` too: each module's rank is its tensors'), scaled by lora_alpha / r (rsLoRA: lora_alpha /
sqrt(r)), lora_alpha by module where ``alpha_pattern`` says (PEFT's matching). What an adapter may carry that we do
not run is refused by name when it loads, never silently dropped: embedding or LM-head adapters, modules_to_save,
biases, DoRA, fan_in_fan_out weights, the router, experts of families whose experts take none (gpt-oss, Llama 4,
Granite MoE, GLM-4.5). This file reads and checks the adapter itself; engine/lora/__init__.py checks it against the
model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load

# The projections an adapter may target, by Hugging Face module name (which of them a model has, and where:
# its ``lora_targets``, engine/models/).
MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "in_proj", "out_proj",  # a Mamba mixer's
                     "input_linear", "output_linear",  # a Granite hybrid's shared MLP (never its experts' stacks)
                     "qkv_proj", "gate_up_proj"})  # checkpoints that store them fused (Phi-3)
# A routed expert's projections (engine/lora/experts.py), by the names its checkpoint gives them: Qwen's and Mixtral's.
EXPERT_MODULES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"})
# Under a decoder layer's attention, MLP or mixer (NemotronH), or a Granite hybrid's mamba / shared_mlp; an expert
# (``experts.{e}.``, under mlp or Mixtral's block_sparse_moe) or Qwen2-MoE's shared expert (``shared_expert.``). A
# Granite MoE layer's stacked experts (block_sparse_moe.input_linear) are refused by name.
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|mixer|mamba|shared_mlp|block_sparse_moe)\."
                  r"((?:experts\.\d+\.|shared_experts?\.)?\w+)\.lora_([AB])\.weight$")


# PEFT's target_parameters form of a MoE layer's experts (transformers 5 keeps them as [E, out, in] parameters): one
# ParamWrapper per targeted parameter, nested (``experts.lora_A``, ``experts.base_layer.lora_A``, ...).
_STACKED_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(mlp|mixer)\.experts((?:\.base_layer)*)\.lora_([AB])\.weight$")


def _module_name(block: str, module: str) -> str | None:
    """The name an adapter's tensor is kept under (its module's, with ``experts.{e}.`` / ``shared_expert.`` where it
    has one), None for a module we do not run."""
    *prefix, leaf = module.split(".")
    if prefix and prefix[0] == "experts":
        return module if leaf in EXPERT_MODULES else None
    if block == "block_sparse_moe":  # anything but a per-expert projection: a Granite MoE's stacks, the router
        return None
    if prefix == ["shared_expert"]:  # Qwen2-MoE's
        return module if block == "mlp" and leaf in ("gate_proj", "up_proj", "down_proj") else None
    if prefix:  # NemotronH's shared_experts.
        return module if block == "mixer" and leaf in ("up_proj", "down_proj") else None
    return module if leaf in MODULES else None


class LoraAdapterError(ValueError):
    """An adapter that cannot be served here; the message names the adapter, the file and what is wrong."""


@dataclass(frozen=True)
class LoraWeights:
    """One projection's low-rank update: ``delta(x) = scale * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    # (layer index, HF module name: "q_proj", "experts.3.down_proj", "shared_expert.up_proj", ...) -> its update
    modules: dict[tuple[int, str], LoraWeights]
    # Of its files' contents: workers that exchange KV must hold the same adapter under each name, and KV
    # kept on disk must not outlive a change of it (engine/lora/__init__.py fingerprint).
    digest: str = ""
    # PEFT's ``target_parameters`` form of a layer's experts (engine/lora/experts.py ``unstack``, which needs the
    # model's number of experts and shapes): (layer, wrapper depth) -> that parameter's stacked A and B.
    stacked: dict[tuple[int, int], "StackedParameter"] = field(default_factory=dict)
    alphas: "AlphaPattern | None" = None  # lora_alpha by module (the config's alpha_pattern)
    rslora: bool = False
    rank_limit: int = 0  # the max_lora_rank it was read under (a stacked parameter's rank is checked once unstacked)

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.modules.values())


@dataclass(frozen=True)
class StackedParameter:
    """One expert-stack parameter's update as PEFT's ParamWrapper keeps it: ``a`` [E * r, in] (expert-major rows),
    ``b`` [out, r * E] (expert-minor columns), ``path``: the module holding the parameter (for alpha_pattern)."""

    a: torch.Tensor
    b: torch.Tensor
    path: str


@dataclass(frozen=True)
class AlphaPattern:
    """lora_alpha by module: the first of the config's alpha_pattern keys that matches a module's path (PEFT's
    get_pattern_key: a regular expression matching the path's end after a dot, or the whole path), else lora_alpha."""

    default: float
    patterns: tuple[tuple[str, float], ...] = ()

    def of(self, module_path: str) -> float:
        for key, alpha in self.patterns:
            if re.match(rf"(.*\.)?({key})$", module_path):
                return alpha
        return self.default


def _refuse(name: str, path: Path, what: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {name!r} ({path}): {what}")


def read_adapter_config(name: str, path: Path) -> tuple[dict, bytes]:
    """adapter_config.json checked for what we cannot run, and its bytes (the adapter's digest covers them)."""
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise _refuse(name, path, "no adapter_config.json (expected a PEFT adapter directory, as "
                                  "PeftModel.save_pretrained writes)")
    raw = cfg_file.read_bytes()
    return parse_adapter_config(name, path, raw), raw


def parse_adapter_config(name: str, path: Path, raw: bytes) -> dict:
    """adapter_config.json's bytes checked for what we cannot run."""
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _refuse(name, path, f"adapter_config.json is not JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, path, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "layer_replication": "layer_replication is not supported",
    }
    for key, why in unsupported.items():
        if cfg.get(key):
            raise _refuse(name, path, why)
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, path, f"bias={cfg['bias']!r}: adapters with biases are not supported (only 'none')")
    alphas = cfg.get("alpha_pattern") or {}
    if not isinstance(alphas, dict) or not all(isinstance(v, (int, float)) for v in alphas.values()):
        raise _refuse(name, path, f"alpha_pattern {alphas!r} is not a mapping of module names to numbers")
    if not isinstance(cfg.get("r"), int) or cfg["r"] <= 0 or not isinstance(cfg.get("lora_alpha", 8), (int, float)):
        raise _refuse(name, path, f"adapter_config.json needs a positive integer r and a numeric lora_alpha, got "
                                  f"r={cfg.get('r')!r}, lora_alpha={cfg.get('lora_alpha')!r}")
    return cfg


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    """The adapter at ``path`` as float32 tensors on the CPU, each module's A and B paired and of one rank, at
    most ``max_rank`` (its fit to the model: engine/lora/__init__.py ``install``)."""
    return parse_adapter(name, path, *read_adapter_files(name, path), max_rank)


def read_adapter_files(name: str, path: str | Path) -> tuple[bytes, bytes]:
    """The bytes of the adapter's adapter_config.json and adapter_model.safetensors, read once (a tensor-parallel
    engine's other ranks parse these same bytes: engine/lora/runtime.py)."""
    path = Path(path)
    if not path.is_dir():
        raise _refuse(name, path, "no such directory")
    _, cfg_bytes = read_adapter_config(name, path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        bin_hint = " (adapter_model.bin: resave it with safe_serialization=True)" if (
            path / "adapter_model.bin").exists() else ""
        raise _refuse(name, path, f"no adapter_model.safetensors{bin_hint}")
    return cfg_bytes, weights_file.read_bytes()


def parse_adapter(name: str, path: str | Path, cfg_bytes: bytes, weights_bytes: bytes, max_rank: int) -> LoraAdapter:
    """load_adapter over the files' bytes (read_adapter_files's)."""
    path = Path(path)
    cfg = parse_adapter_config(name, path, cfg_bytes)
    tensors = load(weights_bytes)
    digest = hashlib.sha256(cfg_bytes + weights_bytes).hexdigest()[:16]
    alphas = AlphaPattern(float(cfg.get("lora_alpha", 8)),
                          tuple((k, float(v)) for k, v in (cfg.get("alpha_pattern") or {}).items()))
    rslora = bool(cfg.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    paths: dict[tuple[int, str], str] = {}  # each module's path, as alpha_pattern matches it
    stacked: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    stacked_paths: dict[tuple[int, int], str] = {}
    for key, tensor in tensors.items():
        m = _STACKED_KEY.search(key)
        if m is not None:
            where = (int(m.group(1)), m.group(3).count(".base_layer"))
            stacked.setdefault(where, {})[m.group(4)] = tensor.float()
            stacked_paths[where] = _module_path(key[: m.start(3)])
            continue
        m = _KEY.search(key)
        module = _module_name(m.group(2), m.group(3)) if m is not None else None
        if module is None:
            raise _refuse(name, path, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection "
                                      "(embedding, LM-head, router and DoRA adapters are not supported, nor a Granite "
                                      "MoE's stacked experts)")
        pairs.setdefault((int(m.group(1)), module), {})[m.group(4)] = tensor.float()
        paths[(int(m.group(1)), module)] = _module_path(key.removesuffix(f".lora_{m.group(4)}.weight"))
    if not pairs and not stacked:
        raise _refuse(name, path, "adapter_model.safetensors holds no LoRA weights")
    for (layer, depth), ab in stacked.items():
        if set(ab) != {"A", "B"} or ab["A"].dim() != 2 or ab["B"].dim() != 2 or ab["B"].shape[1] != ab["A"].shape[0]:
            raise _refuse(name, path, f"layer {layer} experts: a stacked parameter's lora_A / lora_B are not a "
                                      "[experts * rank, in] / [out, rank * experts] pair")
    modules: dict[tuple[int, str], LoraWeights] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise _refuse(name, path, f"{where}: has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise _refuse(name, path, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a "
                                      "[rank, in] / [out, rank] pair")
        rank = a.shape[0]
        if rank > max_rank:
            raise _refuse(name, path, f"{where}: rank {rank} exceeds max_lora_rank {max_rank} (raise "
                                      "--max-lora-rank)")
        modules[(layer, module)] = LoraWeights(a.contiguous(), b.contiguous(),
                                               lora_scale(alphas.of(paths[(layer, module)]), rank, rslora))
    return LoraAdapter(name, str(path), modules, digest,
                       {w: StackedParameter(ab["A"], ab["B"], stacked_paths[w]) for w, ab in stacked.items()},
                       alphas, rslora, max_rank)


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling of a module's update: lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def _module_path(key: str) -> str:
    """A tensor key's module as PEFT names it in rank_pattern / alpha_pattern (the model's own module path)."""
    return key.removeprefix("base_model.model.")
