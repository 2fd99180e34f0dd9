"""Schema checks of deploy/, offline: paths and pins, helm lint/template, Kubernetes objects against
their schemas (kubernetes-validate strict; KubeRay CRDs made strict; ServiceMonitor by a small strict
schema; any other kind fails) and the Ray YAMLs through Ray's own validate_config. Each check raises
CheckFailed naming the object and what is wrong. Used by validate_deploy.py and tests/test_deploy.py.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pdcluster"
RAY_YAMLS = (REPO / "deploy" / "ray" / "cluster.yaml", REPO / "deploy" / "ray" / "cluster-gpu.yaml")
VALUES_FILES = ("values.yaml", "values-cpu.yaml", "values-gpu.yaml")
# The KubeRay CRDs sit in shared/, beside the repository (../shared/k8s/crds in CI).
CRD_DIR = REPO.parent / "shared" / "k8s" / "crds"
KUBE_VERSION = "1.30.0"
# validate_config is a private Ray API and the YAMLs pin this Ray (docker image tags): one version.
RAY_VERSION = "2.60.0"
SERVE_SCRIPT = "serve_when_ready.py"


class CheckFailed(AssertionError):
    pass


def fail(where: str, what: str) -> None:
    raise CheckFailed(f"{where}: {what}")


# --- helm ----------------------------------------------------------------------------------------------

def helm_env(home: Path) -> dict[str, str]:
    """Helm's cache, config and data under `home`: nothing read from or written to the user's ~."""
    env = dict(os.environ)
    for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"), ("HELM_DATA_HOME", "data")):
        env[var] = str(home / sub)
    return env


def _set_args(values_files=(), set_values=()) -> list[str]:
    args = []
    for f in values_files:
        args += ["-f", str(CHART / f)]
    for s in set_values:
        args += ["--set", s]
    return args


def run_helm_lint(helm: Path, home: Path, values_files=(), set_values=()) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), "lint", "--strict", str(CHART), *_set_args(values_files, set_values)],
                          capture_output=True, text=True, env=helm_env(home), timeout=120, check=False)


def helm_lint(helm: Path, home: Path, values_files=(), set_values=()) -> None:
    r = run_helm_lint(helm, home, values_files, set_values)
    if r.returncode != 0:
        fail(f"helm lint --strict {values_files} {set_values}", (r.stdout + r.stderr).strip())


def helm_template(helm: Path, home: Path, values_files=(), set_values=()) -> subprocess.CompletedProcess:
    # No --validate: it needs a live API server; the kinds are validated offline below instead.
    return subprocess.run([str(helm), "template", "pd", str(CHART), "--namespace", "serving",
                           "--kube-version", KUBE_VERSION, "--api-versions", "ray.io/v1",
                           *_set_args(values_files, set_values)],
                          capture_output=True, text=True, env=helm_env(home), timeout=120, check=False)


def render(helm: Path, home: Path, values_files=(), set_values=()) -> list[dict]:
    r = helm_template(helm, home, values_files, set_values)
    if r.returncode != 0:
        fail(f"helm template {values_files} {set_values}", r.stderr.strip())
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def merged_values(values_files=(), overrides: dict | None = None) -> dict:
    """The values Helm renders with: maps merge, everything else (lists too) replaces."""
    def merge(base, top):
        for k, v in top.items():
            base[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return base

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in values_files:
        merge(values, yaml.safe_load((CHART / f).read_text()) or {})
    return merge(values, copy.deepcopy(overrides or {}))


# --- Kubernetes schemas --------------------------------------------------------------------------------

def strict_schema(schema: dict) -> dict:
    """A copy of an openAPIV3Schema that rejects unknown fields: `additionalProperties: false` wherever
    there are `properties` and no `x-kubernetes-preserve-unknown-fields` (what the API server prunes or,
    with strict field validation, refuses)."""
    schema = copy.deepcopy(schema)

    def walk(s):
        if not isinstance(s, dict):
            return
        if "properties" in s and not s.get("x-kubernetes-preserve-unknown-fields") \
                and "additionalProperties" not in s:
            s["additionalProperties"] = False
        for sub in s.get("properties", {}).values():
            walk(sub)
        for key in ("items", "additionalProperties", "not"):
            walk(s.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in s.get(key, []):
                walk(sub)

    walk(schema)
    return schema


def load_crd_validators(crd_dir: Path = CRD_DIR) -> dict:
    """{(apiVersion, kind): jsonschema validator} for every served version of every CRD in crd_dir."""
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB each
    validators = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served", True):
                schema = strict_schema(version["schema"]["openAPIV3Schema"])
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return validators


# prometheus-operator's CRDs are not available offline: the fields this chart writes, strictly.
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"], "properties": {
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["port"], "properties": {
                    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}}}}},
}


def validate_manifest(doc: dict, crd_validators: dict | None, kube_version: str = KUBE_VERSION) -> None:
    """One rendered object against its schema; a kind with no schema here is a failure, not a warning."""
    import jsonschema
    import kubernetes_validate

    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    api_version = doc.get("apiVersion", "")
    if api_version.split("/")[0] == "ray.io":
        if crd_validators is None:
            fail(name, "no KubeRay CRD schemas loaded")
        validator = crd_validators.get((api_version, doc.get("kind")))
        if validator is None:
            fail(name, f"no CRD schema for {api_version} {doc.get('kind')}")
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            fail(name, "; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]))
        return
    if api_version.startswith("monitoring.coreos.com/"):
        errors = list(jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).iter_errors(doc))
        if errors:
            fail(name, "; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]))
        return
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        fail(name, f"{'.'.join(map(str, e.path))}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        fail(name, e.message)


# --- Ray cluster launcher ------------------------------------------------------------------------------

def load_ray_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def validate_ray_config(config: dict) -> dict:
    """Ray's own checks, as `ray up` runs them; returns the prepared (defaults-filled) config."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        prepared = prepare_config(copy.deepcopy(config))
        validate_config(prepared)
    except (jsonschema.ValidationError, ValueError, KeyError, AssertionError, RuntimeError) as e:
        fail(f"ray config {config.get('cluster_name')}", f"{type(e).__name__}: {getattr(e, 'message', e)}")
    return prepared
