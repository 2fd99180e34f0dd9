"""Imports flow downward only: cli -> cluster -> prefill_node / decode_node -> node -> engine / kv_transfer
-> kernels. A module that imports from a layer above its own fails here, naming the import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Higher number = higher layer. engine and kv_transfer share a layer (the connector hooks live in
# engine, the transports in kv_transfer); prefill_node and decode_node share one but must not import
# each other.
LAYERS = {"cli": 7, "cluster": 5, "prefill_node": 4, "decode_node": 4, "node": 3, "engine": 2, "kv_transfer": 2, "kernels": 1}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return out


def test_imports_flow_downward():
    problems = []
    for package, layer in LAYERS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for lineno, module in _imports(path):
                parts = module.split(".")
                if parts[0] != "pdcluster" or len(parts) < 2 or parts[1] not in LAYERS:
                    continue
                target = parts[1]
                if target == package:
                    continue
                if LAYERS[target] > layer or (LAYERS[target] == layer and {package, target} == {"prefill_node", "decode_node"}):
                    problems.append(f"{path.relative_to(ROOT)}:{lineno} imports {module} ({package} may not import {target})")
    assert not problems, "\n".join(problems)
