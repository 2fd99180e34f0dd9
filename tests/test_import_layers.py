"""Imports flow downward only: cli -> tools -> cluster -> prefill_node / decode_node -> node -> engine /
kv_transfer -> wire -> kernels. A module that imports from a layer above its own, or from the other
package of its layer, fails here, naming the import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Higher number = higher layer. engine and kv_transfer share a layer and must not import each other:
# what both need (records, the token-logprobs record, the connector contract) is in wire, below them.
# prefill_node and decode_node share one too and must not import each other either.
LAYERS = {"cli": 8, "tools": 7, "cluster": 6, "prefill_node": 5, "decode_node": 5, "node": 4, "engine": 3,
          "kv_transfer": 3, "wire": 2, "kernels": 1}
SEPARATE = ({"prefill_node", "decode_node"}, {"engine", "kv_transfer"})  # same layer, no imports between them


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
                if LAYERS[target] > layer or (LAYERS[target] == layer and {package, target} in SEPARATE):
                    problems.append(f"{path.relative_to(ROOT)}:{lineno} imports {module} ({package} may not import {target})")
    assert not problems, "\n".join(problems)
