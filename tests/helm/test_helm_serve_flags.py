"""`hisparse serve` flags from the chart's values: every serving value reaches the command line in both
modes, the chart's defaults are hisparse's own, the gateway's CPU follows its process count, and the
deadline values accept exactly what hisparse accepts.
"""

from __future__ import annotations

import json

import pytest
import yaml
from helm_chart_support import chart_schema, find, gateway_container, parse_serve, serve_args, worker_group

GiB, MiB = 2**30, 2**20


# Every serving value set away from its default; fractions arrive from --set as numeric strings.
SERVING_SETS = (
    "model.path=/models/dsv4", "model.servedModelName=dsv4-chat", "serve.offload=off", "serve.hotBufferSlots=96",
    "serve.reservedSlots=4", "serve.deviceBudget=40GiB", "serve.hostPoolBytes=2.5GB", "serve.maxRunning=32",
    "serve.maxBatchTokens=4096", "serve.maxConcurrentRequests=100", "serve.maxRestarts=5",
    "serve.blockTokens=512", "prefill.replicas=2", "prefill.maxReplicas=2", "decode.replicas=3", "decode.maxReplicas=4",
    "prefill.actorCpus=2", "decode.actorCpus=0.5", "serve.extraArgs={--verbose-flag-for-test}",
    "serve.maxSequencesPerRequest=8", "serve.maxBodyBytes=1MiB", "serve.streamInterval=4", "gateway.apiWorkers=3",
    "serve.queueTimeoutSeconds=12.5", "serve.maxQueuedRequests=77", "serve.prefillTimeoutSeconds=900",
    "serve.handoffTimeoutSeconds=45", "serve.tokenTimeoutSeconds=7.5", "serve.maxRequestRetries=0",
    "serve.subscriberTimeoutSeconds=2.5", "serve.stepHangSeconds=300", "serve.dtype=bfloat16",
    "serve.prefixCache=off", "serve.prefixCacheHostBytes=512MiB", "serve.speculativeTokens=2",
    "serve.reserve=estimate", "serve.outputEstimateTokens=900",
)


def _assert_serving_values(cfg):
    assert (cfg.model, cfg.server.served_model_name, cfg.dtype) == ("/models/dsv4", "dsv4-chat", "bfloat16")
    t = cfg.tier
    assert (t.offload, t.hot_buffer_slots, t.reserved_slots, t.max_running, t.block_tokens) == (False, 96, 4, 32, 512)
    assert t.speculative_tokens == 2
    assert (t.reserve, t.output_estimate_tokens, t.resident) == ("estimate", 900, False)
    assert (t.device_budget_bytes, t.host_pool_bytes) == (40 * GiB, 2_500_000_000)
    assert cfg.prefill.max_batch_tokens == 4096
    assert (cfg.prefill.prefix_cache.enabled, cfg.prefill.prefix_cache.host_bytes) == (False, 512 * MiB)
    c = cfg.cluster
    assert (c.num_prefill, c.num_decode, c.max_restarts, c.transport) == (2, 3, 5, "object_store")
    assert (c.prefill_num_cpus, c.decode_num_cpus) == (2.0, 0.5)
    s = cfg.server
    assert (s.max_concurrent_requests, s.max_sequences_per_request, s.max_body_bytes, s.stream_interval) == (100, 8, MiB, 4)
    d = cfg.deadlines
    assert (d.queue_timeout_s, d.max_queued_requests, d.prefill_timeout_s, d.handoff_timeout_s) == (12.5, 77, 900.0, 45.0)
    assert (d.token_timeout_s, d.max_request_retries, d.subscriber_timeout_s, d.step_hang_s) == (7.5, 0, 2.5, 300.0)


def test_every_serving_value_reaches_hisparse_serve(helm):
    args = serve_args(helm.render(sets=SERVING_SETS))
    assert args[-1] == "--verbose-flag-for-test"
    cfg = parse_serve(args[:-1])
    _assert_serving_values(cfg)
    assert cfg.server.api_workers == 3


