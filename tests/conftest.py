"""Session-wide test setup.

TRITON_INTERPRET must be set before triton is first imported (FIELD_NOTES), so it is set here, at the
very top, before any test module imports a kernel. Ray and model caches are pointed at per-session
temp dirs so tests never write into the user's home.
"""

import os
from pathlib import Path
import time

# `python -m pytest` puts the checkout on sys.path, where its top-level folders (kernels/, engine/, ...) would shadow
# distributions of the same name: transformers >= 5.2x imports the Hugging Face `kernels` package and got ours
# (ImportError: cannot import name 'CUDAProperties'). The project's code is imported as pdcluster.*; the checkout
# itself is never needed on the path.
from pdcluster.engine.checkout_path import drop_checkout_from_sys_path  # noqa: E402 (a leaf module: no torch)

drop_checkout_from_sys_path()

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Converted models are cached per machine, outside the checkout, so conversion happens once.
os.environ.setdefault("PDCLUSTER_CACHE_DIR", "/tmp/pdcluster-test-cache")
# Under pytest-xdist (the README runs the suite as `-n 2`) every worker process computes on one thread:
# two workers each spinning two OpenMP (or OpenBLAS) threads on a 2-core machine oversubscribe it, and
# spin-waiting made small ops ~10x slower (see _one_torch_thread). Subprocesses inherit the setting;
# engine workers set their own thread count from their config either way.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402


