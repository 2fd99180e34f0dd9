"""Model name -> Hugging Face Llama directory on local disk.

Built-in names are built once into `<cache>/models/<name>/`; any other string must be a path to an HF
directory. Several processes (Ray actors starting together) may resolve the same name at once: an
exclusive flock on `<cache>/models/<name>.lock` makes exactly one build, and the build happens in a
temp dir beside the target that is renamed into place, so a reader never sees a half-written model.

A stamp file records which converter source built a directory; when the converter changes the stale
directory is rebuilt (otherwise a shared cache, e.g. the tests', would hide converter changes). The
rebuild swaps directories with two renames, so a process resolving in that instant may briefly find
no directory; only a converter upgrade under running workers can hit that.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from . import gguf_convert, hub, tiny_hybrid, tiny_hybrid_moe, tiny_random
from .dummy_weights import with_dummy_weights
from .hf_overrides import overlay_dir, parse_hf_overrides
from .tokenizer_overlay import with_tokenizer

CACHE_ENV = "PDCLUSTER_CACHE_DIR"
STAMP_FILE = ".pdcluster-build.json"
REQUIRED_FILES = ("config.json", "tokenizer.json")


def _build_smollm2(out: Path, progress: bool) -> None:
    gguf_convert.convert_gguf_to_hf(gguf_convert.find_smollm2_gguf(), out, progress=progress)


def _build_tiny_random(out: Path, progress: bool) -> None:
    tiny_random.build_tiny_random(out, gguf_convert.find_smollm2_gguf())


def _build_tiny_hybrid(out: Path, progress: bool) -> None:
    tiny_hybrid.build_tiny_hybrid(out, gguf_convert.find_smollm2_gguf())


def _build_tiny_hybrid_moe(out: Path, progress: bool, latent: bool = True) -> None:
    tiny_hybrid_moe.build_tiny_hybrid_moe(out, gguf_convert.find_smollm2_gguf(), latent=latent)


# name -> (builder, modules whose source decides the output)
BUILTIN_MODELS: dict[str, tuple[Callable[[Path, bool], None], tuple]] = {
    "smollm2": (_build_smollm2, (gguf_convert,)),
    "tiny-random": (_build_tiny_random, (gguf_convert, tiny_random)),
    "tiny-hybrid": (_build_tiny_hybrid, (gguf_convert, tiny_random, tiny_hybrid)),
    "tiny-hybrid-moe": (_build_tiny_hybrid_moe, (gguf_convert, tiny_random, tiny_hybrid, tiny_hybrid_moe)),
    "tiny-hybrid-moe-plain": (lambda out, progress: _build_tiny_hybrid_moe(out, progress, latent=False),
                              (gguf_convert, tiny_random, tiny_hybrid, tiny_hybrid_moe)),
}

# The config.json a built-in's builder writes (before its tokenizer's special ids), for questions about the model
# that need no weights, asked before it is built (e.g. whether it has MTP layers of its own); smollm2 is converted
# from its GGUF (a Llama, no MTP layers).
BUILTIN_CONFIGS: dict[str, dict] = {
    "tiny-random": tiny_random.TINY_RANDOM_CONFIG,
    "tiny-hybrid": tiny_hybrid.TINY_HYBRID_CONFIG,
    "tiny-hybrid-moe": tiny_hybrid_moe.TINY_HYBRID_MOE_CONFIG,
    "tiny-hybrid-moe-plain": tiny_hybrid_moe.TINY_HYBRID_MOE_PLAIN_CONFIG,
}


def builtin_config(name: str) -> dict | None:
    """A built-in's config (BUILTIN_CONFIGS), None for other names."""
    return BUILTIN_CONFIGS.get(name)


