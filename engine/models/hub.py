"""Hugging Face Hub model ids (``Qwen/Qwen3-0.6B``, as ``vllm serve`` takes them): the files the engine reads are
fetched into the Hugging Face cache by huggingface_hub, and the model is served from that snapshot directory.

huggingface_hub reads its own environment: ``HF_HOME`` / ``HF_HUB_CACHE`` (where), ``HF_TOKEN`` (gated and private
repositories), ``HF_HUB_OFFLINE=1`` (the cache only), ``HF_ENDPOINT`` (a mirror). A machine that cannot reach the
Hub serves what the cache holds. Only what a model directory needs is fetched: configs, tokenizers, chat templates
and safetensors weights (not the .bin, .pth or GGUF copies many repositories carry too).

Each process resolves an id once (a Ray worker starting on the same node finds the cache the launcher filled).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

# owner/name, as the Hub spells repository ids
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken"]
# What counting tokens needs (a load test's tokenizer): no weights.
TOKENIZER_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken"]
# Mistral's repositories carry the same weights twice: consolidated.safetensors in its own format, beside HF's.
IGNORE_PATTERNS = ["original/*", "consolidated*.safetensors"]


def is_hub_id(name: str) -> bool:
    return HUB_ID.fullmatch(name) is not None


@functools.lru_cache(maxsize=16)
def hub_snapshot(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                 progress: bool = True, weights: bool = True) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or commit; None: main), fetched
    into ``download_dir`` (vLLM's --download-dir; None: the Hugging Face cache); without ``weights`` only the
    configs and tokenizer. LookupError saying why not."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    if not progress:
        disable_progress_bars()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=ALLOW_PATTERNS if weights else TOKENIZER_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS))
    except GatedRepoError:
        raise LookupError(f"{where} is gated: accept its terms on huggingface.co and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise LookupError(f"{where}: no such model on the Hugging Face Hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise LookupError(f"{where}: the repository has no such revision") from None
    except LocalEntryNotFoundError:
        raise LookupError(f"{where} is not in the Hugging Face cache and the Hub cannot be reached (offline, or "
                          "HF_HUB_OFFLINE=1): download it where the Hub is reachable, or give a directory") from None
    except (HfHubHTTPError, OSError) as e:
        raise LookupError(f"{where}: cannot fetch it from the Hugging Face Hub: {e}") from None
    finally:
        if not progress:
            enable_progress_bars()