def _row_invariant_interpreter_dot() -> None:
    """Under TRITON_INTERPRET a kernel's ``tl.dot`` is a numpy matmul (OpenBLAS). The batch-invariance
    tests need a row's bits to depend on that row alone, as a GPU's dot instruction gives: OpenBLAS's
    Haswell kernels (which some machines here pin with OPENBLAS_CORETYPE, see ../.library/env/README.md)
    give a row other bits by its place in the tile. Each row's product is taken alone here (a batch of
    1-row matmuls, one path for every row), so the interpreter's dot is row-invariant on every BLAS."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = np.matmul(a.data[:, None, :], b.data, dtype=d.data.dtype)[:, 0, :]
        return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_invariant_interpreter_dot()


def _remove_dead_processes_shared_memory() -> None:
    """/dev/shm is memory: torch's shared CPU tensors (torch_<pid>_..., the cuda_ipc transport's CPU caches) of worker
    processes the tests kill stay there after their process is gone, about 230 MB a run (2.1 GB after a few runs
    here), and Ray's memory monitor then kills workers of a later run on a 24 GiB machine (OutOfMemoryError). Removed
    once the process whose pid names them is gone; a name whose owner lives is left alone."""
    import re

    shm = "/dev/shm"
    if not os.path.isdir(shm):
        return
    for name in os.listdir(shm):
        match = re.fullmatch(r"torch_(\d+)_\d+_\d+", name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:  # its process is gone; a reader that mapped it keeps its mapping
            try:
                os.unlink(os.path.join(shm, name))
            except OSError:
                pass
        except PermissionError:  # another user's live process
            continue


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the xdist controller (or a run without xdist), not a worker
        _remove_dead_processes_shared_memory()


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput"):  # every worker is done by now
        _remove_dead_processes_shared_memory()


@pytest.fixture(scope="session")
def smollm2_dir():
    from pdcluster.engine.models.registry import resolve_model

    return resolve_model("smollm2", progress=False)


@pytest.fixture(scope="session")
def tiny_dir():
    from pdcluster.engine.models.registry import resolve_model

    return resolve_model("tiny-random", progress=False)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    """SmolLM2 (the ``smollm2`` built-in) in transformers, float32: the oracle the engine's outputs are
    checked against. One per module, freed with it."""
    transformers = pytest.importorskip("transformers")
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def engine_config(model: str = "tiny-random", **kwargs):
    """An EngineConfig with test-friendly defaults (small pool, float32); keyword arguments override
    them. ``functools.partial(engine_config, ...)`` gives a test module its own defaults."""
    from pdcluster.engine.config import EngineConfig

    kwargs.setdefault("num_kv_blocks", 512)
    kwargs.setdefault("max_model_len", 1024)
    if kwargs.get("spec_method") == "mtp":
        # The tiny models have no trained head; losslessness never depends on draft quality.
        kwargs.setdefault("mtp_checkpoint", "random")
    if kwargs.get("spec_method") == "draft_model" and "draft_model" not in kwargs:
        kwargs["draft_model"] = layer_skip_draft_dir(model)  # the model's first layers (mostly rejected drafts)
    return EngineConfig(model=model, **kwargs)


def layer_skip_draft_dir(model: str = "tiny-random", num_layers: int = 3) -> str:
    """A draft model for ``--spec draft_model``: ``model``'s first ``num_layers`` layers (engine/models/layer_skip.py),
    written once into the test cache (beside it, then renamed into place: xdist workers may race)."""
    import shutil
    import tempfile

    from pdcluster.engine.models.layer_skip import write_layer_skip_draft
    from pdcluster.engine.models.registry import default_cache_dir, resolve_model

    out = default_cache_dir() / "drafts" / f"{model}-first{num_layers}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + "."))
        write_layer_skip_draft(resolve_model(model, progress=False), tmp, num_layers)
        try:
            tmp.rename(out)
        except OSError:  # another worker's copy landed first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def forward_from_scratch(model, token_ids: list[int]):
    """``model``'s final hidden states over ``token_ids`` from position 0, in a paged cache of its own (one block
    table, 16-token blocks): the from-scratch reference the draft-head and model tests compare against."""
    return paged_from_scratch(model, token_ids)[0]


def paged_from_scratch(model, token_ids: list[int], block_size: int = 16):
    """(final hidden states, the paged cache it wrote: [layers, 2, blocks, block_size, kv heads, head_dim]) of
    ``model`` over ``token_ids`` from position 0, one block table."""
    import torch

    from pdcluster.engine.attention import AttentionMetadata

    a, bs, n = model.arch, block_size, len(token_ids)
    num_blocks = -(-n // bs)
    cache = torch.zeros((a.num_layers, 2, num_blocks, bs, a.num_kv_heads, a.head_dim))
    pos = torch.arange(n)
    meta = AttentionMetadata(pos.clone(), torch.arange(num_blocks, dtype=torch.int32)[None],
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), None,
                             model.scale)
    return model.forward(torch.tensor(token_ids), pos, cache, meta), cache


def paged_in_chunks(forward, arch, scale: float, length: int, split: int = 20):
    """``forward(rows, positions, layer_cache, meta)`` over positions 0..length-1 of one request in two chunks (as a
    chunked prefill runs a draft head) on a one-layer paged cache with a shuffled block table; returns (the outputs
    concatenated, the cache, the slots of the positions)."""
    import torch

    from pdcluster.engine.attention import AttentionMetadata

    bs = 16
    cache = torch.zeros((2, 8, bs, arch.num_kv_heads, arch.head_dim))
    table = torch.tensor([[3, 1, 5, 0, 2, 4, 6, 7]], dtype=torch.int32)
    pos = torch.arange(length)
    outs = []
    for lo, hi in ((0, split), (split, length)):
        p = pos[lo:hi]
        slots = table[0, p // bs].long() * bs + p % bs
        meta = AttentionMetadata(slots, table, torch.tensor([hi], dtype=torch.int32),
                                 torch.tensor([0, hi - lo], dtype=torch.int32), None, scale)
        outs.append(forward(slice(lo, hi), p, cache, meta))
    return torch.cat(outs), cache, table[0, pos // bs].long() * bs + pos % bs


def make_engine(model: str = "tiny-random", **kwargs):
    """An LLMEngine on :func:`engine_config` (the same defaults and overrides)."""
    from pdcluster.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(engine_config(model, **kwargs), progress=False)


def settled_worker_stats(cluster, timeout_s: float = 5.0) -> dict[str, dict]:
    """Every worker's stats once all its blocks are free, or as they are when ``timeout_s`` has passed
    (frees land a message or two after a request's last token)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.worker_stats()
        if all(s["num_free_blocks"] == s["num_blocks"] for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def assert_drained_cleanly(cluster, recorder, leaving: str, began: int | None = None) -> None:
    """After a drain of ``leaving``: nothing was recovered (recomputed), nothing was placed on it from
    decision ``began`` on, it is gone from the cluster and the router, and every worker has all its blocks
    back (no reservation or transfer left over)."""
    router = cluster.router
    assert not recorder.recoveries, "a drain must not recover (recompute) anything"
    if began is not None:
        assert all(d.decode_id != leaving and d.prefill_id != leaving for d in recorder.decisions[began:])
    assert leaving not in cluster.decode_handles and leaving not in cluster.prefill_handles
    assert leaving not in router.views
    assert_all_blocks_free(cluster)


def assert_all_blocks_free(cluster) -> None:
    for wid, s in settled_worker_stats(cluster, 10).items():
        assert s["num_free_blocks"] == s["num_blocks"], (wid, s)
        assert s.get("num_reserved", 0) == 0 and s.get("num_transfers", 0) == 0, (wid, s)


async def router_generate(router, request_id: str, prompt, params) -> list[int]:
    """Every token of one request through a router's stream; it must end by length (no failure)."""
    tokens, last = [], None
    async for delta in router.generate(request_id, prompt, params):
        tokens += delta.new_token_ids
        last = delta
    assert last.finish_reason == "length", (request_id, last.finish_reason, last.error)
    return tokens


def run_with_router(router, scenario):
    """``asyncio.run(scenario())`` with ``router`` started on that loop first (its background tasks live on
    the loop that runs the requests); returns what the scenario returns."""
    import asyncio

    async def main():
        router.start(asyncio.get_running_loop())
        return await scenario()

    return asyncio.run(main())


def slow_params(values, slow) -> list:
    """``values`` as pytest parameters, the ones in ``slow`` marked slow (.ci/run runs them after the default
    run). A value may already be a ``pytest.param`` (its marks are kept; its first value is the one compared)."""
    out = []
    for v in values:
        p = v if isinstance(v, type(pytest.param(None))) else pytest.param(v)
        out.append(pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow]) if p.values[0] in slow else v)
    return out