class UnknownModelError(ValueError):
    """Neither a built-in model name nor a Hugging Face model directory."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdcluster").expanduser()


def resolve_model(
    name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, progress: bool = True,
    hf_overrides: str | dict | None = None, revision: str | None = None, download_dir: str | None = None,
    tokenizer: str | None = None, tokenizer_revision: str | None = None, load_format: str = "auto",
) -> Path:
    """The HF directory for a built-in model name (built on first use), an existing model directory or a Hugging
    Face Hub id (``owner/name``, fetched at ``revision`` into ``download_dir`` or the Hugging Face cache:
    engine/models/hub.py); with ``hf_overrides`` (vLLM's, JSON or a dict) an overlay of it whose config.json has
    them set (engine/models/hf_overrides.py); with ``tokenizer`` (vLLM's --tokenizer: a built-in name, a directory or
    a Hub id at ``tokenizer_revision``) an overlay of it whose tokenizer files are that one's
    (engine/models/tokenizer_overlay.py); the model directory then need not have a tokenizer of its own. With
    ``load_format`` "dummy" (vLLM's) an overlay with random weights (engine/models/dummy_weights.py): a Hub id's
    configs and tokenizer alone are fetched, and a directory need hold no weights.

    A built-in name wins over a same-named folder in the working directory, and a folder over a Hub id.
    """
    name = os.fspath(name_or_path)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    overrides = parse_hf_overrides(hf_overrides)
    tokenizer_dir = (resolve_tokenizer(tokenizer, cache, progress, tokenizer_revision, download_dir)
                     if tokenizer else None)
    needed = REQUIRED_FILES if tokenizer_dir is None else ("config.json",)
    dummy = load_format == "dummy"  # (EngineConfig checks the value)
    model_dir = _model_dir(name, cache, progress, revision, download_dir, needed, weights=not dummy)
    if tokenizer_dir is not None:
        model_dir = with_tokenizer(model_dir, tokenizer_dir, cache)
    model_dir = overlay_dir(model_dir, overrides, cache)
    return with_dummy_weights(model_dir, cache) if dummy else model_dir


def _model_dir(name: str, cache: Path, progress: bool, revision: str | None, download_dir: str | None,
               needed: tuple[str, ...], weights: bool = True) -> Path:
    if name in BUILTIN_MODELS:
        return _ensure_built(name, cache / "models", progress)
    path = Path(name).expanduser()
    if not path.is_dir() and hub.is_hub_id(name):
        try:
            path = hub.hub_snapshot(name, revision or None, download_dir or None, progress, weights=weights)
        except LookupError as e:
            raise UnknownModelError(f"model {name!r}: {e}") from None
        missing = _missing_files(path, needed, weights)
        if missing:
            raise UnknownModelError(f"model {name!r} from the Hugging Face Hub: its files ({path}) lack "
                                    f"{', '.join(missing)}; served here are repositories of safetensors weights with "
                                    "config.json and tokenizer.json (or a --tokenizer of their own; "
                                    "--load-format dummy for random weights)")
        return path
    problem = _hf_dir_problem(path, needed, weights)
    if problem is None:
        return path.resolve()
    raise UnknownModelError(
        f"unknown model {name!r}: {problem}; give a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        "a Hugging Face model directory with config.json, *.safetensors and tokenizer.json (--load-format dummy: no "
        "weights), or a Hub id (owner/name)"
    )


def resolve_tokenizer(name: str, cache: Path, progress: bool = True, revision: str | None = None,
                      download_dir: str | None = None) -> Path:
    """The directory of vLLM's ``--tokenizer NAME``: a built-in model's, a directory with tokenizer.json, or a Hub
    repository's configs and tokenizer (no weights) at ``revision``; UnknownModelError naming the flag otherwise."""
    if name in BUILTIN_MODELS:
        return _ensure_built(name, cache / "models", progress)
    path = Path(name).expanduser()
    if not path.is_dir() and hub.is_hub_id(name):
        try:
            path = hub.hub_snapshot(name, revision or None, download_dir or None, progress, weights=False)
        except LookupError as e:
            raise UnknownModelError(f"--tokenizer {name!r}: {e}") from None
    elif not path.is_dir():
        raise UnknownModelError(f"--tokenizer {name!r}: no such directory, and not a built-in name "
                                f"({', '.join(sorted(BUILTIN_MODELS))}) or a Hub id (owner/name)")
    if not (path / "tokenizer.json").is_file():
        raise UnknownModelError(f"--tokenizer {name!r}: {path} has no tokenizer.json (the tokenizers library's "
                                "file, which every tokenizer served here is read from)")
    return path.resolve()


def _hf_dir_problem(path: Path, needed: tuple[str, ...] = REQUIRED_FILES, weights: bool = True) -> str | None:
    if not path.is_dir():
        return "it is not a built-in name and no such directory exists"
    missing = _missing_files(path, needed, weights)
    return f"directory lacks {', '.join(missing)}" if missing else None


def _missing_files(path: Path, needed: tuple[str, ...] = REQUIRED_FILES, weights: bool = True) -> list[str]:
    missing = [f for f in needed if not (path / f).is_file()]
    if weights and not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def _stamp(name: str) -> dict:
    _, modules = BUILTIN_MODELS[name]
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return {"name": name, "builder_sha256": digest.hexdigest()}


def _is_current(target: Path, stamp: dict) -> bool:
    try:
        return json.loads((target / STAMP_FILE).read_text(encoding="utf-8")) == stamp
    except (OSError, ValueError):
        return False


def _ensure_built(name: str, models_dir: Path, progress: bool) -> Path:
    target = models_dir / name
    stamp = _stamp(name)
    if _is_current(target, stamp):  # fast path: no lock once built
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f"{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if _is_current(target, stamp):  # another process built it while we waited
            return target
        for leftover in models_dir.glob(f".{name}.tmp-*"):  # from a builder that died; we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir))
        try:
            BUILTIN_MODELS[name][0](tmp, progress)
            (tmp / STAMP_FILE).write_text(json.dumps(stamp) + "\n", encoding="utf-8")
            _make_durable(tmp)
            _swap_into_place(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _make_durable(folder: Path) -> None:
    # mkdtemp makes the folder 0700 and safetensors writes 0600; a model cache is not secret.
    os.chmod(folder, 0o755)
    for f in folder.iterdir():
        os.chmod(f, 0o644)
        with open(f, "rb") as fh:  # data on disk before the rename publishes the folder
            os.fsync(fh.fileno())


def _swap_into_place(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():  # stale build: move it aside first, rename() cannot replace a non-empty dir
        old = target.with_name(f".{target.name}.tmp-old-{os.getpid()}")
        os.rename(target, old)
    os.rename(tmp, target)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
