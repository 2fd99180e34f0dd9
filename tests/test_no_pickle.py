"""No pickle on any network path: everything our own planes decode (control plane, data-plane headers,
worker events, HTTP bodies) is msgpack or JSON. This scans the shipped source for every way Python code
can unpickle bytes, so a later change cannot slip one in unnoticed. (Ray's own actor calls pickle inside
Ray's RPC, which Ray protects with its cluster token; that is outside our planes.)"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["cluster", "prefill_node", "decode_node", "kv_transfer", "engine", "kernels"]
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
# Calls that unpickle under the hood.
BANNED_ATTRS = {"recv_pyobj", "send_pyobj", "recv_serialized", "loads_pickle"}


def _violations(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(f"{name}:{node.lineno} imports from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS:
            found.append(f"{name}:{node.lineno} calls {node.attr}")
        elif isinstance(node, ast.Call):
            fn = ast.unparse(node.func)
            if fn in ("torch.load", "np.load", "numpy.load"):
                unsafe = fn != "torch.load" and any(k.arg == "allow_pickle" for k in node.keywords)
                weights_only = any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords)
                if unsafe or (fn == "torch.load" and not weights_only):
                    found.append(f"{name}:{node.lineno} calls {fn} in a way that unpickles")
    return found


def test_shipped_source_never_unpickles():
    files = [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50, "the scan must see the source tree"
    bad = [v for f in files for v in _violations(f.read_text(), str(f.relative_to(ROOT)))]
    assert not bad, "pickle on a possible network path:\n" + "\n".join(bad)


@pytest.mark.parametrize("snippet", [
    "import pickle", "from pickle import loads", "import cloudpickle as cp", "sock.recv_pyobj()",
    "torch.load(path)", "np.load(f, allow_pickle=True)",
])
def test_the_scan_catches_each_way_in(snippet):
    assert _violations(snippet, "x.py"), snippet


def test_the_scan_accepts_safe_loading():
    assert not _violations("torch.load(path, weights_only=True)\nimport msgpack\nnp.load(f)", "x.py")
