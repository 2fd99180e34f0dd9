"""Session-wide test setup.

TRITON_INTERPRET must be set before triton is first imported (FIELD_NOTES), so it is set here, at the
very top, before any test module imports a kernel. Ray and model caches are pointed at per-session
temp dirs so tests never write into the user's home.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Converted models are cached per machine, outside the checkout, so conversion happens once.
os.environ.setdefault("PDCLUSTER_CACHE_DIR", "/tmp/pdcluster-test-cache")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir():
    from pdcluster.engine.model_registry import resolve_model

    return resolve_model("smollm2", progress=False)


@pytest.fixture(scope="session")
def tiny_dir():
    from pdcluster.engine.model_registry import resolve_model

    return resolve_model("tiny-random", progress=False)


def make_engine(model: str = "tiny-random", **kwargs):
    """An LLMEngine with test-friendly defaults (small pool, float32)."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.llm_engine import LLMEngine

    kwargs.setdefault("num_kv_blocks", 512)
    kwargs.setdefault("max_model_len", 1024)
    return LLMEngine(EngineConfig(model=model, **kwargs), progress=False)
