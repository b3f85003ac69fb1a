"""The Helm chart: lint, render, and what the rendered manifests promise.

Each test names the behaviour it pins: worker groups that advertise their role resource in a form
every KubeRay parser reads, GPU limits, probes on /health, the serve flags reaching `hisparse serve`
(checked with the project's own argument parser), memory requests that hold the host pool and
/dev/shm, and values the schema or the chart refuse.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
import yaml
from helm_chart_support import (
    CHART_DIR,
    NAMESPACE,
    RELEASE,
    chart_schema,
    find,
    gateway_container,
    parse_serve,
    ray_cluster_spec,
    render_notes,
    serve_args,
    worker_group,
)

GiB, MiB = 2**30, 2**20
SHM_HEADROOM = 256 * MiB
VALUE_SETS = {
    "default": (),
    "gpu": ("values-gpu.yaml",),
    "cpu-example": ("values-cpu-example.yaml",),
}
GATEWAY = f"{RELEASE}-hisparse-gateway"


_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12,
          "Ki": 2**10, "KiB": 2**10, "Mi": 2**20, "MiB": 2**20, "Gi": 2**30, "GiB": 2**30, "Ti": 2**40, "TiB": 2**40}


def _bytes(value) -> int:
    """The chart's byte-size spellings, read independently of the chart's own helper."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)", str(value))
    assert m and m.group(2) in _UNITS, value
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _mebibytes(quantity: str) -> int:
    assert quantity.endswith("Mi"), f"memory rendered as {quantity!r}, expected a Mi quantity"
    return int(quantity[:-2]) * MiB


