"""New weights for a loaded model, in place (RL rollouts: the trainer writes a checkpoint, the servers take it).

The engine loads the new checkpoint as a second model of the same architecture and copies every tensor of it into
the tensor at the same place in the served model (``copy_weights``): the served tensors keep their storage, so what
holds them keeps working as it is (CUDA graphs captured on them, the draft heads that share the embedding, the LoRA
wrappers around the projections, the KV transports' registered memory is not involved). Derived layouts (packed
GEMM weights, fp32 copies of a bias) are tensors of the freshly loaded model too, made by the same loader, so they
are copied like the weights and never go stale.

Each update names a *weight version*. Requests are stamped with the version they run under
(SamplingParams.weight_version), and the version roots their block hashes (engine/block_manager.py
``block_hash_root``): KV computed under other weights never matches a new request in the prefix cache, the offload
tiers or the router's KV index, and a worker holding other weights refuses a request placed under a version it does
not hold (a prefill and a decode worker of one request hold the same weights). The weights a worker starts with are
version ``default`` (SGLang's name for them), whose hashes are the plain ones: serving without updates is unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.engine.sampling_params import DEFAULT_WEIGHT_VERSION

MAX_VERSION_CHARS = 256

# Parts of a served model that are not its checkpoint's weights: the LoRA adapters (kept across an update, as vLLM
# keeps them), a split model's driver and group (and its row-parallel layers' group), an image tower attached after loading (not in a text checkpoint's
# load), the architecture (compared before any copy) and a step's image rows.
_NOT_WEIGHTS = frozenset({"lora", "tp_driver", "tp_group", "tp_shard", "image_encoder", "image_rows", "arch",
                          "unsplit_arch", "group", "draft_head"})


class WeightUpdateError(ValueError):
    """The update cannot be made; nothing was changed (the served weights are as before)."""


class WeightVersionMismatch(RuntimeError):
    """A request placed under other weights than the worker serves (an update passed it on its way): not the
    request's fault, so a RuntimeError and not a ValueError: the worker answers that it cannot take it, and the
    router places it on a worker serving its version (or anew under the new one)."""


@dataclass(frozen=True)
class WeightUpdate:
    """What an update did: the version now served, where its weights came from, how much was copied."""

    weight_version: str
    model_path: str
    digest: str  # checkpoint_digest of what was read
    num_tensors: int
    num_bytes: int
    seconds: float


DIGEST_SAMPLES = 64  # 4 KiB pieces read from each weight file, evenly spaced
_PIECE_BYTES = 4096
_HEAD_BYTES = 1 << 16


def checkpoint_digest(model_dir: str | Path) -> str:
    """A digest of a checkpoint's contents that costs a few hundred small reads, not the whole files: config.json,
    and of each weight file its name, size, first 64 KiB (safetensors' header: names, shapes, offsets) and
    DIGEST_SAMPLES pieces spread over it. A training step changes every weight, so its checkpoint's digest
    differs; two nodes holding copies of one checkpoint agree on it."""
    digest = hashlib.blake2b(digest_size=12)
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(_HEAD_BYTES))
            for i in range(DIGEST_SAMPLES):
                fh.seek(size * i // DIGEST_SAMPLES)
                digest.update(fh.read(_PIECE_BYTES))
    return digest.hexdigest()


def check_version(version: str, used: dict[str, str], digest: str) -> str:
    """A new update's version: non-empty, at most MAX_VERSION_CHARS, never ``default``, and not a name given before
    to other weights (``used``: version -> checkpoint_digest). A version roots block hashes: one name for two sets
    of weights would let KV of the first serve the second. The same name for the same contents is the same weights
    (a worker brought back in line after it missed an update)."""
    if not isinstance(version, str) or not version.strip() or len(version) > MAX_VERSION_CHARS:
        raise WeightUpdateError(f"weight_version: give a non-empty name of at most {MAX_VERSION_CHARS} characters, "
                                f"got {version!r}")
    if version == DEFAULT_WEIGHT_VERSION:
        raise WeightUpdateError(f"weight_version: {DEFAULT_WEIGHT_VERSION!r} names the weights the server started "
                                "with; give the update another name")
    if used.get(version, digest) != digest:
        raise WeightUpdateError(f"weight_version: {version!r} was given to other weights by an earlier update here; "
                                "each checkpoint needs a name of its own (KV computed under one version is matched "
                                "by its name)")
    return version


def _is_leaf(value) -> bool:
    return value is None or isinstance(value, (str, bytes, int, float, bool, complex, torch.dtype, torch.device,
                                                type, types.ModuleType, types.FunctionType, types.MethodType,
                                                types.BuiltinFunctionType, range, slice))


def _fields(obj) -> dict | None:
    """An object's attributes to walk (instances with a __dict__ or dataclass slots); None for anything else."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not hasattr(obj, "__dict__"):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return vars(obj) if hasattr(obj, "__dict__") else None


def _unwrapped(obj):
    """A LoRA wrapper's base projection (engine/lora/layers.py LoraLinear): the new model has the plain one there."""
    base = getattr(obj, "base", None)
    return base if base is not None and type(obj).__name__ == "LoraLinear" else obj


def _tensors(root) -> dict[int, tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``root`` outside _NOT_WEIGHTS, by id: the first path it was found at, and it."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    stack = [(root, "model")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), (path, obj))
            continue
        if _is_leaf(obj) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif isinstance(obj, dict):
            stack.extend((v, f"{path}[{k!r}]") for k, v in obj.items())
        elif (attrs := _fields(obj)) is not None:
            stack.extend((v, f"{path}.{k}") for k, v in attrs.items() if k not in _NOT_WEIGHTS)
    return found


def served_tensors(roots) -> list[torch.Tensor]:
    """The tensors a weight update writes under ``roots`` (walked as ``copy_weights`` walks the served model: a LoRA
    wrapper's base projection, nothing under _NOT_WEIGHTS), each once: what a level-2 sleep discards
    (engine/sleep.py)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [roots]
    while stack:
        obj = _unwrapped(stack.pop())
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
            continue
        if _is_leaf(obj) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif (attrs := _fields(obj)) is not None:
            stack.extend(v for k, v in attrs.items() if k not in _NOT_WEIGHTS)
    return list(found.values())


def served_bytes(model) -> int:
    """Bytes of ``model``'s weights (its tensors outside _NOT_WEIGHTS, each once): what a second copy needs."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(model).values())


def copy_weights(dst, src) -> tuple[int, int]:
    """Copy every tensor of model ``src`` into the tensor at the same place in model ``dst`` (the served one), in
    place; returns (tensors copied, bytes). The two were built by one loader from checkpoints of one architecture,
    so the places match: a place whose tensors differ in shape or dtype, or a tensor of ``src`` with no place in
    ``dst``, raises WeightUpdateError *before anything is copied*."""
    pairs: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    seen: set[tuple[int, int]] = set()
    stack = [(dst, src, "model")]
    while stack:
        d, s, path = stack.pop()
        d = _unwrapped(d)
        if isinstance(s, torch.Tensor):
            if not isinstance(d, torch.Tensor):
                raise WeightUpdateError(f"{path}: the new checkpoint has a tensor where the served model has "
                                        f"{type(d).__name__}")
            if d.shape != s.shape or d.dtype != s.dtype:
                raise WeightUpdateError(f"{path}: the new checkpoint's tensor is {tuple(s.shape)} {s.dtype}, the "
                                        f"served one {tuple(d.shape)} {d.dtype}")
            pairs.append((d, s, path))
            continue
        if _is_leaf(s) or (id(d), id(s)) in seen:
            continue
        seen.add((id(d), id(s)))
        if isinstance(s, (list, tuple)):
            if not isinstance(d, (list, tuple)) or len(d) != len(s):
                raise WeightUpdateError(f"{path}: {len(s)} entries in the new checkpoint's model, "
                                        f"{len(d) if isinstance(d, (list, tuple)) else type(d).__name__} served")
            stack.extend((dv, sv, f"{path}[{i}]") for i, (dv, sv) in enumerate(zip(d, s)))
        elif isinstance(s, dict):
            if isinstance(d, dict):
                stack.extend((d[k], v, f"{path}[{k!r}]") for k, v in s.items() if k in d)
        elif (s_attrs := _fields(s)) is not None and (d_attrs := _fields(d)) is not None:
            stack.extend((d_attrs[k], v, f"{path}.{k}") for k, v in s_attrs.items()
                         if k not in _NOT_WEIGHTS and k in d_attrs)
    first: dict[int, tuple[torch.Tensor, str]] = {}
    for d, s, path in pairs:  # one served tensor at two places (a tied embedding) takes one value
        if id(d) not in first:
            first[id(d)] = (s, path)
        elif first[id(d)][0] is not s and not torch.equal(first[id(d)][0], s):
            raise WeightUpdateError(f"{first[id(d)][1]} and {path} are one tensor in the served model (tied) but "
                                    "differ in the new checkpoint: save it with its tied weights equal")
    placed = {id(s) for _, s, _ in pairs}
    missing = [path for tid, (path, _) in _tensors(src).items() if tid not in placed]
    if missing:
        raise WeightUpdateError(f"{len(missing)} tensors of the new checkpoint's model have no place in the served "
                                f"one (e.g. {', '.join(sorted(missing)[:3])})")
    done: set[int] = set()
    num_bytes = 0
    with torch.inference_mode():  # a split model's other ranks loaded theirs as inference tensors
        for d, s, _ in pairs:
            if id(d) in done:  # a tensor two places share (a tied embedding): once
                continue
            done.add(id(d))
            d.copy_(s)
            num_bytes += d.numel() * d.element_size()
    return len(done), num_bytes


def _arch_differences(served, new) -> list[str]:
    """The fields in which two architectures differ (``served``'s value first)."""
    if type(served) is not type(new):
        return [f"architecture {type(served).__name__} != {type(new).__name__}"]
    if not dataclasses.is_dataclass(served):
        return [] if served == new else ["config"]
    return [f"{f.name} {getattr(served, f.name)!r} != {getattr(new, f.name)!r}" for f in dataclasses.fields(served)
            if getattr(served, f.name) != getattr(new, f.name)]


@dataclass
class PreparedWeights:
    """A checkpoint read and checked against the served model, not yet copied in (``prepare``): a cluster
    prepares every worker first, and copies only once all could read it, so a worker that cannot leaves none
    changed."""

    weight_version: str
    model_path: str
    digest: str  # checkpoint_digest
    model: object
    started: float


def prepare(engine, model_path: str, weight_version: str | None = None) -> PreparedWeights:
    """Read the checkpoint at ``model_path`` (a Hugging Face directory, a built-in name or a Hub id, as --model) for
    ``engine``'s model, as ``weight_version`` (None: a name made from the path and the update's count), and check
    it fits: WeightUpdateError for a checkpoint of another architecture (or other image processing), a version name
    given to other contents or reserved, or (CUDA) too little free device memory to hold it beside the served
    weights. A split model's other ranks read their slices too; a model serving images, its image tower.
    Nothing served changes. The new checkpoint is read whole before the copy: for a while the device holds the
    weights twice."""
    import time

    from pdcluster.engine.models.architectures import arch_from_dir, model_class_of
    from pdcluster.engine.models.registry import UnknownModelError, resolve_model

    config, model = engine.config, engine.model
    if config.pipeline_parallel_size > 1:
        raise WeightUpdateError(f"pipeline_parallel_size {config.pipeline_parallel_size}: weight updates are not "
                                "served on a pipeline split yet (each stage would read its layers): restart the "
                                "server on the new checkpoint")
    driver = model.tp_driver
    if driver is not None and engine.scheduler.has_unfinished():  # the other ranks read instead of forwarding
        raise WeightUpdateError(f"{len(engine.scheduler.requests)} requests are running: pause generation first "
                                "(a split model's other ranks stop forwarding while they read the checkpoint)")
    if weight_version is not None:  # a bad name is refused before any file is read
        check_version(weight_version, {}, "")
    started = time.monotonic()
    try:
        # With --tokenizer the served tokenizer is that one: a trainer's checkpoint need not carry one either.
        new_dir = resolve_model(model_path, cache_dir=config.cache_dir or None, progress=False,
                                tokenizer=config.tokenizer or None, tokenizer_revision=config.tokenizer_revision or None)
    except (UnknownModelError, OSError) as e:
        raise WeightUpdateError(f"model_path: {e}") from None
    digest = checkpoint_digest(new_dir)
    version = check_version(weight_version or f"{Path(model_path).name}-{len(engine.used_weight_versions) + 1}",
                            engine.used_weight_versions, digest)
    if model_class_of(new_dir) is not model_class_of(engine.model_dir):
        raise WeightUpdateError(f"model_path: {new_dir} holds a {model_class_of(new_dir).__name__}, the server "
                                f"runs a {model_class_of(engine.model_dir).__name__}")
    differences = _arch_differences(arch_from_dir(engine.model_dir), arch_from_dir(new_dir))
    if differences:
        raise WeightUpdateError(f"model_path: {new_dir}'s config.json differs from the served model's: "
                                + "; ".join(differences[:4]))
    encoder = getattr(model, "image_encoder", None)
    if encoder is not None:  # its tower too, read the way the served one was
        from pdcluster.engine.multimodal.spec import ImageSpec

        try:
            spec = ImageSpec.from_dir(new_dir, config.image_processor_kwargs())
        except ValueError as e:
            raise WeightUpdateError(f"model_path: {new_dir}: {e}") from None
        if spec != encoder.spec:
            raise WeightUpdateError(f"model_path: {new_dir} processes images otherwise than the served model "
                                    f"({spec} != {encoder.spec})")
    if model.device.type == "cuda":  # the new weights sit beside the served ones until the copy
        need = served_bytes(model)
        free, _ = torch.cuda.mem_get_info(model.device)
        if need > free * 0.95:
            raise WeightUpdateError(f"model_path: reading {need / 2**30:.1f} GiB of weights beside the served ones "
                                    f"needs that much free on {model.device}, which has {free / 2**30:.1f} GiB: serve "
                                    "with a lower --gpu-memory-utilization to leave room for weight updates")
    new = _read_model(engine, Path(new_dir), digest)
    return PreparedWeights(version, str(new_dir), digest, new, started)


def prepare_reload(engine) -> PreparedWeights:
    """The served checkpoint (``engine.weights_path``) read again under the served version: what a level-2 sleep
    discarded (engine/sleep.py checks its files are unchanged first). A single-process model only (a split one is
    not put to sleep)."""
    import time

    started = time.monotonic()
    path = Path(engine.weights_path)
    return PreparedWeights(engine.weight_version, str(path), "", _read_model(engine, path, ""), started)


def _read_model(engine, new_dir: Path, digest: str):
    """The checkpoint in ``new_dir`` loaded as a second model of the served one's kind, on its device and dtype (its
    image tower and its draft head with it; a split model's other ranks read their slices). WeightUpdateError where
    its weights cannot be read."""
    from pdcluster.engine.models.architectures import load_model

    config, model = engine.config, engine.model
    driver = model.tp_driver
    encoder = getattr(model, "image_encoder", None)
    shard = None
    if driver is not None:  # a split model: this rank's slice here, the others' there
        from pdcluster.engine.tensor_parallel.layers import Shard

        shard = Shard(0, config.tensor_parallel_size)
    try:
        new = load_model(new_dir, model.dtype, engine.max_model_len + config.num_spec_steps + 1, config.device,
                         deterministic=engine.deterministic, max_model_len=engine.max_model_len, shard=shard,
                         group=model.tp_group)
        if encoder is not None:
            from pdcluster.engine.multimodal.attach import attach_image_encoder

            attach_image_encoder(new, encoder.spec, Path(new_dir), config, model.dtype, engine.deterministic)
        if driver is None:
            new_draft = _draft_on(engine, new, Path(new_dir))
            if new_draft is not None:
                new.draft_head = new_draft  # the draft, carried to the commit beside the model
    except (OSError, KeyError, ValueError) as e:  # a missing or short weight file
        raise WeightUpdateError(f"model_path: {new_dir}: its weights could not be read: {e}") from None
    if driver is not None:
        try:
            driver.read_weights(str(new_dir), digest)
        except ValueError as e:
            raise WeightUpdateError(f"model_path: {e}") from None
    return new


def _draft_on(engine, new, new_dir: Path):
    """The MTP draft head (or EAGLE draft) the engine runs, built again on the new model: a checkpoint's own MTP
    layers from the new checkpoint, any other draft from where it came from, on the new target's weights (a head that
    slices the target's LM head holds a copy of it). None without an MTP proposer."""
    head = getattr(engine.runner.proposer, "head", None)
    if head is None:
        return None
    from pdcluster.engine.models.mtp import find_mtp_checkpoint, resolve_mtp_weights
    from pdcluster.engine.models.registry import default_cache_dir
    from pdcluster.engine.proposers import make_proposer

    config = engine.config
    cache = config.cache_dir or default_cache_dir()
    arch = new.unsplit_arch or new.arch
    own = find_mtp_checkpoint(config.mtp_checkpoint, cache, config.model, arch).kind == "own"
    weights, _ = resolve_mtp_weights(config.mtp_checkpoint, cache, str(new_dir) if own else config.model, arch,
                                     config.seed)
    return make_proposer(config, new, engine.kv_cache, weights).head


def commit(engine, prepared: PreparedWeights) -> WeightUpdate:
    """Copy ``prepared`` into ``engine``'s model, in place. Only between requests: WeightUpdateError while any runs
    (a router pauses and drains first, so no request ever runs on two versions); nothing is changed then."""
    import time

    check_version(prepared.weight_version, engine.used_weight_versions, prepared.digest)
    if engine.scheduler.has_unfinished():
        raise WeightUpdateError(f"{len(engine.scheduler.requests)} requests are running: pause generation first "
                                "(POST /pause?mode=wait or mode=abort); no request runs on two sets of weights")
    num_tensors, num_bytes = copy_prepared(engine, prepared)
    engine.weight_version = prepared.weight_version
    engine.used_weight_versions[prepared.weight_version] = prepared.digest
    engine.weights_path = prepared.model_path
    return WeightUpdate(prepared.weight_version, prepared.model_path, prepared.digest, num_tensors, num_bytes,
                        time.monotonic() - prepared.started)


def copy_prepared(engine, prepared: PreparedWeights) -> tuple[int, int]:
    """Copy ``prepared`` into the served tensors, in place, between steps: (tensors, bytes). The caller checked no
    request runs."""
    model = engine.model
    if engine._stepper is not None:
        engine._stepper.drain()  # a step of finished rows may still be in flight: it reads the old weights
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(model.device)
    try:
        # The model, its image tower and its draft head (outside the model's walk) in one validated copy.
        new = prepared.model
        draft = getattr(new, "draft_head", None)
        num_tensors, num_bytes = copy_weights(
            (model, getattr(model, "image_encoder", None), engine.runner.proposer.head if draft is not None else None),
            (new, getattr(new, "image_encoder", None), draft))
    except WeightUpdateError:
        if model.tp_driver is not None:
            model.tp_driver.discard_weights()
        raise
    if model.tp_driver is not None:
        model.tp_driver.commit_weights()  # the other ranks copy theirs (before the next forward: the pipe's order)
    if cuda:
        torch.cuda.synchronize(model.device)
    prepared.model = None  # the copy's source goes now, not when the caller drops the record
    if engine.runner.image_embeds is not None:  # the old tower's embeddings of images seen before
        engine.runner.image_embeds.clear()
    return num_tensors, num_bytes
