#!/usr/bin/env python3
"""Offline checks of deploy/: the Ray cluster YAMLs and the Helm chart, with no cloud and no API server.

    python deploy/tools/validate_deploy.py        # every check on every shipped file; exit 1 on a failure

- schema_checks.py: Ray's own prepare_config + validate_config (what `ray up` runs before it connects);
  `helm lint --strict` and `helm template` (helm from fetch_helm.py); every rendered built-in kind with
  kubernetes-validate (strict), KubeRay kinds with the CRDs' openAPIV3Schema made strict, and the
  ServiceMonitor with a small strict schema. Any other kind fails.
- behaviour_checks.py: node types and worker groups, replicas, slots and GPUs, the
  `pdcluster serve` flags and the worker pods' preStop `pdcluster drain` (with its grace period),
  parsed with pdcluster's own argparse parser.

tests/test_deploy.py runs the same checks, and feeds each one a broken fixture to show it can fail.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

# The sibling modules import each other by name, as they do when tests/test_deploy.py loads them.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from behaviour_checks import check_chart, check_ray_cluster
from fetch_helm import fetch_helm
from schema_checks import (
    CRD_DIR,
    RAY_YAMLS,
    VALUES_FILES,
    CheckFailed,
    helm_lint,
    load_crd_validators,
    load_ray_yaml,
    merged_values,
    render,
    validate_manifest,
    validate_ray_config,
)


def main() -> int:
    failures = 0

    def run(label, fn, *args):
        nonlocal failures
        try:
            result = fn(*args)
            print(f"ok    {label}")
            return result
        except CheckFailed as e:
            failures += 1
            print(f"FAIL  {label}: {e}")
            return None

    for path in RAY_YAMLS:
        config = load_ray_yaml(path)
        run(f"{path.name}: ray validate_config", validate_ray_config, config)
        run(f"{path.name}: behaviour", check_ray_cluster, config, path.name)
    helm = fetch_helm()
    crds = load_crd_validators() if CRD_DIR.is_dir() else None
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        for f in VALUES_FILES:
            files = () if f == "values.yaml" else (f,)
            run(f"helm lint --strict -f {f}", helm_lint, helm, home, files)
            docs = run(f"helm template -f {f}", render, helm, home, files) or []
            for d in docs:
                if d["apiVersion"].startswith("ray.io/") and crds is None:
                    print(f"skip  {f}: {d['kind']} (no KubeRay CRDs at {CRD_DIR})")
                    continue
                run(f"{f}: {d['kind']}/{d['metadata']['name']} schema", validate_manifest, d, crds)
            if docs:
                run(f"{f}: behaviour", check_chart, docs, merged_values(files))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
