"""A model directory seen through a change, without editing the checkpoint: a folder in the cache of links to the
files it keeps and of the files it writes anew (hf_overrides.py: a config.json with vLLM's --hf-overrides;
tokenizer_overlay.py: another directory's tokenizer, vLLM's --tokenizer).

Every part of the engine and the API reads the model directory, so an overlay is a directory. It is named by what it
is made of, built once in a temp directory and renamed into place, so processes that resolve it together (Ray workers
on one node) share one; an overlay found there that no longer matches (its checkpoint was edited) is replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def place_overlay(target: Path, links: dict[str, Path], files: dict[str, str]) -> Path:
    """``target`` holding a link named ``name`` to each ``links[name]`` and a file ``name`` with each ``files[name]``
    text; ``target`` as it is where it holds exactly that already."""
    if _holds(target, links, files):
        return target
    if target.is_dir():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        try:
            os.rename(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # another process replaced it first
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        for name, source in links.items():
            os.symlink(source, tmp / name)
        for name, text in files.items():
            (tmp / name).write_text(text)
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _holds(target, links, files):  # not another process's same overlay placed first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _holds(target: Path, links: dict[str, Path], files: dict[str, str]) -> bool:
    try:
        names = {p.name for p in target.iterdir()}
        if names != set(links) | set(files):
            return False
        if any(os.readlink(target / name) != os.fspath(source) for name, source in links.items()):
            return False
        return all((target / name).read_text() == text for name, text in files.items())
    except OSError:
        return False
