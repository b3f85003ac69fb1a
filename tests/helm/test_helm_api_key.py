"""The chart's API key: it travels from a Kubernetes Secret to `hisparse serve` as HISPARSE_API_KEY and
nowhere else.

The key must reach every process that serves /v1 (the gateway container in raycluster mode; in
rayservice mode every Ray container, since Ray Serve may build and run the application in any of
them), through a secretKeyRef only: never in an argument, an annotation, a ConfigMap or the Serve
config. Probes and scrapers only use the routes the API key leaves open.
"""

from __future__ import annotations

import base64
from urllib.parse import urlsplit

import pytest
import yaml
from helm_chart_support import RELEASE, find, gateway_container, ray_cluster_spec, render_notes

KEY = "hs-test-key-7f3a9c1e5b"  # distinctive, so a leak anywhere in the output is found by substring
CREATED = ("gateway.apiKey.enabled=true", "gateway.apiKey.create=true", f"gateway.apiKey.value={KEY}")
EXISTING = ("gateway.apiKey.enabled=true", "gateway.apiKey.existingSecret=team-llm-key", "gateway.apiKey.secretKey=token")
CHART_SECRET = f"{RELEASE}-hisparse-api-key"


def _api_key_env():
    from hisparse.cli import API_KEY_ENV

    return API_KEY_ENV


def _containers(docs):
    """(where, container) for every container the chart renders, the Ray groups and the helm-test pod included."""
    for d in docs:
        if d["kind"] in ("Deployment", "Pod"):
            pod = d["spec"]["template"]["spec"] if d["kind"] == "Deployment" else d["spec"]
            for c in pod["containers"]:
                yield f"{d['kind']}/{d['metadata']['name']}", c
    spec = ray_cluster_spec(docs)
    for c in spec["headGroupSpec"]["template"]["spec"]["containers"]:
        yield "head", c
    for g in spec["workerGroupSpecs"]:
        for c in g["template"]["spec"]["containers"]:
            yield g["groupName"], c


def _key_refs(docs) -> dict[str, dict]:
    """where -> the HISPARSE_API_KEY env entry, for every container that has one."""
    out = {}
    for where, c in _containers(docs):
        entries = [e for e in c.get("env", []) if e["name"] == _api_key_env()]
        assert len(entries) <= 1, (where, entries)
        if entries:
            out[where] = entries[0]
    return out


@pytest.mark.parametrize("mode", ["raycluster", "rayservice"])
@pytest.mark.parametrize("source", ["created", "existing"])
def test_key_reaches_the_serving_processes_from_the_secret(helm, mode, source):
    sets = CREATED if source == "created" else EXISTING
    docs = helm.render(sets=(*sets, f"mode={mode}"))
    refs = _key_refs(docs)
    # raycluster: only the gateway serves /v1. rayservice: the Serve application is built by a task and
    # run by a replica that may land on the head or any worker, so every Ray container needs the key.
    expected = {f"Deployment/{RELEASE}-hisparse-gateway"} if mode == "raycluster" else {"head", "prefill", "decode"}
    assert set(refs) == expected
    name, key = (CHART_SECRET, "api-key") if source == "created" else ("team-llm-key", "token")
    for where, entry in refs.items():
        assert entry == {"name": _api_key_env(), "valueFrom": {"secretKeyRef": {"name": name, "key": key, "optional": False}}}, where
    secrets = [d for d in docs if d["kind"] == "Secret"]
    if source == "created":
        (secret,) = secrets
        assert secret["metadata"]["name"] == CHART_SECRET and secret["type"] == "Opaque"
        assert base64.b64decode(secret["data"]["api-key"]).decode() == KEY
    else:
        assert not secrets  # the chart never touches a Secret it does not own


@pytest.mark.parametrize("mode", ["raycluster", "rayservice"])
def test_without_a_key_no_container_gets_one(helm, mode):
    docs = helm.render(sets=(f"mode={mode}",))
    assert not _key_refs(docs)
    assert not [d for d in docs if d["kind"] == "Secret"]


@pytest.mark.parametrize("mode", ["raycluster", "rayservice"])
def test_key_value_appears_only_in_the_created_secret(helm, mode):
    proc = helm.template_raw(sets=(*CREATED, f"mode={mode}"))
    assert proc.returncode == 0, proc.stderr
    encoded = base64.b64encode(KEY.encode()).decode()
    assert KEY not in proc.stdout  # not in args, env values, annotations, serveConfigV2, labels...
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    holders = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if encoded in yaml.safe_dump(d)]
    assert holders == [f"Secret/{CHART_SECRET}"]
    assert not [d for d in docs if d["kind"] == "ConfigMap"]