def _containers(docs):
    """(role, container, pod spec) for every Ray group and the gateway."""
    spec = ray_cluster_spec(docs)
    yield "head", spec["headGroupSpec"]["template"]["spec"]["containers"][0], spec["headGroupSpec"]["template"]["spec"]
    for g in spec["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        yield g["groupName"], pod["containers"][0], pod
    for d in docs:
        if d["kind"] == "Deployment":
            pod = d["spec"]["template"]["spec"]
            yield "gateway", pod["containers"][0], pod


# ---------------------------------------------------------------- values files (no helm needed)

VALUE_FILES = ["values.yaml", "values-gpu.yaml", "values-cpu-example.yaml"]


def _closed(schema: dict, path: list[str]) -> bool:
    """Whether the value at path is one of the chart's own objects (not a free-form Kubernetes one)."""
    node = schema
    for key in path:
        node = node.get("properties", {}).get(key)
        if node is None:
            return False
    return node.get("additionalProperties") is False


def _deep_merge(base: dict, over: dict) -> dict:
    """Helm's rule for -f files: maps merge key by key, everything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _merged_values(files: tuple[str, ...]) -> dict:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    for name in files:
        values = _deep_merge(values, yaml.safe_load((CHART_DIR / name).read_text()) or {})
    return values


@pytest.mark.parametrize("name", VALUE_FILES)
def test_every_value_has_a_comment(name):
    # Each key of the chart's own objects needs a comment line right above it; the insides of free-form
    # values (securityContext, tolerations, ingress hosts...) are covered by the comment on the value.
    schema, stack, previous, missing = chart_schema(), [], "", []
    for line in (CHART_DIR / name).read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z0-9_.-]+):", line)
        if m:
            indent, key = len(m.group(1)), m.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = [k for _, k in stack] + [key]
            stack.append((indent, key))
            if _closed(schema, path[:-1]) and not previous.startswith("#"):
                missing.append(".".join(path))
        if line.strip():
            previous = line.strip()
    assert not missing, f"{name}: values without a comment: {missing}"


@pytest.mark.parametrize("name", VALUE_FILES)
def test_values_files_satisfy_the_schema(name):
    import jsonschema

    values = _merged_values((name,))
    jsonschema.Draft7Validator.check_schema(chart_schema())
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in jsonschema.Draft7Validator(chart_schema()).iter_errors(values)]
    assert not errors, errors


# ---------------------------------------------------------------- lint and render


def test_helm_binary_is_the_pinned_version(helm):
    out = helm.run("version", "--short")
    assert out.returncode == 0 and out.stdout.startswith("v3.17.2"), out.stdout + out.stderr


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
@pytest.mark.parametrize("mode", ["raycluster", "rayservice"])
def test_lint_strict_passes(helm, values, mode):
    proc = helm.lint(VALUE_SETS[values], (f"mode={mode}",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ERROR]" not in proc.stdout and "[WARNING]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_raycluster_mode_renders_cluster_gateway_and_service(helm, values):
    docs = helm.render(VALUE_SETS[values])
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Pod", "RayCluster", "Service"], kinds
    cluster = find(docs, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]] == ["prefill", "decode"]
    assert find(docs, "Service", GATEWAY)["spec"]["selector"] == find(docs, "Deployment", GATEWAY)["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_rayservice_mode_renders_a_rayservice_instead(helm, values):
    docs = helm.render(VALUE_SETS[values], ("mode=rayservice",))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Pod", "RayService"], kinds  # no Deployment, no Service: KubeRay makes the serve Service
    svc = find(docs, "RayService")
    assert svc["apiVersion"] == "ray.io/v1"
    assert [g["groupName"] for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == ["prefill", "decode"]


# ---------------------------------------------------------------- worker groups and role resources


def _role_resources(value: str) -> list[dict]:
    """The role resources as the three readers of this rayStartParam see them."""
    # 1. KubeRay writes `--resources=<value>` into the container's bash command line.
    (arg,) = shlex.split(f"--resources={value}")
    shell = json.loads(arg.removeprefix("--resources="))
    # 2. KubeRay's operator trims surrounding quotes, then parses JSON (to merge accelerator resources).
    operator = json.loads(value.strip("'\"` "))
    # 3. The Ray autoscaler drops the first and last character and the backslashes, then parses JSON.
    autoscaler = json.loads(value[1:-1].replace("\\", ""))
    return [shell, operator, autoscaler]


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_worker_groups_advertise_their_role_resource(helm, values):
    docs = helm.render(VALUE_SETS[values])
    for role in ("prefill", "decode"):
        group = worker_group(docs, role)
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), params
        for seen in _role_resources(params["resources"]):
            assert seen == {f"hisparse_{role}": 1}, (role, params["resources"], seen)
            assert all(isinstance(v, int) for v in seen.values())  # the autoscaler wants integers
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    head = ray_cluster_spec(docs)["headGroupSpec"]["rayStartParams"]
    assert "resources" not in head and head["num-cpus"] == "0"  # no actor may land on the head


def test_extra_resources_and_actors_per_pod_merge_into_the_role_resource(helm):
    docs = helm.render(sets=("decode.actorsPerPod=2", "decode.cpu=4", "decode.extraResources.fast_nic=1",
                             "decode.rayStartParams.resources=ignored", "decode.rayStartParams.num-cpus=4"))
    params = worker_group(docs, "decode")["rayStartParams"]
    for seen in _role_resources(params["resources"]):
        assert seen == {"hisparse_decode": 2, "fast_nic": 1}
    assert params["num-cpus"] == "4"
    assert "--num-decode" in (args := serve_args(docs)) and args[args.index("--num-decode") + 1] == "2"


def test_gpu_values_give_each_worker_group_gpus(helm):
    docs = helm.render(VALUE_SETS["gpu"])
    for role in ("prefill", "decode"):
        group = worker_group(docs, role)
        (container,) = group["template"]["spec"]["containers"]
        for side in ("requests", "limits"):
            assert container["resources"][side]["nvidia.com/gpu"] == 1, (role, side, container["resources"])
        assert group["rayStartParams"]["num-gpus"] == "1"
        assert group["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in group["template"]["spec"]["tolerations"]
    head = ray_cluster_spec(docs)["headGroupSpec"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in gateway_container(docs)["resources"]["limits"]
    cfg = parse_serve(serve_args(docs))
    assert cfg.cluster.prefill_num_gpus == 1.0 and cfg.cluster.decode_num_gpus == 1.0


def test_default_values_use_no_gpus(helm):
    docs = helm.render()
    for role, container, _ in _containers(docs):
        assert "nvidia.com/gpu" not in container["resources"]["limits"], role
    for role in ("prefill", "decode"):
        assert worker_group(docs, role)["rayStartParams"]["num-gpus"] == "0"


# ---------------------------------------------------------------- gateway


def test_gateway_probes_hit_health_on_the_serving_port(helm):
    docs = helm.render()
    container = gateway_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8000
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    svc = find(docs, "Service", GATEWAY)
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    dep = find(docs, "Deployment", GATEWAY)
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}


def test_gateway_joins_the_head_as_a_zero_cpu_ray_node(helm):
    docs = helm.render()
    container = gateway_container(docs)
    script = container["command"][2]
    assert "--num-cpus=0" in script and "--block" in script and "wait -n" in script
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HISPARSE_RAY_ADDRESS"] == f"{RELEASE}-hisparse-head-svc.{NAMESPACE}.svc:6379"
    assert find(docs, "RayCluster")["metadata"]["name"] == f"{RELEASE}-hisparse"  # KubeRay names the head Service after it


def _gateway_sandbox(helm, tmp_path, serve_body: str):
    """The gateway script with stub `ray` and `hisparse` commands, its /tmp/ray moved under tmp_path."""
    import os
    import socket

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash not installed")
    raydir, stubs = tmp_path / "ray", tmp_path / "bin"
    stubs.mkdir()
    (stubs / "ray").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/ray.args\nmkdir -p {raydir}\n"
                               f"echo addr > {raydir}/ray_current_cluster\nexec sleep 300\n")
    (stubs / "hisparse").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/serve.args\n{serve_body}\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    container = gateway_container(helm.render())
    script = container["command"][2].replace("/tmp/ray/", f"{raydir}/")
    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    head.listen()
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "HISPARSE_OBJECT_STORE_BYTES": "123",
           "HISPARSE_RAY_ADDRESS": f"127.0.0.1:{head.getsockname()[1]}"}
    return [bash, "-c", script, "hisparse-gateway", *container["args"]], env, head


def test_gateway_script_exits_when_hisparse_serve_exits(helm, tmp_path):
    import subprocess

    cmd, env, head = _gateway_sandbox(helm, tmp_path, "exit 3")
    with head:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr  # non-zero: the kubelet restarts the container
    ray_args = (tmp_path / "ray.args").read_text().split()
    assert ray_args[0] == "start" and "--num-cpus=0" in ray_args and "--object-store-memory=123" in ray_args
    serve_args = (tmp_path / "serve.args").read_text().split()
    assert serve_args[:1] == ["serve"] and serve_args[1:7] == ["--address", "auto", "--host", "0.0.0.0", "--port", "8000"]


def test_gateway_script_stops_both_processes_on_sigterm(helm, tmp_path):
    import signal
    import subprocess
    import time

    cmd, env, head = _gateway_sandbox(helm, tmp_path, "exec sleep 300")
    with head:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not (tmp_path / "serve.args").exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err  # a clean stop: both children were terminated and reaped


def test_default_serve_flags_parse_with_the_project_cli(helm):
    cfg = parse_serve(serve_args(helm.render()))
    assert cfg.model == "tiny"
    assert (cfg.cluster.address, cfg.cluster.placement) == ("auto", "resources")
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 8000)
    assert (cfg.cluster.num_prefill, cfg.cluster.num_decode) == (1, 1)
    assert cfg.tier.offload is True and cfg.tier.device_budget_bytes == 256 * MiB and cfg.tier.host_pool_bytes is None


def test_explicit_actor_counts_win_over_replicas(helm):
    args = serve_args(helm.render(sets=("serve.numDecode=1", "decode.replicas=2", "decode.maxReplicas=2")))
    assert parse_serve(args).cluster.num_decode == 1


@pytest.mark.parametrize("spelling,expected", [("on", "on"), ("off", "off"), ("true", "on"), ("false", "off")])
def test_offload_accepts_on_off_and_yaml_booleans(helm, tmp_path, spelling, expected):
    # Unquoted on/off are booleans to Helm's YAML 1.1 reader; both forms must reach --offload as on/off.
    values = tmp_path / "offload.yaml"
    values.write_text(f"serve:\n  offload: {spelling}\n")
    args = serve_args(helm.render((str(values),)))
    assert args[args.index("--offload") + 1] == expected


# ---------------------------------------------------------------- memory, /dev/shm, pinned memory


def _shm(pod: dict, container: dict) -> int:
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts, "no /dev/shm mount"
    vol = volumes[mounts["/dev/shm"]]
    assert vol["emptyDir"]["medium"] == "Memory"
    return _mebibytes(vol["emptyDir"]["sizeLimit"])


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_dev_shm_holds_the_object_store_and_counts_in_memory(helm, values):
    docs = helm.render(VALUE_SETS[values])
    merged = _merged_values(VALUE_SETS[values])
    for role, container, pod in _containers(docs):
        shm = _shm(pod, container)
        object_store = _bytes(merged[role]["objectStoreMemory"])
        assert shm == object_store + SHM_HEADROOM, role
        memory = _mebibytes(container["resources"]["requests"]["memory"])
        assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"], role
        assert memory >= _bytes(merged[role]["memory"]) + shm, role
        if role == "gateway":
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert int(env["HISPARSE_OBJECT_STORE_BYTES"]) == object_store
        else:
            params = (ray_cluster_spec(docs)["headGroupSpec"] if role == "head" else worker_group(docs, role))["rayStartParams"]
            assert shm == int(params["object-store-memory"]) + SHM_HEADROOM, role


def test_decode_memory_includes_host_pool_device_budget_and_shm(helm):
    # Defaults: 4Gi base; CPU decode actor: host pool 8 x 256MiB + the 256MiB "device" budget in host memory;
    # /dev/shm 1GiB object store + 256MiB.
    decode = worker_group(helm.render(), "decode")["template"]["spec"]["containers"][0]
    assert _mebibytes(decode["resources"]["requests"]["memory"]) == 4 * GiB + 8 * 256 * MiB + 256 * MiB + GiB + SHM_HEADROOM
    prefill = worker_group(helm.render(), "prefill")["template"]["spec"]["containers"][0]
    assert _mebibytes(prefill["resources"]["requests"]["memory"]) == 4 * GiB + GiB + SHM_HEADROOM


def test_gpu_decode_memory_includes_the_pinned_host_pool(helm):
    decode = worker_group(helm.render(VALUE_SETS["gpu"]), "decode")["template"]["spec"]["containers"][0]
    # 96Gi base + 128GiB host pool + 16GiB object store + 256MiB; the 40GiB device budget lives on the GPU.
    assert _mebibytes(decode["resources"]["requests"]["memory"]) == 96 * GiB + 128 * GiB + 16 * GiB + SHM_HEADROOM
    assert "IPC_LOCK" in decode["securityContext"]["capabilities"]["add"]
    prefill = worker_group(helm.render(VALUE_SETS["gpu"]), "prefill")["template"]["spec"]["containers"][0]
    assert "add" not in prefill["securityContext"]["capabilities"]


def test_host_pool_scales_with_actors_per_pod_and_vanishes_with_offload_off(helm):
    base = ("serve.hostPoolBytes=1GiB", "serve.deviceBudget=128MiB")
    two = worker_group(helm.render(sets=(*base, "decode.actorsPerPod=2")), "decode")["template"]["spec"]["containers"][0]
    assert _mebibytes(two["resources"]["requests"]["memory"]) == 4 * GiB + 2 * (GiB + 128 * MiB) + GiB + SHM_HEADROOM
    off = worker_group(helm.render(sets=(*base, "serve.offload=off")), "decode")["template"]["spec"]["containers"][0]
    assert _mebibytes(off["resources"]["requests"]["memory"]) == 4 * GiB + 128 * MiB + GiB + SHM_HEADROOM
    # A fraction of a GPU per actor still puts the device budget on the GPU (--set hands over "0.5").
    half = worker_group(helm.render(sets=(*base, "decode.gpus=1", "decode.actorGpus=0.5")), "decode")["template"]["spec"]["containers"][0]
    assert _mebibytes(half["resources"]["requests"]["memory"]) == 4 * GiB + GiB + GiB + SHM_HEADROOM


# ---------------------------------------------------------------- model source, RayService, extras


def test_model_pvc_is_mounted_read_only_where_the_model_is_read(helm):
    docs = helm.render(sets=("model.pvc.claimName=models", "model.path=/models/m"))
    for role, container, pod in _containers(docs):
        vols = {v["name"]: v for v in pod["volumes"]}
        if role == "head":  # nothing reads the model on the head in raycluster mode
            assert "model" not in vols
            continue
        assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}, role
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"], role
    assert parse_serve(serve_args(docs)).model == "/models/m"
    rs = helm.render(sets=("mode=rayservice", "model.pvc.claimName=models", "model.pvc.subPath=v4"))
    mounts = {role: c["volumeMounts"] for role, c, _ in _containers(rs)}
    assert set(mounts) == {"head", "prefill", "decode"}  # Serve replicas may run anywhere, the head included
    for role, m in mounts.items():
        assert {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "v4"} in m, role
    for _, _, pod in _containers(helm.render()):
        assert "model" not in {v["name"] for v in pod["volumes"]}


def test_rayservice_runs_the_builder_with_the_serve_flags(helm):
    docs = helm.render(sets=("mode=rayservice", "serve.offload=off", "serve.deviceBudget=1GiB"))
    spec = find(docs, "RayService")["spec"]
    # Ray reads serveConfigV2 with a YAML 1.1 reader, like PyYAML: on/off must stay strings.
    config = yaml.safe_load(spec["serveConfigV2"])
    (app,) = config["applications"]
    assert app["import_path"] == "hisparse.rayserve:app_builder" and app["route_prefix"] == "/"
    argv = app["args"]["argv"]
    assert all(isinstance(a, str) for a in argv), argv
    assert not {"--address", "--host", "--port"} & set(argv)
    cfg = parse_serve(argv)
    assert cfg.tier.offload is False and cfg.tier.device_budget_bytes == GiB and cfg.cluster.placement == "resources"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert spec["serveService"]["metadata"]["name"] == GATEWAY
    assert spec["serveService"]["spec"]["ports"][0]["name"] == "serve"
    head = spec["rayClusterConfig"]["headGroupSpec"]
    assert {"name": "serve", "containerPort": 8000} in head["template"]["spec"]["containers"][0]["ports"]
    assert "num-cpus" not in head["rayStartParams"]  # Serve replicas may use the head's CPUs


def test_ray_cluster_upgrade_strategy_only_in_raycluster_mode(helm):
    assert "upgradeStrategy" not in ray_cluster_spec(helm.render())
    assert ray_cluster_spec(helm.render(sets=("rayClusterUpgradeStrategy=Recreate",)))["upgradeStrategy"] == {"type": "Recreate"}
    rs = helm.render(sets=("mode=rayservice", "rayClusterUpgradeStrategy=Recreate"))
    assert "upgradeStrategy" not in ray_cluster_spec(rs)  # RayService replaces clusters its own way


def test_ingress_and_monitors(helm):
    docs = helm.render(sets=("ingress.enabled=true", "ingress.className=nginx", "metrics.serviceMonitor.enabled=true",
                             "metrics.podMonitor.enabled=true"))
    ingress = find(docs, "Ingress", GATEWAY)
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": GATEWAY, "port": {"number": 8000}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    monitor = find(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "http" and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    svc_labels = find(docs, "Service", GATEWAY)["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc_labels.items()
    pod_monitor = find(docs, "PodMonitor")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    rs = helm.render(sets=("mode=rayservice", "metrics.serviceMonitor.enabled=true"))
    assert find(rs, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "serve"


def test_prometheus_scrape_annotations(helm):
    docs = helm.render()
    gw_pod = find(docs, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["annotations"]
    assert gw_pod == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}
    assert find(docs, "Service", GATEWAY)["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    decode_pod = worker_group(docs, "decode")["template"]["metadata"]["annotations"]
    assert decode_pod["prometheus.io/port"] == "8080"
    quiet = helm.render(sets=("metrics.scrapeAnnotations=false",))
    assert "annotations" not in find(quiet, "Deployment", GATEWAY)["spec"]["template"]["metadata"]


def test_notes_explain_how_to_reach_the_api(helm, tmp_path):
    notes = render_notes(helm, tmp_path)
    assert f"kubectl -n {NAMESPACE} port-forward svc/{GATEWAY} 8000:8000" in notes
    assert "/v1/completions" in notes and "/health" in notes


# ---------------------------------------------------------------- refused values


@pytest.mark.parametrize(
    "bad,field",
    [
        ("serve.offload=maybe", "serve.offload"),
        ("prefill.replicas=-1", "prefill.replicas"),
        ("decode.maxReplicas=-3", "decode.maxReplicas"),
        ("serve.deviceBudget=40gigs", "serve.deviceBudget"),
        ("serve.hostPoolBytes=-1GiB", "serve.hostPoolBytes"),
        ("decode.memory=lots", "decode.memory"),
        ("serve.transport=tcp", "serve.transport"),
        ("serve.maxRunning=0", "serve.maxRunning"),
        ("gateway.port=70000", "gateway.port"),
        ("gateway.port=8080", "gateway.port"),
        ("mode=kubernetes", "mode"),
        ("image.pullPolicy=Sometimes", "image.pullPolicy"),
        ("prefill.cpu=two", "prefill.cpu"),
        ("decode.gpus=1.5", "decode.gpus"),
        ("replicas=2", "Additional property replicas"),
        ("decode.replica=2", "Additional property replica"),
        ("gateway.env[0].name=LEVEL,gateway.env[0].value=1", "gateway.env.0.value"),
        ("serve.layoutLeaseSeconds=30", "Additional property layoutLeaseSeconds"),
        ("serve.queueTimeoutSeconds=0", "serve.queueTimeoutSeconds"),
        ("serve.tokenTimeoutSeconds=-5", "serve.tokenTimeoutSeconds"),
        ("serve.subscriberTimeoutSeconds=2", "serve.subscriberTimeoutSeconds"),
        ("serve.maxQueuedRequests=0", "serve.maxQueuedRequests"),
        ("serve.maxRequestRetries=-1", "serve.maxRequestRetries"),
        ("serve.streamInterval=0", "serve.streamInterval"),
        ("serve.maxSequencesPerRequest=0", "serve.maxSequencesPerRequest"),
        ("serve.maxBodyBytes=lots", "serve.maxBodyBytes"),
        ("gateway.apiWorkers=0", "gateway.apiWorkers"),
        ("gateway.apiKey.enabled=yes", "gateway.apiKey.enabled"),
        ("gateway.apiKey.secretKey=a/b", "gateway.apiKey.secretKey"),
        ("gateway.apiKey.existingSecret=Not_A_Name", "gateway.apiKey.existingSecret"),
        ("gateway.apiKey.apiKey=x", "Additional property apiKey"),
    ],
)
def test_schema_rejects_bad_values(helm, bad, field):
    proc = helm.template_raw(sets=(bad,))
    assert proc.returncode != 0, f"{bad} was accepted"
    assert "schema" in proc.stderr and field in proc.stderr, proc.stderr


def test_lint_fails_on_a_bad_value(helm):
    proc = helm.lint(sets=("serve.offload=maybe",))
    assert proc.returncode != 0 and "serve.offload" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "sets,message",
    [
        (("decode.replicas=3",), "decode.replicas (3) must lie between"),
        (("prefill.replicas=0", "prefill.minReplicas=1"), "prefill.replicas (0) must lie between"),
        (("decode.actorsPerPod=3",), "do not fit in decode.cpu=2"),
        (("prefill.actorGpus=1",), "do not fit in prefill.gpus=0"),
        (("serve.numDecode=2",), "decode replicas never fit"),
        (("serve.transport=nccl",), "serve.transport=nccl moves tensors GPU to GPU"),
    ],
)
def test_chart_refuses_inconsistent_values(helm, sets, message):
    proc = helm.template_raw(sets=sets)
    assert proc.returncode != 0, f"{sets} was accepted"
    assert message in proc.stderr, proc.stderr
