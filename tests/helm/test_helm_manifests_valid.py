"""Rendered manifests against real schemas, strictly (unknown fields are errors).

Core Kubernetes objects go through kubernetes-validate's strict schemas; the RayCluster and
RayService go through the openAPIV3Schema of the KubeRay CRDs (tightened by strict_schema), and
each Ray pod template also through Kubernetes' own PodTemplate schema.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_chart_support import KUBE_VERSION, RELEASE, ray_cluster_spec

RENDERS = {
    "default": ((), ()),
    "gpu": (("values-gpu.yaml",), ()),
    "cpu-example": (("values-cpu-example.yaml",), ()),
    "rayservice": ((), ("mode=rayservice",)),
    "rayservice-gpu": (("values-gpu.yaml",), ("mode=rayservice",)),
    "api-key-created": ((), ("gateway.apiKey.enabled=true", "gateway.apiKey.create=true", "gateway.apiKey.value=k3y")),
    "rayservice-api-key-created": ((), ("mode=rayservice", "gateway.apiKey.enabled=true", "gateway.apiKey.create=true",
                                        "gateway.apiKey.value=k3y", "env[0].name=RAY_BACKEND_LOG_LEVEL", "env[0].value=debug")),
    "everything-on": ((), (
        "gateway.apiKey.enabled=true", "gateway.apiKey.existingSecret=llm-key", "gateway.apiWorkers=2",
        "ingress.enabled=true", "ingress.tls[0].secretName=tls", "ingress.tls[0].hosts[0]=hisparse.example.com",
        "metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true", "autoscaling.enabled=true",
        "model.pvc.claimName=models", "model.path=/models/m", "head.nodeSelector.pool=cpu", "rayClusterUpgradeStrategy=Recreate",
        "decode.podLabels.team=llm", "env[0].name=RAY_BACKEND_LOG_LEVEL", "env[0].value=debug",
    )),
}
CUSTOM_KINDS = {"RayCluster", "RayService", "ServiceMonitor", "PodMonitor"}


def _docs(helm, name):
    values, sets = RENDERS[name]
    return helm.render(values, sets)


@pytest.mark.parametrize("name", list(RENDERS))
def test_core_objects_pass_kubernetes_validate_strict(helm, name):
    core = [d for d in _docs(helm, name) if d["kind"] not in CUSTOM_KINDS]
    assert core or name.startswith("rayservice"), "nothing to validate"
    for doc in core:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")


def test_kubernetes_validate_cli_accepts_the_rendered_files(helm, tmp_path):
    # The same check through the command line, over every core object of every render at once.
    files = []
    for name in RENDERS:
        core = [d for d in _docs(helm, name) if d["kind"] not in CUSTOM_KINDS]
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(core))
        files.append(str(path))
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", KUBE_VERSION, *files],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", list(RENDERS))
def test_ray_pod_templates_pass_the_kubernetes_podtemplate_schema(helm, name):
    spec = ray_cluster_spec(_docs(helm, name))
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    for group, template in templates.items():
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{RELEASE}-{group}"}, "template": template}
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{group} pod template: {'.'.join(map(str, e.path))}: {e.message}")


def _validate_custom(crd_schemas, doc):
    key = (doc["apiVersion"], doc["kind"])
    assert key in crd_schemas, f"no CRD for {key}; have {sorted(crd_schemas)}"
    validator = jsonschema.Draft7Validator(crd_schemas[key])
    return sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))


@pytest.mark.parametrize("name", list(RENDERS))
def test_ray_custom_resources_pass_the_kuberay_crd_schema_strictly(helm, crd_schemas, name):
    ray = [d for d in _docs(helm, name) if d["kind"] in {"RayCluster", "RayService"}]
    assert len(ray) == 1
    errors = _validate_custom(crd_schemas, ray[0])
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_strict_crd_check_catches_unknown_and_mistyped_fields(helm, crd_schemas):
    cluster = next(d for d in _docs(helm, "default") if d["kind"] == "RayCluster")
    assert not _validate_custom(crd_schemas, cluster)

    typo = copy.deepcopy(cluster)
    typo["spec"]["workerGroupSpecs"][1]["replica"] = 2
    assert any("replica" in e.message for e in _validate_custom(crd_schemas, typo))

    deep = copy.deepcopy(cluster)
    deep["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    assert any("imagePullPolcy" in e.message for e in _validate_custom(crd_schemas, deep))

    not_a_string = copy.deepcopy(cluster)
    not_a_string["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 1
    assert _validate_custom(crd_schemas, not_a_string), "rayStartParams values must be strings"

    # int-or-string fields take both forms (here a probe port, by name and by number).
    for port in ("metrics", 8080):
        probed = copy.deepcopy(cluster)
        container = probed["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": port}}
        assert not _validate_custom(crd_schemas, probed), port
    probed["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = 1.5
    assert _validate_custom(crd_schemas, probed)


def test_prometheus_operator_objects_have_the_expected_shape(helm):
    # No prometheus-operator CRDs here: check the few fields that matter by hand.
    docs = _docs(helm, "everything-on")
    monitors = {d["kind"]: d for d in docs if d["kind"] in {"ServiceMonitor", "PodMonitor"}}
    assert set(monitors) == {"ServiceMonitor", "PodMonitor"}
    for doc in monitors.values():
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(doc["spec"]) <= {"selector", "namespaceSelector", "endpoints", "podMetricsEndpoints"}
    assert set(monitors["ServiceMonitor"]["spec"]["endpoints"][0]) == {"port", "path", "interval"}
    assert set(monitors["PodMonitor"]["spec"]["podMetricsEndpoints"][0]) == {"port", "path", "interval"}