@pytest.mark.parametrize("mode", ["raycluster", "rayservice"])
def test_hisparse_serve_reads_the_key_from_the_environment_only(helm, monkeypatch, mode):
    # The rendered flags carry no key; the project's own parser then takes it from HISPARSE_API_KEY,
    # the variable the secretKeyRef fills in (in rayservice mode app_builder parses argv the same way).
    from hisparse.cli import build_parser, serve_config

    docs = helm.render(sets=(*EXISTING, f"mode={mode}"))
    if mode == "raycluster":
        argv = gateway_container(docs)["args"]
    else:
        (app,) = yaml.safe_load(find(docs, "RayService")["spec"]["serveConfigV2"])["applications"]
        argv = app["args"]["argv"]
    assert not [a for a in argv if a.startswith("--api-key")]
    monkeypatch.delenv(_api_key_env(), raising=False)
    assert serve_config(build_parser().parse_args(["serve", *argv])).server.api_key is None
    monkeypatch.setenv(_api_key_env(), KEY)
    assert serve_config(build_parser().parse_args(["serve", *argv])).server.api_key == KEY


def _http_paths(node):
    """Every httpGet path anywhere in a rendered object (probes of every container)."""
    if isinstance(node, dict):
        if isinstance(node.get("httpGet"), dict):
            yield node["httpGet"]["path"]
        for value in node.values():
            yield from _http_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from _http_paths(value)


@pytest.mark.parametrize("mode", ["raycluster", "rayservice"])
def test_probes_and_scrapers_only_use_routes_the_key_leaves_open(helm, mode):
    from api.middleware import OPEN_PATHS

    docs = helm.render(sets=(*EXISTING, f"mode={mode}", "metrics.serviceMonitor.enabled=true"))
    paths = [p for d in docs for p in _http_paths(d)]
    if mode == "raycluster":
        gw = gateway_container(docs)
        assert {gw[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {"/health"}
    else:
        assert not paths  # KubeRay adds its own probes (Ray's and the Serve proxy's health routes, not the app)
    assert all(p in OPEN_PATHS for p in paths), paths
    test_pod = find(docs, "Pod", f"{RELEASE}-hisparse-test-health")
    url = test_pod["spec"]["containers"][0]["command"][-1]  # `helm test` GETs this URL
    assert urlsplit(url).path in OPEN_PATHS, url
    monitor = find(docs, "ServiceMonitor")
    assert all(e["path"] in OPEN_PATHS for e in monitor["spec"]["endpoints"])


def test_notes_show_how_to_call_with_the_key(helm, tmp_path):
    notes = render_notes(helm, tmp_path / "on", CREATED)
    assert f"get secret {CHART_SECRET} -o jsonpath='{{.data.api-key}}'" in notes
    assert 'curl -s $BASE/v1/models -H "Authorization: Bearer $KEY"' in notes
    assert KEY not in notes
    open_notes = render_notes(helm, tmp_path / "off")
    assert "Authorization" not in open_notes and "open to anyone" in open_notes


@pytest.mark.parametrize("mode", ["raycluster", "rayservice"])
@pytest.mark.parametrize("sets", [CREATED, EXISTING], ids=["created", "existing"])
def test_lint_strict_passes_with_a_key(helm, mode, sets):
    proc = helm.lint(sets=(*sets, f"mode={mode}"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ERROR]" not in proc.stdout and "[WARNING]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "sets,message",
    [
        (("gateway.apiKey.enabled=true",),
         "gateway.apiKey: existingSecret (the name of a Secret holding the key) or create=true with value is required"),
        (("gateway.apiKey.enabled=true", "gateway.apiKey.create=true"),
         "gateway.apiKey: value (the API key, with create=true) is required"),
        ((*EXISTING, "gateway.apiKey.create=true", f"gateway.apiKey.value={KEY}"), "either existingSecret or create=true (not both)"),
        (("gateway.apiKey.existingSecret=team-llm-key",),
         "enabled=true (existingSecret, create or value is set, but without enabled the API stays open)"),
        (("gateway.apiKey.create=true", f"gateway.apiKey.value={KEY}"), "but without enabled the API stays open"),
        ((*EXISTING, f"gateway.apiKey.value={KEY}"), "create=true (value is only used to create the Secret"),
    ],
)
@pytest.mark.parametrize("command", ["template", "lint"])
def test_schema_refuses_a_key_configuration_that_would_not_hold(helm, sets, message, command):
    # In the schema, not in a template `fail`: `helm lint` only logs a fail, but it fails on the schema.
    proc = helm.template_raw(sets=sets) if command == "template" else helm.lint(sets=sets)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{sets} was accepted"
    assert message in out, out
    assert KEY not in out  # error messages never echo the key


@pytest.mark.parametrize(
    "sets,message",
    [
        (("decode.env[0].name=HISPARSE_API_KEY", "decode.env[0].value=x"), "decode.env sets HISPARSE_API_KEY"),
        (("env[0].name=HISPARSE_API_KEY", "env[0].value=x"), "env sets HISPARSE_API_KEY"),
        ((f"serve.extraArgs={{--api-key={KEY}}}",), "serve.extraArgs has --api-key"),
        (("serve.extraArgs={--api-key,abc}",), "serve.extraArgs has --api-key"),
        (("serve.extraArgs={--api-ke=abc}",), "serve.extraArgs has --api-key"),  # argparse takes abbreviations
    ],
)
def test_chart_refuses_a_key_outside_the_secret(helm, sets, message):
    proc = helm.template_raw(sets=sets)
    assert proc.returncode != 0, f"{sets} was accepted"
    assert message in proc.stderr, proc.stderr
    assert KEY not in proc.stderr