def transport_params(fast: tuple[str, ...] = ("tcp", "shm")) -> list:
    """usable_transports() as pytest parameters for whole-cluster tests: the ``fast`` ones in the default
    run, the others marked slow (.ci/run runs them after it; every transport is covered at the worker
    level by test_kv_transfer_e2e.py in the default run)."""
    transports = usable_transports()
    return slow_params(transports, [t for t in transports if t not in fast])


def usable_transports() -> list[str]:
    """The KV transports that work on this machine (the others' reasons: available_transports())."""
    from pdcluster.kv_transfer.transports import available_transports

    return [name for name, reason in available_transports().items() if reason is None]


class OracleProposer:
    """Test proposer for speculative decoding: drafts the known greedy continuation (``references``: full
    token sequences, prompt + output), replacing each draft by a wrong token with probability ``corrupt``
    (seeded), so verification sees long accepted runs, partial acceptance and full rejection. It runs the
    engine's own proposer first (so MTP still writes its draft layer's KV) and discards its drafts.
    Correctness never depends on drafts, so outputs must not change."""

    def __init__(self, inner, references: list[list[int]], corrupt: float = 0.25, seed: int = 0):
        import random

        self.inner = inner
        self.num_draft_layers = inner.num_draft_layers
        self.references = [list(r) for r in references]
        self.corrupt = corrupt
        self.rng = random.Random(seed)

    def propose(self, batch):
        self.inner.propose(batch)
        st = batch.states
        drafts = []
        for idx, k in zip(batch.idx_mapping_np, batch.num_drafts_np):
            n = int(st.num_tokens_np[idx])
            committed = st.token_ids_np[idx, :n].tolist()
            ref = next((r for r in self.references if r[:n] == committed), None)
            proposal = ref[n : n + int(k)] if ref is not None else []
            drafts.append([t if self.rng.random() >= self.corrupt else (t + 1) % 49152 for t in proposal])
        return drafts


def _one_torch_thread():
    """Tiny-model tests run single-threaded: their ops are too small to gain from intra-op threads,
    and on a loaded 2-core machine OpenMP's spin-waiting made them ~10x slower (measured; a 13 x 128 x 328
    matmul: 0.04 ms on one thread, 6 ms on two). Restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Per test; or, through ``pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")``, for a
# whole module, its module-scoped fixtures (models built, references computed) included.
one_torch_thread = pytest.fixture(_one_torch_thread, name="one_torch_thread")
one_torch_thread_per_module = pytest.fixture(_one_torch_thread, scope="module", name="one_torch_thread_per_module")


@pytest.fixture(scope="module")
def ray_session(tiny_dir):
    """A local Ray instance per test module with the custom resources the launcher places workers on
    (``prefill_slot`` / ``decode_slot`` stand in for devices on this GPU-less machine)."""
    import tempfile

    ray = pytest.importorskip("ray")
    import shutil

    tmp = tempfile.mkdtemp(prefix="pdcluster-ray-")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(num_cpus=2, resources={"prefill_slot": 4, "decode_slot": 4}, include_dashboard=False,
             log_to_driver=False, _temp_dir=tmp)
    yield ray
    ray.shutdown()
    if before is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = before
    # Ray's session files (logs, sockets): tens of MB a module, which a long suite must not leave behind.
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _sigint_left_as_found(request):
    """A test that leaves SIGINT ignored (or blocked) in this process makes every later subprocess ignore Ctrl-C (an
    ignored disposition and a signal mask survive exec): later Ctrl-C tests then time out in another file's name.
    Restored after each test, with a warning naming the test that changed it."""
    import signal
    import warnings

    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not before:
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"{request.node.nodeid} changed the SIGINT handler (restored)", stacklevel=1)
    # A blocked SIGINT survives fork and exec too (a server then never sees Ctrl-C): unblocked, and named.
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        warnings.warn(f"{request.node.nodeid} left SIGINT blocked in the main thread (unblocked)", stacklevel=1)
