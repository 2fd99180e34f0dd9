"""A fresh ``pip install .`` runs: every third-party module pdcluster imports is declared.

Two checks, both read pyproject.toml:
- the source: each import of a third-party module at module level is a declared ``dependencies`` entry
  (not merely something another dependency happens to pull in); an import inside a function (loaded
  when a feature is used) is a dependency or names an optional extra;
- the install: every module of the package imports, and the ``pdcluster`` command builds its parser and
  answers ``--help`` for each subcommand, in a process where only the runtime closure (the declared
  dependencies and what they require, as pip would install them) can be imported. Modules of an extra
  import with that extra's closure added.
Today's failure it guards against: the load-test chaos module imported psutil (a test extra) at module
level, and the CLI builds the load-test parser at start-up, so a fresh venv's first `pdcluster serve`
died with ModuleNotFoundError.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Modules that belong to an extra (imported only where that feature is used).
EXTRA_MODULES = {
    "pdcluster.tools.loadtest.plot": "loadtest",
    "pdcluster.tools.loadtest.chaos_plot": "loadtest",
}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(extra: str | None = None) -> set[str]:
    reqs = PYPROJECT["project"]["optional-dependencies"][extra] if extra else PYPROJECT["project"]["dependencies"]
    return {_canon(Requirement(r).name) for r in reqs}


def _closure(extras: tuple[str, ...] = ()) -> set[str]:
    """Distributions pip installs for the package (with ``extras``): the requirements' transitive
    closure, markers evaluated for this machine, over what is installed here."""
    reqs = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        reqs += PYPROJECT["project"]["optional-dependencies"][extra]
    seen: set[tuple[str, frozenset]] = set()
    names: set[str] = set()
    stack = [(Requirement(r), frozenset({""})) for r in reqs]
    while stack:
        req, parent_extras = stack.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in parent_extras):
            continue
        key = (_canon(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue  # not for this platform (or not installed here): nothing of it can be imported
        for r in dist.requires or []:
            stack.append((Requirement(r), frozenset({""} | set(req.extras))))
    return names


def _top_level_names(dists: set[str]) -> list[str]:
    return sorted(top for top, owners in md.packages_distributions().items()
                  if any(_canon(d) in dists for d in owners))


def _source_files() -> dict[str, Path]:
    """Module name -> file, from pyproject's package-dir (what a wheel installs)."""
    files = {}
    for pkg, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).glob("*.py")):
            files[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return files


def _imports(tree: ast.Module) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(module-level, function-level) absolute imports as (top-level name, line). ``if TYPE_CHECKING``
    blocks run at no time and are skipped; class bodies run at import."""
    module_level, in_function = [], []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    (in_function if nested else module_level).append((alias.name.split(".")[0], child.lineno))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                (in_function if nested else module_level).append((child.module.split(".")[0], child.lineno))
            visit(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return module_level, in_function


def test_every_imported_third_party_module_is_declared():
    owners = md.packages_distributions()
    runtime = _declared()
    extras = {name: _declared(name) for name in PYPROJECT["project"]["optional-dependencies"] if name != "test"}
    files = _source_files()
    assert len(files) > 150, f"the package walk found only {len(files)} modules: pyproject's layout changed?"
    problems = []
    for module, path in files.items():
        module_level, in_function = _imports(ast.parse(path.read_text(), str(path)))
        allowed_here = runtime | (extras[EXTRA_MODULES[module]] if module in EXTRA_MODULES else set())
        for top, line, allowed in ([(t, n, allowed_here) for t, n in module_level]
                                   + [(t, n, runtime.union(*extras.values())) for t, n in in_function]):
            if top in sys.stdlib_module_names or top in ("pdcluster", "__future__"):
                continue
            dists = {_canon(d) for d in owners.get(top, [])}
            if not dists:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {top!r}, which no installed package provides")
            elif not dists & allowed:
                where = "at module level" if allowed is allowed_here else "in a function"
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {top!r} ({', '.join(sorted(dists))}) "
                                f"{where}, but pyproject.toml does not declare it there")
    assert not problems, "\n".join(problems)


_ISOLATED = textwrap.dedent("""
    import importlib, json, sys
    allowed = set(json.loads(sys.argv[1])) | set(sys.stdlib_module_names) | {"pdcluster"}

    class OnlyDeclared:
        # Top-level modules outside the runtime closure behave as if not installed.
        def find_spec(self, name, path=None, target=None):
            if "." not in name and name not in allowed and not name.startswith("_"):
                raise ModuleNotFoundError(f"No module named {name!r} (not a declared dependency)", name=name)
            return None

    sys.meta_path.insert(0, OnlyDeclared())
    for name in json.loads(sys.argv[2]):
        importlib.import_module(name)
    if sys.argv[3] == "cli":
        from pdcluster.cli.main import build_parser
        parser = build_parser()
        for argv in (["--help"], *([c, "--help"] for c in ("serve", "generate", "loadtest", "drain", "profile", "plan"))):
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
        args = parser.parse_args(["loadtest", "--model", "m", "--plot", "x.png"])
        from pdcluster.tools.loadtest import cli as loadtest_cli
        try:
            loadtest_cli._plan(args)
        except loadtest_cli.LoadtestError as e:
            print("PLOT-REFUSED:", e)
    print("IMPORTED", len(json.loads(sys.argv[2])))
""")


def _run_isolated(allowed: list[str], modules: list[str], cli: bool) -> str:
    proc = subprocess.run([sys.executable, "-c", _ISOLATED, json.dumps(allowed), json.dumps(modules),
                           "cli" if cli else "-"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"importing with only the declared dependencies failed:\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.timeout(600)
def test_every_module_imports_with_only_the_runtime_dependencies():
    runtime = _top_level_names(_closure())
    assert "torch" in runtime and "ray" in runtime and "psutil" not in runtime and "matplotlib" not in runtime
    modules = sorted(m for m in _source_files() if m not in EXTRA_MODULES)
    out = _run_isolated(runtime, modules, cli=True)
    assert f"IMPORTED {len(modules)}" in out
    # The plot flag says what to install before any work, instead of failing after the run.
    assert "PLOT-REFUSED: --plot: needs matplotlib" in out and "pdcluster[loadtest]" in out
    for extra in sorted(set(EXTRA_MODULES.values())):
        with_extra = _top_level_names(_closure((extra,)))
        names = sorted(m for m, e in EXTRA_MODULES.items() if e == extra)
        assert f"IMPORTED {len(names)}" in _run_isolated(with_extra, names, cli=False)


def test_the_isolation_refuses_what_is_not_declared():
    """The check above can fail: psutil, installed here but not a runtime dependency, is refused."""
    proc = subprocess.run([sys.executable, "-c", _ISOLATED, json.dumps(_top_level_names(_closure())),
                           json.dumps(["psutil"]), "-"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "No module named 'psutil' (not a declared dependency)" in proc.stderr


def test_every_package_folder_is_in_the_wheel():
    """A folder with an __init__.py under a packaged folder is a package the wheel must list (the Docker image and
    `ray up` install the wheel: engine/lora, engine/multimodal, engine/kv_offload, engine/tensor_parallel and
    cluster/frontend were left out once, and an installed pdcluster failed to import its engine)."""
    packaged = PYPROJECT["tool"]["setuptools"]["packages"]
    folders = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert sorted(packaged) == sorted(folders), "packages and package-dir must name the same packages"
    listed = {(ROOT / folder).resolve() for folder in folders.values()}
    missing = sorted(str(init.parent.relative_to(ROOT)) for folder in folders.values()
                     for init in (ROOT / folder).glob("*/__init__.py") if init.parent.resolve() not in listed)
    assert not missing, f"package folders the wheel would leave out (add them to pyproject.toml): {missing}"
