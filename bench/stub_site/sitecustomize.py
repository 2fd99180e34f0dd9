"""Every Python process that starts with this folder on PYTHONPATH and PDCLUSTER_BENCH_STUB_MODEL=1 in its
environment stubs its engines' model as bench/serve_stubbed.py does: Ray's worker processes (the decode and prefill
actors of `serve --mode colocated|disagg`) do not inherit the serve process's patch, but they inherit its
environment. The patch waits for pdcluster.engine.llm_engine to be imported. A bench tool only: nothing in the
package reads that variable."""

import os
import sys

if os.environ.get("PDCLUSTER_BENCH_STUB_MODEL") == "1":
    import importlib.abc
    import importlib.util

    TARGET = "pdcluster.engine.llm_engine"

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)  # the real finders find it; this one only wraps its loader
            spec = importlib.util.find_spec(name)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                from serve_stubbed import stub_engines  # bench/ is on PYTHONPATH beside this folder

                stub_engines(module.LLMEngine)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