def test_every_serving_value_reaches_the_rayservice_application(helm):
    spec = find(helm.render(sets=(*SERVING_SETS, "mode=rayservice")), "RayService")["spec"]
    (app,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    argv = app["args"]["argv"]
    assert argv[-1] == "--verbose-flag-for-test"
    # One Serve replica serves HTTP there: the gateway-process count is raycluster's alone.
    assert "--api-workers" not in argv
    _assert_serving_values(parse_serve(argv[:-1]))


def test_default_values_are_hisparse_defaults(helm):
    # The chart passes every flag explicitly; its defaults must be the ones `hisparse serve` has itself.
    from hisparse.cli import build_parser, serve_config

    own = serve_config(build_parser().parse_args(["serve"]))
    default = parse_serve(serve_args(helm.render()))
    assert default.deadlines == own.deadlines
    assert default.tier == own.tier and default.prefill == own.prefill and default.dtype == own.dtype
    chart_owned = {"host", "port"}  # the chart binds 0.0.0.0 on gateway.port
    assert {k: v for k, v in vars(default.server).items() if k not in chart_owned} == \
           {k: v for k, v in vars(own.server).items() if k not in chart_owned}


def test_resident_entries_reach_the_decode_flag(helm):
    for value in ("on", "true"):
        assert parse_serve(serve_args(helm.render(sets=(f"serve.resident={value}",)))).tier.resident is True
    assert parse_serve(serve_args(helm.render())).tier.resident is False


def test_shared_prefixes_reach_the_decode_flag(helm):
    assert parse_serve(serve_args(helm.render(sets=("serve.sharePrefixes=4",)))).tier.share_prefixes == 4
    assert parse_serve(serve_args(helm.render())).tier.share_prefixes == 0


def test_kept_pages_reach_the_decode_flag_and_count_in_the_decode_pod(helm):
    assert parse_serve(serve_args(helm.render(sets=("serve.retainBytes=2GiB",)))).tier.retain_bytes == 2 * GiB
    assert parse_serve(serve_args(helm.render())).tier.retain_bytes == 0

    def memory(*sets):
        q = worker_group(helm.render(sets=sets), "decode")["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
        return int(q[:-2]) * MiB

    assert memory("serve.retainBytes=1GiB", "decode.actorsPerPod=2", "decode.cpu=2") == \
        memory("decode.actorsPerPod=2", "decode.cpu=2") + 2 * GiB


def test_the_prefix_cache_default_is_left_to_hisparse(helm):
    """Unset, the chart passes no prefix-cache flag: each prefill pod then has hisparse's own default (on wherever
    it can run, a host budget from that pod's memory); set, the value reaches the flag (bools as on/off)."""
    args = serve_args(helm.render())
    assert "--prefix-cache" not in args and "--prefix-cache-host-bytes" not in args
    pc = parse_serve(args).prefill.prefix_cache
    assert pc.enabled is None and pc.host_bytes is None and pc.wanted
    for value, want in (("on", True), ("true", True), ("false", False)):
        assert parse_serve(serve_args(helm.render(sets=(f"serve.prefixCache={value}",)))).prefill.prefix_cache.enabled is want


def test_a_prefix_cache_budget_set_in_the_chart_counts_in_the_prefill_pod(helm):
    def memory(*sets):
        q = worker_group(helm.render(sets=sets), "prefill")["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
        return int(q[:-2]) * MiB

    assert memory("serve.prefixCacheHostBytes=1GiB", "prefill.actorsPerPod=2", "prefill.cpu=2") == \
        memory("prefill.actorsPerPod=2", "prefill.cpu=2") + 2 * GiB


def test_prefix_cache_on_with_an_attention_tp_prefill_is_refused(helm):
    proc = helm.template_raw(sets=("serve.prefixCache=on", "prefill.layout=tp2", "prefill.actorsPerPod=2", "prefill.cpu=2"))
    assert proc.returncode != 0 and "prefixCache" in proc.stderr, proc.stderr
    args = serve_args(helm.render(sets=("prefill.layout=tp2", "prefill.actorsPerPod=2", "prefill.cpu=2")))
    assert parse_serve(args).cluster.prefill_layout == "tp2"  # the default: no prefix cache there, no refusal


def _cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize("values,sets,workers,cores", [
    ((), (), 1, 1.0),
    ((), ("gateway.apiWorkers=3", "gateway.cpu=500m"), 3, 1.5),
    ((), ("gateway.apiWorkers=2", "gateway.cpu=0.75"), 2, 1.5),
    ((), ("gateway.apiWorkers=2", "gateway.cpu=2"), 2, 4.0),
    ((), ("gateway.apiWorkers=3", "gateway.cpu=100m"), 3, 0.3),
    (("values-gpu.yaml",), (), 4, 4.0),
])
def test_gateway_cpu_is_per_gateway_process(helm, values, sets, workers, cores):
    container = gateway_container(helm.render(values, sets))
    assert parse_serve(container["args"]).server.api_workers == workers
    assert _cores(container["resources"]["requests"]["cpu"]) == cores
    assert container["resources"]["limits"]["cpu"] == container["resources"]["requests"]["cpu"]


SECONDS_VALUES = {"queueTimeoutSeconds": "queue_timeout_s", "prefillTimeoutSeconds": "prefill_timeout_s",
                  "handoffTimeoutSeconds": "handoff_timeout_s", "tokenTimeoutSeconds": "token_timeout_s",
                  "subscriberTimeoutSeconds": "subscriber_timeout_s", "stepHangSeconds": "step_hang_s"}


@pytest.mark.parametrize("value", [0, 0.0, "0", "0.0", "00", -1, "-1", 0.5, "0.5", "0.05", 1, "1", "1.0", 2, 2.0, "2",
                                   "2.0", "02", 2.5, "2.5", "2.05", 3, "3", "10", 30, "30.0", "abc"])
def test_schema_takes_the_deadlines_hisparse_takes(value):
    # The deadline values must accept exactly what hisparse's DeadlineConfig accepts (plain decimal spellings),
    # numbers and the numeric strings `--set` hands over alike.
    import jsonschema

    from core.configs import DeadlineConfig

    serve = chart_schema()["properties"]["serve"]["properties"]
    for name, field in SECONDS_VALUES.items():
        try:
            DeadlineConfig(**{field: float(value)})
            takes = True
        except ValueError:
            takes = False
        assert jsonschema.Draft7Validator(serve[name]).is_valid(value) == takes, (name, value, takes)


def test_decode_replicas_of_several_ranks_share_a_pod(helm):
    """decode.layout reaches --decode-layout; a pod hosts whole replicas, so --num-decode counts replicas
    (pods x actorsPerPod / ranks) and every rank's GPU is requested by the pod."""
    sets = ("decode.layout=dp4+ep4", "decode.actorsPerPod=4", "decode.actorGpus=1", "decode.gpus=4",
            "decode.cpu=4", "decode.replicas=2", "decode.maxReplicas=2")
    docs = helm.render(sets=sets)
    c = parse_serve(serve_args(docs)).cluster
    assert (c.decode_layout, c.num_decode, c.decode_num_gpus) == ("dp4+ep4", 2, 1.0)
    group = next(g for g in find(docs, "RayCluster")["spec"]["workerGroupSpecs"] if g["groupName"].startswith("decode"))
    container = group["template"]["spec"]["containers"][0]
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "4"
    assert json.loads(group["rayStartParams"]["resources"].strip("'"))["hisparse_decode"] == 4


@pytest.mark.parametrize("sets,message", [
    (("decode.layout=dp2+ep2", "decode.actorsPerPod=3", "decode.cpu=3"), "multiple of 2"),
    (("decode.layout=tp2",), "decode.layout"),
])
def test_decode_layout_the_pods_cannot_hold_is_refused(helm, sets, message):
    proc = helm.template_raw(sets=sets)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_prefill_replicas_reach_hisparse_serve(helm):
    sets = ("prefill.layout=dp2+ep2", "prefill.actorsPerPod=2", "prefill.cpu=2", "prefill.replicas=2",
            "prefill.maxReplicas=2")
    c = parse_serve(serve_args(helm.render(sets=sets))).cluster
    assert (c.prefill_layout, c.num_prefill, c.decode_layout) == ("dp2+ep2", 2, "dp1")


def test_prefill_tp_group_counts_its_ranks(helm):
    sets = ("prefill.layout=tp4+ep4", "prefill.actorsPerPod=4", "prefill.cpu=4", "prefill.replicas=1")
    c = parse_serve(serve_args(helm.render(sets=sets))).cluster
    assert (c.prefill_layout, c.num_prefill) == ("tp4+ep4", 1)
    proc = helm.template_raw(sets=("prefill.layout=tp4", "prefill.actorsPerPod=2", "prefill.cpu=2"))
    assert proc.returncode != 0 and "multiple of 4" in proc.stderr
